//! Stage 7: the batches on disk, for a backend to consume without further thought.
//!
//! `tapline-trainer prepare --out DIR` writes plain JSON files:
//!
//! ```text
//! DIR/mini-batch-00000.json   one file per mini-batch (one optimizer step), in order
//! DIR/mini-batch-00001.json
//! DIR/report.json             the cleaning / tokenize / drift / merge / batch report
//! DIR/manifest.json           written last: its presence means the set is complete
//! ```
//!
//! A mini-batch file:
//!
//! ```json
//! {
//!   "format": "tapline.mini_batch.v1",
//!   "index": 0,
//!   "loss_agg_mode": "token-mean",
//!   "normalizer": {"loss_tokens": 812, "sequences": 6, "episodes": 4, "constant": 32768.0},
//!   "micro_batches": [
//!     {"tokens": 1400, "sequences": [
//!       {
//!         "episode_id": "0193…", "task_id": "t1", "group_id": "", "reward": 1.0,
//!         "span_ids": ["0193…"], "policy_versions": ["step-3"],
//!         "completion_spans": [[17, 41]],
//!         "token_ids": [151644, 872, …],
//!         "loss_mask": [0, 0, …, 1, 1],
//!         "advantages": [0.0, 0.0, …, 0.87, 0.87],
//!         "inference_logprobs": [null, null, …, -0.12, -1.5],
//!         "weights": [0.0, 0.0, …, 0.0012, 0.0012]
//!       }
//!     ]}
//!   ]
//! }
//! ```
//!
//! Per sequence, every array has one entry per token. `loss_mask` is 1 on tokens the
//! model sampled. `advantages` and `weights` are 0 where the mask is 0.
//! `inference_logprobs` holds the serving policy's log-probability of each sampled token
//! when the inference server recorded it, `null` elsewhere; the whole field is `null`
//! when no token of the sequence has one. `completion_spans[i]` is the `[start, end)`
//! token range of the completion of call `span_ids[i]`. The mini-batch loss is
//! `Σ weights[t] · loss[t]` over every token of every micro-batch (see
//! [`crate::schedule`]): a backend computes each micro-batch's weighted sum, calls
//! backward on it, and steps once per mini-batch file — no further normalization.
//! Floating-point arrays are written as f32 (shortest round-trip text).
//!
//! `manifest.json` lists the mini-batch files with their counts, the configuration, the
//! model directory, the store and the segments read.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::RunConfig;
use crate::pipeline::{MiniBatch, Prepared, TrainSequence};
use crate::schedule::Normalizer;

/// Why the output could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[error("cannot write {path}: {source}")]
pub struct OutputError {
    /// The file or directory.
    pub path: PathBuf,
    /// The I/O error.
    pub source: std::io::Error,
}

/// Name of the format of mini-batch files.
pub const MINI_BATCH_FORMAT: &str = "tapline.mini_batch.v1";
/// Name of the format of the manifest.
pub const MANIFEST_FORMAT: &str = "tapline.batches.v1";

#[derive(Serialize)]
struct SequenceOut<'a> {
    episode_id: &'a str,
    task_id: &'a str,
    group_id: &'a str,
    reward: f64,
    span_ids: Vec<&'a str>,
    policy_versions: Vec<&'a str>,
    completion_spans: Vec<[usize; 2]>,
    token_ids: &'a [u32],
    loss_mask: &'a [u8],
    advantages: Vec<f32>,
    inference_logprobs: Option<Vec<Option<f32>>>,
    weights: Vec<f32>,
}

impl<'a> SequenceOut<'a> {
    fn new(t: &'a TrainSequence) -> Self {
        let s = &t.sequence;
        let has_logprobs = s.logprobs.iter().any(Option::is_some);
        SequenceOut {
            episode_id: &t.episode_id,
            task_id: &t.task_id,
            group_id: &t.group_id,
            reward: t.reward,
            span_ids: s.spans.iter().map(|c| c.span_id.as_str()).collect(),
            policy_versions: s.spans.iter().map(|c| c.policy_version.as_str()).collect(),
            completion_spans: s.spans.iter().map(|c| [c.start, c.end]).collect(),
            token_ids: &s.token_ids,
            loss_mask: &s.loss_mask,
            advantages: t.advantages.iter().map(|a| *a as f32).collect(),
            inference_logprobs: has_logprobs
                .then(|| s.logprobs.iter().map(|l| l.map(|l| l as f32)).collect()),
            weights: t.weights.iter().map(|w| *w as f32).collect(),
        }
    }
}

#[derive(Serialize)]
struct MicroBatchOut<'a> {
    tokens: usize,
    sequences: Vec<SequenceOut<'a>>,
}

#[derive(Serialize)]
struct MiniBatchOut<'a> {
    format: &'static str,
    index: usize,
    loss_agg_mode: &'static str,
    normalizer: Normalizer,
    micro_batches: Vec<MicroBatchOut<'a>>,
}

/// One entry of the manifest.
#[derive(Debug, Serialize)]
pub struct MiniBatchEntry {
    /// File name within the output directory.
    pub file: String,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Sequences.
    pub sequences: usize,
    /// Tokens.
    pub tokens: usize,
    /// Tokens with loss.
    pub loss_tokens: usize,
}

/// What the manifest says about where the data came from.
#[derive(Debug, Clone, Serialize)]
pub struct Provenance {
    /// The store, as displayed (no credentials).
    pub store: String,
    /// The model directory.
    pub model_dir: String,
    /// The run's cursor name, when the cursor was used.
    pub run: Option<String>,
    /// Segments read (new and re-read).
    pub segments: Vec<String>,
    /// When the run started, Unix nanoseconds.
    pub created_unix_nanos: i64,
}

#[derive(Serialize)]
struct Manifest<'a> {
    format: &'static str,
    #[serde(flatten)]
    provenance: &'a Provenance,
    config: &'a RunConfig,
    report: &'static str,
    mini_batches: Vec<MiniBatchEntry>,
}

/// The file name of mini-batch `index`.
pub fn mini_batch_file(index: usize) -> String {
    format!("mini-batch-{index:05}.json")
}

/// Serializes one mini-batch as its file's content.
pub fn mini_batch_json(index: usize, mode: &'static str, batch: &MiniBatch) -> Vec<u8> {
    let out = MiniBatchOut {
        format: MINI_BATCH_FORMAT,
        index,
        loss_agg_mode: mode,
        normalizer: batch.normalizer,
        micro_batches: batch
            .micro_batches
            .iter()
            .map(|m| MicroBatchOut {
                tokens: m.sequences.iter().map(|t| t.sequence.len()).sum(),
                sequences: m.sequences.iter().map(SequenceOut::new).collect(),
            })
            .collect(),
    };
    serde_json::to_vec(&out).unwrap_or_default()
}

/// Writes the mini-batches, the report and then the manifest into `dir` (created if
/// missing; earlier mini-batch files, report and manifest there are removed first).
pub fn write(
    dir: &Path,
    prepared: &Prepared,
    config: &RunConfig,
    provenance: &Provenance,
) -> Result<(), OutputError> {
    let err = |path: &Path| {
        let path = path.to_owned();
        move |source| OutputError { path, source }
    };
    std::fs::create_dir_all(dir).map_err(err(dir))?;
    for entry in std::fs::read_dir(dir).map_err(err(dir))? {
        let entry = entry.map_err(err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = (name.starts_with("mini-batch-") && name.ends_with(".json"))
            || name == "manifest.json"
            || name == "report.json";
        if ours {
            std::fs::remove_file(entry.path()).map_err(err(&entry.path()))?;
        }
    }
    let mode = config.schedule.loss_agg_mode.name();
    let mut entries = Vec::new();
    for (index, batch) in prepared.mini_batches.iter().enumerate() {
        let file = mini_batch_file(index);
        let path = dir.join(&file);
        std::fs::write(&path, mini_batch_json(index, mode, batch)).map_err(err(&path))?;
        let seqs = || batch.micro_batches.iter().flat_map(|m| &m.sequences);
        entries.push(MiniBatchEntry {
            file,
            micro_batches: batch.micro_batches.len(),
            sequences: seqs().count(),
            tokens: seqs().map(|t| t.sequence.len()).sum(),
            loss_tokens: seqs().map(|t| t.sequence.loss_tokens()).sum(),
        });
    }
    write_json(&dir.join("report.json"), &prepared.report)?;
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        provenance,
        config,
        report: "report.json",
        mini_batches: entries,
    };
    write_json(&dir.join("manifest.json"), &manifest)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), OutputError> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    std::fs::write(path, body).map_err(|source| OutputError {
        path: path.to_owned(),
        source,
    })
}
