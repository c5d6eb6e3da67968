//! LoRA adapters in PEFT's format: the `[train.lora]` settings, the adapter directory
//! (`adapter_config.json` + `adapter_model.safetensors`) that `peft`, transformers and
//! vLLM load as they are, and attaching an adapter to a [`Transformer`] (new, from a
//! directory, or merged into the base weights).
//!
//! An adapter directory written here holds, besides the two PEFT files, the tokenizer
//! and template files of the base model, `trainer_state.json`, the optimizer state
//! ([`super::optim`]) and the run's `manifest.json`.
//!
//! PEFT's conventions, followed exactly: `A` is `[r, in]`, `B` is `[out, r]`, the forward
//! adds `scaling · B (A x)` with `scaling = lora_alpha / r` (`lora_alpha / √r` with
//! `use_rslora`), a new adapter has `A` Kaiming-uniform (`a = √5`, i.e. uniform in
//! `±1/√in`) and `B` zero, so it starts as the base model. Tensor names are
//! `base_model.model.model.layers.{i}.{self_attn|mlp}.{leaf}.lora_{A|B}.weight`.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::{Device, Kind, Tensor};

use super::model::Transformer;
use super::weights::{self, Checkpoint, WeightsError};

/// PEFT's adapter configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

pub use super::options::LoraOptions;
use super::options::check_targets;

/// Why an adapter directory could not be read, applied or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// A file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A field of `adapter_config.json` is missing, malformed or not supported.
    #[error("{path}: field `{field}`: {message}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// The adapter's tensors do not fit its config or the base model.
    #[error("{path}: {message}")]
    Tensors {
        /// The file.
        path: PathBuf,
        /// What does not fit.
        message: String,
    },
    /// The weights file is not valid safetensors.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The base model the adapter applies to could not be loaded.
    #[error("base model {path}: {source}")]
    Base {
        /// Its directory.
        path: PathBuf,
        /// Why.
        source: super::LoadError,
    },
}

/// Whether `dir` is an adapter directory (has `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// The base model an adapter directory names (`base_model_name_or_path`), if any.
pub fn base_model_of(dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    value
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// Reads `dir/adapter_config.json`, refusing what the model code does not implement
/// (DoRA, per-layer ranks, regular expressions as targets, biases, …) with the field.
pub fn read_config(dir: &Path) -> Result<LoraOptions, AdapterError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| AdapterError::Io {
        path: path.clone(),
        source,
    })?;
    let field = |name: &str, message: String| AdapterError::Field {
        path: path.clone(),
        field: name.to_owned(),
        message,
    };
    let value: Value =
        serde_json::from_str(&text).map_err(|e| field("(file)", format!("not JSON: {e}")))?;
    let Value::Object(c) = value else {
        return Err(field("(file)", "not a JSON object".into()));
    };
    match c.get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => {
            return Err(field(
                "peft_type",
                format!("{other:?}: only \"LORA\" adapters are supported"),
            ));
        }
    }
    if let Some(t) = c.get("task_type").filter(|v| !v.is_null())
        && t.as_str() != Some("CAUSAL_LM")
    {
        return Err(field(
            "task_type",
            format!("{t}: only CAUSAL_LM adapters apply to a causal LM"),
        ));
    }
    let rank = c
        .get("r")
        .and_then(Value::as_i64)
        .filter(|r| *r >= 1)
        .ok_or_else(|| field("r", "missing or not a positive integer".into()))?;
    let alpha = c
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .filter(|a| a.is_finite() && *a > 0.0)
        .ok_or_else(|| field("lora_alpha", "missing or not a positive number".into()))?;
    let dropout = c.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let target_modules: Vec<String> = match c.get("target_modules") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| field("target_modules", "not a list of names".into()))?,
        Some(Value::String(s)) => {
            return Err(field(
                "target_modules",
                format!(
                    "{s:?} is a regular expression; only a list of projection names is supported"
                ),
            ));
        }
        _ => return Err(field("target_modules", "missing".into())),
    };
    check_targets(&target_modules).map_err(|m| field("target_modules", m))?;
    let flag = |name: &str| c.get(name).and_then(Value::as_bool).unwrap_or(false);
    if c.get("bias").and_then(Value::as_str).unwrap_or("none") != "none" {
        return Err(field("bias", "only \"none\" is supported".into()));
    }
    for name in ["fan_in_fan_out", "use_dora", "lora_bias", "use_qalora"] {
        if flag(name) {
            return Err(field(name, "true is not supported".into()));
        }
    }
    for name in ["rank_pattern", "alpha_pattern"] {
        if c.get(name)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(field(
                name,
                "per-module ranks and alphas are not supported".into(),
            ));
        }
    }
    for name in [
        "layers_to_transform",
        "modules_to_save",
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
        "exclude_modules",
    ] {
        if c.get(name)
            .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(field(name, "must be null (not supported)".into()));
        }
    }
    Ok(LoraOptions {
        rank,
        alpha,
        dropout,
        target_modules,
        use_rslora: flag("use_rslora"),
    })
}

/// Attaches a new adapter: `A` Kaiming-uniform from `seed`, `B` zero (fp32, on the
/// model's device).
pub fn attach_new(model: &mut Transformer, options: &LoraOptions, seed: u64) {
    let device = model.device();
    tch::manual_seed(seed as i64);
    let result = model.attach_lora(
        &options.target_modules,
        options.rank,
        options.scaling(),
        &mut |name, shape| {
            Ok(if name.ends_with("lora_A.weight") {
                // kaiming_uniform_(a=√5): bound = √(6 / ((1 + a²) fan_in)) = 1/√fan_in.
                let bound = 1.0 / (shape[1] as f64).sqrt();
                Tensor::rand(shape, (Kind::Float, device)) * (2.0 * bound) - bound
            } else {
                Tensor::zeros(shape, (Kind::Float, device))
            })
        },
    );
    if result.is_err() {
        unreachable!("the new-adapter source never fails");
    }
}

/// Reads the adapter in `dir` and attaches it (fp32) to `model`; every tensor the config
/// implies must be there with its shape, and nothing else.
pub fn load(model: &mut Transformer, dir: &Path) -> Result<LoraOptions, AdapterError> {
    let options = read_config(dir)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    if !path.is_file() {
        return Err(AdapterError::Tensors {
            path,
            message: "missing (a PEFT adapter directory has adapter_model.safetensors)".into(),
        });
    }
    let file = Checkpoint::open_file(&path)?;
    let device = model.device();
    let tensors = |message: String| AdapterError::Tensors {
        path: path.clone(),
        message,
    };
    let mut used = std::collections::BTreeSet::new();
    let attached = model.attach_lora(
        &options.target_modules,
        options.rank,
        options.scaling(),
        &mut |name, shape| {
            used.insert(name.to_owned());
            match file.shape(name) {
                None => Err(WeightsError::Mismatch {
                    message: format!(
                        "no tensor {name} (adapter_config.json targets this projection in every layer)"
                    ),
                }),
                Some(found) if found != shape => Err(WeightsError::Mismatch {
                    message: format!(
                        "tensor {name} has shape {found:?}, but r = {} in {ADAPTER_CONFIG} and the base model's projection imply {shape:?} (wrong r, or an adapter of a base model of another shape)",
                        options.rank
                    ),
                }),
                Some(_) => file.load(name, shape, Kind::Float, device),
            }
        },
    );
    if let Err(e) = attached {
        return Err(match e {
            WeightsError::Mismatch { message } => tensors(message),
            other => other.into(),
        });
    }
    if let Some(extra) = file.names().find(|n| !used.contains(*n)) {
        return Err(tensors(format!(
            "tensor {extra} is not an adapter of this model (expected lora_A/lora_B of {} in layers 0..{}; an adapter of another base model?)",
            options.target_modules.join(", "),
            model.num_layers()
        )));
    }
    Ok(options)
}

/// Writes `adapter_config.json` and `adapter_model.safetensors` (fp32) into `dir`;
/// returns the SHA-256 of the weights file.
pub fn save(
    model: &Transformer,
    options: &LoraOptions,
    base_model: &str,
    dir: &Path,
) -> Result<String, AdapterError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| AdapterError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors: Vec<(String, Tensor)> = model
        .named_adapters()
        .into_iter()
        .map(|(n, t)| (n, t.detach().to_kind(Kind::Float)))
        .collect();
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    weights::save(&weights_path, &tensors)?;
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = serde_json::to_vec_pretty(&options.peft_config(base_model)).unwrap_or_default();
    std::fs::write(&config_path, text).map_err(io(&config_path))?;
    let bytes = std::fs::read(&weights_path).map_err(io(&weights_path))?;
    Ok(crate::ingest::sha256_hex(&bytes))
}

/// Loads the base model from `base` and attaches the adapter in `adapter`.
pub fn load_with_adapter(
    base: &Path,
    adapter: &Path,
    device: Device,
    kind: Kind,
) -> Result<(Transformer, LoraOptions), AdapterError> {
    let mut model = Transformer::load(base, device, kind).map_err(|source| AdapterError::Base {
        path: base.to_path_buf(),
        source,
    })?;
    let options = load(&mut model, adapter)?;
    Ok((model, options))
}
