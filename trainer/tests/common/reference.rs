//! The Hugging Face reference (`hf_reference.py`, run with `TAPLINE_PYTHON`) and the
//! tensors and batches the libtorch tests build.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use tapline_trainer::merge::{CallSpan, Sequence};
use tapline_trainer::nn::Transformer;
use tapline_trainer::pipeline::{MicroBatch, MiniBatch, TrainSequence};
use tapline_trainer::schedule::Normalizer;

pub const TOLERANCE: f64 = 1e-4;

pub fn reference_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hf_reference.py")
}

pub fn run_python(args: &[&str], stdin: Option<&Value>) -> Value {
    let mut child = Command::new(super::python())
        .arg(reference_script())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the reference script with TAPLINE_PYTHON");
    {
        use std::io::Write as _;
        let mut pipe = child.stdin.take().unwrap();
        if let Some(v) = stdin {
            pipe.write_all(v.to_string().as_bytes()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "hf_reference.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A tiny random model made by transformers.
pub fn tiny(arch: &str, seed: u64, flags: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let seed = seed.to_string();
    let mut args = vec!["tiny", "--arch", arch, "--out", out, "--seed", &seed];
    args.extend_from_slice(flags);
    run_python(&args, None);
    dir
}

pub fn hf_logprobs(dir: &Path, sequences: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let v = run_python(
        &["logprobs", "--model", dir.to_str().unwrap()],
        Some(&json!({ "sequences": sequences })),
    );
    serde_json::from_value(v["logprobs"].clone()).unwrap()
}

/// Deterministic pseudo-random ids.
pub fn random_ids(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % u64::from(vocab)) as u32
        })
        .collect()
}

pub fn max_diff(ours: &[f32], theirs: &[f64]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (f64::from(*a) - b).abs())
        .fold(0.0, f64::max)
}

/// A sequence whose second half is sampled, with one advantage and uniform weights.
pub fn seq(ids: &[u32], advantage: f64, weight: f64) -> TrainSequence {
    let n = ids.len();
    let loss_mask: Vec<u8> = (0..n).map(|i| u8::from(i >= n / 2 && i > 0)).collect();
    TrainSequence {
        episode_id: format!("e{}", ids.iter().map(|x| u64::from(*x)).sum::<u64>()),
        task_id: "t".into(),
        group_id: String::new(),
        reward: advantage,
        advantages: loss_mask
            .iter()
            .map(|m| f64::from(*m) * advantage)
            .collect(),
        weights: loss_mask.iter().map(|m| f64::from(*m) * weight).collect(),
        sequence: Sequence {
            token_ids: ids.to_vec(),
            logprobs: loss_mask
                .iter()
                .map(|m| (*m == 1).then_some(-1.0))
                .collect(),
            loss_mask,
            spans: vec![CallSpan {
                span_id: "s".into(),
                call_index: 0,
                start: n / 2,
                end: n,
                policy_version: String::new(),
            }],
        },
    }
}

pub fn micro(sequences: Vec<TrainSequence>) -> MicroBatch {
    let mut sequences = sequences;
    sequences.sort_by_key(|s| std::cmp::Reverse(s.sequence.len()));
    MicroBatch {
        sequences,
        recompute: false,
    }
}

pub fn grads(model: &Transformer) -> Vec<(String, Vec<f32>)> {
    model
        .trainable_parameters()
        .into_iter()
        .map(|(n, t)| {
            let g = t.grad();
            let v = if g.defined() {
                Vec::<f32>::try_from(g.flatten(0, -1)).unwrap()
            } else {
                vec![0.0; t.numel()]
            };
            (n, v)
        })
        .collect()
}

pub fn mini(sequences: Vec<TrainSequence>) -> MiniBatch {
    MiniBatch {
        micro_batches: vec![micro(sequences)],
        normalizer: Normalizer {
            loss_tokens: 0,
            sequences: 0,
            episodes: 0,
            constant: 1.0,
        },
    }
}

/// Clears the gradients of the trainable parameters.
pub fn zero_grads(model: &Transformer) {
    for (_, mut t) in model.trainable_parameters() {
        t.zero_grad();
    }
}
