//! Human-readable option values: sizes (`512MiB`) and durations (`250ms`), parsed by the same
//! rules for flags and for the TOML file, and printed back in a form that parses again.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use orbitkv_proto::{parse_duration, parse_size, UnitError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count, written with a binary unit (`64MiB`) or as a plain number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s).map(Self)
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the count exactly (`1GiB`, `1536MiB`), else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if b != 0 && b.trailing_zeros() >= shift {
                return write!(f, "{}{unit}", b >> shift);
            }
        }
        write!(f, "{b}")
    }
}

/// A span of time, written with a unit (`2ms`, `500us`, `10s`); `0` for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Span(pub Duration);

impl Span {
    /// The duration.
    pub fn duration(self) -> Duration {
        self.0
    }
}

impl FromStr for Span {
    type Err = UnitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_duration(s).map(Self)
    }
}

impl fmt::Display for Span {
    /// The largest unit that divides the span exactly (`10s`, `2ms`, `500us`), else `ns`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0.as_nanos();
        if ns == 0 {
            return write!(f, "0");
        }
        for (unit, per) in [("s", 1_000_000_000u128), ("ms", 1_000_000), ("us", 1_000)] {
            if ns.is_multiple_of(per) {
                return write!(f, "{}{unit}", ns / per);
            }
        }
        write!(f, "{ns}ns")
    }
}

/// Serializes as the string `Display` writes.
macro_rules! as_string {
    ($t:ty, $what:literal) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        /// Reads a string as `FromStr` does, or an integer (bytes, or seconds).
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                #[derive(Deserialize)]
                #[serde(untagged)]
                enum Raw {
                    Text(String),
                    Number(u64),
                }
                let text = match Raw::deserialize(d).map_err(|_| {
                    serde::de::Error::custom(concat!("expected ", $what, " as a string"))
                })? {
                    Raw::Text(t) => t,
                    Raw::Number(n) => n.to_string(),
                };
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

as_string!(ByteSize, "a size such as \"512MiB\"");
as_string!(Span, "a duration such as \"250ms\"");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_in_a_form_that_parses_back() {
        for (text, bytes, shown) in [
            ("1GiB", 1 << 30, "1GiB"),
            ("1536MiB", 1536 << 20, "1536MiB"),
            ("64KiB", 64 << 10, "64KiB"),
            ("0", 0, "0"),
            ("1000", 1000, "1000"),
            ("2TiB", 2 << 40, "2TiB"),
        ] {
            let s: ByteSize = text.parse().unwrap();
            assert_eq!(s.bytes(), bytes);
            assert_eq!(s.to_string(), shown);
            assert_eq!(s.to_string().parse::<ByteSize>().unwrap(), s);
        }
        assert!("lots".parse::<ByteSize>().is_err());
    }

    #[test]
    fn spans_print_in_a_form_that_parses_back() {
        for (text, shown) in
            [("2ms", "2ms"), ("500us", "500us"), ("10s", "10s"), ("0", "0"), ("1.5s", "1500ms")]
        {
            let s: Span = text.parse().unwrap();
            assert_eq!(s.to_string(), shown);
            assert_eq!(s.to_string().parse::<Span>().unwrap(), s);
        }
        assert!("soon".parse::<Span>().is_err());
    }
}
