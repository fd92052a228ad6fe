//! Durations as the spec writes them (`500ms`, `30s`, `5m`, `24h`, `1h30m`).

use std::time::Duration;

/// A duration in the spec that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not of the form `<number><unit>...` with units ms, s, m, h.
    #[error("`{0}` is not a duration like 500ms, 30s, 5m or 1h30m")]
    Malformed(String),
    /// Zero, where a pause or a threshold must be positive.
    #[error("`{0}` must be longer than zero")]
    Zero(String),
    /// Longer than the API server reads one: its durations (Go's, and the CRD rules'
    /// `duration()`) are nanoseconds in 64 bits, so at most 2562047h47m16.854775807s.
    #[error("`{0}` is longer than the 2562047h the API server can read")]
    TooLong(String),
}

/// The longest duration Go (and so the API server's CEL `duration()`) reads.
const LONGEST: Duration = Duration::from_nanos(i64::MAX as u64);

/// A command-line duration: as the spec writes them (`90s`, `1h30m`), or zero (`0s`).
pub fn duration_arg(text: &str) -> Result<Duration, String> {
    if matches!(text, "0" | "0s" | "0ms") {
        return Ok(Duration::ZERO);
    }
    parse_duration(text).map_err(|e| e.to_string())
}

/// A command-line time: RFC 3339 (`2026-12-07T10:00:00Z`).
pub fn time_arg(text: &str) -> Result<std::time::SystemTime, String> {
    humantime::parse_rfc3339_weak(text.trim())
        .map_err(|e| format!("{text}: not an RFC 3339 time such as 2026-12-07T10:00:00Z ({e})"))
}

/// Parses a positive Go-style duration; the schema's pattern admits the same strings.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let malformed = || DurationError::Malformed(text.to_owned());
    // The schema only lets ms|s|m|h through; humantime alone would also take days,
    // months and spaces, which the schema rejects, so both agree on what is valid.
    if text.is_empty() || text.contains(char::is_whitespace) {
        return Err(malformed());
    }
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return Err(malformed());
        }
        rest = &rest[digits..];
        let unit = ["ms", "s", "m", "h"]
            .into_iter()
            .find(|u| rest.starts_with(u))
            .ok_or_else(malformed)?;
        rest = &rest[unit.len()..];
    }
    let duration = humantime::parse_duration(text).map_err(|_| malformed())?;
    if duration.is_zero() {
        return Err(DurationError::Zero(text.to_owned()));
    }
    if duration > LONGEST {
        return Err(DurationError::TooLong(text.to_owned()));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_units_the_schema_allows() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
    }

    #[test]
    fn rejects_what_the_schema_rejects() {
        for bad in ["", "5", "ms", "5 m", "1d", "-5s", "5sec", "1.5s"] {
            assert!(
                matches!(parse_duration(bad), Err(DurationError::Malformed(_))),
                "{bad:?} should be malformed"
            );
        }
    }

    #[test]
    fn rejects_what_go_cannot_read() {
        assert_eq!(
            parse_duration("2562047h"),
            Ok(Duration::from_secs(2_562_047 * 3600))
        );
        for long in ["2562048h", "9999999h", "99999999999999999999ms"] {
            assert!(
                matches!(
                    parse_duration(long),
                    Err(DurationError::TooLong(_) | DurationError::Malformed(_))
                ),
                "{long:?} should be refused"
            );
        }
        assert_eq!(
            parse_duration("2562048h"),
            Err(DurationError::TooLong("2562048h".to_owned()))
        );
    }

    #[test]
    fn rejects_zero() {
        assert_eq!(
            parse_duration("0s"),
            Err(DurationError::Zero("0s".to_owned()))
        );
    }
}
