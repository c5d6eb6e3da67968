//! The local spool: where a record lives from the moment it is captured until the store
//! has acknowledged the segment that holds it.
//!
//! # On-disk format
//!
//! ```text
//! {spool_dir}/
//!   {first_seq:016x}.open     the file being appended to (at most one)
//!   {first_seq:016x}.sealed   closed files waiting for upload; one file = one segment
//!   {first_seq:016x}.corrupt  sealed files that failed their checks (kept for inspection)
//!   high-water                the highest sequence number ever sealed (20 decimal digits, rewritten in place)
//!
//! file   = header frame*
//! header = "TLSP" | version u8 (= 2; 1 is still read) | 3 zero bytes
//! frame  = length u32 LE | crc32c(payload) u32 LE | payload (one `Record`, protobuf, `length` bytes)
//! ```
//!
//! Version 2 files hold `LlmCall` records as captured: raw bodies, timings, transport
//! outcome; what is derived from the raw bytes (completions, usage, the final outcome)
//! is filled in by [`crate::rebuild::complete`] when the segment is built, off the
//! response path. Version 1 files (written by older sidecars) hold completed records.
//!
//! # Invariants
//!
//! - A record counts as captured once its frame has been written to the open file. The
//!   page cache survives a crash of the process; the fsyncs of [`Spool::sync_job`], run
//!   on a short interval by a thread of their own so that appends never wait for the
//!   disk, make it survive a crash of the machine.
//! - Files are only ever appended to, then sealed (fsync, then rename), then deleted once
//!   the store acknowledged the segment built from them ([`Spool::ack`]). Nothing else
//!   changes them, so the segment built from a sealed file — and its key — is the same on
//!   every retry, before and after a restart.
//! - [`Spool::open`] turns an `.open` file left by a crash into a sealed one. In every
//!   file, frames are read until the first one that is cut or fails its checksum; the
//!   file is truncated there and the loss is reported in [`Recovery`].
//! - Sequence numbers are assigned here, in append order, strictly increasing per spool
//!   across restarts: the next one is above every one on disk, above the high-water mark
//!   written at each seal (so it survives the deletion of every file), and at least the
//!   current time in microseconds. Keys of segments already uploaded never repeat.
//! - The spool never holds more than `max_bytes` of files; an append that would exceed it
//!   fails with [`AppendError::Full`] and changes nothing.
//!
//! This module holds the format, the types and the writer side of [`Spool`] (append,
//! seal, sync, forget); `read.rs` reads spool files back: the frame reader, the readers
//! of sealed files, and the recovery in [`Spool::open`].

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use prost::Message;
use tapline_proto::encode::Pieces;
use tapline_proto::{Record, RecordKind};

mod read;

pub use read::{for_each_sealed, for_each_sealed_sized, read_sealed};

const MAGIC: [u8; 4] = *b"TLSP";
const VERSION: u8 = 2;
/// The oldest file version still read.
const OLDEST_VERSION: u8 = 1;
const HEADER: [u8; 8] = [b'T', b'L', b'S', b'P', VERSION, 0, 0, 0];
/// Bytes of a frame before its payload.
pub const FRAME_OVERHEAD: u64 = 8;
/// Largest payload accepted when reading a spool file.
const MAX_FRAME: u32 = 256 << 20;

/// Why an append failed. Nothing was written either way.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppendError {
    /// The spool is at its size cap.
    #[error("spool is full ({used} of {max} bytes used)")]
    Full {
        /// Bytes in use.
        used: u64,
        /// The cap.
        max: u64,
    },
    /// The file system refused the write.
    #[error("spool write failed: {0}")]
    Io(#[from] io::Error),
}

/// A sealed file waiting for upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// Sequence number of its first record (also its file name).
    pub first_seq: u64,
    /// Its path.
    pub path: PathBuf,
    /// Records in it.
    pub records: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// `written_unix_nanos` of its first record.
    pub first_written_unix_nanos: i64,
}

/// What [`Spool::open`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Sealed files found (including the ones sealed during recovery).
    pub sealed_files: usize,
    /// Records in them, waiting for upload.
    pub records: u64,
    /// Files whose tail was torn by a crash.
    pub torn_files: usize,
    /// Bytes cut off torn tails.
    pub torn_bytes: u64,
}

#[derive(Debug)]
struct OpenFile {
    file: File,
    path: PathBuf,
    first_seq: u64,
    first_written_unix_nanos: i64,
    records: u64,
    bytes: u64,
    opened: Instant,
    dirty: bool,
}

/// The spool of one sidecar. Not shared: one writer owns it (behind a mutex).
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    open: Option<OpenFile>,
    sealed: BTreeMap<u64, Sealed>,
    bytes: u64,
    records: u64,
    next_seq: u64,
    scratch: Vec<u8>,
    /// Sealed files not yet fsynced.
    unsynced: Vec<PathBuf>,
}

/// Largest encoding buffer kept between appends; a larger one (a large call) is freed
/// after its record is written.
const SCRATCH_KEEP_BYTES: usize = 1 << 20;

fn file_name(first_seq: u64, ext: &str) -> String {
    format!("{first_seq:016x}.{ext}")
}

fn parse_name(path: &Path) -> Option<(u64, &str)> {
    let name = path.file_name()?.to_str()?;
    let (stem, ext) = name.split_once('.')?;
    if stem.len() != 16 {
        return None;
    }
    Some((u64::from_str_radix(stem, 16).ok()?, ext))
}

/// What the records of a spool file still need before they go into a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// `LlmCall` records are as captured: complete them ([`crate::rebuild::complete`]).
    AsCaptured,
    /// Records are complete (files of format version 1).
    Completed,
}

/// Deletes a spool file; one already gone is fine.
pub fn delete_file(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Records the highest sequence number handed out (write, rename; made durable by the
/// next sync job's directory fsync).
///
/// The mark is written in place, always 20 digits at offset 0, instead of through a
/// temporary file and a rename: a rename over the old file frees an inode each time, and
/// on ext4 with online discard freeing blocks waits for the disk (milliseconds) on the
/// thread that sealed, which may be the one serving requests. A torn mark reads as
/// absent, and sequence numbers then start from the clock and the files present.
fn write_high_water(dir: &Path, seq: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("high-water"))?;
    file.write_all_at(format!("{seq:020}").as_bytes(), 0)
}

/// fsyncs to run outside the spool lock: see [`Spool::sync_job`].
#[derive(Debug)]
pub struct SyncJob {
    open: Option<File>,
    sealed: Vec<PathBuf>,
    dir: PathBuf,
}

impl SyncJob {
    /// Runs the fsyncs. Files deleted meanwhile (uploaded already) are skipped.
    pub fn run(self) -> io::Result<()> {
        if let Some(file) = &self.open {
            file.sync_data()?;
        }
        for path in &self.sealed {
            match File::open(path) {
                Ok(file) => file.sync_all()?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if !self.sealed.is_empty() {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Spool {
    /// Appends a record built from the payload in `slot`; returns its sequence number.
    /// The payload is taken out of `slot` only on success, so a caller can retry a full
    /// spool without copying it.
    pub fn append(
        &mut self,
        sidecar_id: &str,
        written_unix_nanos: i64,
        slot: &mut Option<RecordKind>,
    ) -> Result<u64, AppendError> {
        let Some(kind) = slot.take() else {
            return Err(AppendError::Io(io::Error::other("nothing to append")));
        };
        let seq = self.next_seq;
        let mut record = Record::new(sidecar_id, seq, written_unix_nanos, kind);
        let payload_len = record.encoded_len() as u64;
        let frame_len = FRAME_OVERHEAD + payload_len;
        let header_len = if self.open.is_none() {
            HEADER.len() as u64
        } else {
            0
        };
        if self.bytes + frame_len + header_len > self.max_bytes {
            *slot = record.kind.take();
            return Err(AppendError::Full {
                used: self.bytes,
                max: self.max_bytes,
            });
        }
        // The encoding in pieces: a large call's bodies are written from the buffers
        // it holds, not copied into a frame buffer first. A small record is framed in
        // the scratch buffer and written at once.
        let pieces = Pieces::of(&mut record, false);
        debug_assert_eq!(pieces.len() as u64, payload_len);
        let small = frame_len as usize <= SCRATCH_KEEP_BYTES;
        self.scratch.clear();
        self.scratch
            .extend_from_slice(&(payload_len as u32).to_le_bytes());
        self.scratch
            .extend_from_slice(&pieces.crc32c().to_le_bytes());
        if small {
            // Writing into a Vec cannot fail.
            let _ = pieces.write_to(&mut self.scratch);
        }
        if self.open.is_none() {
            let path = self.dir.join(file_name(seq, "open"));
            let opened = OpenOptions::new()
                .create_new(true)
                .append(true)
                .open(&path)
                .and_then(|mut file| {
                    file.write_all(&HEADER)?;
                    Ok(file)
                });
            let file = match opened {
                Ok(file) => file,
                Err(e) => {
                    *slot = record.kind.take();
                    return Err(e.into());
                }
            };
            self.bytes += HEADER.len() as u64;
            self.open = Some(OpenFile {
                file,
                path,
                first_seq: seq,
                first_written_unix_nanos: written_unix_nanos,
                records: 0,
                bytes: HEADER.len() as u64,
                opened: Instant::now(),
                dirty: true,
            });
        }
        let open = self.open.as_mut().expect("opened above");
        let written = open.file.write_all(&self.scratch).and_then(|()| {
            if small {
                Ok(())
            } else {
                pieces.write_to(&mut open.file)
            }
        });
        if let Err(e) = written {
            // A partial frame may be on disk: cut it off so the file stays well-formed.
            let _ = open.file.set_len(open.bytes);
            *slot = record.kind.take();
            return Err(e.into());
        }
        open.records += 1;
        open.bytes += frame_len;
        open.dirty = true;
        if self.scratch.capacity() > SCRATCH_KEEP_BYTES {
            // One large call must not pin its size in memory for the life of the process.
            self.scratch = Vec::new();
        }
        self.bytes += frame_len;
        self.records += 1;
        self.next_seq += 1;
        Ok(seq)
    }

    /// Makes everything appended so far durable (fsync), if anything changed.
    pub fn sync(&mut self) -> io::Result<()> {
        if let Some(job) = self.sync_job()? {
            job.run()?;
        }
        Ok(())
    }

    /// What must be fsynced to make everything so far durable, to run without holding
    /// the spool (fsync can take long; appends must not wait for it).
    pub fn sync_job(&mut self) -> io::Result<Option<SyncJob>> {
        let open = match &mut self.open {
            Some(open) if open.dirty => {
                open.dirty = false;
                Some(open.file.try_clone()?)
            }
            _ => None,
        };
        let sealed = std::mem::take(&mut self.unsynced);
        if open.is_none() && sealed.is_empty() {
            return Ok(None);
        }
        Ok(Some(SyncJob {
            open,
            sealed,
            dir: self.dir.clone(),
        }))
    }

    /// Closes the open file for upload. Returns it, or `None` if nothing was open.
    pub fn seal(&mut self) -> io::Result<Option<Sealed>> {
        let Some(open) = self.open.take() else {
            return Ok(None);
        };
        // Remember the highest sequence number before the file can be deleted (made
        // durable by the next sync job, like the sealed file).
        write_high_water(&self.dir, self.next_seq - 1)?;
        let mark = self.dir.join("high-water");
        if !self.unsynced.contains(&mark) {
            self.unsynced.push(mark);
        }
        let path = self.dir.join(file_name(open.first_seq, "sealed"));
        fs::rename(&open.path, &path)?;
        // The fsync of the file and of the directory runs in the next sync job.
        self.unsynced.push(path.clone());
        let sealed = Sealed {
            first_seq: open.first_seq,
            path,
            records: open.records,
            bytes: open.bytes,
            first_written_unix_nanos: open.first_written_unix_nanos,
        };
        self.sealed.insert(sealed.first_seq, sealed.clone());
        Ok(Some(sealed))
    }

    /// Forgets a sealed file once the store has acknowledged its segment, and returns its
    /// path for the caller to delete outside the spool lock (deleting can wait for the
    /// disk). A file that is not deleted is uploaded again after a restart (harmless: the
    /// segment key is the same and uploads are create-only).
    pub fn forget(&mut self, first_seq: u64) -> Option<PathBuf> {
        self.end_build(first_seq);
        let sealed = self.sealed.remove(&first_seq)?;
        self.bytes = self.bytes.saturating_sub(sealed.bytes);
        self.records = self.records.saturating_sub(sealed.records);
        Some(sealed.path)
    }

    /// Deletes a sealed file once the store has acknowledged its segment.
    pub fn ack(&mut self, first_seq: u64) -> io::Result<()> {
        match self.forget(first_seq) {
            Some(path) => delete_file(&path),
            None => Ok(()),
        }
    }

    /// Moves a sealed file that cannot be read aside (`.corrupt`), so uploads go on.
    pub fn quarantine(&mut self, first_seq: u64) -> io::Result<()> {
        self.set_aside(first_seq, "corrupt")
    }

    /// Moves a sealed file aside under the extension `ext` (kept for an operator, never
    /// read again by the sidecar), so the files after it flow.
    pub fn set_aside(&mut self, first_seq: u64, ext: &str) -> io::Result<()> {
        if let Some(sealed) = self.sealed.remove(&first_seq) {
            fs::rename(&sealed.path, self.dir.join(file_name(first_seq, ext)))?;
            self.bytes = self.bytes.saturating_sub(sealed.bytes);
            self.records = self.records.saturating_sub(sealed.records);
        }
        self.end_build(first_seq);
        Ok(())
    }

    /// Notes that a segment is about to be built from the sealed file `first_seq`, and
    /// returns how many earlier builds of it began and never ended: each is a process
    /// that died while building it (an OOM kill, most likely), since a build that
    /// finishes, or fails, ends with [`Spool::end_build`]. The note is a small file
    /// beside the spool file (`.building`); the page cache keeps it through a kill.
    pub fn begin_build(&mut self, first_seq: u64) -> io::Result<u32> {
        let path = self.dir.join(file_name(first_seq, "building"));
        let before = fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .unwrap_or(0);
        fs::write(&path, format!("{}\n", before.saturating_add(1)))?;
        Ok(before)
    }

    /// Removes the note of [`Spool::begin_build`] (a build ended, well or not).
    pub fn end_build(&mut self, first_seq: u64) {
        let _ = fs::remove_file(self.dir.join(file_name(first_seq, "building")));
    }

    /// Sealed files in upload order.
    pub fn sealed(&self) -> Vec<Sealed> {
        self.sealed.values().cloned().collect()
    }

    /// Records in the open file.
    pub fn open_records(&self) -> u64 {
        self.open.as_ref().map_or(0, |o| o.records)
    }

    /// Bytes in the open file.
    pub fn open_bytes(&self) -> u64 {
        self.open.as_ref().map_or(0, |o| o.bytes)
    }

    /// How long the open file has been open.
    pub fn open_age(&self) -> Option<std::time::Duration> {
        self.open.as_ref().map(|o| o.opened.elapsed())
    }

    /// Bytes of every spool file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Records not yet acknowledged.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// `written_unix_nanos` of the oldest record not yet acknowledged.
    pub fn oldest_unacked_nanos(&self) -> Option<i64> {
        self.sealed
            .values()
            .next()
            .map(|s| s.first_written_unix_nanos)
            .or_else(|| self.open.as_ref().map(|o| o.first_written_unix_nanos))
    }

    /// The size cap.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tapline_proto::Reward;

    /// A small record, `r{i}`.
    pub(super) fn reward(i: u64) -> RecordKind {
        RecordKind::Reward(Reward {
            reward_id: format!("r{i}"),
            episode_id: "e".into(),
            value: i as f64,
            ..Default::default()
        })
    }

    fn ids(records: &[Record]) -> Vec<String> {
        records.iter().map(|r| r.id.clone()).collect()
    }

    /// The ids of the records in the sealed files, in order.
    pub(super) fn all_unacked(spool: &Spool) -> Vec<String> {
        spool
            .sealed()
            .iter()
            .flat_map(|s| ids(&read_sealed(&s.path).unwrap()))
            .collect()
    }

    #[test]
    fn sequence_numbers_stay_above_the_mark_when_the_clock_goes_back() {
        let dir = tempfile::tempdir().unwrap();
        // A mark in the old format (unpadded text) is read and then rewritten in place.
        fs::write(dir.path().join("high-water"), "7").unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 20, 5_000).unwrap();
        let mut last = 0;
        for i in 0..3 {
            last = spool.append("s", 0, &mut Some(reward(i))).unwrap();
        }
        let sealed = spool.seal().unwrap().unwrap();
        spool.sync().unwrap();
        let mark = fs::read_to_string(dir.path().join("high-water")).unwrap();
        assert_eq!(mark, format!("{last:020}"));
        // Uploaded and deleted: nothing is left on disk but the mark.
        fs::remove_file(spool.forget(sealed.first_seq).unwrap()).unwrap();
        assert_eq!(spool.records(), 0);
        drop(spool);
        // The clock now reads earlier than the sequence numbers handed out.
        let (mut again, recovery) = Spool::open(dir.path(), 1 << 20, 1).unwrap();
        assert_eq!(recovery.records, 0);
        let next = again.append("s", 0, &mut Some(reward(9))).unwrap();
        assert!(next > last, "{next} <= {last}");
        again.seal().unwrap();
        let mark = fs::read_to_string(dir.path().join("high-water")).unwrap();
        assert_eq!(mark.parse::<u64>().unwrap(), next);
    }

    #[test]
    fn build_notes_count_builds_that_never_ended() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
        spool.append("s", 0, &mut Some(reward(0))).unwrap();
        let first = spool.seal().unwrap().unwrap().first_seq;
        assert_eq!(spool.begin_build(first).unwrap(), 0);
        // The process "dies" here twice: each begin without an end is counted.
        assert_eq!(spool.begin_build(first).unwrap(), 1);
        assert_eq!(spool.begin_build(first).unwrap(), 2);
        spool.end_build(first);
        assert_eq!(
            spool.begin_build(first).unwrap(),
            0,
            "an ended build is forgotten"
        );
        // A note whose file is gone (deleted after upload, note left by a kill) is
        // removed when the spool opens; the note of a file still there is kept.
        spool.append("s", 0, &mut Some(reward(1))).unwrap();
        let second = spool.seal().unwrap().unwrap().first_seq;
        spool.begin_build(second).unwrap();
        let gone = spool.forget(first).unwrap();
        fs::remove_file(&gone).unwrap();
        fs::write(dir.path().join(file_name(first, "building")), "1\n").unwrap();
        drop(spool);
        let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
        assert!(!dir.path().join(file_name(first, "building")).exists());
        assert_eq!(spool.begin_build(second).unwrap(), 1);
        spool.set_aside(second, "unbuildable").unwrap();
        assert!(dir.path().join(file_name(second, "unbuildable")).exists());
        assert!(!dir.path().join(file_name(second, "building")).exists());
        assert_eq!(spool.records(), 0);
    }

    #[test]
    fn a_large_record_does_not_keep_its_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
        spool.append("s", 0, &mut Some(reward(0))).unwrap();
        let small = spool.scratch.capacity();
        assert!(small <= SCRATCH_KEEP_BYTES, "{small}");
        let mut big = Some(RecordKind::Reward(Reward {
            reward_id: "big".into(),
            episode_id: "e".into(),
            tags: [("blob".to_owned(), "x".repeat(20 << 20))].into(),
            ..Default::default()
        }));
        spool.append("s", 0, &mut big).unwrap();
        assert!(
            spool.scratch.capacity() <= SCRATCH_KEEP_BYTES,
            "a 20 MiB record left a {} byte buffer behind",
            spool.scratch.capacity()
        );
        spool.append("s", 0, &mut Some(reward(2))).unwrap();
        spool.seal().unwrap();
        assert_eq!(all_unacked(&spool).len(), 3);
    }

    #[test]
    fn the_cap_refuses_appends_without_writing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 200, 0).unwrap();
        let mut accepted = 0;
        loop {
            match spool.append("s", 1, &mut Some(reward(accepted))) {
                Ok(_) => accepted += 1,
                Err(AppendError::Full { used, max }) => {
                    assert!(used <= max);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(accepted > 0);
        assert!(spool.bytes() <= 200);
        let before = spool.bytes();
        let mut slot = Some(reward(99));
        assert!(spool.append("s", 1, &mut slot).is_err());
        assert!(slot.is_some(), "a refused payload is given back");
        assert_eq!(spool.bytes(), before);
        let sealed = spool.seal().unwrap().unwrap();
        spool.ack(sealed.first_seq).unwrap();
        assert_eq!(spool.bytes(), 0);
        spool.append("s", 1, &mut Some(reward(100))).unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append,
        Seal,
        AckOldest,
        Sync,
        Restart,
        TearOpenTail,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => Just(Op::Append),
            2 => Just(Op::Seal),
            2 => Just(Op::AckOldest),
            1 => Just(Op::Sync),
            1 => Just(Op::Restart),
            1 => Just(Op::TearOpenTail),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// The spool against a model: the records not yet acknowledged, in order.
        #[test]
        fn spool_matches_a_model(ops in proptest::collection::vec(op(), 1..60)) {
            let dir = tempfile::tempdir().unwrap();
            let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
            // Model: sealed groups and the open group, each a list of record ids.
            let mut sealed: Vec<Vec<String>> = Vec::new();
            let mut open: Vec<String> = Vec::new();
            let mut next = 0u64;
            let mut last_seq = 0u64;
            for op in ops {
                match op {
                    Op::Append => {
                        let seq = spool.append("s", 1, &mut Some(reward(next))).unwrap();
                        prop_assert!(seq > last_seq, "sequence numbers increase");
                        last_seq = seq;
                        open.push(format!("r{next}"));
                        next += 1;
                    }
                    Op::Seal => {
                        if spool.seal().unwrap().is_some() {
                            sealed.push(std::mem::take(&mut open));
                        } else {
                            prop_assert!(open.is_empty());
                        }
                    }
                    Op::AckOldest => {
                        if let Some(first) = spool.sealed().first() {
                            spool.ack(first.first_seq).unwrap();
                            sealed.remove(0);
                        }
                    }
                    Op::Sync => spool.sync().unwrap(),
                    Op::Restart => {
                        drop(spool);
                        let reopened = Spool::open(dir.path(), 1 << 30, 0).unwrap();
                        spool = reopened.0;
                        prop_assert_eq!(reopened.1.torn_files, 0);
                        if !open.is_empty() {
                            sealed.push(std::mem::take(&mut open));
                        }
                    }
                    Op::TearOpenTail => {
                        // A crash in the middle of appending the next record.
                        if let Some(o) = &spool.open {
                            let mut f = OpenOptions::new().append(true).open(&o.path).unwrap();
                            f.write_all(&[200, 0, 0, 0, 7]).unwrap();
                        }
                        drop(spool);
                        let reopened = Spool::open(dir.path(), 1 << 30, 0).unwrap();
                        spool = reopened.0;
                        if !open.is_empty() {
                            prop_assert_eq!(reopened.1.torn_files, 1);
                            sealed.push(std::mem::take(&mut open));
                        }
                    }
                }
                let expected: Vec<String> = sealed.iter().flatten().cloned().collect();
                prop_assert_eq!(all_unacked(&spool), expected);
                prop_assert_eq!(spool.records(), (sealed.iter().map(Vec::len).sum::<usize>() + open.len()) as u64);
            }
        }
    }
}
