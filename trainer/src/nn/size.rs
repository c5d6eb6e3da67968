//! Sizes with units, as a user writes them in a config or on the command line
//! (`"16GiB"`, `"20GB"`, `"512MiB"`). A leaf below `options` (which checks
//! `train.max_memory` with it) and `memory` (which reads `options`), so the two do not
//! import each other.

/// Parses a size with a unit: `16GiB`, `16Gi`, `1.5 GiB`, `500MB` (decimal: `kB`, `MB`,
/// `GB`, `TB`; binary: `KiB`, `MiB`, `GiB`, `TiB` or Kubernetes' `Ki`, `Mi`, `Gi`,
/// `Ti`), or a plain number of bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || {
        format!(
            "{text:?} is not a size: write a number with a unit, e.g. \"16GiB\", \"512MiB\" or \"20GB\""
        )
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => (1u64 << 20) as f64,
        "gi" | "gib" => (1u64 << 30) as f64,
        "ti" | "tib" => (1u64 << 40) as f64,
        _ => return Err(bad()),
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!(
            "{text:?}: a memory budget must be at least one byte"
        ));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("16Gi"), Ok(16 << 30));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("20GB"), Ok(20_000_000_000));
        assert_eq!(parse_size("512mib"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in ["", "GiB", "16 parsecs", "-1GiB", "1.2.3GB", "0"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }
}
