//! The libtorch backend (tch 0.26 = libtorch 2.13): the model, the policy-gradient
//! update and the checkpoint. Only [`options`], [`config`], [`size`] and [`memory`] are
//! built without the `torch` feature; the rest needs libtorch.
//!
//! - [`options`] — the `[train]` settings (schedule, loss, LoRA), checked without tensors;
//! - [`config`] — `config.json` → [`TransformerConfig`], refusing what is not implemented;
//! - [`size`] — sizes with units (`"16GiB"`), below `options` and `memory`;
//! - [`memory`] — the estimate of a step's peak memory, and fitting micro-batches to
//!   `[train] max_memory` (split, recompute, or a clear error before any step);
//! - [`weights`] — safetensors in (single or sharded, checked) and out;
//! - [`model`] — [`Transformer`]: Llama / Qwen2 / Qwen3 with HF's conventions;
//! - [`packing`] — a micro-batch's sequences padded to rows or packed end to end in
//!   one row (`[train] packing`), with per-token positions;
//! - [`attention`] — causal attention that keeps each token inside its sequence;
//! - [`loss`] — PPO / GSPO surrogate with dual clip, truncated IS and KL;
//! - [`lora`] — LoRA adapters in PEFT's format (settings, directory, attach, merge);
//! - [`optim`] — AdamW with fp32 moments and fp32 master weights, its saved state,
//!   schedules, clipping;
//! - [`dist`] — data parallelism over c10d: micro-batch assignment, gradient
//!   all-reduce, AdamW sharded across ranks;
//! - [`train`] — mini-batches from the pipeline → optimizer steps, with metrics;
//! - [`checkpoint`] — the HF directory a run writes.

#[cfg(feature = "torch")]
pub mod attention;
#[cfg(feature = "torch")]
pub mod bench;
#[cfg(feature = "torch")]
pub mod checkpoint;
#[cfg(feature = "torch")]
pub mod comm;
pub mod config;
#[cfg(feature = "torch")]
pub mod dist;
#[cfg(feature = "torch")]
pub mod lora;
#[cfg(feature = "torch")]
pub mod loss;
#[cfg(feature = "torch")]
pub mod manifest;
pub mod memory;
#[cfg(feature = "torch")]
pub mod model;
#[cfg(feature = "torch")]
pub mod optim;
pub mod options;
#[cfg(feature = "torch")]
pub mod packing;
pub mod size;
#[cfg(feature = "torch")]
pub mod train;
#[cfg(feature = "torch")]
pub mod weights;

pub use config::TransformerConfig;
#[cfg(feature = "torch")]
pub use model::Transformer;

#[cfg(feature = "torch")]
/// Why a model directory could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// `config.json` is missing, unreadable or unsupported.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The weights are missing, corrupt or do not fit the config.
    #[error(transparent)]
    Weights(#[from] weights::WeightsError),
    /// The device is not available.
    #[error("{0}")]
    Device(String),
}

#[cfg(feature = "torch")]
/// Parses `cpu`, `cuda` or `cuda:N`; refuses CUDA when libtorch sees no GPU.
pub fn parse_device(name: &str) -> Result<tch::Device, LoadError> {
    let device = match name {
        "cpu" => tch::Device::Cpu,
        "cuda" => tch::Device::Cuda(0),
        other => match other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => tch::Device::Cuda(n),
            None => {
                return Err(LoadError::Device(format!(
                    "--device {other:?}: expected cpu, cuda or cuda:N"
                )));
            }
        },
    };
    if let tch::Device::Cuda(n) = device {
        let count = tch::Cuda::device_count();
        if n as i64 >= count {
            return Err(LoadError::Device(format!(
                "--device {name}: libtorch sees {count} CUDA device(s) (is this a CUDA build of torch, and is the driver visible?)"
            )));
        }
    }
    Ok(device)
}

#[cfg(feature = "torch")]
/// The training dtype: `auto` is fp32 on CPU and bf16 on CUDA.
pub fn parse_dtype(name: &str, device: tch::Device) -> Result<tch::Kind, LoadError> {
    Ok(match name {
        "auto" if device == tch::Device::Cpu => tch::Kind::Float,
        "auto" => tch::Kind::BFloat16,
        "float32" | "fp32" => tch::Kind::Float,
        "bfloat16" | "bf16" => tch::Kind::BFloat16,
        other => {
            return Err(LoadError::Device(format!(
                "dtype {other:?}: expected auto, float32 or bfloat16"
            )));
        }
    })
}
