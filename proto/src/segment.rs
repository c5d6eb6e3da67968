//! Segment objects: many [`Record`]s in one compressed, checksummed object.
//!
//! Version 2 (written since tapline 0.2): the header and the trailer are zstd
//! *skippable frames*, so the whole object is a valid zstd stream and `zstd -dc` of it
//! yields the body — the length-delimited record stream — as is:
//!
//! ```text
//! header  16 bytes   skippable frame: magic 0x184D2A5E u32 LE | frame size u32 LE (= 8)
//!                    | "TLSG" | version u8 (= 2) | flags u8 (= 0) | reserved u16 (= 0)
//! body               one zstd frame (with content checksum) whose content is a sequence
//!                    of length-delimited records: varint(len) | Record protobuf (len bytes)
//! trailer 32 bytes   skippable frame: magic 0x184D2A5E u32 LE | frame size u32 LE (= 24)
//!                    | record count u64 LE | body length u64 LE (uncompressed bytes)
//!                    | crc32c u32 LE | end magic "GSLT"
//! ```
//!
//! Version 1 (tapline 0.1) is the same without the two skippable-frame prefixes: an
//! 8-byte header `"TLSG" | 1 | 0 | 0 0` and a 24-byte trailer. The reader reads both;
//! [`SegmentWriter::with_version`] still writes version 1, for readers not yet upgraded.
//!
//! The crc32c covers every byte before it: header, compressed body, the trailer's frame
//! prefix, count and length. Together with the end magic, the frame prefixes and the
//! count and length checks, every single-byte corruption and every truncation of a valid
//! object is reported as an error.
//!
//! The reader streams: it holds one input buffer, the zstd window (capped by
//! [`Limits::max_window_log`]) and at most one record (capped by
//! [`Limits::max_record_bytes`]), whatever the size of the object. A record larger than
//! that limit is skipped, not the segment: its length prefix says where the next record
//! starts, its bytes are decompressed and checksummed but never held, and the reader
//! names it ([`SegmentReader::skipped`]) so the records around it are not lost with it.
//! A streaming reader hands records out before it has seen the trailer, so a record is
//! only known to be good once [`SegmentReader::next_record`] has returned `Ok(None)`;
//! [`read_segment`] and [`decode_segment`] return nothing unless the whole object
//! verified.

use std::io::{self, Read, Write};

use prost::Message;
use zstd::stream::raw::{Decoder as RawDecoder, InBuffer, Operation, OutBuffer};

use crate::Record;

/// First four bytes of every segment object.
pub const MAGIC: [u8; 4] = *b"TLSG";
/// Last four bytes of every segment object.
pub const END_MAGIC: [u8; 4] = *b"GSLT";
/// The format version this crate writes by default, and the newest it reads.
pub const VERSION: u8 = 2;
/// The oldest format version this crate reads and writes.
pub const OLDEST_VERSION: u8 = 1;
/// The zstd skippable-frame magic number (one of 0x184D2A50..=0x184D2A5F) that frames
/// the header and the trailer of a version 2 segment; little-endian in the object.
pub const SKIPPABLE_MAGIC: u32 = 0x184D_2A5E;
/// Size of the header in bytes (version 2).
pub const HEADER_LEN: usize = 16;
/// Size of the trailer in bytes (version 2).
pub const TRAILER_LEN: usize = 32;
/// Size of a version 1 header in bytes.
pub const V1_HEADER_LEN: usize = 8;
/// Size of a version 1 trailer in bytes.
pub const V1_TRAILER_LEN: usize = 24;
/// Bytes of a skippable frame's prefix: magic and frame size.
const FRAME_PREFIX_LEN: usize = 8;
/// Default zstd level for segments.
pub const DEFAULT_LEVEL: i32 = 3;

/// Why a segment could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SegmentError {
    /// The object does not start with the segment magic: it is not a segment.
    #[error("not a tapline segment: expected magic {expected:?}, found {found:?}")]
    WrongMagic {
        /// The magic bytes expected.
        expected: [u8; 4],
        /// The bytes found.
        found: Vec<u8>,
    },
    /// The object was written by a newer tapline; upgrade the reader.
    #[error(
        "segment format version {version} is newer than this reader supports ({supported}); upgrade tapline to read it"
    )]
    FutureVersion {
        /// Version in the header.
        version: u8,
        /// Newest version this reader supports.
        supported: u8,
    },
    /// The object ends early: an interrupted upload or a partial read.
    #[error("segment is truncated: it ends inside the {part}")]
    Truncated {
        /// Which part of the object was cut.
        part: &'static str,
    },
    /// The object's bytes are damaged.
    #[error("segment is corrupted: {detail}")]
    Corrupted {
        /// What check failed.
        detail: String,
    },
    /// The object exceeds a memory limit of the reader.
    #[error("segment exceeds reader limit: {detail}")]
    LimitExceeded {
        /// Which limit, and by how much.
        detail: String,
    },
    /// Reading the source or writing the sink failed.
    #[error("segment I/O error: {0}")]
    Io(#[from] io::Error),
}

impl SegmentError {
    fn corrupted(detail: impl Into<String>) -> Self {
        SegmentError::Corrupted {
            detail: detail.into(),
        }
    }
}

/// Memory limits of a [`SegmentReader`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest single record accepted, in bytes.
    pub max_record_bytes: usize,
    /// Largest total decompressed body accepted, in bytes.
    pub max_body_bytes: u64,
    /// Largest zstd window accepted (log2 of bytes); bounds the decoder's memory.
    pub max_window_log: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_record_bytes: 64 << 20,
            max_body_bytes: 4 << 30,
            max_window_log: 27,
        }
    }
}

/// What a finished [`SegmentWriter`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSummary {
    /// Number of records.
    pub records: u64,
    /// Uncompressed body bytes (length prefixes included).
    pub body_bytes: u64,
    /// Total object size in bytes, header and trailer included.
    pub object_bytes: u64,
    /// The trailer's crc32c.
    pub crc32c: u32,
}

/// A `Write` that keeps a running crc32c and byte count of what passes through it.
#[derive(Debug)]
struct Checksummed<W> {
    inner: W,
    crc: u32,
    written: u64,
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes one segment object to a `Write`.
pub struct SegmentWriter<W: Write> {
    encoder: zstd::stream::write::Encoder<'static, Checksummed<W>>,
    version: u8,
    records: u64,
    body_bytes: u64,
}

impl<W: Write> std::fmt::Debug for SegmentWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentWriter")
            .field("records", &self.records)
            .field("body_bytes", &self.body_bytes)
            .finish_non_exhaustive()
    }
}

impl<W: Write> SegmentWriter<W> {
    /// Starts a segment of the current format ([`VERSION`]) with the given zstd level
    /// (1..=22; [`DEFAULT_LEVEL`] is a good choice).
    pub fn new(sink: W, level: i32) -> Result<Self, SegmentError> {
        Self::with_version(sink, level, VERSION)
    }

    /// Starts a segment of format `version` ([`OLDEST_VERSION`]..=[`VERSION`]): version 1
    /// is for readers older than tapline 0.2, during an upgrade.
    pub fn with_version(sink: W, level: i32, version: u8) -> Result<Self, SegmentError> {
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(SegmentError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "segment format version {version} cannot be written: use {OLDEST_VERSION} to {VERSION}"
                ),
            )));
        }
        let mut sink = Checksummed {
            inner: sink,
            crc: 0,
            written: 0,
        };
        if version >= 2 {
            sink.write_all(&frame_prefix(V1_HEADER_LEN))?;
        }
        sink.write_all(&header(version))?;
        let mut encoder = zstd::stream::write::Encoder::new(sink, level)?;
        encoder.include_checksum(true)?;
        Ok(SegmentWriter {
            encoder,
            version,
            records: 0,
            body_bytes: 0,
        })
    }

    /// Appends one record.
    pub fn append(&mut self, record: &Record) -> Result<(), SegmentError> {
        let encoded = record.encode_length_delimited_to_vec();
        self.encoder.write_all(&encoded)?;
        self.records += 1;
        self.body_bytes += encoded.len() as u64;
        Ok(())
    }

    /// Appends one record, as [`append`](Self::append) does, but writes a large call's
    /// bodies into the compressor from the buffers the record holds instead of encoding
    /// the whole record into one buffer first (see [`crate::encode::Pieces`]). The
    /// record is the same when this returns.
    pub fn append_in_place(&mut self, record: &mut Record) -> Result<(), SegmentError> {
        let pieces = crate::encode::Pieces::of(record, true);
        pieces.write_to(&mut self.encoder)?;
        self.records += 1;
        self.body_bytes += pieces.len() as u64;
        Ok(())
    }

    /// Number of records appended so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Uncompressed body bytes appended so far.
    pub fn body_bytes(&self) -> u64 {
        self.body_bytes
    }

    /// Ends the zstd frame, writes the trailer, and returns the sink.
    pub fn finish(self) -> Result<(W, SegmentSummary), SegmentError> {
        let mut sink = self.encoder.finish()?;
        if self.version >= 2 {
            sink.write_all(&frame_prefix(V1_TRAILER_LEN))?;
        }
        let mut tail = [0u8; 16];
        tail[..8].copy_from_slice(&self.records.to_le_bytes());
        tail[8..].copy_from_slice(&self.body_bytes.to_le_bytes());
        sink.write_all(&tail)?;
        let crc = sink.crc;
        let mut end = [0u8; 8];
        end[..4].copy_from_slice(&crc.to_le_bytes());
        end[4..].copy_from_slice(&END_MAGIC);
        sink.inner.write_all(&end)?;
        sink.inner.flush()?;
        let summary = SegmentSummary {
            records: self.records,
            body_bytes: self.body_bytes,
            object_bytes: sink.written + end.len() as u64,
            crc32c: crc,
        };
        Ok((sink.inner, summary))
    }
}

/// The tapline header proper: the whole header of version 1, the skippable frame's
/// content in version 2.
fn header(version: u8) -> [u8; V1_HEADER_LEN] {
    let mut h = [0u8; V1_HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = version;
    h
}

/// A skippable frame's magic and the size of the `content_len` bytes that follow it.
fn frame_prefix(content_len: usize) -> [u8; FRAME_PREFIX_LEN] {
    let mut p = [0u8; FRAME_PREFIX_LEN];
    p[..4].copy_from_slice(&SKIPPABLE_MAGIC.to_le_bytes());
    p[4..].copy_from_slice(&(content_len as u32).to_le_bytes());
    p
}

/// Encodes records into one segment object (of the current format) in memory.
pub fn encode_segment<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    level: i32,
) -> Result<(Vec<u8>, SegmentSummary), SegmentError> {
    encode_segment_version(records, level, VERSION)
}

/// [`encode_segment`] in format `version` (see [`SegmentWriter::with_version`]).
pub fn encode_segment_version<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    level: i32,
    version: u8,
) -> Result<(Vec<u8>, SegmentSummary), SegmentError> {
    let mut writer = SegmentWriter::with_version(Vec::new(), level, version)?;
    for record in records {
        writer.append(record)?;
    }
    writer.finish()
}

/// A record the reader passed over because it is larger than
/// [`Limits::max_record_bytes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRecord {
    /// Its position in the segment (0-based, counting every record).
    pub index: u64,
    /// Its encoded size in bytes.
    pub bytes: u64,
}

impl std::fmt::Display for SkippedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "record {} ({} bytes) is larger than the reader's limit and was skipped",
            self.index, self.bytes
        )
    }
}

/// The records of a verified segment object, and those skipped as too large.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SegmentContents {
    /// Every record the reader could hold, in order.
    pub records: Vec<Record>,
    /// Records over [`Limits::max_record_bytes`], passed over.
    pub skipped: Vec<SkippedRecord>,
}

/// Reads a whole segment object: its records and the oversized ones it skipped, only if
/// every check of the object passed.
pub fn read_segment(bytes: &[u8], limits: Limits) -> Result<SegmentContents, SegmentError> {
    let mut reader = SegmentReader::new(bytes, limits)?;
    let mut records = Vec::new();
    while let Some(record) = reader.next_record()? {
        records.push(record);
    }
    Ok(SegmentContents {
        records,
        skipped: reader.skipped,
    })
}

/// Decodes a whole segment object; returns the records only if every check passed and
/// no record exceeded [`Limits::max_record_bytes`] (use [`read_segment`] to read the
/// others).
pub fn decode_segment(bytes: &[u8], limits: Limits) -> Result<Vec<Record>, SegmentError> {
    let contents = read_segment(bytes, limits)?;
    if let Some(first) = contents.skipped.first() {
        return Err(SegmentError::LimitExceeded {
            detail: format!(
                "record {} is {} bytes, more than the limit of {} bytes",
                first.index, first.bytes, limits.max_record_bytes
            ),
        });
    }
    Ok(contents.records)
}

const INPUT_CHUNK: usize = 64 << 10;
const OUTPUT_CHUNK: usize = 64 << 10;

/// Streams the records of one segment object out of a `Read`.
pub struct SegmentReader<R> {
    source: R,
    limits: Limits,
    version: u8,
    decoder: RawDecoder<'static>,
    /// Compressed bytes read from `source` and not yet consumed: `input[input_pos..]`.
    input: Vec<u8>,
    input_pos: usize,
    source_eof: bool,
    /// Decompressed bytes not yet parsed: `output[output_pos..]`.
    output: Vec<u8>,
    output_pos: usize,
    frame_done: bool,
    decoder_full: bool,
    finished: bool,
    crc: u32,
    records: u64,
    body_bytes: u64,
    /// Bytes of an oversized record still to pass over.
    skipping: u64,
    skipped: Vec<SkippedRecord>,
}

impl<R> std::fmt::Debug for SegmentReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentReader")
            .field("records", &self.records)
            .field("body_bytes", &self.body_bytes)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<R: Read> SegmentReader<R> {
    /// Reads and checks the header (of either format version).
    pub fn new(mut source: R, limits: Limits) -> Result<Self, SegmentError> {
        let skippable = SKIPPABLE_MAGIC.to_le_bytes();
        let mut h = [0u8; HEADER_LEN];
        let n = read_full(&mut source, &mut h[..4])?;
        if n < 4 {
            return Err(if n == 0 {
                SegmentError::Truncated {
                    part: "header (the object is empty)",
                }
            } else if h[..n] == MAGIC[..n] || h[..n] == skippable[..n] {
                SegmentError::Truncated { part: "header" }
            } else {
                SegmentError::WrongMagic {
                    expected: MAGIC,
                    found: h[..n].to_vec(),
                }
            });
        }
        let (len, framed) = if h[..4] == MAGIC {
            (V1_HEADER_LEN, false)
        } else if h[..4] == skippable {
            (HEADER_LEN, true)
        } else {
            return Err(SegmentError::WrongMagic {
                expected: MAGIC,
                found: h[..4].to_vec(),
            });
        };
        if 4 + read_full(&mut source, &mut h[4..len])? < len {
            return Err(SegmentError::Truncated { part: "header" });
        }
        // The tapline header proper: all of version 1, the frame's content in version 2.
        let inner = &h[len - V1_HEADER_LEN..len];
        if framed && inner[..4] != MAGIC {
            return Err(SegmentError::WrongMagic {
                expected: MAGIC,
                found: inner[..4].to_vec(),
            });
        }
        let version = inner[4];
        match (framed, version) {
            (false, 1) | (true, 2..=VERSION) => {}
            (_, v) if v > VERSION => {
                return Err(SegmentError::FutureVersion {
                    version: v,
                    supported: VERSION,
                });
            }
            (false, v) => {
                return Err(SegmentError::corrupted(format!(
                    "a bare header names format version {v}: only version 1 has one"
                )));
            }
            (true, v) => {
                return Err(SegmentError::corrupted(format!(
                    "a framed header names format version {v}: framing started with version 2"
                )));
            }
        }
        if framed && h[4..8] != (V1_HEADER_LEN as u32).to_le_bytes() {
            return Err(SegmentError::corrupted(format!(
                "header frame size is {}, not {V1_HEADER_LEN}",
                u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"))
            )));
        }
        if inner[5..] != [0, 0, 0] {
            return Err(SegmentError::corrupted(format!(
                "header flags {:02x?} are not zero",
                &inner[5..]
            )));
        }
        let mut decoder = RawDecoder::new()?;
        decoder.set_parameter(zstd::stream::raw::DParameter::WindowLogMax(
            limits.max_window_log,
        ))?;
        Ok(SegmentReader {
            source,
            limits,
            version,
            decoder,
            input: Vec::with_capacity(INPUT_CHUNK),
            input_pos: 0,
            source_eof: false,
            output: Vec::new(),
            output_pos: 0,
            frame_done: false,
            decoder_full: false,
            finished: false,
            crc: crc32c::crc32c(&h[..len]),
            records: 0,
            body_bytes: 0,
            skipping: 0,
            skipped: Vec::new(),
        })
    }

    /// The format version of the segment (from its header).
    pub fn version(&self) -> u8 {
        self.version
    }

    /// Number of records passed so far (returned or skipped).
    pub fn records_read(&self) -> u64 {
        self.records
    }

    /// Records skipped so far as larger than [`Limits::max_record_bytes`].
    pub fn skipped(&self) -> &[SkippedRecord] {
        &self.skipped
    }

    /// Returns the next record, `Ok(None)` once the trailer verified, or the first error.
    /// After an error the reader returns that kind of error again, never more records.
    pub fn next_record(&mut self) -> Result<Option<Record>, SegmentError> {
        if self.finished {
            return Ok(None);
        }
        let result = self.next_inner();
        if !matches!(result, Ok(Some(_))) {
            self.finished = true;
        }
        result
    }

    fn next_inner(&mut self) -> Result<Option<Record>, SegmentError> {
        loop {
            if self.skipping > 0 {
                // Pass over what is decompressed of an oversized record, never holding it.
                let available = (self.output.len() - self.output_pos) as u64;
                let take = available.min(self.skipping);
                self.output_pos += take as usize;
                self.skipping -= take;
                if self.skipping == 0 {
                    self.records += 1;
                    continue;
                }
            }
            let pending = &self.output[self.output_pos..];
            match decode_varint(pending) {
                Varint::Invalid if self.skipping == 0 => {
                    return Err(SegmentError::corrupted("invalid record length prefix"));
                }
                Varint::Value(len, prefix) if self.skipping == 0 => {
                    if len > self.limits.max_record_bytes as u64 {
                        self.skipped.push(SkippedRecord {
                            index: self.records,
                            bytes: len,
                        });
                        self.output_pos += prefix;
                        self.skipping = len;
                        continue;
                    }
                    let end = prefix + len as usize;
                    if pending.len() >= end {
                        let record = Record::decode(&pending[prefix..end]).map_err(|e| {
                            SegmentError::corrupted(format!(
                                "record {} does not decode: {e}",
                                self.records
                            ))
                        })?;
                        self.output_pos += end;
                        self.records += 1;
                        return Ok(Some(record));
                    }
                }
                Varint::Incomplete | Varint::Invalid | Varint::Value(..) => {}
            }
            if self.frame_done {
                if self.output_pos < self.output.len() || self.skipping > 0 {
                    return Err(SegmentError::corrupted("body ends inside a record"));
                }
                self.read_trailer()?;
                return Ok(None);
            }
            self.decompress_more()?;
        }
    }

    /// Reads more compressed input when none is buffered. Returns false at end of source.
    fn fill_input(&mut self) -> Result<bool, SegmentError> {
        if self.input_pos < self.input.len() {
            return Ok(true);
        }
        if self.source_eof {
            return Ok(false);
        }
        self.input.resize(INPUT_CHUNK, 0);
        let n = loop {
            match self.source.read(&mut self.input) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        };
        self.input.truncate(n);
        self.input_pos = 0;
        if n == 0 {
            self.source_eof = true;
        }
        Ok(n > 0)
    }

    fn decompress_more(&mut self) -> Result<(), SegmentError> {
        // Drop parsed output so the buffer holds at most one record plus one chunk.
        if self.output_pos > 0 {
            self.output.drain(..self.output_pos);
            self.output_pos = 0;
        }
        let have_input = self.fill_input()?;
        if !have_input && !self.decoder_full {
            return Err(SegmentError::Truncated {
                part: "compressed body",
            });
        }
        let old_len = self.output.len();
        self.output.resize(old_len + OUTPUT_CHUNK, 0);
        let mut src = InBuffer::around(&self.input[self.input_pos..]);
        let mut dst = OutBuffer::around(&mut self.output[old_len..]);
        let hint = self.decoder.run(&mut src, &mut dst).map_err(|e| {
            SegmentError::corrupted(format!("compressed body does not decode: {e}"))
        })?;
        let consumed = src.pos();
        let produced = dst.pos();
        self.output.truncate(old_len + produced);
        self.crc = crc32c::crc32c_append(
            self.crc,
            &self.input[self.input_pos..self.input_pos + consumed],
        );
        self.input_pos += consumed;
        self.body_bytes += produced as u64;
        // A full output buffer means the decoder may hold more output for the next call.
        self.decoder_full = produced == OUTPUT_CHUNK;
        if self.body_bytes > self.limits.max_body_bytes {
            return Err(SegmentError::LimitExceeded {
                detail: format!(
                    "decompressed body is larger than the limit of {} bytes",
                    self.limits.max_body_bytes
                ),
            });
        }
        if hint == 0 {
            // zstd returns 0 only once the frame is decoded and fully flushed.
            self.frame_done = true;
        } else if consumed == 0 && produced == 0 {
            return Err(if have_input {
                SegmentError::corrupted("compressed body makes no progress")
            } else {
                SegmentError::Truncated {
                    part: "compressed body",
                }
            });
        }
        Ok(())
    }

    fn read_trailer(&mut self) -> Result<(), SegmentError> {
        // Version 2 prefixes the version 1 trailer with a skippable frame's magic and size.
        let (len, off) = if self.version >= 2 {
            (TRAILER_LEN, FRAME_PREFIX_LEN)
        } else {
            (V1_TRAILER_LEN, 0)
        };
        let mut trailer = [0u8; TRAILER_LEN];
        let mut have = 0;
        while have < len {
            if !self.fill_input()? {
                return Err(SegmentError::Truncated { part: "trailer" });
            }
            let take = (len - have).min(self.input.len() - self.input_pos);
            trailer[have..have + take]
                .copy_from_slice(&self.input[self.input_pos..self.input_pos + take]);
            self.input_pos += take;
            have += take;
        }
        if self.fill_input()? {
            return Err(SegmentError::corrupted("bytes follow the trailer"));
        }
        let trailer = &trailer[..len];
        if trailer[len - 4..] != END_MAGIC {
            return Err(SegmentError::corrupted("trailer magic is wrong"));
        }
        if off > 0 && trailer[..off] != frame_prefix(V1_TRAILER_LEN) {
            return Err(SegmentError::corrupted(
                "trailer frame prefix is wrong (expected a skippable frame of 24 bytes)",
            ));
        }
        let crc = crc32c::crc32c_append(self.crc, &trailer[..off + 16]);
        let field = |at: usize| trailer[off + at..off + at + 8].try_into().expect("8 bytes");
        let stored_crc =
            u32::from_le_bytes(trailer[off + 16..off + 20].try_into().expect("4 bytes"));
        if crc != stored_crc {
            return Err(SegmentError::corrupted(format!(
                "checksum mismatch: trailer says {stored_crc:08x}, content hashes to {crc:08x}"
            )));
        }
        let count = u64::from_le_bytes(field(0));
        let body_len = u64::from_le_bytes(field(8));
        if count != self.records {
            return Err(SegmentError::corrupted(format!(
                "trailer counts {count} records, body holds {}",
                self.records
            )));
        }
        if body_len != self.body_bytes {
            return Err(SegmentError::corrupted(format!(
                "trailer says the body is {body_len} bytes, it is {}",
                self.body_bytes
            )));
        }
        Ok(())
    }
}

fn read_full(source: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match source.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

enum Varint {
    /// Value and the number of bytes it took.
    Value(u64, usize),
    /// More bytes are needed.
    Incomplete,
    /// Longer than 10 bytes: not a varint.
    Invalid,
}

fn decode_varint(buf: &[u8]) -> Varint {
    let mut value = 0u64;
    for (i, &b) in buf.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Varint::Value(value, i + 1);
        }
    }
    if buf.len() >= 10 {
        Varint::Invalid
    } else {
        Varint::Incomplete
    }
}
