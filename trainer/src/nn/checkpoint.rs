//! The HF directory a training run writes: weights as safetensors (`lm_head` left out
//! when tied, as transformers saves it), `config.json` with the dtype of the saved
//! weights, the tokenizer and template files copied from the model trained from, and
//! `trainer_state.json` with the global step (so a schedule continues across runs).
//! Files are written into the directory first and `manifest.json` last (by the caller):
//! a directory with a manifest is complete.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::model::Transformer;
use super::weights::{self, WeightsError};

/// Files copied from the source model directory when present.
pub const COPIED_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Name of the file that carries the global step between runs.
pub const TRAINER_STATE: &str = "trainer_state.json";

/// Why a checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// File system.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The output directory already holds a complete checkpoint.
    #[error("{0} already holds a checkpoint (manifest.json); choose a new --out directory per run")]
    Exists(PathBuf),
    /// The weights could not be written.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The source config.json is not JSON.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Refuses an output directory that already holds a finished run; creates it otherwise.
pub fn prepare_dir(out: &Path) -> Result<(), CheckpointError> {
    if out.join("manifest.json").exists() {
        return Err(CheckpointError::Exists(out.to_path_buf()));
    }
    std::fs::create_dir_all(out).map_err(io(out))
}

/// The global step recorded in `dir/trainer_state.json` (0 when absent or unreadable).
pub fn global_step(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(TRAINER_STATE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("global_step").and_then(Value::as_u64))
        .unwrap_or(0)
}

/// Writes the model into `out`; returns the SHA-256 of `model.safetensors`.
pub fn save(
    model: &Transformer,
    source: &Path,
    out: &Path,
    global_step: u64,
) -> Result<String, CheckpointError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let tensors = model.named_parameters();
    let weights_path = out.join("model.safetensors");
    weights::save(&weights_path, &tensors)?;

    let config_path = source.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let mut config: Value = serde_json::from_str(&text).map_err(|e| CheckpointError::Config {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    let dtype = match model.kind() {
        tch::Kind::BFloat16 => "bfloat16",
        tch::Kind::Half => "float16",
        _ => "float32",
    };
    if let Some(obj) = config.as_object_mut() {
        // transformers 5 writes `dtype`, older versions `torch_dtype`; keep whichever the
        // source had, and default to the new spelling.
        let key = if obj.contains_key("torch_dtype") && !obj.contains_key("dtype") {
            "torch_dtype"
        } else {
            "dtype"
        };
        obj.insert(key.into(), Value::String(dtype.into()));
    }
    let config_out = out.join("config.json");
    std::fs::write(
        &config_out,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(io(&config_out))?;
    copy_model_files(source, out)?;
    write_trainer_state(out, global_step)?;
    let bytes = std::fs::read(&weights_path).map_err(io(&weights_path))?;
    Ok(crate::ingest::sha256_hex(&bytes))
}

/// Copies the tokenizer, template and generation files ([`COPIED_FILES`]) that exist in
/// `source` into `out`.
pub fn copy_model_files(source: &Path, out: &Path) -> Result<(), CheckpointError> {
    for name in COPIED_FILES {
        let from = source.join(name);
        if from.is_file() {
            let to = out.join(name);
            std::fs::copy(&from, &to).map_err(io(&to))?;
        }
    }
    Ok(())
}

/// Writes `out/trainer_state.json` with the global step.
pub fn write_trainer_state(out: &Path, global_step: u64) -> Result<(), CheckpointError> {
    let state = out.join(TRAINER_STATE);
    std::fs::write(
        &state,
        serde_json::to_vec_pretty(&serde_json::json!({ "global_step": global_step }))
            .unwrap_or_default(),
    )
    .map_err(io(&state))
}
