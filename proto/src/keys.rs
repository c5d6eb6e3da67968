//! The object key scheme for segments — the one place that formats and parses keys.
//!
//! ```text
//! {prefix}/segments/v1/{yyyy}/{mm}/{dd}/{hh}/{sidecar_id}/{first_seq:016x}.tlseg
//! ```
//!
//! - The date and hour (UTC) are those of the segment's first record, so keys sort by
//!   time across sidecars at hour granularity.
//! - `first_seq` is the spool sequence number of the segment's first record, strictly
//!   increasing per sidecar, so a sidecar's keys sort in write order.
//! - The key depends only on the segment's content, so re-uploading a segment after a
//!   crash produces the same key and a create-only PUT makes the retry harmless.

use object_store::path::Path;

/// The directory under the store prefix that holds segments.
pub const SEGMENTS_DIR: &str = "segments";
/// Version component of the key scheme.
pub const SCHEME_VERSION: &str = "v1";
/// File extension of segment objects.
pub const EXTENSION: &str = "tlseg";

/// Longest accepted sidecar id.
pub const MAX_SIDECAR_ID_LEN: usize = 128;

/// Why a key or a sidecar id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The sidecar id cannot appear in a key.
    #[error(
        "invalid sidecar id {id:?}: use 1 to {MAX_SIDECAR_ID_LEN} characters from A-Z a-z 0-9 . _ - , not starting with '.'"
    )]
    InvalidSidecarId {
        /// The refused id.
        id: String,
    },
    /// The path is not a segment key of this scheme.
    #[error("{path:?} is not a segment key ({reason})")]
    NotASegmentKey {
        /// The refused path.
        path: String,
        /// What did not match.
        reason: &'static str,
    },
}

/// Checks that a sidecar id can be used as one component of an object key.
pub fn validate_sidecar_id(id: &str) -> Result<(), KeyError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_SIDECAR_ID_LEN
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::InvalidSidecarId { id: id.to_owned() })
    }
}

/// The identity of one segment object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentKey {
    /// Start of the UTC hour of the segment's first record, in Unix seconds.
    pub hour_unix_secs: i64,
    /// The sidecar that wrote it.
    pub sidecar_id: String,
    /// Spool sequence number of its first record.
    pub first_seq: u64,
}

impl SegmentKey {
    /// The key of a segment whose first record was written at `first_record_unix_nanos`.
    pub fn new(
        sidecar_id: &str,
        first_seq: u64,
        first_record_unix_nanos: i64,
    ) -> Result<Self, KeyError> {
        validate_sidecar_id(sidecar_id)?;
        let secs = first_record_unix_nanos.div_euclid(1_000_000_000);
        Ok(SegmentKey {
            hour_unix_secs: secs - secs.rem_euclid(3600),
            sidecar_id: sidecar_id.to_owned(),
            first_seq,
        })
    }

    /// The object path of the segment under `prefix`.
    pub fn to_path(&self, prefix: &Path) -> Path {
        hour_dir(prefix, self.hour_unix_secs)
            .child(self.sidecar_id.as_str())
            .child(format!("{:016x}.{EXTENSION}", self.first_seq))
    }

    /// Parses an object path written by [`SegmentKey::to_path`] under `prefix`.
    pub fn parse(prefix: &Path, path: &Path) -> Result<Self, KeyError> {
        let err = |reason| KeyError::NotASegmentKey {
            path: path.to_string(),
            reason,
        };
        let root = segments_root(prefix);
        let parts: Vec<_> = path
            .prefix_match(&root)
            .ok_or_else(|| err("not under the segments directory"))?
            .map(|p| p.as_ref().to_owned())
            .collect();
        let [y, m, d, h, sidecar, file] = parts.as_slice() else {
            return Err(err("expected yyyy/mm/dd/hh/sidecar/seq.tlseg"));
        };
        let num = |s: &str, len: usize, max: i64| -> Result<i64, KeyError> {
            if s.len() != len || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(err("date components must be zero-padded numbers"));
            }
            let v: i64 = s.parse().map_err(|_| err("bad number"))?;
            if v > max {
                Err(err("date component out of range"))
            } else {
                Ok(v)
            }
        };
        let (y, m, d, h) = (
            num(y, 4, 9999)?,
            num(m, 2, 12)?,
            num(d, 2, 31)?,
            num(h, 2, 23)?,
        );
        if m == 0 || d == 0 {
            return Err(err("date component out of range"));
        }
        let seq = file
            .strip_suffix(&format!(".{EXTENSION}"))
            .ok_or_else(|| err("file name must end in .tlseg"))?;
        if seq.len() != 16 {
            return Err(err("sequence number must be 16 hex digits"));
        }
        let first_seq =
            u64::from_str_radix(seq, 16).map_err(|_| err("sequence number must be hex"))?;
        validate_sidecar_id(sidecar).map_err(|_| err("invalid sidecar id"))?;
        let key = SegmentKey {
            hour_unix_secs: days_from_civil(y, m, d) * 86_400 + h * 3600,
            sidecar_id: sidecar.clone(),
            first_seq,
        };
        // Reject non-canonical dates such as 02/31, which would not round-trip.
        if key.to_path(prefix) != *path {
            return Err(err("date does not exist"));
        }
        Ok(key)
    }
}

/// The directory that holds every segment under `prefix`.
pub fn segments_root(prefix: &Path) -> Path {
    prefix.child(SEGMENTS_DIR).child(SCHEME_VERSION)
}

/// The directory of the segments of the UTC hour starting at `hour_unix_secs` (rounded
/// down to the hour): `{prefix}/segments/v1/yyyy/mm/dd/hh`. Hour directories sort in time
/// order, and every key of an hour sorts after its directory and before the next one's.
pub fn hour_dir(prefix: &Path, hour_unix_secs: i64) -> Path {
    let hour = hour_unix_secs - hour_unix_secs.rem_euclid(3600);
    let (y, m, d) = civil_from_days(hour.div_euclid(86_400));
    let h = hour.rem_euclid(86_400) / 3600;
    let mut path = segments_root(prefix);
    for part in [
        format!("{y:04}"),
        format!("{m:02}"),
        format!("{d:02}"),
        format!("{h:02}"),
    ] {
        path = path.child(part);
    }
    path
}

/// The hour (Unix seconds) of an hour directory written by [`hour_dir`].
pub fn parse_hour_dir(prefix: &Path, dir: &Path) -> Result<i64, KeyError> {
    let probe = dir.child("x").child(format!("{:016x}.{EXTENSION}", 0));
    SegmentKey::parse(prefix, &probe)
        .map(|k| k.hour_unix_secs)
        .map_err(|_| KeyError::NotASegmentKey {
            path: dir.to_string(),
            reason: "not an hour directory (yyyy/mm/dd/hh under the segments directory)",
        })
}

/// Days since 1970-01-01 to a (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hour_dirs_round_trip_and_bracket_their_keys() {
        let prefix = Path::from("p");
        for hour in [
            0_i64,
            1_798_758_000,
            1_798_761_600 - 3600,
            4_102_444_800 - 3600,
        ] {
            let dir = hour_dir(&prefix, hour + 1234);
            assert_eq!(parse_hour_dir(&prefix, &dir).unwrap(), hour);
            let key = SegmentKey::new("sc", 7, (hour + 59) * 1_000_000_000)
                .unwrap()
                .to_path(&prefix);
            let next = hour_dir(&prefix, hour + 3600);
            assert!(dir.as_ref() < key.as_ref() && key.as_ref() < next.as_ref());
        }
        assert!(parse_hour_dir(&prefix, &Path::from("p/segments/v1/2026/12")).is_err());
    }

    #[test]
    fn formats_the_documented_layout() {
        // 2026-12-02T09:49:02Z
        let key = SegmentKey::new("harness-7", 42, 1_796_204_942_000_000_000).unwrap();
        let path = key.to_path(&Path::from("runs/a"));
        assert_eq!(
            path.as_ref(),
            "runs/a/segments/v1/2026/12/02/09/harness-7/000000000000002a.tlseg"
        );
        assert_eq!(
            SegmentKey::parse(&Path::from("runs/a"), &path).unwrap(),
            key
        );
    }

    #[test]
    fn keys_sort_by_time_then_sidecar_then_seq() {
        let prefix = Path::from("p");
        let a = SegmentKey::new("b", 9, 1_000_000_000_000_000_000)
            .unwrap()
            .to_path(&prefix);
        let b = SegmentKey::new("a", 1, 1_000_003_600_000_000_000)
            .unwrap()
            .to_path(&prefix);
        let c = SegmentKey::new("a", 2, 1_000_003_600_000_000_000)
            .unwrap()
            .to_path(&prefix);
        assert!(a.as_ref() < b.as_ref() && b.as_ref() < c.as_ref());
    }

    #[test]
    fn calendar_round_trips_over_four_centuries() {
        for days in (-1_000..146_097 * 2).step_by(7) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn refuses_ids_that_would_escape_the_key() {
        for id in ["", "a/b", "..", ".hidden", "é", &"x".repeat(129)] {
            assert!(validate_sidecar_id(id).is_err(), "{id:?}");
        }
        validate_sidecar_id("pod-1.zone_a").unwrap();
    }

    #[test]
    fn refuses_foreign_paths() {
        let prefix = Path::from("p");
        for bad in [
            "p/other/x.tlseg",
            "p/segments/v1/2026/12/02/09/s/2a.tlseg",
            "p/segments/v1/2026/02/31/09/s/000000000000002a.tlseg",
            "p/segments/v1/2026/12/02/24/s/000000000000002a.tlseg",
            "p/segments/v1/2026/12/02/09/s/000000000000002a.json",
        ] {
            assert!(
                SegmentKey::parse(&prefix, &Path::from(bad)).is_err(),
                "{bad}"
            );
        }
    }
}
