//! `tapline-trainer train` and `score` end to end on SmolLM2-135M-Instruct: multi-turn
//! episodes recorded as a sidecar records them (text only, so the trainer renders the
//! chat template and tokenizes), one training run, then what it wrote.

mod common;

use std::path::Path;

use common::cli::{run_score_with, score_with, trainer};
use common::traces::Trace;
use serde_json::{Value, json};
use tapline_proto::store::open_store;

const T0: i64 = 1_780_000_000_000_000_000;

/// Two tasks × four episodes × two calls (answer, feedback, answer again).
fn trace() -> Trace {
    trace_of("sc-train", "")
}

/// The same episodes from sidecar `sidecar`, their ids prefixed with `prefix`.
fn trace_of(sidecar: &str, prefix: &str) -> Trace {
    common::traces::two_tasks(sidecar, prefix, T0)
}

/// An inference server that takes every adapter but refuses the first `fail_first`
/// loads with a 500: records `(path, body)` of each request (std threads, so it answers
/// while the test blocks on a process).
/// Requests an [`adapter_server`] received: `(path, JSON body)`.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>;

fn adapter_server(fail_first: usize) -> (String, Seen) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Seen = Default::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for mut socket in listener.incoming().flatten() {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let (end, len) = loop {
                let n = socket.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break (0, 0);
                }
                got.extend_from_slice(&buf[..n]);
                if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    break (end + 4, len);
                }
            };
            while end > 0 && got.len() < end + len {
                let n = socket.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            let head = String::from_utf8_lossy(&got[..end]).into_owned();
            let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
            let body = serde_json::from_slice(&got[end..]).unwrap_or(Value::Null);
            let mut log = log.lock().unwrap();
            let loads = log
                .iter()
                .filter(|(p, _)| p.ends_with("/load_lora_adapter"))
                .count();
            let fail = path.ends_with("/load_lora_adapter") && loads < fail_first;
            log.push((path, body));
            drop(log);
            let _ = socket.write_all(if fail {
                &b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 6\r\nconnection: close\r\n\r\nno GPU"[..]
            } else {
                &b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nconnection: close\r\n\r\nSuccess"[..]
            });
        }
    });
    (url, seen)
}

/// SmolLM2; a temporary directory with a local store holding [`trace`], the store's URL
/// and the store; `--now-unix-secs` ten minutes after the trace.
async fn smollm2_and_store() -> (
    std::path::PathBuf,
    tempfile::TempDir,
    String,
    tapline_proto::store::StoreLocation,
    String,
) {
    let model = common::smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", tmp.path().join("store").display());
    let store = open_store(&store_url).unwrap();
    trace().write(&store, 9).await;
    let now = ((T0 / 1_000_000_000) + 600).to_string();
    (model, tmp, store_url, store, now)
}

/// The lines of `dir/metrics.jsonl`.
fn metrics_lines(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).expect("read file")).expect("JSON file")
}

fn run(cmd: &mut std::process::Command) -> (bool, String, String) {
    let out = cmd.output().expect("run tapline-trainer");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `score` with `input` on stdin.
fn run_score(model: &Path, input: &str) -> std::process::Output {
    run_score_with(model, None, input)
}

fn score(model: &Path, ids: &[u32]) -> Vec<f64> {
    score_with(model, None, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_writes_a_checkpoint_manifest_and_chart_and_advances_the_cursor() {
    let model = common::smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", tmp.path().join("store").display());
    let store = open_store(&store_url).unwrap();
    trace().write(&store, 9).await;
    let out = tmp.path().join("ckpt-1");
    let now = ((T0 / 1_000_000_000) + 600).to_string();
    let train = |model: &Path, out: &Path| {
        let mut c = trainer();
        c.args(["train", "--store", &store_url, "--model"])
            .arg(model)
            .arg("--out")
            .arg(out)
            .args([
                "--lr",
                "2e-5",
                "--now-unix-secs",
                &now,
                "--mini-batch-episodes",
                "4",
            ])
            .args(["--max-seq-len", "512", "--micro-batch-tokens", "512"]);
        c
    };
    let (ok, stdout, stderr) = run(&mut train(&model, &out));
    assert!(ok, "train failed: {stderr}\n{stdout}");
    assert!(stdout.contains("step 1/2 (global 1) loss"), "{stdout}");
    assert!(stdout.contains("step 2/2 (global 2) loss"), "{stdout}");

    // The manifest: provenance, report, steps, compute, checkpoint.
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["format"], "tapline.train_run.v1");
    assert_eq!(
        m["git_commit"].as_str().unwrap().len(),
        40,
        "{}",
        m["git_commit"]
    );
    assert_eq!(m["config"]["train"]["lr"], 2e-5);
    let segments = m["input_segments"].as_array().unwrap();
    assert!(!segments.is_empty());
    for s in segments {
        let key = s["key"].as_str().unwrap();
        let bytes = std::fs::read(tmp.path().join("store").join(key)).unwrap();
        assert_eq!(
            s["sha256"],
            tapline_trainer::ingest::sha256_hex(&bytes),
            "{key}"
        );
    }
    assert_eq!(m["report"]["input"]["episodes"], 8);
    let steps = m["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    for s in steps {
        for field in [
            "loss",
            "grad_norm",
            "clip_fraction",
            "entropy",
            "kl",
            "reward_mean",
        ] {
            assert!(s[field].as_f64().unwrap().is_finite(), "{field}: {s}");
        }
        assert!(s["grad_norm"].as_f64().unwrap() > 0.0);
        assert_eq!(s["episodes"], 4);
    }
    // The second mini-batch was scored before the first update: its ratios moved.
    assert!(
        steps[1]["ratio_max"].as_f64().unwrap() != 1.0
            || steps[1]["ratio_min"].as_f64().unwrap() != 1.0
    );
    assert_eq!(steps[0]["ratio_min"], 1.0);
    assert!(m["tokens_trained"].as_u64().unwrap() > m["loss_tokens_trained"].as_u64().unwrap());
    assert!(m["compute"]["peak_rss_bytes"].as_u64().unwrap() > 100 << 20);
    assert!(m["compute"]["wall_clock_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(m["compute"]["gpu_seconds"], 0.0);
    assert_eq!(m["checkpoint"]["global_step"], 2);
    assert_eq!(m["mode"], "full");
    assert_eq!(m["resumed"], Value::Null);
    // The optimizer state is beside the checkpoint, named in the manifest.
    let state = std::fs::read(out.join("optimizer.safetensors")).unwrap();
    let state_sha = tapline_trainer::ingest::sha256_hex(&state);
    assert_eq!(m["checkpoint"]["optimizer_sha256"], state_sha.as_str());
    assert_eq!(m["checkpoint"]["optimizer_step"], 2);
    assert_eq!(read_json(&out.join("optimizer.json"))["step"], 2);
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    assert_eq!(
        m["checkpoint"]["model_safetensors_sha256"],
        tapline_trainer::ingest::sha256_hex(&weights)
    );
    // metrics.jsonl in --out: the run's start, each step as the manifest has it, the
    // run's summary, its end.
    let lines = metrics_lines(&out);
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(
        events,
        ["run_started", "step", "step", "run", "run_finished"]
    );
    assert_eq!(lines[1]["loss"], steps[0]["loss"]);
    assert_eq!(lines[2]["step"], 2);
    assert_eq!(lines[3]["summary"]["episodes"], 8);
    assert!(lines[3]["summary"]["reward"]["mean"].is_f64());
    assert_eq!(lines[4]["status"], "FINISHED");
    assert_eq!(m["tracking"]["backends"], serde_json::json!(["jsonl"]));
    // report.html: self-contained, the curves, the episodes' tokens; rendered again the
    // same from the directory.
    let page = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(page.starts_with("<!doctype html>") && page.contains("id=\"curves\""));
    // Nothing fetched (SVG's xmlns is a name, not a fetch).
    assert!(!page.contains("src=") && !page.contains("href=") && !page.contains("<script"));
    assert!(
        page.matches("class=\"l\"").count() > 10,
        "trained tokens are marked"
    );
    assert!(
        page.contains("trainer log-prob -"),
        "the trainer's log-prob of each trained token"
    );
    let samples = read_json(&out.join("samples.json"));
    assert_eq!(samples["episodes"], 8);
    std::fs::remove_file(out.join("report.html")).unwrap();
    let (ok, _, stderr) = run(trainer().args(["report", "--run"]).arg(&out));
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::read_to_string(out.join("report.html")).unwrap(),
        page
    );
    assert_eq!(m["tracking"]["failures"], 0);
    // The chart is an SVG; the tokenizer and template came along.
    let chart = std::fs::read_to_string(out.join("chart.svg")).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("<polyline"),
        "{chart}"
    );
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        assert!(out.join(f).is_file(), "{f} not copied");
    }

    // The checkpoint is a different model: the rewarded answer became likelier.
    let tokenizer = tapline_trainer::Model::load(&model, &Default::default()).unwrap();
    let ids = tokenizer
        .encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
        .unwrap();
    let before = score(&model, &ids);
    let after = score(&out, &ids);
    assert_eq!(before.len(), ids.len() - 1);
    let i = before.len() - 2; // the answer token
    assert!(
        after[i] > before[i],
        "log p(5): {} -> {}",
        before[i],
        after[i]
    );

    // The cursor moved: a second run finds nothing new and still writes a loadable model.
    let out2 = tmp.path().join("ckpt-2");
    let (ok, stdout, stderr) = run(&mut train(&out, &out2));
    assert!(ok, "second run failed: {stderr}\n{stdout}");
    let m2 = read_json(&out2.join("manifest.json"));
    assert_eq!(m2["steps"].as_array().unwrap().len(), 0);
    assert_eq!(m2["checkpoint"]["global_step"], 2);
    // ... continuing the optimizer state it found beside the weights.
    assert_eq!(m2["resumed"]["from"], out.display().to_string());
    assert_eq!(m2["resumed"]["optimizer_sha256"], state_sha.as_str());
    assert_eq!(m2["resumed"]["optimizer_step"], 2);
    assert!(stdout.contains("optimizer state resumed from"), "{stdout}");

    // A finished output directory is refused before any work.
    let (ok, _, stderr) = run(&mut train(&model, &out));
    assert!(!ok);
    assert!(stderr.contains("already holds a checkpoint"), "{stderr}");
}

/// Two trainers on one cursor (a scheduled run that overlapped the previous one): B reads
/// the cursor and is held (SIGSTOP) while A trains and commits; B then finishes its
/// steps, but its cursor write is refused: it exits non-zero saying why, leaves no
/// manifest, marks its directory incomplete, and the cursor is A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_trainers_on_one_cursor_exactly_one_advances_it() {
    use std::io::BufRead as _;
    let (model, tmp, store_url, _store, now) = smollm2_and_store().await;
    let train = |out: &Path| {
        let mut c = trainer();
        c.args([
            "train", "--store", &store_url, "--run", "nightly", "--model",
        ])
        .arg(&model)
        .arg("--out")
        .arg(out)
        .args(["--lr", "2e-5", "--now-unix-secs", &now])
        .args(["--mini-batch-episodes", "4", "--max-seq-len", "512"])
        .args(["--micro-batch-tokens", "512"]);
        c
    };
    let cursor_key = tmp.path().join("store/trainer/runs/nightly/cursor.json");
    let signal = |sig: &str, pid: u32| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };

    let (out_a, out_b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut b = train(&out_b)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The line before the first step: B has read the cursor and prepared its batch.
    let mut b_stdout = std::io::BufReader::new(b.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = b_stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "B ended before training: {seen}");
        seen.push_str(&line);
        if line.contains("step(s) from global step") {
            break;
        }
    }
    signal("-STOP", b.id());
    assert!(!cursor_key.exists(), "B wrote the cursor before its steps");

    let (ok, stdout, stderr) = run(&mut train(&out_a));
    signal("-CONT", b.id());
    assert!(ok, "A failed: {stderr}\n{stdout}");
    let cursor_a = std::fs::read(&cursor_key).expect("A wrote the cursor");
    assert!(out_a.join("manifest.json").is_file());

    let mut rest = String::new();
    std::io::Read::read_to_string(&mut b_stdout, &mut rest).unwrap();
    let b = b.wait_with_output().unwrap();
    let b_stderr = String::from_utf8_lossy(&b.stderr);
    assert!(!b.status.success(), "B succeeded: {seen}{rest}{b_stderr}");
    assert!(
        rest.contains("step 2/2"),
        "B was stopped mid-run, not before it: {seen}{rest}{b_stderr}"
    );
    assert!(
        b_stderr.contains("cursor trainer/runs/nightly/cursor.json of run \"nightly\" moved since this run read it"),
        "{b_stderr}"
    );
    assert!(!out_b.join("manifest.json").exists());
    assert!(!out_b.join("cursor-commit.json").exists());
    let marker = std::fs::read_to_string(out_b.join("INCOMPLETE")).unwrap();
    assert!(marker.contains("another trainer advanced it"), "{marker}");
    assert_eq!(
        std::fs::read(&cursor_key).unwrap(),
        cursor_a,
        "B moved the cursor"
    );

    // The next run starts from A's cursor: nothing new to train, and it commits.
    let (ok, stdout, stderr) = run(&mut train(&tmp.path().join("c")));
    assert!(ok, "C failed: {stderr}\n{stdout}");
    let c = read_json(&tmp.path().join("c/manifest.json"));
    assert_eq!(c["steps"].as_array().unwrap().len(), 0);
}

#[test]
fn score_refuses_bad_input_with_a_message() {
    let model = common::smollm2();
    for (input, expected) in [
        ("not json", "not JSON"),
        ("{\"tokens\": [1]}", "no \"ids\" array"),
        ("{\"ids\": [1, -2]}", "ids[1]"),
        ("{\"ids\": [1, 999999]}", "outside the model's vocabulary"),
    ] {
        let out = run_score(&model, input);
        assert!(!out.status.success(), "{input}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{input}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_with_lora_writes_a_peft_adapter_that_scores_merges_and_resumes() {
    let (model, tmp, store_url, store, now) = smollm2_and_store().await;
    let config = |rank: u32| {
        let path = tmp.path().join(format!("lora-{rank}.toml"));
        std::fs::write(
            &path,
            format!(
                "[train]\nlr = 5e-4\n\n[train.lora]\nrank = {rank}\nalpha = {}\n",
                2 * rank
            ),
        )
        .unwrap();
        path
    };
    let train = |out: &Path, config: &Path, extra: &[&str]| {
        let mut c = trainer();
        c.args(["train", "--store", &store_url, "--model"])
            .arg(&model)
            .arg("--out")
            .arg(out)
            .arg("--config")
            .arg(config)
            .args(["--now-unix-secs", &now, "--mini-batch-episodes", "4"])
            .args(["--max-seq-len", "512", "--micro-batch-tokens", "512"])
            .args(extra);
        c
    };
    let out = tmp.path().join("adapter-1");
    // The first run also publishes its adapter ([publish]).
    let (server, seen) = adapter_server(0);
    let publishing = tmp.path().join("lora-8-publish.toml");
    std::fs::write(
        &publishing,
        format!(
            "{}\n[publish]\npolicy = \"coder\"\nservers = [\"{server}\"]\npath_on_server = \"/adapters/{{out_name}}\"\n",
            std::fs::read_to_string(config(8)).unwrap()
        ),
    )
    .unwrap();
    let (ok, stdout, stderr) = run(&mut train(&out, &publishing, &[]));
    assert!(ok, "train failed: {stderr}\n{stdout}");
    assert!(stdout.contains("LoRA r 8 alpha 16"), "{stdout}");
    assert!(
        stdout.contains("published") && stdout.contains("coder@v1"),
        "{stdout}"
    );
    assert_eq!(
        seen.lock().unwrap().clone(),
        [(
            "/v1/load_lora_adapter".to_owned(),
            json!({"lora_name": "coder@v1", "lora_path": "/adapters/adapter-1"})
        )]
    );
    let announced = tapline_trainer::publish::announced(&store, "coder")
        .await
        .unwrap()
        .expect("the version is announced");
    assert_eq!(announced.version, 1);
    assert_eq!(
        announced.manifest_sha256,
        tapline_trainer::ingest::sha256_hex(&std::fs::read(out.join("manifest.json")).unwrap())
    );
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "trainer_state.json",
        "tokenizer.json",
        "chat_template.jinja",
        "manifest.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    assert!(!out.join("model.safetensors").exists());
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["mode"], "lora");
    assert_eq!(m["steps"].as_array().unwrap().len(), 2);
    let trainable = m["model"]["trainable_parameters"].as_u64().unwrap();
    // 30 layers × (4 attention + 3 MLP projections) × r (in + out).
    assert_eq!(
        trainable,
        30 * 8 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    );
    let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        m["checkpoint"]["adapter_model_safetensors_sha256"],
        tapline_trainer::ingest::sha256_hex(&adapter)
    );
    let config_json = read_json(&out.join("adapter_config.json"));
    assert_eq!(config_json["r"], 8);
    assert_eq!(
        config_json["base_model_name_or_path"],
        std::fs::canonicalize(&model).unwrap().display().to_string()
    );

    // The adapter made the rewarded answer likelier; merged, it is the same model.
    let tokenizer = tapline_trainer::Model::load(&model, &Default::default()).unwrap();
    let ids = tokenizer
        .encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
        .unwrap();
    let before = score(&model, &ids);
    let after = score_with(&model, Some(&out), &ids);
    let i = before.len() - 2;
    assert!(
        after[i] > before[i],
        "log p(5): {} -> {}",
        before[i],
        after[i]
    );
    let merged = tmp.path().join("merged");
    let (ok, _, stderr) = run(trainer()
        .args(["merge-lora", "--model"])
        .arg(&model)
        .arg("--adapter")
        .arg(&out)
        .arg("--out")
        .arg(&merged));
    assert!(ok, "merge-lora failed: {stderr}");
    let merged_lp = score(&merged, &ids);
    let gap = merged_lp
        .iter()
        .zip(&after)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        gap < 1e-4,
        "merged model differs from model + adapter by {gap:e}"
    );

    // --resume continues the adapter and its optimizer state (no new data: no steps).
    let out2 = tmp.path().join("adapter-2");
    let (ok, stdout, stderr) = run(&mut train(
        &out2,
        &config(8),
        &["--resume", out.to_str().unwrap()],
    ));
    assert!(ok, "resumed run failed: {stderr}\n{stdout}");
    let m2 = read_json(&out2.join("manifest.json"));
    assert_eq!(m2["resumed"]["from"], out.display().to_string());
    assert_eq!(m2["checkpoint"]["global_step"], 2);
    assert_eq!(
        std::fs::read(out2.join("adapter_model.safetensors")).unwrap(),
        adapter,
        "no step, same adapter"
    );
    // A config that asks for another adapter shape is refused, naming both.
    let (ok, _, stderr) = run(&mut train(
        &tmp.path().join("adapter-3"),
        &config(4),
        &["--resume", out.to_str().unwrap()],
    ));
    assert!(!ok);
    assert!(
        stderr.contains("[train.lora]") && stderr.contains("rank: 8"),
        "{stderr}"
    );
    // --resume of a directory without optimizer state says what to do.
    let (ok, _, stderr) = run(&mut train(
        &tmp.path().join("adapter-4"),
        &config(8),
        &["--resume", merged.to_str().unwrap()],
    ));
    assert!(!ok);
    assert!(
        stderr.contains("full checkpoint") && stderr.contains("[train.lora]"),
        "{stderr}"
    );
}

/// A `train --follow` process whose stdout is read as it runs.
struct Follower {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Follower {
    fn start(cmd: &mut std::process::Command) -> Follower {
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let lines: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let out = child.stdout.take().unwrap();
        let log = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok)
            {
                log.lock().unwrap().push(line);
            }
        });
        Follower { child, lines }
    }

    /// Waits until `n` lines of stdout contain `needle`.
    fn wait_for_line(&self, needle: &str, n: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        loop {
            let seen = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(needle))
                .count();
            if seen >= n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{needle:?} x{n} never printed:\n{}",
                self.lines.lock().unwrap().join("\n")
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// SIGTERM, then the exit: (stdout, stderr).
    fn terminate(mut self) -> (String, String) {
        std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let stdout = self.lines.lock().unwrap().join("\n");
        assert!(
            status.success(),
            "follow exited with {status}: {stderr}\n{stdout}"
        );
        assert!(stdout.contains("train: stopped"), "{stdout}");
        (stdout, stderr)
    }
}

fn wait_for(path: std::path::PathBuf) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while !path.is_file() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// `train --follow` with `[publish]`: each batch is trained from the run before and
/// published; a failed publish is retried; SIGTERM in the middle of a run drops it
/// without touching the cursor; a restart after a stop between the manifest and the
/// cursor (and before the publish) finishes both and does not train that batch again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_follow_trains_publishes_and_recovers_from_stops_at_any_point() {
    let model = common::smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", tmp.path().join("store").display());
    let store = open_store(&store_url).unwrap();
    trace_of("sc-first", "a-").write(&store, 9).await;
    // The first load fails: the publish is retried at the next poll.
    let (server, seen) = adapter_server(1);
    let config = tmp.path().join("lora.toml");
    std::fs::write(
        &config,
        format!("[train]\nlr = 5e-4\n\n[train.lora]\nrank = 4\nalpha = 8\n\n[publish]\npolicy = \"coder\"\nservers = [\"{server}\"]\n"),
    )
    .unwrap();
    let base = tmp.path().join("runs");
    let now = ((T0 / 1_000_000_000) + 600).to_string();
    let follower = || {
        let mut cmd = trainer();
        cmd.args([
            "train",
            "--follow",
            "--min-episodes",
            "8",
            "--poll-secs",
            "0.2",
        ])
        .args(["--store", &store_url, "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&base)
        .arg("--config")
        .arg(&config)
        .args(["--now-unix-secs", &now, "--mini-batch-episodes", "8"])
        .args(["--max-seq-len", "512", "--micro-batch-tokens", "512"]);
        Follower::start(&mut cmd)
    };
    let announced_now = || async {
        tapline_trainer::publish::announced(&store, "coder")
            .await
            .unwrap()
            .unwrap()
    };
    let published_from = |run: &str| -> (u64, String) {
        let p = read_json(&base.join(run).join("published.json"));
        (
            p["announcement"]["version"].as_u64().unwrap(),
            p["announcement"]["adapter"].as_str().unwrap().to_owned(),
        )
    };

    let f = follower();
    wait_for(base.join("000001/published.json"));
    // Version 1 was claimed by the failed try, so the retry is version 2.
    assert_eq!(
        published_from("000001"),
        (2, base.join("000001").display().to_string())
    );
    // Nothing new: it waits. Then a second batch arrives and is trained on, from the
    // first run's adapter and optimizer state.
    std::thread::sleep(std::time::Duration::from_millis(800));
    assert!(!base.join("000002").join("manifest.json").exists());
    trace_of("sc-second", "b-").write(&store, 9).await;
    wait_for(base.join("000002/published.json"));
    assert_eq!(published_from("000002").0, 3);
    assert_eq!(announced_now().await.version, 3);

    // Stopped while waiting.
    f.terminate();

    // A batch of two mini-batches (written while no follower runs, so that it is seen
    // whole); SIGTERM before its last step drops the run.
    trace_of("sc-third", "c-").write(&store, 9).await;
    trace_of("sc-third-b", "d-").write(&store, 9).await;
    let f = follower();
    f.wait_for_line("step(s) from global step", 1);
    let (stdout, _) = f.terminate();
    assert!(
        stdout.contains("train: stopped after 1 of 2 step(s)"),
        "{stdout}"
    );
    assert!(!base.join("000003").exists());

    let first = read_json(&base.join("000001/manifest.json"));
    let second = read_json(&base.join("000002/manifest.json"));
    let keys = |m: &Value| -> Vec<String> {
        m["input_segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["key"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(
        !keys(&first).is_empty() && keys(&first).iter().all(|k| k.contains("sc-first")),
        "{:?}",
        keys(&first)
    );
    assert!(
        !keys(&second).is_empty() && keys(&second).iter().all(|k| k.contains("sc-second")),
        "{:?}",
        keys(&second)
    );
    assert_eq!(
        second["resumed"]["from"].as_str().unwrap(),
        base.join("000001").display().to_string()
    );
    assert_eq!(
        second["model"]["global_step_before"],
        first["steps"].as_array().unwrap().len() as u64
    );

    // As if the second run had stopped right after its manifest: its cursor not
    // written (the commit file not renamed yet), its adapter not published.
    let stopped_before_cursor = |dir: &str| {
        let dir = base.join(dir);
        assert!(!dir.join("cursor-commit.json").exists());
        std::fs::rename(
            dir.join("cursor-committed.json"),
            dir.join("cursor-commit.json"),
        )
        .unwrap();
        read_json(&dir.join("cursor-commit.json"))
    };
    let commit = stopped_before_cursor("000002");
    let before: tapline_trainer::ingest::Cursor =
        serde_json::from_value(commit["before"].clone()).unwrap();
    let run_name = commit["run"].as_str().unwrap();
    let (_, version) = tapline_trainer::ingest::read_cursor_versioned(&store, run_name)
        .await
        .unwrap();
    tapline_trainer::ingest::write_cursor(&store, run_name, &before, &version)
        .await
        .unwrap();
    std::fs::remove_file(base.join("000002/published.json")).unwrap();

    let f = follower();
    wait_for(base.join("000003/published.json"));
    let (stdout, _) = f.terminate();
    assert!(stdout.contains("its cursor not written"), "{stdout}");
    assert!(base.join("000002/cursor-committed.json").is_file());
    assert_eq!(
        published_from("000002"),
        (4, base.join("000002").display().to_string())
    );
    assert_eq!(published_from("000003").0, 5);
    assert_eq!(announced_now().await.version, 5);
    let third = read_json(&base.join("000003/manifest.json"));
    assert!(
        keys(&third).iter().all(|k| k.contains("sc-third")) && keys(&third).len() >= 2,
        "the second batch is not trained again: {:?}",
        keys(&third)
    );
    assert_eq!(third["steps"].as_array().unwrap().len(), 2);
    assert!(!base.join("000004").join("manifest.json").exists());
    // One series in the --out root: every run's start, steps and end, the stopped one
    // marked KILLED, the global steps of the runs kept counting on.
    let lines = metrics_lines(&base);
    let statuses: Vec<&str> = lines
        .iter()
        .filter(|l| l["event"] == "run_finished")
        .map(|l| l["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["FINISHED", "FINISHED", "KILLED", "FINISHED"]);
    // Each publish adds its version, also that of a run a restarted follower found on
    // disk unpublished (000002's second publish, v4, with the tracking its manifest
    // recorded).
    let versions: Vec<u64> = lines
        .iter()
        .filter(|l| l["event"] == "policy_published")
        .map(|l| l["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, [2, 3, 4, 5], "{lines:?}");
    let mut kept = Vec::new();
    let mut run_steps = Vec::new();
    for l in &lines {
        match l["event"].as_str().unwrap() {
            "step" => run_steps.push(l["step"].as_u64().unwrap()),
            "run_finished" if l["status"] == "FINISHED" => kept.append(&mut run_steps),
            "run_finished" => run_steps.clear(),
            _ => {}
        }
    }
    assert!(
        kept.len() == 4 && kept.windows(2).all(|w| w[0] < w[1]),
        "{kept:?}"
    );
    assert_eq!(third["tracking"]["dir"], base.display().to_string());
    // Every version the server loaded: 1 failed, then 2..=5 in order.
    let loads: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "/v1/load_lora_adapter")
        .map(|(_, b)| b["lora_name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        loads,
        ["coder@v1", "coder@v2", "coder@v3", "coder@v4", "coder@v5"]
    );

    // The cursor holds every batch: a prepare of the same run finds nothing new.
    let out = tmp.path().join("after");
    let (ok, stdout, stderr) = run(trainer()
        .args(["prepare", "--store", &store_url, "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .args(["--now-unix-secs", &now]));
    assert!(ok, "{stderr}");
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["input"]["segments"], 0, "{stdout}");

    // As if the third run had stopped right after its manifest, and another trainer on
    // the same cursor had moved it since: the restart cannot commit the third run; it
    // says so, exits non-zero and marks the directory incomplete (no manifest).
    let commit = stopped_before_cursor("000003");
    let mut elsewhere: tapline_trainer::ingest::Cursor =
        serde_json::from_value(commit["before"].clone()).unwrap();
    elsewhere
        .pending_episodes
        .insert("another-trainer".to_owned());
    let (_, version) = tapline_trainer::ingest::read_cursor_versioned(&store, run_name)
        .await
        .unwrap();
    tapline_trainer::ingest::write_cursor(&store, run_name, &elsewhere, &version)
        .await
        .unwrap();
    let mut f = follower();
    let status = f.child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(f.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("another trainer has moved the cursor since; it is marked incomplete"),
        "{stderr}"
    );
    assert!(!base.join("000003/manifest.json").exists());
    assert!(base.join("000003/INCOMPLETE").is_file());
    assert_eq!(
        tapline_trainer::ingest::read_cursor(&store, run_name)
            .await
            .unwrap(),
        elsewhere,
        "the other trainer's cursor is left as it is"
    );

    // --no-cursor cannot follow.
    let (ok, _, stderr) = run(trainer()
        .args([
            "train",
            "--follow",
            "--no-cursor",
            "--store",
            &store_url,
            "--model",
        ])
        .arg(&model)
        .arg("--out")
        .arg(tmp.path().join("never")));
    assert!(!ok && stderr.contains("drop --no-cursor"), "{stderr}");
}

/// A store in `dir` with two episodes of one group, each one call whose prompt is about
/// `words` tokens long (rewards 1 and 0); its URL.
async fn long_episodes_store(dir: &Path, words: usize) -> String {
    let store_url = format!("file://{}", dir.display());
    let store = open_store(&store_url).unwrap();
    let mut t = Trace::new("sc-memory", T0);
    for (i, reward) in [1.0, 0.0].into_iter().enumerate() {
        let episode = format!("long-{i}");
        t.start(&episode, "long", "g");
        let text = format!("Summarize this log:{}", " error retry".repeat(words / 2));
        let request = json!({"model": "m", "messages": [{"role": "user", "content": text}]});
        t.chat_call(
            &episode,
            "long",
            0,
            &request,
            common::traces::answer("It retried after each error.").completion(vec![], vec![]),
            vec![],
            tapline_proto::Outcome::Ok,
        );
        t.reward(&episode, "", "", reward);
        t.end(&episode, "long", "g", false);
    }
    t.write(&store, 16).await;
    store_url
}

/// `train` of [`long_episodes_store`] with a LoRA adapter, one micro-batch holding both
/// sequences, and `extra` flags.
fn train_long(tmp: &Path, store_url: &str, out: &str, extra: &[&str]) -> (bool, String, String) {
    let config = tmp.join("memory.toml");
    std::fs::write(
        &config,
        "[clean]\ndrop_zero_variance_groups = false\n[train]\nlr = 1e-5\n[train.lora]\nrank = 8\nalpha = 16\n",
    )
    .unwrap();
    let now = ((T0 / 1_000_000_000) + 600).to_string();
    run(trainer()
        .args(["train", "--no-cursor", "--store", store_url, "--model"])
        .arg(common::smollm2())
        .arg("--out")
        .arg(tmp.join(out))
        .arg("--config")
        .arg(&config)
        .args(["--now-unix-secs", &now])
        .args(["--max-seq-len", "8192", "--micro-batch-tokens", "8192"])
        .args(extra))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_too_long_for_the_memory_budget_fails_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let store_url = long_episodes_store(&tmp.path().join("store"), 3000).await;
    // Above the weights and optimizer state of SmolLM2 with an adapter (~1.05 GiB), below
    // what a 3000-token sequence needs even with recompute (~0.5 GiB more: each layer's
    // input, and one layer recomputed).
    let (ok, stdout, stderr) = train_long(
        tmp.path(),
        &store_url,
        "small",
        &["--max-memory", "1.25GiB"],
    );
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("tokens (episode long-")
            && stderr.contains("even with recompute")
            && stderr.contains("max_memory = 1.25 GiB")
            && stderr.contains("--max-memory"),
        "{stderr}"
    );
    assert!(!stdout.contains("step 1/"), "no step is taken: {stdout}");
    assert!(!tmp.path().join("small/manifest.json").exists());

    // Bad input: an unparsable size is refused before anything is read.
    let (ok, _, stderr) = train_long(
        tmp.path(),
        &store_url,
        "bad",
        &["--max-memory", "16 parsecs"],
    );
    assert!(!ok);
    assert!(
        stderr.contains("\"16 parsecs\" is not a size") && stderr.contains("16GiB"),
        "{stderr}"
    );
    // A budget below the weights alone.
    let (ok, _, stderr) = train_long(tmp.path(), &store_url, "tiny", &["--max-memory", "300MiB"]);
    assert!(!ok);
    assert!(
        stderr.contains("below what the weights, gradients and optimizer state alone need"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_sequence_trains_under_a_budget_it_fits_only_with_recompute() {
    let tmp = tempfile::tempdir().unwrap();
    let store_url = long_episodes_store(&tmp.path().join("store"), 3000).await;
    let budget: u64 = 7 << 29; // 3.5 GiB
    let (ok, stdout, stderr) =
        train_long(tmp.path(), &store_url, "fit", &["--max-memory", "3.5GiB"]);
    assert!(ok, "train failed: {stderr}\n{stdout}");
    let m = read_json(&tmp.path().join("fit/manifest.json"));
    let memory = &m["memory"];
    assert_eq!(memory["budget_bytes"], budget, "{memory}");
    assert_eq!(memory["budget_source"], "--max-memory");
    // Both sequences were scheduled into one micro-batch; each alone needs more than the
    // budget without recompute, and both fit together with it.
    assert_eq!(memory["micro_batches_scheduled"], 1, "{memory}");
    assert_eq!(memory["micro_batches"], 1, "{memory}");
    assert_eq!(memory["split"], 0, "{memory}");
    assert_eq!(memory["recompute"], 1, "{memory}");
    let per_token = memory["bytes_per_token"].as_u64().unwrap();
    let fixed = memory["static_bytes"].as_u64().unwrap();
    assert!(fixed + 3000 * per_token > budget, "{memory}");
    // What matters: the step stayed inside the budget, and inside the estimate.
    let peak = memory["peak_measured_bytes"].as_u64().unwrap();
    let estimate = memory["estimated_peak_bytes"].as_u64().unwrap();
    assert!(peak <= estimate && estimate <= budget, "{memory}");
    assert_eq!(m["steps"].as_array().unwrap().len(), 1);
    assert!(
        stdout.contains("train: memory budget 3.50 GiB (--max-memory)"),
        "{stdout}"
    );

    // A budget above the machine's memory is taken, with a warning naming both.
    let short = long_episodes_store(&tmp.path().join("short"), 8).await;
    let (ok, stdout, stderr) = train_long(tmp.path(), &short, "big", &["--max-memory", "1000TiB"]);
    assert!(ok, "train failed: {stderr}\n{stdout}");
    assert!(
        stderr.contains("--max-memory = 1000.00 TiB is more than this machine's memory"),
        "{stderr}"
    );
    let m = read_json(&tmp.path().join("big/manifest.json"));
    assert_eq!(m["memory"]["recompute"], 0, "{}", m["memory"]);
}
