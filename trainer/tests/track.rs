//! What the trainer writes for TensorBoard, read back by TensorBoard's own Python readers
//! (`tensorboard_check.py`, from `TAPLINE_PYTHON`'s venv): two runs of one series into
//! one directory, as `train --follow` writes them.

mod common;

use std::path::Path;

use serde_json::{Value, json};
use tapline_trainer::track::{Status, TrackOptions, Tracker};

fn read(dir: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tensorboard_check.py");
    let output = std::process::Command::new(common::python())
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run tensorboard_check.py with TAPLINE_PYTHON");
    assert!(
        output.status.success(),
        "tensorboard_check.py:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn tensorboard_reads_two_runs_as_one_series() {
    let dir = tempfile::tempdir().unwrap();
    let options = TrackOptions {
        tensorboard: true,
        ..TrackOptions::default()
    };
    // Two runs, the second continuing the global steps of the first.
    for (run, first) in [(1u64, 0u64), (2, 2)] {
        let out = dir.path().join(format!("{run:06}"));
        let config = json!({"run": "demo", "train": {"lr": 0.5}, "note": "<script>x</script>"});
        let mut t = Tracker::open(&options, dir.path(), "demo", &out, first, &config);
        for step in first + 1..=first + 2 {
            t.step(
                step,
                &json!({"step": step, "loss": step as f64 / 10.0, "skipped": false,
                        "inference_logprob_gap": null}),
            );
        }
        t.summary(
            first + 2,
            &json!({"reward": {"mean": run as f64 / 4.0}}),
            &[("run/advantages", vec![-1.0, 0.0, 0.5, 1.0])],
        );
        t.finish(Status::Finished, None);
        assert_eq!(t.failures(), 0);
    }
    let got = read(dir.path());
    assert_eq!(got["files"], 2, "{got}");
    assert_eq!(got["versions"], json!(["brain.Event:2", "brain.Event:2"]));
    let loss = &got["scalars"]["train/loss"];
    let steps: Vec<u64> = loss
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "one series: {got}");
    assert!((loss[3][1].as_f64().unwrap() - 0.4).abs() < 1e-6);
    assert_eq!(got["scalars"]["train/skipped"][0][1], 0.0);
    assert!(
        got["scalars"].get("train/inference_logprob_gap").is_none(),
        "a null is no point"
    );
    assert!(got["scalars"].get("train/step").is_none());
    assert_eq!(
        got["scalars"]["run/reward/mean"],
        json!([[2, 0.25], [4, 0.5]])
    );
    let h = &got["histograms"]["run/advantages"];
    assert_eq!(h.as_array().unwrap().len(), 2);
    assert_eq!(h[0]["num"], 4.0);
    assert_eq!(h[0]["counts"], 4.0);
    assert_eq!(
        (h[0]["min"].as_f64(), h[0]["max"].as_f64()),
        (Some(-1.0), Some(1.0))
    );
    let config = &got["text"]["config"];
    assert_eq!(config[1][0], 2, "each run's config at its first step");
    let text = config[0][1].as_str().unwrap();
    assert!(text.contains("lr = 0.5"), "{text}");
    assert_eq!(got["plugins"]["config"], "text");
    // metrics.jsonl beside the event files holds the same steps.
    let jsonl = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps = jsonl
        .lines()
        .filter(|l| l.contains("\"event\":\"step\""))
        .count();
    assert_eq!(steps, 4);
}

/// `mlflow server` from `TAPLINE_MLFLOW_PYTHON`'s venv (`cargo xtask test` installs it
/// in `.cache/mlflow-venv`) on a free port, with a SQLite store and served artifacts.
struct MlflowServer {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn mlflow_server() -> MlflowServer {
    let python = std::env::var_os("TAPLINE_MLFLOW_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/mlflow-venv/bin/python")
        });
    let mlflow = python.with_file_name("mlflow");
    assert!(
        mlflow.is_file(),
        "{} not found: set TAPLINE_MLFLOW_PYTHON or run `cargo xtask test`, which installs .cache/mlflow-venv",
        mlflow.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    let child = std::process::Command::new(&mlflow)
        .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--backend-store-uri")
        .arg(format!(
            "sqlite:///{}",
            dir.path().join("mlflow.db").display()
        ))
        .arg("--artifacts-destination")
        .arg(dir.path().join("artifacts"))
        .args(["--workers", "1"])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let server = MlflowServer {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    };
    let started = std::time::Instant::now();
    while get(&server.url, "/health").0 != 200 {
        assert!(
            started.elapsed().as_secs() < 120,
            "mlflow server not healthy after 120 s: {}",
            std::fs::read_to_string(server._dir.path().join("server.log")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    server
}

/// A GET over a plain TCP connection: status and body (0 when nothing answers).
fn get(base: &str, path_and_query: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let host = base.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return (0, String::new());
    };
    write!(
        s,
        "GET {path_and_query} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    // Chunked answers: the JSON object between the first `{` and the last `}`.
    let body = match (body.find('{'), body.rfind('}')) {
        (Some(a), Some(b)) if a < b => &body[a..=b],
        _ => body,
    };
    (status, body.to_owned())
}

fn get_json(base: &str, path_and_query: &str) -> Value {
    let (status, body) = get(base, path_and_query);
    assert_eq!(status, 200, "{path_and_query}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn mlflow_options(uri: &str, timeout_secs: f64) -> TrackOptions {
    TrackOptions {
        mlflow: Some(tapline_trainer::track::mlflow::MlflowOptions {
            uri: Some(uri.into()),
            experiment: Some("tapline-test".into()),
            timeout_secs,
        }),
        ..TrackOptions::default()
    }
}

#[test]
fn mlflow_holds_the_runs_params_metrics_artifacts_and_status() {
    let server = mlflow_server();
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("manifest.json");
    std::fs::write(&manifest, br#"{"format": "tapline.train_run.v1"}"#).unwrap();
    let options = mlflow_options(&server.url, 30.0);
    let config = json!({"run": "coder", "train": {"lr": 0.5, "lora": {"rank": 8}}});
    let mut run_ids = Vec::new();
    for (first, status) in [(0u64, Status::Killed), (600, Status::Finished)] {
        let mut t = Tracker::open(&options, dir.path(), "coder", dir.path(), first, &config);
        // 600 steps of two scalars: more than one log-batch holds (1000 metrics).
        for step in first + 1..=first + 600 {
            t.step(
                step,
                &json!({"step": step, "loss": step as f64 / 1000.0, "lr": 0.5}),
            );
        }
        // A reward component named as a harness may name it: MLflow refuses `@` in a
        // metric name, which would fail the whole batch.
        t.summary(
            first + 600,
            &json!({"reward": {"mean": 0.75, "components": {"pass@1": {"mean": 0.5}}}}),
            &[],
        );
        t.artifact(&manifest);
        t.finish(status, None);
        assert_eq!(t.failures(), 0);
        assert_eq!(t.backends(), vec!["jsonl", "mlflow"]);
        let (uri, run_id) = t.mlflow_run().unwrap();
        assert_eq!(uri, server.url);
        run_ids.push(run_id.expect("the run was made"));
    }
    let url = &server.url;
    for (run_id, status) in run_ids.iter().zip(["KILLED", "FINISHED"]) {
        let run = get_json(url, &format!("/api/2.0/mlflow/runs/get?run_id={run_id}"));
        assert_eq!(run["run"]["info"]["status"], status, "{run}");
        let params = &run["run"]["data"]["params"];
        let param = |key: &str| {
            params
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["key"] == key)
                .map(|p| p["value"].clone())
        };
        assert_eq!(param("train.lr"), Some(json!("0.5")), "{params}");
        assert_eq!(param("train.lora.rank"), Some(json!("8")));
        let tags = run["run"]["data"]["tags"].to_string();
        assert!(tags.contains("tapline.run"), "{tags}");
        let files = get_json(
            url,
            &format!("/api/2.0/mlflow/artifacts/list?run_id={run_id}"),
        );
        assert_eq!(files["files"][0]["path"], "manifest.json", "{files}");
    }
    let history = get_json(
        url,
        &format!(
            "/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=train/loss&max_results=5000",
            run_ids[1]
        ),
    );
    let mut steps: Vec<u64> = history["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    steps.sort_unstable();
    assert_eq!(
        steps,
        (601..=1200).collect::<Vec<_>>(),
        "the global steps count on"
    );
    let reward = get_json(
        url,
        &format!(
            "/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=run/reward/mean",
            run_ids[0]
        ),
    );
    assert_eq!(reward["metrics"][0]["value"], 0.75);
    assert_eq!(reward["metrics"][0]["step"], 600);
    let component = get_json(
        url,
        &format!(
            "/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=run/reward/components/pass_1/mean",
            run_ids[0]
        ),
    );
    assert_eq!(component["metrics"][0]["value"], 0.5, "{component}");
    // A publish after the run finished adds its version to the same MLflow run.
    let run = tapline_trainer::track::TrackedRun {
        options: options.clone(),
        dir: dir.path().to_owned(),
        step: 1200,
        mlflow: Some((server.url.clone(), run_ids[1].clone())),
    };
    tapline_trainer::track::record_published(&run, &json!({"version": 7}), Some(7));
    let version = get_json(
        url,
        &format!(
            "/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=run/policy_version",
            run_ids[1]
        ),
    );
    assert_eq!(version["metrics"][0]["value"], 7.0, "{version}");
    assert_eq!(version["metrics"][0]["step"], 1200);
    let info = get_json(
        url,
        &format!("/api/2.0/mlflow/runs/get?run_id={}", run_ids[1]),
    );
    assert_eq!(info["run"]["info"]["status"], "FINISHED");
    let published: Vec<Value> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["event"] == "policy_published")
        .collect();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0]["step"], 1200);
}

/// A server that accepts connections and answers each with `answer` (`None`: never).
fn fake_server(answer: Option<&'static str>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            match answer {
                Some(a) => {
                    use std::io::{Read, Write};
                    let mut conn = conn;
                    let mut buf = [0u8; 65536];
                    let _ = conn.read(&mut buf);
                    let _ = conn.write_all(a.as_bytes());
                }
                None => held.push(conn),
            }
        }
    });
    url
}

#[test]
fn an_mlflow_server_down_slow_or_answering_garbage_never_stops_or_slows_training() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    let slow = fake_server(None);
    let garbage = fake_server(Some(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\ngarbage",
    ));
    let failing = fake_server(Some(
        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\noops!",
    ));
    for (name, uri) in [
        ("down", closed),
        ("slow", slow),
        ("garbage", garbage),
        ("500", failing),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let started = std::time::Instant::now();
        let mut t = Tracker::open(
            &mlflow_options(&uri, 0.5),
            dir.path(),
            "r",
            dir.path(),
            0,
            &json!({}),
        );
        for step in 1..=200 {
            t.step(step, &json!({"loss": 1.0}));
        }
        let stepped = started.elapsed();
        t.finish(Status::Finished, None);
        let ended = started.elapsed();
        assert!(
            stepped.as_secs_f64() < 0.4,
            "{name}: 200 steps took {stepped:?}: the trainer waited on the server"
        );
        assert!(
            ended.as_secs_f64() < 3.0,
            "{name}: finishing took {ended:?} (timeout 0.5 s)"
        );
        assert_eq!(t.failures(), 1, "{name}: one failure, counted once");
        // metrics.jsonl has every step all the same.
        let jsonl = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let steps = jsonl
            .lines()
            .filter(|l| l.contains("\"event\":\"step\""))
            .count();
        assert_eq!(steps, 200, "{name}");
    }
}
