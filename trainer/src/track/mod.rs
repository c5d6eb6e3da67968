//! Watching a run while it trains: every step and every run-level event to
//! `metrics.jsonl` (one JSON object per line, serialized from the structs the manifest
//! holds), with `[track] tensorboard` to TensorBoard event files ([`tfevents`]), with
//! `[track.mlflow]` to an MLflow tracking server ([`mlflow`]).
//!
//! Invariants:
//! - Tracking never fails or stops training: a write that fails is logged once per
//!   backend, counted ([`Tracker::failures`]), and that backend is written no more in
//!   this run; the manifest keeps every figure either way.
//! - One directory per series: `train --follow` and the demo's iterations write every run
//!   into the same directory, each run appending to `metrics.jsonl` and adding its own
//!   event file, with global steps counting on, so TensorBoard shows one curve.
//! - Only rank 0 of a distributed run tracks.
//! - A run that is not [`Tracker::finish`]ed (an error, a stop) ends with a
//!   `run_finished` event whose status says so (`FAILED`, `KILLED`).

pub mod mlflow;
pub mod tfevents;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The `metrics.jsonl` file name.
pub const JSONL: &str = "metrics.jsonl";

/// `[track]` of the run configuration (`train` only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrackOptions {
    /// Write `metrics.jsonl`.
    pub jsonl: bool,
    /// Write TensorBoard event files (`--tensorboard`).
    pub tensorboard: bool,
    /// Where (`--track-dir`); default: `--out` of `train`, the `--out` root of `train
    /// --follow` (one series for all its runs).
    pub dir: Option<PathBuf>,
    /// An MLflow tracking server (present: on).
    pub mlflow: Option<mlflow::MlflowOptions>,
}

impl Default for TrackOptions {
    fn default() -> Self {
        TrackOptions {
            jsonl: true,
            tensorboard: false,
            dir: None,
            mlflow: None,
        }
    }
}

impl TrackOptions {
    /// Checks the options (the MLflow URI, from the config or `MLFLOW_TRACKING_URI`).
    pub fn validate(&self) -> Result<(), String> {
        match &self.mlflow {
            Some(m) => m.validate(),
            None => Ok(()),
        }
    }
}

/// How a tracked run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Every step done and the checkpoint written.
    Finished,
    /// Ended by an error.
    Failed,
    /// Stopped by a signal before its last step.
    Killed,
}

impl Status {
    /// The name in `metrics.jsonl` (MLflow's run status names).
    pub fn name(self) -> &'static str {
        match self {
            Status::Finished => "FINISHED",
            Status::Failed => "FAILED",
            Status::Killed => "KILLED",
        }
    }
}

/// One backend: written until its first failure.
#[derive(Debug)]
struct Backend<W> {
    name: &'static str,
    writer: Option<W>,
    failures: u64,
}

impl<W> Backend<W> {
    fn new(name: &'static str, writer: Result<W, std::io::Error>) -> Self {
        let mut b = Backend {
            name,
            writer: None,
            failures: 0,
        };
        match writer {
            Ok(w) => b.writer = Some(w),
            Err(e) => b.failed(&e),
        }
        b
    }

    fn off() -> Self {
        Backend {
            name: "",
            writer: None,
            failures: 0,
        }
    }

    fn failed(&mut self, error: &dyn std::fmt::Display) {
        self.failures += 1;
        self.writer = None;
        tracing::warn!(
            "tracking: {}: {error}; training goes on without it (manifest.json keeps every figure)",
            self.name
        );
        eprintln!(
            "train: tracking to {} failed ({error}); training goes on without it",
            self.name
        );
    }

    fn with(&mut self, f: impl FnOnce(&mut W) -> std::io::Result<()>) {
        if let Some(w) = self.writer.as_mut()
            && let Err(e) = f(w)
        {
            self.failed(&e);
        }
    }
}

/// A run's tracking: made by [`Tracker::open`], fed by the trainer, ended by
/// [`Tracker::finish`] (or by being dropped, as failed).
#[derive(Debug)]
pub struct Tracker {
    dir: PathBuf,
    jsonl: Backend<BufWriter<File>>,
    tensorboard: Backend<tfevents::EventWriter>,
    mlflow: Option<mlflow::Mlflow>,
    finished: bool,
}

impl Tracker {
    /// Opens the backends `options` turn on in `dir` and records the run's start: its
    /// name, output directory, first global step and configuration (also as text in
    /// TensorBoard).
    pub fn open(
        options: &TrackOptions,
        dir: &Path,
        run: &str,
        out: &Path,
        first_step: u64,
        config: &impl Serialize,
    ) -> Self {
        let jsonl = if options.jsonl {
            let file = std::fs::create_dir_all(dir).and_then(|()| {
                File::options()
                    .create(true)
                    .append(true)
                    .open(dir.join(JSONL))
            });
            Backend::new("metrics.jsonl", file.map(BufWriter::new))
        } else {
            Backend::off()
        };
        let tensorboard = if options.tensorboard {
            Backend::new("tensorboard", tfevents::EventWriter::create(dir))
        } else {
            Backend::off()
        };
        let config_value = serde_json::to_value(config).unwrap_or_default();
        let mlflow = options.mlflow.as_ref().and_then(|m| {
            let start = mlflow::RunStart {
                name: format!("{run} {}", out.display()),
                params: mlflow::params(&config_value),
                tags: vec![
                    ("tapline.run".into(), run.into()),
                    ("tapline.out".into(), out.display().to_string()),
                    ("tapline.first_step".into(), first_step.to_string()),
                    ("tapline.git_commit".into(), crate::GIT_COMMIT.into()),
                    ("mlflow.source.name".into(), "tapline-trainer train".into()),
                ],
            };
            match mlflow::Mlflow::start(m, start) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!("tracking: mlflow: {e}");
                    None
                }
            }
        });
        let mut t = Tracker {
            dir: dir.to_owned(),
            jsonl,
            tensorboard,
            mlflow,
            finished: false,
        };
        t.line(json!({
            "event": "run_started",
            "unix_secs": unix_secs(),
            "run": run,
            "out": out.display().to_string(),
            "first_step": first_step,
            "config": config_value,
        }));
        let text = format!(
            "run `{run}` into `{}` from global step {first_step}\n\n```toml\n{}\n```",
            out.display(),
            toml::to_string(config).unwrap_or_else(|e| format!("(not TOML: {e})"))
        );
        t.tensorboard.with(|w| {
            w.text("config", first_step, &text)?;
            w.flush()
        });
        t
    }

    /// The directory written.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The backends written, by name.
    pub fn backends(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.jsonl.writer.is_some() || self.jsonl.failures > 0 {
            names.push("jsonl");
        }
        if self.tensorboard.writer.is_some() || self.tensorboard.failures > 0 {
            names.push("tensorboard");
        }
        if self.mlflow.is_some() {
            names.push("mlflow");
        }
        names
    }

    /// Writes that failed, all backends together (an MLflow server that fails counts
    /// once).
    pub fn failures(&self) -> u64 {
        self.jsonl.failures
            + self.tensorboard.failures
            + self.mlflow.as_ref().map_or(0, mlflow::Mlflow::failures)
    }

    /// The MLflow run: tracking URI and run id (once the server made it).
    pub fn mlflow_run(&self) -> Option<(String, Option<String>)> {
        self.mlflow
            .as_ref()
            .map(|m| (m.uri().to_owned(), m.run_id()))
    }

    /// A file of the run for the backends that keep files (MLflow's artifacts), under
    /// its file name.
    pub fn artifact(&mut self, path: &Path) {
        let Some(m) = &self.mlflow else { return };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match std::fs::read(path) {
            Ok(bytes) => m.artifact(&name, bytes),
            Err(e) => tracing::warn!("tracking: read {}: {e}", path.display()),
        }
    }

    fn line(&mut self, value: Value) {
        self.jsonl.with(|w| {
            serde_json::to_writer(&mut *w, &value)?;
            w.write_all(b"\n")?;
            w.flush()
        });
    }

    /// One optimizer step: `metrics` (a `StepMetrics`, serialized) as a `step` line, and
    /// each of its numbers as a scalar `train/<field>` at global step `step`.
    pub fn step(&mut self, step: u64, metrics: &Value) {
        let mut line = Map::new();
        line.insert("event".into(), "step".into());
        if let Value::Object(m) = metrics {
            line.extend(m.clone());
        }
        self.line(Value::Object(line));
        let mut scalars = Vec::new();
        flatten("train", metrics, &mut scalars);
        scalars.retain(|(tag, _)| !matches!(tag.as_str(), "train/step"));
        if let Some(m) = &self.mlflow {
            m.metrics(step, &scalars);
        }
        self.tensorboard.with(|w| {
            w.scalars(step, &scalars)?;
            w.flush()
        });
    }

    /// A run-level summary at global step `step` (the run's last): a `run` line, each of
    /// its numbers as a scalar `run/<path>`, and `histograms` (name, values) as
    /// TensorBoard histograms.
    pub fn summary(&mut self, step: u64, summary: &Value, histograms: &[(&str, Vec<f64>)]) {
        self.line(json!({"event": "run", "step": step, "summary": summary}));
        let mut scalars = Vec::new();
        flatten("run", summary, &mut scalars);
        if let Some(m) = &self.mlflow {
            m.metrics(step, &scalars);
        }
        self.tensorboard.with(|w| {
            w.scalars(step, &scalars)?;
            for (tag, values) in histograms {
                w.histogram(tag, step, values)?;
            }
            w.flush()
        });
    }

    /// Ends the run with `status` (and `detail`, e.g. the error).
    pub fn finish(&mut self, status: Status, detail: Option<&str>) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.line(json!({
            "event": "run_finished",
            "unix_secs": unix_secs(),
            "status": status.name(),
            "detail": detail,
        }));
        self.tensorboard.with(tfevents::EventWriter::flush);
        if let Some(m) = self.mlflow.as_mut() {
            m.end(status.name());
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Not finished: the run ended by an error (a stop calls `finish` itself).
        self.finish(Status::Failed, Some("the run ended with an error"));
    }
}

/// Where a finished run's metrics went, so that what happens to the run afterwards (its
/// publish) joins the same series: the options it ran with, its tracking directory, its
/// last global step and its MLflow run (tracking URI, run id).
#[derive(Debug, Clone, PartialEq)]
pub struct TrackedRun {
    /// The run's `[track]`.
    pub options: TrackOptions,
    /// Its tracking directory.
    pub dir: PathBuf,
    /// Its last global step.
    pub step: u64,
    /// Its MLflow run, when the server made one: (tracking URI, run id).
    pub mlflow: Option<(String, String)>,
}

impl TrackedRun {
    /// The tracking a run's manifest recorded (`None`: it tracked nothing, e.g. a manifest
    /// written before tracking existed). A restarted `train --follow` publishes a run
    /// found on disk with this.
    pub fn from_manifest(manifest: &Value) -> Option<Self> {
        let tracking = manifest.get("tracking").filter(|t| !t.is_null())?;
        let options: TrackOptions =
            serde_json::from_value(manifest["config"].get("track")?.clone()).ok()?;
        let dir = PathBuf::from(tracking["dir"].as_str()?);
        let step = manifest["checkpoint"]["global_step"].as_u64().or_else(|| {
            let before = manifest["model"]["global_step_before"].as_u64()?;
            Some(before + manifest["steps"].as_array()?.len() as u64)
        })?;
        let mlflow = tracking["mlflow"]["uri"]
            .as_str()
            .zip(tracking["mlflow"]["run_id"].as_str())
            .map(|(uri, id)| (uri.to_owned(), id.to_owned()));
        Some(TrackedRun {
            options,
            dir,
            step,
            mlflow,
        })
    }
}

/// A run's adapter was published (after its tracker finished): a `policy_published`
/// line in `metrics.jsonl` with what `publish` returned, and the announced version as
/// the scalar `run/policy_version` at the run's last global step, in TensorBoard and in
/// the run's MLflow run (MLflow takes metrics into a finished run; `version` is `None`
/// when another publisher's newer version won). Failures are logged, never returned.
pub fn record_published(run: &TrackedRun, published: &Value, version: Option<u64>) {
    let (options, dir, step) = (&run.options, &run.dir, run.step);
    if options.jsonl {
        let line = json!({
            "event": "policy_published",
            "unix_secs": unix_secs(),
            "step": step,
            "version": version,
            "published": published,
        });
        let written = File::options()
            .create(true)
            .append(true)
            .open(dir.join(JSONL))
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            tracing::warn!("tracking: metrics.jsonl: {e}");
        }
    }
    let Some(v) = version else { return };
    if options.tensorboard {
        let written = tfevents::EventWriter::create(dir).and_then(|mut w| {
            w.scalars(step, &[("run/policy_version".to_owned(), v as f64)])?;
            w.flush()
        });
        if let Err(e) = written {
            tracing::warn!("tracking: tensorboard: {e}");
        }
    }
    if let (Some(m), Some((uri, run_id))) = (&options.mlflow, &run.mlflow) {
        let timeout = std::time::Duration::from_secs_f64(m.timeout_secs);
        if let Err(e) =
            mlflow::log_metric(uri, run_id, "run/policy_version", v as f64, step, timeout)
        {
            tracing::warn!("tracking: mlflow: run/policy_version: {e}");
            eprintln!(
                "train: tracking the published version to MLflow failed ({e}); metrics.jsonl has it"
            );
        }
    }
}

/// What a run's batches say about rewards and advantages: the mean reward over episodes,
/// its spread within groups (a group whose rewards are all equal teaches nothing), and
/// the advantages of the loss tokens; with those advantages, for a histogram.
pub fn batch_summary(mini_batches: &[crate::batch::MiniBatch]) -> (Value, Vec<f64>) {
    use std::collections::BTreeMap;
    let mut episodes: BTreeMap<&str, (&str, &str, f64)> = BTreeMap::new();
    let mut advantages = Vec::new();
    for s in mini_batches
        .iter()
        .flat_map(|mb| &mb.micro_batches)
        .flat_map(|m| &m.sequences)
    {
        episodes.insert(&s.episode_id, (&s.task_id, &s.group_id, s.reward));
        advantages.extend(
            s.advantages
                .iter()
                .zip(&s.weights)
                .filter(|(_, w)| **w != 0.0)
                .map(|(a, _)| *a),
        );
    }
    let mut groups: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    for (task, group, reward) in episodes.values() {
        groups.entry((task, group)).or_default().push(*reward);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let std = |v: &[f64]| {
        let m = mean(v);
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len().max(1) as f64).sqrt()
    };
    let rewards: Vec<f64> = episodes.values().map(|e| e.2).collect();
    let group_stds: Vec<f64> = groups.values().map(|g| std(g)).collect();
    let abs: Vec<f64> = advantages.iter().map(|a: &f64| a.abs()).collect();
    let summary = json!({
        "episodes": rewards.len(),
        "groups": groups.len(),
        "reward": {
            "mean": mean(&rewards),
            "std": std(&rewards),
            "group_std_mean": mean(&group_stds),
        },
        "advantage": {
            "abs_mean": mean(&abs),
            "mean": mean(&advantages),
            "tokens": advantages.len(),
        },
    });
    (summary, advantages)
}

/// Every number under `value` as (`prefix/path`, number); booleans as 0 or 1.
fn flatten(prefix: &str, value: &Value, out: &mut Vec<(String, f64)>) {
    for (path, v) in crate::flatten::leaves(prefix, '/', value) {
        match v {
            Value::Number(n) => out.extend(n.as_f64().map(|x| (path, x))),
            Value::Bool(b) => out.push((path, f64::from(u8::from(*b)))),
            _ => {}
        }
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(dir: &Path) -> Vec<Value> {
        std::fs::read_to_string(dir.join(JSONL))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_run_appends_its_start_steps_summary_and_end() {
        let dir = tempfile::tempdir().unwrap();
        let options = TrackOptions::default();
        for (first, status) in [(0, Status::Finished), (2, Status::Killed)] {
            let mut t = Tracker::open(
                &options,
                dir.path(),
                "demo",
                Path::new("/out"),
                first,
                &json!({"train": {"lr": 1e-6}}),
            );
            t.step(first + 1, &json!({"step": first + 1, "loss": 0.25}));
            t.summary(first + 1, &json!({"reward": {"mean": 0.5}}), &[]);
            t.finish(status, None);
            assert_eq!(t.failures(), 0);
            assert_eq!(t.backends(), vec!["jsonl"]);
        }
        let l = lines(dir.path());
        let events: Vec<&str> = l.iter().map(|v| v["event"].as_str().unwrap()).collect();
        assert_eq!(
            events,
            ["run_started", "step", "run", "run_finished"].repeat(2),
            "the second run appends"
        );
        assert_eq!(l[1]["loss"], 0.25);
        assert_eq!(l[0]["config"]["train"]["lr"], 1e-6);
        assert_eq!(l[3]["status"], "FINISHED");
        assert_eq!(l[7]["status"], "KILLED");
        assert_eq!(l[5]["step"], 3, "global steps count on");
    }

    #[test]
    fn a_tracker_dropped_unfinished_says_the_run_failed() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tracker::open(
            &TrackOptions::default(),
            dir.path(),
            "r",
            Path::new("/o"),
            0,
            &json!({}),
        );
        drop(t);
        let l = lines(dir.path());
        assert_eq!(l.last().unwrap()["status"], "FAILED");
    }

    #[test]
    fn a_directory_that_cannot_be_written_does_not_stop_the_run() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be.
        let blocked = dir.path().join("blocked");
        std::fs::write(&blocked, b"").unwrap();
        let options = TrackOptions {
            tensorboard: true,
            ..TrackOptions::default()
        };
        let mut t = Tracker::open(&options, &blocked, "r", Path::new("/o"), 0, &json!({}));
        t.step(1, &json!({"loss": 1.0}));
        t.finish(Status::Finished, None);
        assert_eq!(
            t.failures(),
            2,
            "each backend fails once, then is left alone"
        );
    }

    #[test]
    fn the_batch_summary_counts_episodes_once_and_groups_apart() {
        use crate::batch::{MicroBatch, MiniBatch, TrainSequence};
        let seq = |episode: &str, group: &str, reward: f64, adv: f64| TrainSequence {
            episode_id: episode.into(),
            task_id: "t".into(),
            group_id: group.into(),
            reward,
            sequence: crate::merge::Sequence::default(),
            advantages: vec![0.0, adv, adv],
            weights: vec![0.0, 1.0, 1.0],
        };
        let mini = MiniBatch {
            micro_batches: vec![MicroBatch {
                sequences: vec![
                    seq("a", "g1", 1.0, 1.0),
                    // A second sequence of episode a: its reward counts once.
                    seq("a", "g1", 1.0, 1.0),
                    seq("b", "g1", 0.0, -1.0),
                    seq("c", "g2", 0.5, 0.0),
                ],
                recompute: false,
            }],
            normalizer: crate::schedule::Normalizer {
                loss_tokens: 8,
                sequences: 4,
                episodes: 3,
                constant: 1.0,
            },
        };
        let (summary, advantages) = batch_summary(&[mini]);
        assert_eq!(summary["episodes"], 3);
        assert_eq!(summary["groups"], 2);
        assert_eq!(summary["reward"]["mean"], 0.5);
        // g1: rewards 1 and 0 (std 0.5); g2: one episode (std 0).
        assert_eq!(summary["reward"]["group_std_mean"], 0.25);
        assert_eq!(advantages.len(), 8, "the masked token is left out");
        assert_eq!(summary["advantage"]["tokens"], 8);
    }

    #[test]
    fn unknown_track_keys_and_bad_mlflow_uris_are_refused_before_training() {
        let err = toml::from_str::<crate::RunConfig>("[track]\ntensorbord = true")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensorbord"), "{err}");
        let cfg: crate::RunConfig =
            toml::from_str("[track.mlflow]\nuri = \"localhost:5000\"").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("has no scheme"), "{err}");
    }

    #[test]
    fn numbers_are_flattened_with_their_path() {
        let mut out = Vec::new();
        flatten(
            "run",
            &json!({"a": 1, "b": {"c": 2.5, "d": "text", "e": true}, "f": null}),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                ("run/a".to_owned(), 1.0),
                ("run/b/c".to_owned(), 2.5),
                ("run/b/e".to_owned(), 1.0)
            ]
        );
    }

    #[test]
    fn a_manifest_says_where_its_run_was_tracked() {
        let manifest = json!({
            "config": {"track": {"jsonl": true, "tensorboard": true}},
            "tracking": {"dir": "/runs", "backends": ["jsonl"], "failures": 0,
                         "mlflow": {"uri": "http://m:5000", "run_id": "abc"}},
            "checkpoint": {"global_step": 12},
        });
        let run = TrackedRun::from_manifest(&manifest).unwrap();
        assert!(run.options.tensorboard);
        assert_eq!(run.dir, PathBuf::from("/runs"));
        assert_eq!(run.step, 12);
        assert_eq!(run.mlflow, Some(("http://m:5000".into(), "abc".into())));
        // Without a checkpoint step: the steps after the one it started from.
        let mut older = manifest.clone();
        older["checkpoint"] = json!({});
        older["model"] = json!({"global_step_before": 4});
        older["steps"] = json!([{}, {}]);
        older["tracking"]["mlflow"] = json!({"uri": "http://m:5000", "run_id": null});
        let run = TrackedRun::from_manifest(&older).unwrap();
        assert_eq!((run.step, run.mlflow), (6, None));
        // A manifest from before tracking, or of a rank that did not track.
        let mut untracked = manifest;
        untracked["tracking"] = Value::Null;
        assert_eq!(TrackedRun::from_manifest(&untracked), None);
    }
}
