//! Byte quantities as people write them: `8GiB`, `7.5 GB`, `8192MiB`, `123`.
//!
//! Decimal units are powers of 1000 (`KB`, `MB`, `GB`, `TB`), binary units
//! powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`); a bare number or `B` is bytes.
//! Parsing is exact: `7.5GB` is 7,500,000,000 bytes, and a value that is not a
//! whole number of bytes (`0.5B`) is refused.

/// Parses a byte quantity.
///
/// ```
/// use oomfix::units::parse_bytes;
/// assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
/// assert_eq!(parse_bytes("7.5 GB"), Ok(7_500_000_000));
/// assert_eq!(parse_bytes("8192MiB"), Ok(8 << 30));
/// assert!(parse_bytes("8 parsecs").is_err());
/// ```
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" | "k" => 1_000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        "tb" | "t" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "unknown unit `{unit}` in `{text}` (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty()
        || !frac.chars().all(|c| c.is_ascii_digit())
        || frac.len() > 18
    {
        return Err(format!(
            "`{text}` is not a byte quantity (like 8GiB or 7.5GB)"
        ));
    }
    let digits = |s: &str| -> Result<u128, String> {
        if s.is_empty() {
            Ok(0)
        } else {
            s.parse::<u128>()
                .map_err(|_| format!("`{text}` is too large"))
        }
    };
    let scale = 10u128.pow(frac.len() as u32);
    let numerator = digits(int)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(digits(frac).ok()?))
        .and_then(|v| v.checked_mul(multiplier))
        .ok_or_else(|| format!("`{text}` is too large"))?;
    if numerator % scale != 0 {
        return Err(format!("`{text}` is not a whole number of bytes"));
    }
    u64::try_from(numerator / scale).map_err(|_| format!("`{text}` is too large"))
}

/// Formats bytes in binary units with two decimals (`7.50 GiB`), bytes below 1 KiB.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Formats an integer with thousands separators (`124,439,808`).
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The memory the host can still give without swapping (`MemAvailable` of
/// `/proc/meminfo`), where the system says, rounded down to a whole GiB so
/// that the same command on the same machine plans the same (the figure
/// moves by megabytes from one moment to the next).
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / (1 << 20) * (1 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_exact() {
        assert_eq!(parse_bytes("1"), Ok(1));
        assert_eq!(parse_bytes("1B"), Ok(1));
        assert_eq!(parse_bytes("1KB"), Ok(1000));
        assert_eq!(parse_bytes("1kib"), Ok(1024));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes("7.5GiB"), Ok(8_053_063_680));
        assert_eq!(parse_bytes("2TiB"), Ok(2 << 40));
        assert_eq!(parse_bytes(".5KB"), Ok(500));
        assert!(parse_bytes("0.5B").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("1.2.3GB").is_err());
        assert!(parse_bytes("-1GB").is_err());
        assert!(parse_bytes("99999999999999999999TiB").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(8 << 30), "8.00 GiB");
        assert_eq!(group_digits(124_439_808), "124,439,808");
        assert_eq!(group_digits(999), "999");
    }
}
