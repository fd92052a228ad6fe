//! Byte sizes written as Kubernetes quantities (`512Mi`, `1Gi`, `10G`).
//!
//! Written by hand: only whole numbers with one binary or decimal suffix are allowed by
//! the schema, which is a few lines; a general quantity parser would accept more than
//! the schema does.

/// A byte size that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a byte size like 512Mi, 1Gi or 10G")]
pub struct QuantityError(pub String);

/// Parses a whole-number quantity with an optional `Ki|Mi|Gi|Ti|k|M|G|T` suffix.
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    let err = || QuantityError(text.to_owned());
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| err())?;
    let factor: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return Err(err()),
    };
    number.checked_mul(factor).ok_or_else(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_suffixes() {
        assert_eq!(parse_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("10G"), Ok(10_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
    }

    #[test]
    fn rejects_other_forms() {
        for bad in [
            "",
            "Gi",
            "1.5Gi",
            "1GB",
            "-1",
            "1 Gi",
            "99999999999999999999Ti",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
