//! The episode table on disk: a journal beside the spool, so that a restart (after a
//! SIGKILL, an OOM kill, a crash of the machine) still knows which episodes are open.
//!
//! Spool files are deleted once uploaded, so the table cannot be rebuilt from them: it
//! lives in a file of its own.
//!
//! # On-disk format
//!
//! ```text
//! {spool_dir}/episodes.journal       the table: a snapshot followed by the changes since
//! {spool_dir}/episodes.journal.tmp   the next snapshot while it is written (then renamed)
//!
//! file   = header frame*
//! header = "TLEP" | version u8 (= 1) | 3 zero bytes
//! frame  = length u32 LE | crc32c(payload) u32 LE | payload (one [`Entry`], JSON)
//! ```
//!
//! # Invariants
//!
//! - A change counts once its frame is written (`write(2)`, before the control API
//!   answers): the page cache survives a SIGKILL of the process. A background task
//!   fsyncs the file on the spool's interval ([`Journal::sync`]) for crashes of the
//!   machine.
//! - The file is only appended to, except by compaction, which writes a snapshot of the
//!   whole table to `.tmp`, fsyncs it and renames it over the journal: a kill at any
//!   point leaves either the old journal or the new one, both whole. A `.tmp` found at
//!   start is an unfinished snapshot and is deleted.
//! - Reading stops at the first frame that is cut or fails its checksum (the one being
//!   written when the process died); the file is truncated there. A file that is not a
//!   journal at all is moved aside as `episodes.journal.corrupt`, and the sidecar starts
//!   with an empty table rather than not at all.
//! - Call numbers are reserved in blocks of [`SEQ_BLOCK`]: the journal holds, per
//!   episode, a number above every `seq` handed out, so after a restart an episode's
//!   calls go on numbering above the ones before (with a gap), never repeating one.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// File name of the journal inside the spool directory.
pub const FILE_NAME: &str = "episodes.journal";
const MAGIC: [u8; 4] = *b"TLEP";
const VERSION: u8 = 1;
const HEADER: [u8; 8] = [b'T', b'L', b'E', b'P', VERSION, 0, 0, 0];
/// Largest entry read back; entries are a few hundred bytes.
const MAX_ENTRY: u32 = 1 << 20;
/// Call numbers reserved per journal entry.
pub const SEQ_BLOCK: u32 = 64;
/// The journal is compacted when it grows past this many bytes and past four times its
/// last snapshot.
const COMPACT_MIN_BYTES: u64 = 1 << 20;

/// One change to the table, as written to the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Entry {
    /// An episode is open (created, reopened, or in a snapshot).
    Open {
        /// Episode id.
        id: String,
        /// Task id.
        task: String,
        /// Group id.
        #[serde(default)]
        group: String,
        /// The metadata it was created with.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        tags: BTreeMap<String, String>,
        /// It is the bound episode.
        #[serde(default)]
        bound: bool,
        /// Call numbers handed out or reserved: the next call's `seq` is at least this.
        #[serde(default)]
        calls: u32,
        /// Records of the episode that had to be dropped.
        #[serde(default)]
        dropped: u64,
    },
    /// An episode that is not open but is remembered: ended here (answered 409), or only
    /// named by calls (its calls keep numbering).
    Known {
        /// Episode id.
        id: String,
        /// Task id.
        #[serde(default)]
        task: String,
        /// Group id.
        #[serde(default)]
        group: String,
        /// Call numbers handed out or reserved.
        #[serde(default)]
        calls: u32,
        /// It ended here.
        #[serde(default)]
        ended: bool,
    },
    /// Call numbers of an episode, open or not, reserved up to `upto`.
    Calls {
        /// Episode id.
        id: String,
        /// The next call's `seq` after a restart.
        upto: u32,
    },
    /// An open episode's count of dropped records.
    Dropped {
        /// Episode id.
        id: String,
        /// Records dropped so far.
        count: u64,
    },
    /// An open episode ended (and is unbound if it was bound).
    End {
        /// Episode id.
        id: String,
    },
}

/// What reading the journal at start found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Entries read.
    pub entries: u64,
    /// Bytes cut off the end (a frame being written when the process died).
    pub torn_bytes: u64,
    /// The file was not a journal and was moved aside to this path.
    pub moved_aside: Option<PathBuf>,
}

/// The open journal file.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    file: File,
    /// Bytes in the file.
    bytes: u64,
    /// Bytes of the last snapshot (the file's size right after compaction).
    snapshot_bytes: u64,
    /// Written since the last fsync.
    dirty: bool,
    /// Writes that failed (the table stays right in memory; only a restart loses it).
    pub errors: u64,
    /// The last write error.
    pub last_error: Option<String>,
    frame: Vec<u8>,
}

fn encode_frame(entry: &Entry, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0; 8]);
    // An entry is plain strings and numbers: serializing it cannot fail.
    serde_json::to_writer(&mut *out, entry).unwrap_or_default();
    let len = (out.len() - 8) as u32;
    let crc = crc32c::crc32c(&out[8..]);
    out[0..4].copy_from_slice(&len.to_le_bytes());
    out[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// Reads the entries of a journal's bytes: those before the first cut or damaged frame,
/// and the length of the good part. `None` when the header is not a journal's.
pub fn decode(data: &[u8]) -> Option<(Vec<Entry>, usize)> {
    if data.len() < HEADER.len() {
        // A journal whose header was being written: empty.
        return HEADER.starts_with(data).then(|| (Vec::new(), 0));
    }
    if data[..4] != MAGIC || data[4] != VERSION {
        return None;
    }
    let mut entries = Vec::new();
    let mut at = HEADER.len();
    while data.len() - at >= 8 {
        let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap_or_default());
        if len > MAX_ENTRY || data.len() - at - 8 < len as usize {
            break;
        }
        let payload = &data[at + 8..at + 8 + len as usize];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        let Ok(entry) = serde_json::from_slice::<Entry>(payload) else {
            break;
        };
        entries.push(entry);
        at += 8 + len as usize;
    }
    Some((entries, at))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Journal {
    /// Opens (or creates) the journal in `dir` and returns what it holds.
    pub fn open(dir: &Path) -> io::Result<(Journal, Vec<Entry>, Recovery)> {
        fs::create_dir_all(dir)?;
        let path = dir.join(FILE_NAME);
        let tmp = dir.join(format!("{FILE_NAME}.tmp"));
        match fs::remove_file(&tmp) {
            Ok(()) => {
                tracing::warn!(path = %tmp.display(), "deleted an unfinished episode snapshot")
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut recovery = Recovery::default();
        let mut data = Vec::new();
        match File::open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut data)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let (entries, good) = match decode(&data) {
            Some(found) => found,
            None => {
                let aside = dir.join(format!("{FILE_NAME}.corrupt"));
                fs::rename(&path, &aside)?;
                tracing::error!(
                    path = %path.display(),
                    moved_to = %aside.display(),
                    "the episode journal is not one (bad header); moved aside, starting with no open episodes"
                );
                recovery.moved_aside = Some(aside);
                data.clear();
                (Vec::new(), 0)
            }
        };
        recovery.entries = entries.len() as u64;
        recovery.torn_bytes = (data.len() - good) as u64;
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)?;
        if good < HEADER.len() {
            file.set_len(0)?;
            file.write_all(&HEADER)?;
        } else if recovery.torn_bytes > 0 {
            file.set_len(good as u64)?;
        }
        let bytes = (good.max(HEADER.len())) as u64;
        let journal = Journal {
            dir: dir.to_owned(),
            file,
            bytes,
            snapshot_bytes: bytes,
            dirty: true,
            errors: 0,
            last_error: None,
            frame: Vec::new(),
        };
        Ok((journal, entries, recovery))
    }

    fn failed(&mut self, what: &str, error: &io::Error) {
        self.errors += 1;
        let message = format!("{what} {}: {error}", self.dir.join(FILE_NAME).display());
        if self.errors == 1 || self.errors.is_power_of_two() {
            tracing::error!(
                errors = self.errors,
                "{message}; open episodes live on in memory but would be forgotten by a restart"
            );
        }
        self.last_error = Some(message);
    }

    /// Appends one entry. A failed write is counted and logged, never returned: the
    /// table in memory is right either way.
    pub fn append(&mut self, entry: &Entry) {
        let mut frame = std::mem::take(&mut self.frame);
        encode_frame(entry, &mut frame);
        match self.file.write_all(&frame) {
            Ok(()) => {
                self.bytes += frame.len() as u64;
                self.dirty = true;
            }
            Err(e) => {
                self.failed("cannot write the episode journal", &e);
                // A partial frame is cut at the next start; later frames would not be
                // read past it, so take the file's true length for the next write.
                if let Ok(meta) = self.file.metadata() {
                    self.bytes = meta.len();
                }
            }
        }
        self.frame = frame;
    }

    /// Whether the journal has grown enough to be rewritten as a snapshot.
    pub fn wants_compaction(&self) -> bool {
        self.bytes > COMPACT_MIN_BYTES && self.bytes > 4 * self.snapshot_bytes
    }

    /// Replaces the journal by a snapshot holding `entries` (the whole table).
    pub fn compact(&mut self, entries: impl IntoIterator<Item = Entry>) {
        if let Err(e) = self.try_compact(entries) {
            self.failed("cannot compact the episode journal", &e);
        }
    }

    fn try_compact(&mut self, entries: impl IntoIterator<Item = Entry>) -> io::Result<()> {
        let path = self.dir.join(FILE_NAME);
        let tmp = self.dir.join(format!("{FILE_NAME}.tmp"));
        let mut out = io::BufWriter::new(File::create(&tmp)?);
        out.write_all(&HEADER)?;
        let mut bytes = HEADER.len() as u64;
        for entry in entries {
            encode_frame(&entry, &mut self.frame);
            out.write_all(&self.frame)?;
            bytes += self.frame.len() as u64;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_data()?;
        fs::rename(&tmp, &path)?;
        sync_dir(&self.dir)?;
        self.file = OpenOptions::new().append(true).read(true).open(&path)?;
        self.bytes = bytes;
        self.snapshot_bytes = bytes;
        self.dirty = false;
        Ok(())
    }

    /// The file to fsync, if anything was written since the last call (run the fsync
    /// outside the table's lock).
    pub fn sync_job(&mut self) -> Option<io::Result<File>> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        Some(self.file.try_clone())
    }

    /// Bytes in the journal.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(id: &str) -> Entry {
        Entry::Open {
            id: id.into(),
            task: "t".into(),
            group: "g".into(),
            tags: BTreeMap::from([("k".into(), "v".into())]),
            bound: false,
            calls: 0,
            dropped: 0,
        }
    }

    #[test]
    fn entries_come_back_in_order_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, entries, _) = Journal::open(dir.path()).unwrap();
        assert!(entries.is_empty());
        let written = vec![
            open("a"),
            Entry::Calls {
                id: "a".into(),
                upto: 64,
            },
            Entry::End { id: "a".into() },
        ];
        for e in &written {
            j.append(e);
        }
        drop(j);
        let (_, entries, recovery) = Journal::open(dir.path()).unwrap();
        assert_eq!(entries, written);
        assert_eq!(recovery.torn_bytes, 0);
    }

    #[test]
    fn a_kill_at_any_byte_leaves_a_readable_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        let written: Vec<Entry> = (0..5).map(|i| open(&format!("e{i}"))).collect();
        let mut ends = vec![HEADER.len()];
        for e in &written {
            j.append(e);
            ends.push(j.bytes() as usize);
        }
        drop(j);
        let whole = fs::read(dir.path().join(FILE_NAME)).unwrap();
        for cut in 0..=whole.len() {
            let (entries, good) = decode(&whole[..cut]).expect("every prefix is a journal");
            let whole_frames = ends
                .iter()
                .filter(|&&end| end <= cut)
                .count()
                .saturating_sub(1);
            assert_eq!(entries, written[..whole_frames], "cut at {cut}");
            assert!(good <= cut);
        }
        // Reopening a cut file truncates the torn frame and appends after the good ones.
        fs::write(dir.path().join(FILE_NAME), &whole[..whole.len() - 3]).unwrap();
        let (mut j, entries, recovery) = Journal::open(dir.path()).unwrap();
        assert_eq!(entries, written[..4]);
        assert!(recovery.torn_bytes > 0);
        j.append(&open("after"));
        drop(j);
        let (_, entries, _) = Journal::open(dir.path()).unwrap();
        assert_eq!(entries.len(), 5);
        assert_eq!(entries[4], open("after"));
    }

    #[test]
    fn a_damaged_frame_ends_the_read_there() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        j.append(&open("a"));
        let first_end = j.bytes() as usize;
        j.append(&open("b"));
        drop(j);
        let path = dir.path().join(FILE_NAME);
        let mut data = fs::read(&path).unwrap();
        data[first_end + 10] ^= 0x55;
        fs::write(&path, &data).unwrap();
        let (_, entries, recovery) = Journal::open(dir.path()).unwrap();
        assert_eq!(entries, [open("a")]);
        assert_eq!(recovery.torn_bytes, (data.len() - first_end) as u64);
    }

    #[test]
    fn compaction_replaces_the_file_and_a_leftover_snapshot_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        for i in 0..100 {
            j.append(&open(&format!("e{i}")));
        }
        j.compact([open("kept")]);
        j.append(&Entry::End { id: "kept".into() });
        drop(j);
        // A snapshot that a kill interrupted before its rename.
        fs::write(
            dir.path().join(format!("{FILE_NAME}.tmp")),
            b"TLEP\x01\0\0\0junk",
        )
        .unwrap();
        let (_, entries, _) = Journal::open(dir.path()).unwrap();
        assert_eq!(entries, [open("kept"), Entry::End { id: "kept".into() }]);
        assert!(!dir.path().join(format!("{FILE_NAME}.tmp")).exists());
    }

    #[test]
    fn a_file_that_is_not_a_journal_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(FILE_NAME), b"something else entirely").unwrap();
        let (mut j, entries, recovery) = Journal::open(dir.path()).unwrap();
        assert!(entries.is_empty());
        let aside = recovery.moved_aside.expect("moved aside");
        assert_eq!(fs::read(aside).unwrap(), b"something else entirely");
        j.append(&open("a"));
        drop(j);
        assert_eq!(Journal::open(dir.path()).unwrap().1, [open("a")]);
    }
}
