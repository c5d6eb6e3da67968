//! safetensors in and out: HF checkpoints (one file or sharded with
//! `model.safetensors.index.json`) read tensor by tensor, and checkpoints written with
//! the `safetensors` crate and `{"format": "pt"}` metadata, as transformers writes them.
//!
//! Reading parses the header itself and checks every offset against the file before it
//! reads a byte, so a truncated or corrupt file is an error that names the file and the
//! tensor, never a panic inside libtorch.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// Why weights could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// A file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not a valid safetensors file (or index).
    #[error("{path}: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The directory has no weights.
    #[error(
        "{dir}: no model.safetensors or model.safetensors.index.json (a Hugging Face model directory saved with safe_serialization)"
    )]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// A tensor the model needs is absent, or has the wrong shape.
    #[error("{message}")]
    Mismatch {
        /// What does not fit.
        message: String,
    },
}

/// Where one tensor is.
#[derive(Debug, Clone)]
struct Entry {
    file: PathBuf,
    kind: Kind,
    shape: Vec<i64>,
    /// Absolute byte range in the file.
    start: u64,
    end: u64,
}

/// The tensors of a checkpoint, indexed but not read.
#[derive(Debug)]
pub struct Checkpoint {
    entries: BTreeMap<String, Entry>,
}

fn corrupt(path: &Path, message: impl Into<String>) -> WeightsError {
    WeightsError::Corrupt {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "F64" => Kind::Double,
        _ => return None,
    })
}

/// Reads the header of one safetensors file.
fn index_file(path: &Path, into: &mut BTreeMap<String, Entry>) -> Result<(), WeightsError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let file_len = file.metadata().map_err(io(path))?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| corrupt(path, "shorter than the 8-byte header length"))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > 100_000_000 || 8 + header_len > file_len {
        return Err(corrupt(
            path,
            format!("header length {header_len} does not fit a file of {file_len} bytes"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io(path))?;
    let header: Value = serde_json::from_slice(&header)
        .map_err(|e| corrupt(path, format!("header is not JSON: {e}")))?;
    let Value::Object(map) = header else {
        return Err(corrupt(path, "header is not a JSON object"));
    };
    let data_start = 8 + header_len;
    for (name, info) in map {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: &str| corrupt(path, format!("tensor {name}: {m}"));
        let dtype = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no dtype"))?;
        let kind = kind_of(dtype).ok_or_else(|| {
            bad(&format!(
                "dtype {dtype} is not supported (F32, F16, BF16, F64)"
            ))
        })?;
        let shape: Vec<i64> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_i64().filter(|d| *d >= 0))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of sizes"))?;
        let offsets: Vec<u64> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let [begin, end] = offsets[..] else {
            return Err(bad("data_offsets is not [begin, end]"));
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d as u64))
            .ok_or_else(|| bad("shape overflows"))?;
        let bytes = numel
            .checked_mul(kind.elt_size_in_bytes() as u64)
            .ok_or_else(|| bad("shape overflows"))?;
        if end < begin || end - begin != bytes {
            return Err(bad(&format!(
                "data_offsets [{begin}, {end}] do not hold {numel} {dtype} values"
            )));
        }
        if data_start + end > file_len {
            return Err(bad(&format!(
                "data ends at byte {} but the file has {file_len} (truncated?)",
                data_start + end
            )));
        }
        into.insert(
            name,
            Entry {
                file: path.to_path_buf(),
                kind,
                shape,
                start: data_start + begin,
                end: data_start + end,
            },
        );
    }
    Ok(())
}

impl Checkpoint {
    /// Indexes `dir/model.safetensors` or the shards named by
    /// `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, WeightsError> {
        let mut entries = BTreeMap::new();
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.is_file() {
            index_file(&single, &mut entries)?;
        } else if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(io(&index))?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| corrupt(&index, format!("not JSON: {e}")))?;
            let map = value
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| corrupt(&index, "no weight_map object"))?;
            let mut files: Vec<&str> = map.values().filter_map(Value::as_str).collect();
            files.sort_unstable();
            files.dedup();
            for f in files {
                if f.contains('/') || f.contains("..") {
                    return Err(corrupt(
                        &index,
                        format!("shard name {f:?} leaves the directory"),
                    ));
                }
                index_file(&dir.join(f), &mut entries)?;
            }
            for (name, file) in map {
                if !entries.contains_key(name) {
                    return Err(corrupt(
                        &index,
                        format!("{name} is mapped to {file} but that shard does not hold it"),
                    ));
                }
            }
        } else {
            return Err(WeightsError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        Ok(Checkpoint { entries })
    }

    /// Indexes one safetensors file (an adapter, an optimizer state).
    pub fn open_file(path: &Path) -> Result<Self, WeightsError> {
        let mut entries = BTreeMap::new();
        index_file(path, &mut entries)?;
        Ok(Checkpoint { entries })
    }

    /// Shape of a tensor, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether the checkpoint has a tensor.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Reads one tensor, checks its shape, converts it to `kind` on `device`.
    pub fn load(
        &self,
        name: &str,
        shape: &[i64],
        kind: Kind,
        device: Device,
    ) -> Result<Tensor, WeightsError> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| WeightsError::Mismatch {
                message: format!("the checkpoint has no tensor {name}"),
            })?;
        if entry.shape != shape {
            return Err(WeightsError::Mismatch {
                message: format!(
                    "tensor {name} has shape {:?} in {} but config.json implies {shape:?}",
                    entry.shape,
                    entry.file.display()
                ),
            });
        }
        let mut file = std::fs::File::open(&entry.file).map_err(io(&entry.file))?;
        file.seek(SeekFrom::Start(entry.start))
            .map_err(io(&entry.file))?;
        let mut bytes = vec![0u8; (entry.end - entry.start) as usize];
        file.read_exact(&mut bytes).map_err(io(&entry.file))?;
        let tensor = Tensor::f_from_data_size(&bytes, &entry.shape, entry.kind)
            .map_err(|e| corrupt(&entry.file, format!("tensor {name}: {e}")))?;
        Ok(tensor.to_device(device).to_kind(kind))
    }
}

/// One tensor to write: its bytes on the host.
struct HostTensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &HostTensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` (name → tensor, any device) to `path` as safetensors with
/// `{"format": "pt"}` metadata. The file is written next to `path` and renamed into
/// place, so a reader never sees half a file.
pub fn save(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), WeightsError> {
    let mut host = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let (dtype, kind) = match t.kind() {
            Kind::Float => (safetensors::Dtype::F32, Kind::Float),
            Kind::Half => (safetensors::Dtype::F16, Kind::Half),
            Kind::BFloat16 => (safetensors::Dtype::BF16, Kind::BFloat16),
            other => {
                return Err(WeightsError::Mismatch {
                    message: format!("tensor {name} has dtype {other:?}, not a float type"),
                });
            }
        };
        let numel = t.numel();
        let mut data = vec![0u8; numel * kind.elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, numel)
            .map_err(|e| WeightsError::Mismatch {
                message: format!("copy {name} to the host: {e}"),
            })?;
        host.push((
            name.clone(),
            HostTensor {
                dtype,
                shape: t.size().iter().map(|d| *d as usize).collect(),
                data,
            },
        ));
    }
    let tmp = path.with_extension("safetensors.partial");
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(
        host.iter().map(|(n, t)| (n.as_str(), t)),
        Some(metadata),
        &tmp,
    )
    .map_err(|e| corrupt(&tmp, format!("write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}
