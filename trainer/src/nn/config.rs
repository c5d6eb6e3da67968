//! `config.json` of a Hugging Face causal LM → the shape of a [`super::Transformer`].
//!
//! Llama, Qwen2 and Qwen3 are read the way transformers reads them; anything the model
//! code does not implement is refused with the name of the field, never silently
//! ignored (a wrong RoPE or a missing bias gives plausible but wrong log-probs).

use std::path::Path;

use serde_json::Value;

/// The architectures the model code implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `model_type: llama` (also SmolLM2, Llama 3).
    Llama,
    /// `model_type: qwen2`: biases on q/k/v.
    Qwen2,
    /// `model_type: qwen3`: RMSNorm on q and k per head, explicit `head_dim`.
    Qwen3,
}

impl Arch {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3 frequency rescaling (`rope_type: llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: f64,
}

/// Everything the model code needs from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary (rows of the embedding).
    pub vocab_size: i64,
    /// Model width.
    pub hidden_size: i64,
    /// MLP width.
    pub intermediate_size: i64,
    /// Decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (GQA when fewer than the query heads).
    pub num_key_value_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama 3 rescaling, when configured.
    pub rope_llama3: Option<Llama3Scaling>,
    /// Whether `lm_head` shares the embedding's weights.
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// RMSNorm of q and k per head (Qwen3).
    pub qk_norm: bool,
    /// Longest position the model was trained for (informational).
    pub max_position_embeddings: i64,
    /// The dtype the checkpoint declares (`torch_dtype` or `dtype`), if any.
    pub dtype: Option<String>,
}

/// Why a model configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `config.json` cannot be read or is not JSON.
    #[error("{path}: {message}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A field is missing, has the wrong type or a value the model code does not implement.
    #[error("{path}: field `{field}`: {message}")]
    Field {
        /// The file.
        path: String,
        /// The field.
        field: String,
        /// What is wrong and what is supported.
        message: String,
    },
}

impl TransformerConfig {
    /// Reads `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            message: format!("{e} (a Hugging Face model directory has a config.json)"),
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            message: format!("not JSON: {e}"),
        })?;
        Self::from_json(&value).map_err(|(field, message)| ConfigError::Field {
            path: path.display().to_string(),
            field,
            message,
        })
    }

    /// Reads a parsed `config.json`; errors are `(field, message)`.
    pub fn from_json(c: &Value) -> Result<Self, (String, String)> {
        let field = |name: &str, message: String| Err((name.to_owned(), message));
        let arch = match c.get("model_type").and_then(Value::as_str) {
            Some("llama") => Arch::Llama,
            Some("qwen2") => Arch::Qwen2,
            Some("qwen3") => Arch::Qwen3,
            Some(other) => {
                return field(
                    "model_type",
                    format!("{other:?} is not supported (supported: llama, qwen2, qwen3)"),
                );
            }
            None => return field("model_type", "missing".into()),
        };
        let int = |name: &str| -> Result<i64, (String, String)> {
            match c.get(name) {
                Some(v) => match v.as_i64() {
                    Some(n) if n > 0 => Ok(n),
                    _ => Err((
                        name.to_owned(),
                        format!("must be a positive integer, not {v}"),
                    )),
                },
                None => Err((name.to_owned(), "missing".into())),
            }
        };
        let float_or = |name: &str, default: f64| -> Result<f64, (String, String)> {
            match c.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                    _ => Err((
                        name.to_owned(),
                        format!("must be a positive number, not {v}"),
                    )),
                },
            }
        };
        let flag = |name: &str, default: bool| -> Result<bool, (String, String)> {
            match c.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err((name.to_owned(), format!("must be true or false, not {v}"))),
            }
        };

        let vocab_size = int("vocab_size")?;
        let hidden_size = int("hidden_size")?;
        let intermediate_size = int("intermediate_size")?;
        let num_hidden_layers = int("num_hidden_layers")?;
        let num_attention_heads = int("num_attention_heads")?;
        let num_key_value_heads = match c.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => int("num_key_value_heads")?,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return field(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
                ),
            );
        }
        let head_dim = match c.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_attention_heads != 0 {
                    return field(
                        "head_dim",
                        format!(
                            "missing, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
                        ),
                    );
                }
                hidden_size / num_attention_heads
            }
            Some(_) => int("head_dim")?,
        };
        if head_dim % 2 != 0 {
            return field(
                "head_dim",
                format!("{head_dim} is odd; RoPE needs an even width"),
            );
        }
        let rms_norm_eps = float_or("rms_norm_eps", 1e-6)?;
        match c.get("hidden_act").and_then(Value::as_str) {
            None | Some("silu") => {}
            Some(other) => {
                return field(
                    "hidden_act",
                    format!("{other:?} is not supported (only silu)"),
                );
            }
        }
        if flag("mlp_bias", false)? {
            return field("mlp_bias", "MLP biases are not supported".into());
        }
        if arch == Arch::Qwen2 && flag("use_sliding_window", false)? {
            return field(
                "use_sliding_window",
                "sliding-window attention is not supported".into(),
            );
        }
        if arch == Arch::Qwen3 && flag("use_sliding_window", false)? {
            return field(
                "use_sliding_window",
                "sliding-window attention is not supported".into(),
            );
        }
        let attention_bias = flag("attention_bias", false)?;
        let (qkv_bias, o_bias, qk_norm) = match arch {
            Arch::Llama => (attention_bias, attention_bias, false),
            Arch::Qwen2 => (true, false, false),
            Arch::Qwen3 => (attention_bias, attention_bias, true),
        };

        // RoPE: transformers 5 writes `rope_parameters` (with `rope_theta` and
        // `rope_type`); older files have top-level `rope_theta` and `rope_scaling`.
        let (rope_field, rope) = match (c.get("rope_parameters"), c.get("rope_scaling")) {
            (Some(p @ Value::Object(_)), _) => ("rope_parameters", Some(p)),
            (_, Some(p @ Value::Object(_))) => ("rope_scaling", Some(p)),
            (Some(Value::Null) | None, Some(Value::Null) | None) => ("rope_scaling", None),
            (Some(v), _) if !v.is_null() => {
                return field("rope_parameters", format!("must be an object, not {v}"));
            }
            (_, Some(v)) => return field("rope_scaling", format!("must be an object, not {v}")),
            _ => ("rope_scaling", None),
        };
        let mut rope_theta = float_or("rope_theta", 10000.0)?;
        let mut rope_llama3 = None;
        if let Some(p) = rope {
            if let Some(theta) = p.get("rope_theta") {
                rope_theta = theta
                    .as_f64()
                    .filter(|t| t.is_finite() && *t > 0.0)
                    .ok_or_else(|| {
                        (
                            format!("{rope_field}.rope_theta"),
                            format!("must be a positive number, not {theta}"),
                        )
                    })?;
            }
            let kind = p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "llama3" => {
                    let num = |name: &str| -> Result<f64, (String, String)> {
                        p.get(name)
                            .and_then(Value::as_f64)
                            .filter(|x| x.is_finite() && *x > 0.0)
                            .ok_or_else(|| {
                                (
                                    format!("{rope_field}.{name}"),
                                    "missing or not a positive number (needed by rope_type llama3)"
                                        .into(),
                                )
                            })
                    };
                    let scaling = Llama3Scaling {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    };
                    if scaling.high_freq_factor <= scaling.low_freq_factor {
                        return field(
                            &format!("{rope_field}.high_freq_factor"),
                            "must be greater than low_freq_factor".into(),
                        );
                    }
                    rope_llama3 = Some(scaling);
                }
                other => {
                    return field(
                        &format!("{rope_field}.rope_type"),
                        format!("{other:?} is not supported (supported: default, llama3)"),
                    );
                }
            }
        }
        let tie_word_embeddings = flag("tie_word_embeddings", false)?;
        let max_position_embeddings = match c.get("max_position_embeddings") {
            None | Some(Value::Null) => 0,
            Some(_) => int("max_position_embeddings")?,
        };
        let dtype = c
            .get("torch_dtype")
            .or_else(|| c.get("dtype"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        Ok(TransformerConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_llama3,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            qk_norm,
            max_position_embeddings,
            dtype,
        })
    }

    /// Parameter count (embedding counted once when tied).
    pub fn parameters(&self) -> i64 {
        let (d, h, kv, hd, f) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        );
        let attn = d * h * hd + 2 * d * kv * hd + h * hd * d;
        let bias = if self.qkv_bias {
            h * hd + 2 * kv * hd
        } else {
            0
        };
        let norms = 2 * d + if self.qk_norm { 2 * hd } else { 0 };
        let layer = attn + bias + 3 * d * f + norms;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": true
        })
    }

    #[test]
    fn reads_both_rope_spellings() {
        let mut c = base();
        let cfg = TransformerConfig::from_json(&c).unwrap();
        assert_eq!((cfg.head_dim, cfg.rope_theta), (16, 10000.0));
        c["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let cfg = TransformerConfig::from_json(&c).unwrap();
        assert_eq!(cfg.rope_theta, 500000.0);
        assert_eq!(cfg.rope_llama3.unwrap().factor, 8.0);
    }

    #[test]
    fn unsupported_settings_name_their_field() {
        for (key, value, named) in [
            ("model_type", json!("mistral"), "model_type"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_scaling.rope_type",
            ),
            ("num_key_value_heads", json!(3), "num_key_value_heads"),
            ("vocab_size", json!(-1), "vocab_size"),
            ("mlp_bias", json!(true), "mlp_bias"),
        ] {
            let mut c = base();
            c[key] = value;
            let (field, message) = TransformerConfig::from_json(&c).unwrap_err();
            assert_eq!(field, named, "{message}");
        }
    }
}
