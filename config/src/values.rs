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

/// The quota of one model's namespaces (`--model-quota`):
/// `MODEL:KEY=SIZE[,KEY=SIZE...]`, keys `dram-limit`, `dram-guarantee`, `ssd-limit` and
/// `ssd-guarantee`. A key not given takes the `--namespace-*` flag's value. The model is
/// everything before the last `:` ahead of the first `=` (so a model name may hold `:` but no
/// `=` or `,`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelQuota {
    /// The model, as its namespaces' descriptors name it.
    pub model: String,
    /// `dram-limit`.
    pub dram_limit: Option<ByteSize>,
    /// `dram-guarantee`.
    pub dram_guarantee: Option<ByteSize>,
    /// `ssd-limit`.
    pub ssd_limit: Option<ByteSize>,
    /// `ssd-guarantee`.
    pub ssd_guarantee: Option<ByteSize>,
}

/// Why a `--model-quota` value does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} (expected MODEL:KEY=SIZE[,KEY=SIZE...], keys dram-limit, dram-guarantee, ssd-limit, ssd-guarantee)")]
pub struct ModelQuotaError(String);

impl ModelQuota {
    fn field(&mut self, key: &str) -> Option<&mut Option<ByteSize>> {
        Some(match key {
            "dram-limit" => &mut self.dram_limit,
            "dram-guarantee" => &mut self.dram_guarantee,
            "ssd-limit" => &mut self.ssd_limit,
            "ssd-guarantee" => &mut self.ssd_guarantee,
            _ => return None,
        })
    }

    fn fields(&self) -> [(&'static str, Option<ByteSize>); 4] {
        [
            ("dram-limit", self.dram_limit),
            ("dram-guarantee", self.dram_guarantee),
            ("ssd-limit", self.ssd_limit),
            ("ssd-guarantee", self.ssd_guarantee),
        ]
    }
}

impl FromStr for ModelQuota {
    type Err = ModelQuotaError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why: String| ModelQuotaError(format!("{s:?}: {why}"));
        let first_eq = s.find('=').ok_or_else(|| err("no KEY=SIZE".into()))?;
        let (model, _) = s[..first_eq]
            .rsplit_once(':')
            .ok_or_else(|| err("no ':' between the model and its first key".into()))?;
        if model.is_empty() || model.len() > 256 {
            return Err(err("the model must be 1 to 256 bytes".into()));
        }
        let mut q = ModelQuota {
            model: model.to_owned(),
            dram_limit: None,
            dram_guarantee: None,
            ssd_limit: None,
            ssd_guarantee: None,
        };
        for pair in s[model.len() + 1..].split(',') {
            let (key, value) =
                pair.split_once('=').ok_or_else(|| err(format!("{pair:?} is not KEY=SIZE")))?;
            let size: ByteSize =
                value.parse().map_err(|e| err(format!("{key}: {value:?}: {e}")))?;
            let slot = q.field(key).ok_or_else(|| err(format!("unknown key {key:?}")))?;
            if slot.replace(size).is_some() {
                return Err(err(format!("{key} given twice")));
            }
        }
        Ok(q)
    }
}

impl fmt::Display for ModelQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.model)?;
        let mut sep = "";
        for (key, value) in self.fields() {
            if let Some(v) = value {
                write!(f, "{sep}{key}={v}")?;
                sep = ",";
            }
        }
        Ok(())
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
as_string!(ModelQuota, "a model quota such as \"my-model:dram-limit=8GiB\"");

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

    #[test]
    fn model_quotas_parse_print_back_and_name_what_is_wrong() {
        let q: ModelQuota = "org/m:rev1:dram-limit=8GiB,ssd-guarantee=1GiB".parse().unwrap();
        assert_eq!(q.model, "org/m:rev1", "the model keeps its own ':'");
        assert_eq!(
            (q.dram_limit, q.ssd_guarantee),
            (Some(ByteSize(8 << 30)), Some(ByteSize(1 << 30)))
        );
        assert_eq!((q.dram_guarantee, q.ssd_limit), (None, None));
        assert_eq!(q.to_string(), "org/m:rev1:dram-limit=8GiB,ssd-guarantee=1GiB");
        assert_eq!(q.to_string().parse::<ModelQuota>().unwrap(), q);
        for (text, why) in [
            ("m", "no KEY=SIZE"),
            ("dram-limit=1GiB", "no ':'"),
            (":dram-limit=1GiB", "1 to 256 bytes"),
            ("m:dram-limit=lots", "dram-limit"),
            ("m:dram-limt=1GiB", "unknown key \"dram-limt\""),
            ("m:dram-limit=1GiB,dram-limit=2GiB", "given twice"),
            ("m:dram-limit=1GiB,", "is not KEY=SIZE"),
        ] {
            let e = text.parse::<ModelQuota>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("MODEL:KEY=SIZE"), "{text}: {e}");
        }
    }
}
