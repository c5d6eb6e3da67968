//! TensorBoard's event files without TensorFlow: `events.out.tfevents.*` files that
//! `tensorboard --logdir`, its Python `EventAccumulator` and `wandb sync
//! --sync-tensorboard` read.
//!
//! A file is a sequence of TFRecords, each `u64` LE length, masked CRC-32C of those 8
//! bytes, the data, masked CRC-32C of the data; each record's data is an `Event` proto.
//! The first event carries `file_version: "brain.Event:2"`. The messages below are the
//! subset of TensorBoard's `event.proto`, `summary.proto`, `histogram.proto`,
//! `tensor.proto` and `tensor_shape.proto` this writer sets, with their field numbers
//! and types (`tensorboard/compat/proto/` in TensorBoard's repository); fields not set
//! here are left out, which protobuf readers take as unset.
//!
//! Scalars are `simple_value`s, histograms `HistogramProto`s, text a rank-0 `DT_STRING`
//! tensor with the `text` plugin's metadata, as `torch.utils.tensorboard` writes them.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The version string of the first event in a file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `Event` (event.proto).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `oneof what`: the file version (first event only).
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// `oneof what`: summary values.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `Summary` (summary.proto).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The series' name.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// `oneof value`: a scalar.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    /// `oneof value`: a histogram.
    #[prost(message, optional, tag = "5")]
    pub histo: Option<Histogram>,
    /// `oneof value`: a tensor (text).
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<Tensor>,
    /// Which plugin reads the value.
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    /// The plugin.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    /// `text`, `scalars`, `histograms`, ...
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// The plugin's own serialized metadata (empty: its defaults).
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `HistogramProto` (histogram.proto): bucket `i` counts the values in
/// `(bucket_limit[i-1], bucket_limit[i]]`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Histogram {
    /// Smallest value.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// Largest value.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// Number of values.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// Their sum.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// The sum of their squares.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// Right edges of the buckets.
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// Counts per bucket.
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}

/// `TensorProto` (tensor.proto), string tensors only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Tensor {
    /// `DataType` (types.proto): [`DT_STRING`].
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// The shape (no dimensions: a scalar).
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    /// The strings.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `TensorShapeProto` (tensor_shape.proto) with no dimensions.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {}

/// `DT_STRING` of types.proto.
pub const DT_STRING: i32 = 7;

/// The number of buckets of a histogram.
const BUCKETS: usize = 30;

/// TFRecord's CRC mask (tensorflow/core/lib/hash/crc32c.h).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// A histogram of `values` (non-finite ones left out) in [`BUCKETS`] equal buckets;
/// `None` when no value is finite.
pub fn histogram(values: &[f64]) -> Option<Histogram> {
    let finite = || values.iter().copied().filter(|v| v.is_finite());
    let (min, max) = finite().fold(None, |acc: Option<(f64, f64)>, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })?;
    let width = (max - min) / BUCKETS as f64;
    let (bucket_limit, mut bucket) = if width > 0.0 {
        let limits: Vec<f64> = (1..=BUCKETS).map(|i| min + width * i as f64).collect();
        (limits, vec![0.0; BUCKETS])
    } else {
        (vec![max], vec![0.0])
    };
    let (mut num, mut sum, mut sum_squares) = (0.0, 0.0, 0.0);
    for v in finite() {
        let i = if width > 0.0 {
            (((v - min) / width).ceil() as usize).clamp(1, bucket.len()) - 1
        } else {
            0
        };
        bucket[i] += 1.0;
        num += 1.0;
        sum += v;
        sum_squares += v * v;
    }
    Some(Histogram {
        min,
        max,
        num,
        sum,
        sum_squares,
        bucket_limit,
        bucket,
    })
}

/// Seconds since the Unix epoch.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An open event file. Each call writes one event; [`EventWriter::flush`] makes what
/// was written visible to a reader.
#[derive(Debug)]
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new file in `dir` (made if missing), named as TensorBoard's writers name
    /// theirs (`events.out.tfevents.<secs>.<host>.<pid>.<n>`: a later run's file sorts
    /// after an earlier one's, and TensorBoard reads a directory's files in that order),
    /// and writes the file-version event.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().replace(['/', '\\'], "_"))
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now() as u64,
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::options().create_new(true).write(true).open(&path)?;
        let mut writer = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            file_version: Some(FILE_VERSION.into()),
            summary: None,
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event.
    pub fn write(&mut self, event: &Event) -> std::io::Result<()> {
        self.out
            .write_all(&frame(&prost::Message::encode_to_vec(event)))
    }

    /// Writes scalars of one step as one event.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        let value = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| SummaryValue {
                tag: tag.clone(),
                simple_value: Some(*v as f32),
                ..Default::default()
            })
            .collect::<Vec<_>>();
        if value.is_empty() {
            return Ok(());
        }
        self.summary(step, value)
    }

    /// Writes a histogram of `values` (nothing when none is finite).
    pub fn histogram(&mut self, tag: &str, step: u64, values: &[f64]) -> std::io::Result<()> {
        let Some(histo) = histogram(values) else {
            return Ok(());
        };
        self.summary(
            step,
            vec![SummaryValue {
                tag: tag.into(),
                histo: Some(histo),
                ..Default::default()
            }],
        )
    }

    /// Writes text (Markdown, which TensorBoard's text plugin renders).
    pub fn text(&mut self, tag: &str, step: u64, text: &str) -> std::io::Result<()> {
        self.summary(
            step,
            vec![SummaryValue {
                tag: tag.into(),
                tensor: Some(Tensor {
                    dtype: DT_STRING,
                    tensor_shape: Some(TensorShape {}),
                    string_val: vec![text.as_bytes().to_vec()],
                }),
                metadata: Some(SummaryMetadata {
                    plugin_data: Some(PluginData {
                        plugin_name: "text".into(),
                        content: Vec::new(),
                    }),
                }),
                ..Default::default()
            }],
        )
    }

    fn summary(&mut self, step: u64, value: Vec<SummaryValue>) -> std::io::Result<()> {
        self.write(&Event {
            wall_time: now(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    /// Makes everything written so far visible to readers.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads the records of a file back, checking both CRCs of each.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let len: [u8; 8] = rest[..8].try_into().unwrap();
            let crc = u32::from_le_bytes(rest[8..12].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(&len), "length CRC");
            let n = u64::from_le_bytes(len) as usize;
            let data = &rest[12..12 + n];
            let crc = u32::from_le_bytes(rest[12 + n..16 + n].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(data), "data CRC");
            out.push(data.to_vec());
            rest = &rest[16 + n..];
        }
        out
    }

    #[test]
    fn the_mask_is_tensorflows() {
        // crc32c("123456789") is 0xE3069283 (RFC 3720's check value); masked, it is
        // what TensorBoard's own `masked_crc32c` (compat/tensorflow_stub) gives.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_file_starts_with_its_version_and_holds_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(3, &[("train/loss".into(), 0.5), ("nan".into(), f64::NAN)])
            .unwrap();
        w.text("config", 3, "<b>").unwrap();
        w.flush().unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let events: Vec<Event> = records(&std::fs::read(w.path()).unwrap())
            .iter()
            .map(|r| prost::Message::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
        let loss = &events[1].summary.as_ref().unwrap().value;
        assert_eq!(events[1].step, 3);
        assert_eq!(loss.len(), 1, "the NaN is left out");
        assert_eq!(loss[0].simple_value, Some(0.5));
        let text = &events[2].summary.as_ref().unwrap().value[0];
        assert_eq!(
            text.tensor.as_ref().unwrap().string_val,
            vec![b"<b>".to_vec()]
        );
    }

    #[test]
    fn histograms_count_every_finite_value_once() {
        let values = [0.0, 1.0, 1.0, 2.5, 3.0, f64::INFINITY];
        let h = histogram(&values).unwrap();
        assert_eq!((h.min, h.max, h.num), (0.0, 3.0, 5.0));
        assert_eq!(h.bucket.iter().sum::<f64>(), 5.0);
        assert_eq!(h.bucket[0], 1.0, "the minimum is in the first bucket");
        assert_eq!(*h.bucket.last().unwrap(), 1.0, "the maximum in the last");
        assert!((h.sum - 7.5).abs() < 1e-12);
        let one = histogram(&[2.0, 2.0]).unwrap();
        assert_eq!((one.bucket_limit, one.bucket), (vec![2.0], vec![2.0]));
        assert!(histogram(&[f64::NAN]).is_none());
    }
}
