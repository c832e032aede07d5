//! Human sizes (`512MiB`) and durations (`250ms`) as used by every flag and config file.

use std::time::Duration;

/// The arena's page and the SSD tier's block: allocations, slot offsets, SSD records and their
/// file offsets are whole multiples of it (O_DIRECT needs the alignment).
pub const PAGE_SIZE: u64 = 4096;

/// A size or duration string that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {input:?}: {reason}")]
pub struct UnitError {
    what: &'static str,
    input: String,
    reason: &'static str,
}

fn unit_error(what: &'static str, input: &str, reason: &'static str) -> UnitError {
    UnitError { what, input: input.to_string(), reason }
}

fn split_number(s: &str) -> (&str, &str) {
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    (&s[..end], s[end..].trim())
}

/// Parses a byte size: a plain number of bytes or a number with a unit
/// (`B`, `KiB`, `MiB`, `GiB`, `TiB`, binary; `KB`, `MB`, `GB`, `TB`, decimal; `K`/`M`/`G`/`T`
/// are binary). Fractions are allowed (`1.5GiB`). Case-insensitive units.
pub fn parse_size(input: &str) -> Result<u64, UnitError> {
    let s = input.trim();
    let (num, unit) = split_number(s);
    if num.is_empty() {
        return Err(unit_error("size", input, "expected a number such as 512MiB"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(unit_error("size", input, "unknown unit (use B, KiB, MiB, GiB, TiB)")),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| unit_error("size", input, "too large"));
    }
    let f: f64 = num.parse().map_err(|_| unit_error("size", input, "not a number"))?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(unit_error("size", input, "too large"));
    }
    Ok(bytes.round() as u64)
}

/// Parses a duration: a number with a unit `ns`, `us`, `ms`, `s`, `m`, `h`
/// (`250ms`, `1.5s`, `10m`). A bare number is seconds.
pub fn parse_duration(input: &str) -> Result<Duration, UnitError> {
    let s = input.trim();
    let (num, unit) = split_number(s);
    if num.is_empty() {
        return Err(unit_error("duration", input, "expected a number such as 250ms"));
    }
    let f: f64 = num.parse().map_err(|_| unit_error("duration", input, "not a number"))?;
    let secs = match unit {
        "ns" => f / 1e9,
        "us" | "µs" => f / 1e6,
        "ms" => f / 1e3,
        "" | "s" => f,
        "m" | "min" => f * 60.0,
        "h" => f * 3600.0,
        _ => return Err(unit_error("duration", input, "unknown unit (use ns, us, ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| unit_error("duration", input, "out of range"))
}

/// Formats a byte count with a binary unit (`1.5 GiB`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2 gb").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999TiB").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3 fortnights").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
    }
}
