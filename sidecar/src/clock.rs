//! The wall clock that stamps records, spool files and metrics.

/// Current time in Unix nanoseconds (0 if the clock reads before 1970).
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
