//! The `tapline-trainer` binary as the tests run it.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

/// The binary under test.
pub fn trainer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tapline-trainer"))
}

/// Runs `score --model MODEL [--adapter ADAPTER]` with `input` on stdin.
pub fn run_score_with(model: &Path, adapter: Option<&Path>, input: &str) -> Output {
    use std::io::Write as _;
    let mut cmd = trainer();
    cmd.args(["score", "--model"]).arg(model);
    if let Some(adapter) = adapter {
        cmd.arg("--adapter").arg(adapter);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tapline-trainer score");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// The log-probs `score` prints for `ids`.
pub fn score_with(model: &Path, adapter: Option<&Path>, ids: &[u32]) -> Vec<f64> {
    let out = run_score_with(model, adapter, &json!({ "ids": ids }).to_string());
    assert!(
        out.status.success(),
        "score: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::from_value(v["logprobs"].clone()).unwrap()
}
