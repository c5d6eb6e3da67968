//! MLflow through its REST API (`/api/2.0/mlflow/...`, artifacts through the tracking
//! server's proxy, `mlflow server --serve-artifacts`, MLflow's default): one MLflow run
//! per training run in the configured experiment (made when missing), the configuration
//! flattened into params, metrics in `runs/log-batch` requests within MLflow's limits,
//! files as artifacts, the run's end status.
//!
//! Invariants:
//! - Nothing here blocks a training step: requests go out from one worker thread, fed by
//!   a bounded queue the trainer never waits on (a full queue drops, counted).
//! - A server that is down, slow (every request has `timeout_secs`) or answers errors
//!   or garbage is logged and counted once; the worker then drops what is queued, so a
//!   broken server costs one timeout, not one per step. [`Mlflow::end`] waits for the
//!   queue at most `timeout_secs` more.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Most metrics in one `runs/log-batch` (MLflow's `MAX_METRICS_PER_BATCH`).
pub const MAX_METRICS_PER_BATCH: usize = 1000;
/// Most params in one `runs/log-batch` (`MAX_PARAMS_TAGS_PER_BATCH`).
pub const MAX_PARAMS_PER_BATCH: usize = 100;
/// Longest param value MLflow stores (`MAX_PARAM_VAL_LENGTH`); longer ones are cut.
pub const MAX_PARAM_VALUE: usize = 6000;
/// Longest key (`MAX_ENTITY_KEY_LENGTH`).
pub const MAX_KEY: usize = 250;
/// Messages queued for the worker before new ones are dropped.
const QUEUE: usize = 4096;

/// `[track.mlflow]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlflowOptions {
    /// The tracking server, `http://` or `https://` (default: `MLFLOW_TRACKING_URI`).
    pub uri: Option<String>,
    /// The experiment (made when missing; default: `MLFLOW_EXPERIMENT_NAME`, else
    /// `tapline`).
    pub experiment: Option<String>,
    /// Seconds each request may take.
    pub timeout_secs: f64,
}

impl Default for MlflowOptions {
    fn default() -> Self {
        MlflowOptions {
            uri: None,
            experiment: None,
            timeout_secs: 10.0,
        }
    }
}

impl MlflowOptions {
    /// The tracking URI, checked: from the config, else `MLFLOW_TRACKING_URI`.
    pub fn resolved_uri(&self) -> Result<String, String> {
        let (uri, from) = match &self.uri {
            Some(u) => (u.clone(), "track.mlflow.uri"),
            None => match std::env::var("MLFLOW_TRACKING_URI") {
                Ok(u) if !u.is_empty() => (u, "MLFLOW_TRACKING_URI"),
                _ => {
                    return Err(
                        "[track.mlflow] needs the tracking server: set track.mlflow.uri (e.g. \"http://mlflow:5000\") or MLFLOW_TRACKING_URI".into(),
                    );
                }
            },
        };
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(format!(
                "{from} {uri:?} has no scheme: write the tracking server's URL, e.g. \"http://{uri}\""
            ));
        };
        if !matches!(scheme, "http" | "https") || rest.is_empty() {
            return Err(format!(
                "{from} {uri:?}: only an MLflow tracking server over http:// or https:// is supported (not a file store or a Databricks profile)"
            ));
        }
        Ok(uri.trim_end_matches('/').to_owned())
    }

    /// The experiment's name.
    pub fn experiment_name(&self) -> String {
        self.experiment
            .clone()
            .or_else(|| std::env::var("MLFLOW_EXPERIMENT_NAME").ok())
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| "tapline".into())
    }

    /// Checks the options; no IO.
    pub fn validate(&self) -> Result<(), String> {
        self.resolved_uri()?;
        if !(self.timeout_secs.is_finite() && self.timeout_secs > 0.0) {
            return Err(format!(
                "track.mlflow.timeout_secs {} is not a positive number of seconds",
                self.timeout_secs
            ));
        }
        Ok(())
    }
}

enum Msg {
    Metrics(Vec<Value>),
    Artifact(String, Vec<u8>),
    End(&'static str, SyncSender<()>),
}

/// What the worker shares with the trainer.
#[derive(Debug, Default)]
struct Shared {
    failures: AtomicU64,
    dropped: AtomicBool,
    run_id: Mutex<Option<String>>,
}

/// One MLflow run, fed from the trainer, written by a worker thread.
#[derive(Debug)]
pub struct Mlflow {
    tx: Option<SyncSender<Msg>>,
    shared: Arc<Shared>,
    timeout: Duration,
    uri: String,
}

/// A run to start: its name, params and tags.
#[derive(Debug, Clone)]
pub struct RunStart {
    /// MLflow's run name.
    pub name: String,
    /// The params (keys and values cut to MLflow's limits).
    pub params: Vec<(String, String)>,
    /// Tags.
    pub tags: Vec<(String, String)>,
}

impl Mlflow {
    /// Starts the worker, which makes the experiment when missing and the run. `options`
    /// were validated.
    pub fn start(options: &MlflowOptions, run: RunStart) -> Result<Self, String> {
        let uri = options.resolved_uri()?;
        let timeout = Duration::from_secs_f64(options.timeout_secs);
        let (tx, rx) = sync_channel(QUEUE);
        let shared = Arc::new(Shared::default());
        let worker = Worker {
            base: format!("{uri}/api/2.0"),
            timeout,
            shared: shared.clone(),
            experiment: options.experiment_name(),
            broken: false,
        };
        std::thread::Builder::new()
            .name("tapline-mlflow".into())
            .spawn(move || worker.run(run, rx))
            .map_err(|e| format!("start the MLflow worker: {e}"))?;
        Ok(Mlflow {
            tx: Some(tx),
            shared,
            timeout,
            uri,
        })
    }

    /// Failed requests and queue overflows (each kind counted once).
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// The MLflow run's id, once the server made it.
    pub fn run_id(&self) -> Option<String> {
        self.shared.run_id.lock().ok().and_then(|g| g.clone())
    }

    /// The tracking server.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    fn send(&self, msg: Msg) {
        let Some(tx) = &self.tx else { return };
        if let Err(TrySendError::Full(_)) = tx.try_send(msg)
            && !self.shared.dropped.swap(true, Ordering::Relaxed)
        {
            self.shared.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "tracking: mlflow: the server falls behind; metrics are dropped (metrics.jsonl keeps them)"
            );
        }
    }

    /// Scalars of one global step.
    pub fn metrics(&self, step: u64, values: &[(String, f64)]) {
        let timestamp = unix_millis();
        let metrics: Vec<Value> = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(key, value)| {
                json!({"key": metric_key(key), "value": value, "timestamp": timestamp, "step": step})
            })
            .collect();
        if !metrics.is_empty() {
            self.send(Msg::Metrics(metrics));
        }
    }

    /// A file of the run (e.g. `manifest.json`).
    pub fn artifact(&self, name: &str, bytes: Vec<u8>) {
        self.send(Msg::Artifact(name.to_owned(), bytes));
    }

    /// Ends the run with `status` (`FINISHED`, `FAILED`, `KILLED`), waiting for what is
    /// queued at most the request timeout more.
    pub fn end(&mut self, status: &'static str) {
        let Some(tx) = self.tx.take() else { return };
        let (done_tx, done_rx) = sync_channel(1);
        if tx.try_send(Msg::End(status, done_tx)).is_ok() {
            drop(tx);
            match done_rx.recv_timeout(self.timeout + Duration::from_secs(1)) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {}
                Err(RecvTimeoutError::Timeout) => tracing::warn!(
                    "tracking: mlflow: the run's last requests did not finish in time; leaving them"
                ),
            }
        }
    }
}

impl Drop for Mlflow {
    fn drop(&mut self) {
        self.end("FAILED");
    }
}

struct Worker {
    base: String,
    timeout: Duration,
    shared: Arc<Shared>,
    experiment: String,
    broken: bool,
}

impl Worker {
    fn run(mut self, start: RunStart, rx: Receiver<Msg>) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => return self.failed(&format!("start its runtime: {e}")),
        };
        let client = match reqwest::Client::builder().timeout(self.timeout).build() {
            Ok(c) => c,
            Err(e) => return self.failed(&format!("make an HTTP client: {e}")),
        };
        let run = runtime.block_on(self.create_run(&client, &start));
        let (run_id, artifact_root) = match run {
            Ok(r) => r,
            Err(e) => {
                self.failed(&e);
                (String::new(), String::new())
            }
        };
        while let Ok(msg) = rx.recv() {
            match msg {
                Msg::Metrics(mut metrics) => {
                    // What else is queued goes in the same requests.
                    let mut end = None;
                    while metrics.len() < MAX_METRICS_PER_BATCH * 4 {
                        match rx.try_recv() {
                            Ok(Msg::Metrics(more)) => metrics.extend(more),
                            Ok(other) => {
                                end = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    for chunk in metrics.chunks(MAX_METRICS_PER_BATCH) {
                        let body = json!({"run_id": run_id, "metrics": chunk});
                        runtime.block_on(self.post(&client, "mlflow/runs/log-batch", &body));
                    }
                    if let Some(msg) = end {
                        self.other(&runtime, &client, &run_id, &artifact_root, msg);
                    }
                }
                msg => self.other(&runtime, &client, &run_id, &artifact_root, msg),
            }
        }
    }

    fn other(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        client: &reqwest::Client,
        run_id: &str,
        artifact_root: &str,
        msg: Msg,
    ) {
        match msg {
            Msg::Metrics(_) => {}
            Msg::Artifact(name, bytes) => {
                if self.broken {
                    return;
                }
                let url = format!(
                    "{}/mlflow-artifacts/artifacts/{artifact_root}/{name}",
                    self.base
                );
                let sent = runtime.block_on(async {
                    let resp = client.put(&url).body(bytes).send().await;
                    check(resp).await.map(|_| ())
                });
                if let Err(e) = sent {
                    self.failed(&format!("upload {name}: {e}"));
                }
            }
            Msg::End(status, done) => {
                let body = json!({"run_id": run_id, "status": status, "end_time": unix_millis()});
                runtime.block_on(self.post(client, "mlflow/runs/update", &body));
                let _ = done.try_send(());
            }
        }
    }

    /// The experiment (made when missing) and the run with its params and tags: the
    /// run's id and the artifact path under the server's proxy.
    async fn create_run(
        &mut self,
        client: &reqwest::Client,
        start: &RunStart,
    ) -> Result<(String, String), String> {
        let get = format!("{}/mlflow/experiments/get-by-name", self.base);
        let found = client
            .get(&get)
            .query(&[("experiment_name", &self.experiment)])
            .send()
            .await;
        let experiment_id = match check(found).await {
            Ok(v) => id(&v["experiment"]["experiment_id"])?,
            Err(e) if e.contains("RESOURCE_DOES_NOT_EXIST") => {
                let url = format!("{}/mlflow/experiments/create", self.base);
                let made = client
                    .post(&url)
                    .json(&json!({"name": self.experiment}))
                    .send()
                    .await;
                match check(made).await {
                    Ok(v) => id(&v["experiment_id"])?,
                    // Made by another trainer in between.
                    Err(e) if e.contains("RESOURCE_ALREADY_EXISTS") => {
                        let again = client
                            .get(&get)
                            .query(&[("experiment_name", &self.experiment)])
                            .send()
                            .await;
                        id(&check(again).await?["experiment"]["experiment_id"])?
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let tags: Vec<Value> = start
            .tags
            .iter()
            .map(|(k, v)| json!({"key": cut(k, MAX_KEY), "value": cut(v, 5000)}))
            .collect();
        let url = format!("{}/mlflow/runs/create", self.base);
        let made = client
            .post(&url)
            .json(&json!({
                "experiment_id": experiment_id,
                "run_name": start.name,
                "start_time": unix_millis(),
                "tags": tags,
            }))
            .send()
            .await;
        let info = check(made).await?["run"]["info"].clone();
        let run_id = id(&info["run_id"])?;
        let root = info["artifact_uri"]
            .as_str()
            .and_then(|u| u.strip_prefix("mlflow-artifacts:/"))
            .unwrap_or("")
            .trim_start_matches('/')
            .to_owned();
        if let Ok(mut g) = self.shared.run_id.lock() {
            *g = Some(run_id.clone());
        }
        let params: Vec<Value> = start
            .params
            .iter()
            .map(|(k, v)| json!({"key": cut(k, MAX_KEY), "value": cut(v, MAX_PARAM_VALUE)}))
            .collect();
        for chunk in params.chunks(MAX_PARAMS_PER_BATCH) {
            let url = format!("{}/mlflow/runs/log-batch", self.base);
            let sent = client
                .post(&url)
                .json(&json!({"run_id": run_id, "params": chunk}))
                .send()
                .await;
            check(sent).await?;
        }
        if root.is_empty() {
            return Err(format!(
                "the run's artifact_uri {:?} is not served by the tracking server: start it with --serve-artifacts (MLflow's default)",
                info["artifact_uri"]
            ));
        }
        Ok((run_id, root))
    }

    async fn post(&mut self, client: &reqwest::Client, path: &str, body: &Value) {
        if self.broken {
            return;
        }
        let url = format!("{}/{path}", self.base);
        let sent = client.post(&url).json(body).send().await;
        if let Err(e) = check(sent).await {
            self.failed(&format!("{path}: {e}"));
        }
    }

    fn failed(&mut self, error: &str) {
        if self.broken {
            return;
        }
        self.broken = true;
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "tracking: mlflow at {}: {error}; this run is not sent there any more (metrics.jsonl keeps everything)",
            self.base
        );
        eprintln!(
            "train: tracking to MLflow failed ({error}); training goes on, metrics.jsonl keeps everything"
        );
    }
}

/// One metric into the existing run `run_id` at `uri`, waiting for the answer (at most
/// `timeout`): for what happens after a run ended, e.g. its publish.
pub fn log_metric(
    uri: &str,
    run_id: &str,
    key: &str,
    value: f64,
    step: u64,
    timeout: Duration,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("start a runtime: {e}"))?;
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| format!("make an HTTP client: {e}"))?;
    let body = json!({
        "run_id": run_id,
        "metrics": [{"key": metric_key(key), "value": value, "timestamp": unix_millis(), "step": step}],
    });
    let url = format!("{uri}/api/2.0/mlflow/runs/log-batch");
    runtime
        .block_on(async { check(client.post(&url).json(&body).send().await).await })
        .map(drop)
}

/// `key` as MLflow takes a metric name: only letters, digits, `_ - . / :` and spaces
/// (`_VALID_PARAM_AND_METRIC_NAMES`), no `..` and no leading or doubled `/` (names are
/// checked as paths); other characters become `_`, and it is cut to [`MAX_KEY`]. Names
/// come from outside (reward components as the harness named them, e.g. `pass@1`): one
/// MLflow refuses would fail the whole batch it is in.
pub fn metric_key(key: &str) -> String {
    let allowed: String = key
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':' | ' ') {
                c
            } else {
                '_'
            }
        })
        .collect();
    // As a path it must be its own normal form: no empty, `.` or `..` segments.
    let segments: Vec<&str> = allowed
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            "." => "_",
            ".." => "_.",
            s => s,
        })
        .collect();
    let out = segments.join("/");
    cut(if out.is_empty() { "_" } else { &out }, MAX_KEY)
}

/// The JSON of a 2xx answer; anything else as an error that says what came back.
async fn check(resp: reqwest::Result<reqwest::Response>) -> Result<Value, String> {
    let resp = resp.map_err(|e| {
        if e.is_timeout() {
            format!("no answer in time ({e})")
        } else {
            e.to_string()
        }
    })?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| e.to_string())?;
    let value = serde_json::from_str::<Value>(&text);
    if !status.is_success() {
        return Err(format!("HTTP {status}: {}", cut(&text, 300)));
    }
    if text.trim().is_empty() {
        // The artifact proxy answers an upload with an empty 200.
        return Ok(Value::Null);
    }
    value.map_err(|_| format!("not MLflow's JSON: {}", cut(&text, 120)))
}

fn id(v: &Value) -> Result<String, String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no id in the answer ({v})"))
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A configuration as MLflow params: every value under `value` with its dotted path
/// (`train.lr`), strings as they are, lists and tables below a list as JSON.
pub fn params(value: &Value) -> Vec<(String, String)> {
    crate::flatten::leaves("", '.', value)
        .into_iter()
        .filter_map(|(path, v)| match v {
            Value::Null => None,
            Value::Object(_) => None, // an empty table
            Value::String(s) => Some((path, s.clone())),
            other => Some((path, other.to_string())),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_without_a_scheme_or_of_other_stores_are_refused_by_name() {
        let with = |uri: &str| MlflowOptions {
            uri: Some(uri.into()),
            ..MlflowOptions::default()
        };
        let err = with("mlflow:5000").validate().unwrap_err();
        assert!(
            err.contains("has no scheme") && err.contains("http://mlflow:5000"),
            "{err}"
        );
        let err = with("file:///tmp/mlruns").validate().unwrap_err();
        assert!(err.contains("only an MLflow tracking server"), "{err}");
        assert_eq!(
            with("http://h:5000/").resolved_uri().unwrap(),
            "http://h:5000"
        );
        let err = MlflowOptions {
            timeout_secs: 0.0,
            ..with("http://h")
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("timeout_secs"), "{err}");
    }

    #[test]
    fn metric_names_from_outside_become_names_mlflow_takes() {
        assert_eq!(
            metric_key("run/reward/components/pass@1/mean"),
            "run/reward/components/pass_1/mean"
        );
        assert_eq!(metric_key("train/loss"), "train/loss");
        assert_eq!(metric_key("run/x/../y/./z"), "run/x/_./y/_/z");
        assert_eq!(metric_key("/a//b/"), "a/b");
        assert_eq!(metric_key("tëst:ok 1"), "tëst:ok 1");
        assert_eq!(metric_key("@"), "_");
        assert_eq!(metric_key(&"k".repeat(300)).len(), MAX_KEY);
    }

    #[test]
    fn a_config_flattens_into_dotted_params() {
        let p = params(&json!({"run": "r", "train": {"lr": 1e-6, "lora": null,
            "targets": ["q", "v"]}}));
        assert_eq!(
            p,
            vec![
                ("run".to_owned(), "r".to_owned()),
                ("train.lr".to_owned(), "1e-6".to_owned()),
                ("train.targets".to_owned(), "[\"q\",\"v\"]".to_owned()),
            ]
        );
        assert_eq!(cut("ééé", 3), "é");
    }
}
