//! A model directory's tokenizer assets: `tokenizer.json`, the chat template and the
//! special tokens, loaded once and shared by every stage that turns text into ids.
//!
//! The chat template is resolved as transformers resolves it: `chat_template.jinja`, else
//! `chat_template` in `chat_template.json`, else `chat_template` in
//! `tokenizer_config.json` — a string, or a list of `{name, template}` of which
//! `default` is used (and `tool_use` when the request has tools and the list has one).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::template::ChatTemplate;

/// Special tokens that end an assistant turn in common chat formats. When one of them is
/// in the vocabulary it counts as a stop token, as the model's `generation_config.json`
/// usually says (Llama 3 instruct ends turns with `<|eot_id|>` although its tokenizer's
/// `eos_token` is `<|end_of_text|>`).
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<|return|>",
];

/// Why a model directory could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file is missing or unreadable.
    #[error("model directory {dir}: cannot read {file}: {source}")]
    Read {
        /// The model directory.
        dir: PathBuf,
        /// The file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A JSON file does not parse or has an unexpected shape.
    #[error("model directory {dir}: {file} is not valid: {reason}")]
    Invalid {
        /// The model directory.
        dir: PathBuf,
        /// The file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// `tokenizer.json` cannot be loaded by the tokenizers library.
    #[error("model directory {dir}: tokenizer.json cannot be loaded: {reason}")]
    Tokenizer {
        /// The model directory.
        dir: PathBuf,
        /// The library's complaint.
        reason: String,
    },
    /// No chat template was found.
    #[error(
        "model directory {dir}: no chat template (looked for chat_template.jinja, chat_template.json and chat_template in tokenizer_config.json); pass --chat-template FILE"
    )]
    NoChatTemplate {
        /// The model directory.
        dir: PathBuf,
    },
    /// The chat template does not compile.
    #[error("model directory {dir}: {source}")]
    Template {
        /// The model directory.
        dir: PathBuf,
        /// The compile error.
        source: crate::template::TemplateError,
    },
    /// A configured stop token is not in the vocabulary.
    #[error("stop token {token:?} is not in the vocabulary of {dir}")]
    UnknownStopToken {
        /// The model directory.
        dir: PathBuf,
        /// The token.
        token: String,
    },
}

/// How to load a model directory.
#[derive(Debug, Clone, Default)]
pub struct ModelOptions {
    /// Use this template file instead of the directory's.
    pub chat_template_file: Option<PathBuf>,
    /// Stop tokens to use instead of the ones found in the directory.
    pub stop_tokens: Vec<String>,
}

/// The tokenizer, chat templates and special tokens of one model.
#[derive(Debug)]
pub struct Model {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    default_template: ChatTemplate,
    tool_use_template: Option<ChatTemplate>,
    variables: Map<String, Value>,
    stop_ids: HashSet<u32>,
    eos_id: Option<u32>,
    special_ids: HashSet<u32>,
    special_texts: Vec<String>,
}

impl Model {
    /// Loads `tokenizer.json`, `tokenizer_config.json`, the chat template and, when
    /// present, `generation_config.json` from `dir`.
    pub fn load(dir: &Path, options: &ModelOptions) -> Result<Self, ModelError> {
        let read = |file: &str| -> Result<Option<String>, ModelError> {
            match std::fs::read_to_string(dir.join(file)) {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(ModelError::Read {
                    dir: dir.to_owned(),
                    file: file.to_owned(),
                    source,
                }),
            }
        };
        let invalid = |file: &str, reason: String| ModelError::Invalid {
            dir: dir.to_owned(),
            file: file.to_owned(),
            reason,
        };
        let parse_json = |file: &str| -> Result<Option<Value>, ModelError> {
            read(file)?
                .map(|s| serde_json::from_str(&s).map_err(|e| invalid(file, e.to_string())))
                .transpose()
        };

        let tokenizer_bytes =
            std::fs::read(dir.join("tokenizer.json")).map_err(|source| ModelError::Read {
                dir: dir.to_owned(),
                file: "tokenizer.json".into(),
                source,
            })?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| {
            ModelError::Tokenizer {
                dir: dir.to_owned(),
                reason: e.to_string(),
            }
        })?;
        let config = parse_json("tokenizer_config.json")?.unwrap_or(Value::Null);

        // Special tokens, as transformers passes them to the template.
        let mut variables = Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(text) = config.get(key).and_then(token_text) {
                variables.insert(key.to_owned(), Value::String(text));
            }
        }
        if let Some(Value::Array(list)) = config.get("additional_special_tokens") {
            let texts: Vec<Value> = list
                .iter()
                .filter_map(token_text)
                .map(Value::String)
                .collect();
            variables.insert("additional_special_tokens".into(), Value::Array(texts));
        }

        // Chat templates.
        let mut sources: BTreeMap<String, String> = BTreeMap::new();
        if let Some(file) = &options.chat_template_file {
            let source = std::fs::read_to_string(file).map_err(|source| ModelError::Read {
                dir: dir.to_owned(),
                file: file.display().to_string(),
                source,
            })?;
            sources.insert("default".into(), source);
        } else if let Some(source) = read("chat_template.jinja")? {
            sources.insert("default".into(), source);
        } else if let Some(Value::String(s)) =
            parse_json("chat_template.json")?.and_then(|v| v.get("chat_template").cloned())
        {
            sources.insert("default".into(), s);
        } else {
            match config.get("chat_template") {
                Some(Value::String(s)) => {
                    sources.insert("default".into(), s.clone());
                }
                Some(Value::Array(list)) => {
                    for entry in list {
                        let (Some(name), Some(template)) = (
                            entry.get("name").and_then(Value::as_str),
                            entry.get("template").and_then(Value::as_str),
                        ) else {
                            return Err(invalid(
                                "tokenizer_config.json",
                                "chat_template list entries need `name` and `template` strings"
                                    .into(),
                            ));
                        };
                        sources.insert(name.to_owned(), template.to_owned());
                    }
                    if !sources.contains_key("default") {
                        return Err(invalid(
                            "tokenizer_config.json",
                            format!(
                                "chat_template list has no \"default\" entry (has {:?}); pass --chat-template FILE",
                                sources.keys().collect::<Vec<_>>()
                            ),
                        ));
                    }
                }
                _ => {}
            }
        }
        let compile = |source: &str| {
            ChatTemplate::new(source).map_err(|source| ModelError::Template {
                dir: dir.to_owned(),
                source,
            })
        };
        let default_template = match sources.get("default") {
            Some(source) => compile(source)?,
            None => {
                return Err(ModelError::NoChatTemplate {
                    dir: dir.to_owned(),
                });
            }
        };
        let tool_use_template = sources.get("tool_use").map(|s| compile(s)).transpose()?;

        // Stop tokens.
        let specials: Vec<(u32, String)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (id, t.content))
            .collect();
        let special_ids: HashSet<u32> = specials.iter().map(|(id, _)| *id).collect();
        let special_texts: Vec<String> = specials.into_iter().map(|(_, t)| t).collect();
        let eos_id = variables
            .get("eos_token")
            .and_then(Value::as_str)
            .and_then(|t| tokenizer.token_to_id(t));
        let mut stop_ids = HashSet::new();
        if options.stop_tokens.is_empty() {
            stop_ids.extend(eos_id);
            if let Some(generation) = parse_json("generation_config.json")? {
                match generation.get("eos_token_id") {
                    Some(Value::Number(n)) => {
                        stop_ids.extend(n.as_u64().and_then(|n| u32::try_from(n).ok()));
                    }
                    Some(Value::Array(list)) => stop_ids.extend(
                        list.iter()
                            .filter_map(Value::as_u64)
                            .filter_map(|n| u32::try_from(n).ok()),
                    ),
                    _ => {}
                }
            }
            for token in END_OF_TURN_TOKENS {
                if let Some(id) = tokenizer.token_to_id(token)
                    && special_ids.contains(&id)
                {
                    stop_ids.insert(id);
                }
            }
        } else {
            for token in &options.stop_tokens {
                let id =
                    tokenizer
                        .token_to_id(token)
                        .ok_or_else(|| ModelError::UnknownStopToken {
                            dir: dir.to_owned(),
                            token: token.clone(),
                        })?;
                stop_ids.insert(id);
            }
        }
        Ok(Model {
            dir: dir.to_owned(),
            tokenizer,
            default_template,
            tool_use_template,
            variables,
            stop_ids,
            eos_id,
            special_ids,
            special_texts,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The template to use for a request with (`true`) or without tools.
    pub(crate) fn template(&self, has_tools: bool) -> &ChatTemplate {
        match &self.tool_use_template {
            Some(template) if has_tools => template,
            _ => &self.default_template,
        }
    }

    /// Special tokens passed to the template (`bos_token`, `eos_token`, ...).
    pub(crate) fn variables(&self) -> &Map<String, Value> {
        &self.variables
    }

    /// Tokenizes `text` without adding special tokens (as transformers and vLLM do
    /// for rendered chat templates).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_with(text, false)
    }

    /// Tokenizes `text`, adding the tokenizer's special tokens when `add_special` (as
    /// vLLM does for the completions API).
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Decodes ids back to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// Whether `id` ends a generation (EOS or an end-of-turn token).
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    /// The id of `eos_token`, if the tokenizer has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The texts of the special (control) tokens.
    pub(crate) fn special_texts(&self) -> &[String] {
        &self.special_texts
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}
