//! Reading spool files back: the frame reader (every frame checked, reading stops at
//! the first one cut or damaged), the readers of sealed files the segment builder uses,
//! and [`Spool::open`], which recovers a spool directory after a crash (torn tails cut,
//! `.open` files sealed, sequence numbers continued above everything seen).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;
use tapline_proto::Record;

use super::{
    FRAME_OVERHEAD, HEADER, MAGIC, MAX_FRAME, OLDEST_VERSION, Recovery, Sealed, Spool, Stored,
    VERSION, file_name, parse_name, sync_dir, write_high_water,
};

/// Reads the frames of a spool file. Returns the records, the offset after the last good
/// frame, and whether anything followed it (a torn or corrupted tail).
/// Hands each good record of a spool file to `each`, one at a time (a whole file's
/// records are never in memory together). Returns the offset after the last good frame
/// and whether anything followed it (a torn or corrupted tail).
fn visit_frames(
    path: &Path,
    each: impl FnMut(Record, Stored) -> io::Result<()>,
) -> io::Result<(u64, bool)> {
    visit_frames_sized(path, |_| {}, each)
}

/// [`visit_frames`], telling `before` each frame's length before its payload is read.
fn visit_frames_sized(
    path: &Path,
    mut before: impl FnMut(u32),
    mut each: impl FnMut(Record, Stored) -> io::Result<()>,
) -> io::Result<(u64, bool)> {
    let mut reader = BufReader::new(File::open(path)?);
    let mut header = [0u8; 8];
    let mut got = 0;
    while got < header.len() {
        let n = reader.read(&mut header[got..])?;
        if n == 0 {
            break;
        }
        got += n;
    }
    if got < header.len()
        || header[..4] != MAGIC
        || !(OLDEST_VERSION..=VERSION).contains(&header[4])
    {
        return Ok((0, got > 0));
    }
    let stored = if header[4] >= 2 {
        Stored::AsCaptured
    } else {
        Stored::Completed
    };
    let mut good = HEADER.len() as u64;
    loop {
        let mut head = [0u8; 8];
        let mut got = 0;
        while got < head.len() {
            let n = reader.read(&mut head[got..])?;
            if n == 0 {
                break;
            }
            got += n;
        }
        if got == 0 {
            return Ok((good, false));
        }
        if got < head.len() {
            return Ok((good, true));
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_FRAME {
            return Ok((good, true));
        }
        before(len);
        // Each payload gets its own buffer: the record decodes its bodies as slices of
        // it (`Bytes`), so a large call is in memory once, not read and then copied.
        let mut payload = vec![0; len as usize];
        if reader.read_exact(&mut payload).is_err() || crc32c::crc32c(&payload) != crc {
            return Ok((good, true));
        }
        match Record::decode(bytes::Bytes::from(payload)) {
            Ok(record) => each(record, stored)?,
            Err(_) => return Ok((good, true)),
        }
        good += FRAME_OVERHEAD + u64::from(len);
    }
}

/// Hands every record of a sealed file to `each`, in order, with what it still needs;
/// an error if the file fails any check (after the records before the damage were
/// handed over).
pub fn for_each_sealed(
    path: &Path,
    each: impl FnMut(Record, Stored) -> io::Result<()>,
) -> io::Result<()> {
    for_each_sealed_sized(path, |_| {}, each)
}

/// [`for_each_sealed`], telling `before` each record's frame length before it is read
/// (the segment builder reserves its memory there).
pub fn for_each_sealed_sized(
    path: &Path,
    before: impl FnMut(u32),
    mut each: impl FnMut(Record, Stored) -> io::Result<()>,
) -> io::Result<()> {
    let mut records = 0u64;
    let (_, damaged) = visit_frames_sized(path, before, |record, stored| {
        records += 1;
        each(record, stored)
    })?;
    if damaged {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "spool file {} is damaged after {records} good records",
                path.display(),
            ),
        ));
    }
    Ok(())
}

/// Reads every record of a sealed file as stored (see [`Stored`]); an error if the file
/// fails any check.
pub fn read_sealed(path: &Path) -> io::Result<Vec<Record>> {
    let mut records = Vec::new();
    for_each_sealed(path, |record, _| {
        records.push(record);
        Ok(())
    })?;
    Ok(records)
}

impl Spool {
    /// Opens (or creates) the spool in `dir`, recovering from a crash if needed.
    pub fn open(dir: &Path, max_bytes: u64, now_micros: u64) -> io::Result<(Spool, Recovery)> {
        fs::create_dir_all(dir)?;
        let mut spool = Spool {
            dir: dir.to_owned(),
            max_bytes,
            open: None,
            sealed: BTreeMap::new(),
            bytes: 0,
            records: 0,
            next_seq: 1,
            scratch: Vec::new(),
            unsynced: Vec::new(),
        };
        let mut recovery = Recovery::default();
        let mut max_seq = 0u64;
        let mut entries: Vec<PathBuf> = fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for path in entries {
            let Some((first_seq, ext)) = parse_name(&path) else {
                continue;
            };
            match ext {
                "open" | "sealed" => {}
                "building" => {
                    // A build note outlives its file only if the process died between
                    // deleting the file and the note.
                    if !dir.join(file_name(first_seq, "sealed")).exists() {
                        let _ = fs::remove_file(&path);
                    }
                    continue;
                }
                _ => continue,
            }
            // Counted, not collected: recovery holds one record at a time.
            let (mut count, mut first_written, mut last_seq) = (0u64, 0i64, 0u64);
            let (good_len, damaged) = visit_frames(&path, |record, _| {
                if count == 0 {
                    first_written = record.written_unix_nanos;
                }
                count += 1;
                last_seq = record.sidecar_seq;
                Ok(())
            })?;
            if damaged {
                // A crash (of the process or the machine, before a background fsync)
                // cut the file: keep the good frames, cut the rest.
                let len = fs::metadata(&path)?.len();
                recovery.torn_files += 1;
                recovery.torn_bytes += len.saturating_sub(good_len);
                let mut file = OpenOptions::new().write(true).open(&path)?;
                file.set_len(good_len.max(HEADER.len() as u64))?;
                if good_len < HEADER.len() as u64 {
                    // Not even a header survived: rewrite it so the file reads as empty.
                    file.write_all(&HEADER)?;
                }
                file.sync_all()?;
            }
            if count == 0 {
                fs::remove_file(&path)?;
                continue;
            }
            if ext == "open" {
                fs::rename(&path, dir.join(file_name(first_seq, "sealed")))?;
                sync_dir(dir)?;
            }
            let bytes = fs::metadata(dir.join(file_name(first_seq, "sealed")))?.len();
            max_seq = max_seq.max(last_seq);
            let info = Sealed {
                first_seq,
                path: dir.join(file_name(first_seq, "sealed")),
                records: count,
                bytes,
                first_written_unix_nanos: first_written,
            };
            spool.bytes += bytes;
            spool.records += info.records;
            recovery.sealed_files += 1;
            recovery.records += info.records;
            spool.sealed.insert(first_seq, info);
        }
        let mark = fs::read_to_string(dir.join("high-water"))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if max_seq > mark {
            write_high_water(dir, max_seq)?;
        }
        max_seq = max_seq.max(mark);
        spool.next_seq = (max_seq + 1).max(now_micros).max(1);
        Ok((spool, recovery))
    }
}

#[cfg(test)]
mod tests {
    use std::fs::{self, OpenOptions};
    use std::io::Write;

    use super::super::Spool;
    use super::super::tests::{all_unacked, reward};

    #[test]
    fn a_torn_tail_is_cut_and_the_good_records_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        for i in 0..5 {
            spool.append("s", 1, &mut Some(reward(i))).unwrap();
        }
        let path = spool.open.as_ref().unwrap().path.clone();
        drop(spool);
        // A crash in the middle of the next frame: a length, a crc, half a payload.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[40, 0, 0, 0, 1, 2, 3, 4, 9, 9, 9]).unwrap();
        drop(f);
        let (spool, recovery) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        assert_eq!(recovery.torn_files, 1);
        assert_eq!(recovery.torn_bytes, 11);
        assert_eq!(recovery.records, 5);
        assert_eq!(all_unacked(&spool), ["r0", "r1", "r2", "r3", "r4"]);
        assert!(
            spool.next_seq > 5,
            "sequence numbers continue after the recovered ones"
        );
    }

    #[test]
    fn a_flipped_bit_in_an_open_file_ends_recovery_there() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        for i in 0..3 {
            spool.append("s", 1, &mut Some(reward(i))).unwrap();
        }
        let path = spool.open.as_ref().unwrap().path.clone();
        drop(spool);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 0x10;
        fs::write(&path, bytes).unwrap();
        let (spool, recovery) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        assert_eq!(recovery.torn_files, 1);
        assert_eq!(all_unacked(&spool), ["r0", "r1"]);
    }
}
