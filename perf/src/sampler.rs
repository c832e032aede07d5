//! Key choice: uniform, or Zipf by rejection-inversion (Hörmann and Derflinger, 1996), which
//! needs O(1) setup and memory for any key count and any exponent > 0 (1 included).

use rand::Rng;

/// Picks key indices in `0..n`.
#[derive(Clone, Debug)]
pub(crate) enum KeyPicker {
    /// Every index equally likely.
    Uniform {
        /// Number of keys.
        n: u64,
    },
    /// Index `r` with probability proportional to `1 / (r + 1)^theta`.
    Zipf(Zipf),
}

impl KeyPicker {
    /// The next index, always below the key count.
    pub fn pick<R: Rng>(&self, rng: &mut R) -> u64 {
        match self {
            KeyPicker::Uniform { n } => rng.gen_range(0..*n),
            KeyPicker::Zipf(z) => z.sample(rng),
        }
    }
}

/// A Zipf distribution over ranks `0..n` (rank 0 is the most popular).
#[derive(Clone, Debug)]
pub(crate) struct Zipf {
    n: f64,
    theta: f64,
    h_integral_x1: f64,
    h_integral_n: f64,
    s: f64,
}

impl Zipf {
    /// A distribution over `n >= 1` ranks with exponent `theta > 0`.
    pub fn new(n: u64, theta: f64) -> Result<Self, String> {
        if n == 0 {
            return Err("needs at least one key".into());
        }
        if !(theta.is_finite() && theta > 0.0) {
            return Err(format!("exponent {theta} is not a positive number"));
        }
        let nf = n as f64;
        Ok(Self {
            n: nf,
            theta,
            h_integral_x1: h_integral(1.5, theta) - 1.0,
            h_integral_n: h_integral(nf + 0.5, theta),
            s: 2.0 - h_integral_inverse(h_integral(2.5, theta) - h(2.0, theta), theta),
        })
    }

    /// One rank in `0..n`.
    pub fn sample<R: Rng>(&self, rng: &mut R) -> u64 {
        loop {
            let u = self.h_integral_n + rng.gen::<f64>() * (self.h_integral_x1 - self.h_integral_n);
            let x = h_integral_inverse(u, self.theta);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.s || u >= h_integral(k + 0.5, self.theta) - h(k, self.theta) {
                // k is an integer in 1..=n, so the cast is exact.
                return k as u64 - 1;
            }
        }
    }
}

/// `h(x) = x^-theta`.
fn h(x: f64, theta: f64) -> f64 {
    (-theta * x.ln()).exp()
}

/// An antiderivative of `h`: `(x^(1-theta) - 1) / (1 - theta)`, or `ln x` at `theta = 1`.
fn h_integral(x: f64, theta: f64) -> f64 {
    let log_x = x.ln();
    helper2((1.0 - theta) * log_x) * log_x
}

/// The inverse of [`h_integral`].
fn h_integral_inverse(x: f64, theta: f64) -> f64 {
    let t = (x * (1.0 - theta)).max(-1.0);
    (helper1(t) * x).exp()
}

/// `ln(1 + x) / x`, stable near 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, stable near 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn zipf_stays_in_range() {
        let mut rng = SmallRng::seed_from_u64(1);
        for n in [1u64, 2, 10, 1000, 1 << 40] {
            for theta in [0.01, 0.5, 0.99, 1.0, 1.2, 3.0] {
                let z = KeyPicker::Zipf(Zipf::new(n, theta).unwrap());
                for _ in 0..10_000 {
                    let k = z.pick(&mut rng);
                    assert!(k < n, "n {n} theta {theta} gave {k}");
                }
            }
        }
    }

    #[test]
    fn zipf_favours_low_ranks_and_reaches_the_top() {
        let mut rng = SmallRng::seed_from_u64(7);
        let z = Zipf::new(100, 0.99).unwrap();
        let mut counts = [0u32; 100];
        for _ in 0..200_000 {
            counts[z.sample(&mut rng) as usize] += 1;
        }
        // Expected share of rank 0 is ~19%, of rank 9 ~2%, of rank 99 ~0.2%.
        assert!(counts[0] > counts[1] && counts[1] > counts[9] && counts[9] > counts[99]);
        assert!(counts[99] > 0);
    }

    #[test]
    fn uniform_stays_in_range_and_zipf_rejects_bad_parameters() {
        let mut rng = SmallRng::seed_from_u64(3);
        let u = KeyPicker::Uniform { n: 5 };
        let mut seen = [false; 5];
        for _ in 0..1000 {
            seen[u.pick(&mut rng) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert!(Zipf::new(0, 0.99).is_err());
        assert!(Zipf::new(10, 0.0).is_err());
        assert!(Zipf::new(10, f64::NAN).is_err());
    }
}
