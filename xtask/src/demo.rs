//! `cargo xtask demo`: the closed loop on this machine, as a user would run it.
//!
//! ```text
//!   examples/loop_harness.py ──openai client──▶ tapline-sidecar ──▶ tapline-policy-server
//!        │ tapline SDK (episodes,   model "policy"  │ --policy demo:     (SmolLM2-135M-Instruct
//!        │ rewards)                    → demo@vN    │ records, follows    + adapters demo@vN)
//!        ▼                                          ▼ policies/demo.json      ▲ /v1/load_lora_adapter
//!   control API ──────────────────────────▶ .cache/demo/store ──▶ tapline-trainer train ([publish])
//!                                                                      └▶ checkpoints/iter-N
//! ```
//!
//! Each iteration runs the harness's episodes (groups per task), waits until the sidecar
//! has uploaded every record, trains a LoRA adapter on the new records (the trainer's
//! cursor knows what is new) and publishes it: the policy server loads it as `demo@vN`,
//! the version is announced in the store, and the sidecar sends the harness's calls for
//! model `policy` to it from then on, recording the version on each call. `--full` trains
//! every weight instead and has the policy server reload the checkpoint (no versions).
//! The last iteration only measures. It prints a line per iteration (with the version
//! that served its calls) and writes `.cache/demo/reward.svg`; the last line is `demo:
//! mean reward first=<x> last=<y>`.
//!
//! `--smoke` is the short version `cargo xtask test` runs: two tiny iterations, then
//! checks that records reached the store, the trainer made batches and a checkpoint that
//! differs from the start, and the policy server serves the new weights.
//!
//! Ctrl-C reaches every child (same process group): the sidecar flushes its spool, the
//! servers stop, a running trainer stops before writing its manifest (so its cursor does
//! not move). The demo notices, says so and exits with status 130. Children are also
//! stopped (SIGTERM) when the demo fails.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};

use crate::assets::{ensure_smollm2, ensure_venv, install_sdk, torch_env};

/// Settings of a demo run.
#[derive(Debug, Clone)]
struct Options {
    iterations: usize,
    tasks: usize,
    group_size: usize,
    max_tokens: usize,
    lr: f64,
    seed: u64,
    smoke: bool,
    lora: bool,
}

impl Options {
    fn parse(args: &[String]) -> anyhow::Result<Self> {
        let mut o = Options {
            iterations: 6,
            tasks: 3,
            group_size: 4,
            max_tokens: 16,
            lr: 3e-5,
            seed: 0,
            smoke: false,
            lora: true,
        };
        let mut lr_given = false;
        let mut it = args.iter().filter(|a| *a != "--");
        while let Some(flag) = it.next() {
            let mut value = |name: &str| {
                it.next()
                    .with_context(|| format!("{name} needs a value"))
                    .cloned()
            };
            match flag.as_str() {
                "--iterations" => o.iterations = value(flag)?.parse()?,
                "--tasks" => o.tasks = value(flag)?.parse()?,
                "--group-size" => o.group_size = value(flag)?.parse()?,
                "--max-tokens" => o.max_tokens = value(flag)?.parse()?,
                "--lr" => {
                    o.lr = value(flag)?.parse()?;
                    lr_given = true;
                }
                "--lora" => o.lora = true,
                "--full" => o.lora = false,
                "--seed" => o.seed = value(flag)?.parse()?,
                "--smoke" => {
                    o.smoke = true;
                    o.iterations = 2;
                    o.tasks = 2;
                    o.group_size = 3;
                    o.max_tokens = 8;
                }
                other => bail!(
                    "unknown demo flag {other:?} (flags: --iterations N --tasks N --group-size N --max-tokens N --lr X --seed N --full --smoke)"
                ),
            }
        }
        if o.lora && !lr_given {
            // LoRA learning rates are about 10x a full fine-tune's.
            o.lr *= 10.0;
        }
        ensure!(o.iterations >= 2, "--iterations must be at least 2");
        ensure!(
            o.group_size >= 2,
            "--group-size must be at least 2 (GRPO compares samples)"
        );
        Ok(o)
    }
}

/// Child processes stopped with SIGTERM (then waited for) when dropped.
#[derive(Default)]
pub(crate) struct Children(pub(crate) Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for (name, child) in &mut self.0 {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        eprintln!("demo: {name} did not stop in 10 s; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A small blocking HTTP client over the Python in the venv would be overkill; curl is
/// not guaranteed either, so this speaks HTTP/1.1 over a TcpStream.
/// The status, the response head and the body as JSON (null if it is not JSON).
pub(crate) fn http(
    method: &str,
    url: &str,
    body: Option<&Value>,
) -> anyhow::Result<(u16, String, Value)> {
    let (status, head, payload) = http_raw(method, url, body)?;
    let value = serde_json::from_str(&payload).unwrap_or(Value::Null);
    Ok((status, head, value))
}

/// A plain HTTP/1.1 request: the status, the response head and the body as text.
pub(crate) fn http_raw(
    method: &str,
    url: &str,
    body: Option<&Value>,
) -> anyhow::Result<(u16, String, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").context("http:// URL")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(600)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, payload) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let payload = if chunked {
        dechunk(payload)
    } else {
        payload.to_owned()
    };
    Ok((status, head.to_owned(), payload))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Waits (at most 60 s) until the sidecar at `sidecar` holds no record in its spool:
/// everything it recorded is in the store.
pub(crate) fn wait_uploaded(sidecar: &str) -> anyhow::Result<()> {
    let wait = Instant::now();
    loop {
        let (_, _, h) = http("GET", &format!("{sidecar}/tapline/v1/health"), None)?;
        if h["spool_records"].as_u64() == Some(0) {
            return Ok(());
        }
        ensure!(
            wait.elapsed() < Duration::from_secs(60),
            "sidecar still holds records after 60 s: {h}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub(crate) fn wait_healthy(
    name: &str,
    url: &str,
    child: &mut Child,
    timeout: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        if let Ok((200, _, _)) = http("GET", url, None) {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "{name} exited with {status} before it was healthy (see its log under .cache/demo/logs)"
            );
        }
        ensure!(
            started.elapsed() < timeout,
            "{name} not healthy after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `tapline-sidecar` (the debug build) on 127.0.0.1:`port` in front of `upstream`,
/// recording to `store` as `id`, cutting a segment every second.
pub(crate) fn sidecar_command(
    root: &Path,
    port: u16,
    upstream: &str,
    kind: &str,
    store: &str,
    spool: &Path,
    id: &str,
) -> Command {
    let mut cmd = Command::new(root.join("target/debug/tapline-sidecar"));
    cmd.args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--upstream", upstream, "--upstream-kind", kind])
        .args(["--store", store])
        .arg("--spool-dir")
        .arg(spool)
        .args(["--sidecar-id", id, "--segment-max-age-secs", "1"]);
    cmd
}

pub(crate) fn spawn(
    name: &str,
    cmd: &mut Command,
    logs: &Path,
    children: &mut Children,
) -> anyhow::Result<()> {
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let child = cmd
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("start {name}: {cmd:?}"))?;
    children.0.push((name.to_owned(), child));
    Ok(())
}

fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    ensure!(
        out.status.success(),
        "sha256sum {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// Greedy log-probs of a fixed prompt: a fingerprint of the weights serving `model`.
fn fingerprint(policy: &str, model: &str) -> anyhow::Result<(String, Vec<f64>)> {
    let (status, head, v) = http(
        "POST",
        &format!("{policy}/v1/chat/completions"),
        Some(&json!({
            "model": model, "max_tokens": 4, "temperature": 0, "logprobs": true,
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        })),
    )?;
    ensure!(status == 200, "policy server answered {status}: {v}");
    let version = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-tapline-policy-version")
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default();
    let lps = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t["logprob"].as_f64()).collect())
        .unwrap_or_default();
    Ok((version, lps))
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

pub fn demo(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let o = Options::parse(args)?;
    // The terminal sends SIGINT to every process of the group; the children stop on
    // their own, this process only has to notice instead of dying mid-sentence.
    let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst));
    let result = run_demo(root, &o);
    if interrupted() {
        eprintln!(
            "demo: interrupted (Ctrl-C); the policy server, the sidecar and the trainer stopped"
        );
        std::process::exit(130);
    }
    result
}

/// Debug builds of the three binaries, into `target/debug`.
pub fn build_binaries(python: &Path) -> anyhow::Result<()> {
    crate::run(torch_env(
        Command::new("cargo").args([
            "build",
            "-p",
            "tapline-sidecar",
            "-p",
            "tapline-trainer",
            "-p",
            "tapline-policy-server",
        ]),
        python,
    ))
}

fn run_demo(root: &Path, o: &Options) -> anyhow::Result<()> {
    let started = Instant::now();
    let python = ensure_venv(root)?;
    let model = ensure_smollm2(root, &python)?;
    install_sdk(root, &python)?;
    eprintln!("demo: building the sidecar, the trainer and the policy server");
    build_binaries(&python)?;
    let bin = |name: &str| root.join("target/debug").join(name);

    let dir = root
        .join(".cache")
        .join(if o.smoke { "demo-smoke" } else { "demo" });
    let _ = std::fs::remove_dir_all(&dir);
    let logs = dir.join("logs");
    let checkpoints = dir.join("checkpoints");
    // Every iteration's metrics in one series: metrics.jsonl and TensorBoard's files.
    let track = dir.join("track");
    for d in [&logs, &checkpoints] {
        std::fs::create_dir_all(d)?;
    }
    let store = format!("file://{}", dir.join("store").display());
    let config = dir.join("trainer.toml");
    std::fs::write(
        &config,
        format!(
            "run = \"demo\"\n[clean]\nmax_seq_len = 1024\n{}[schedule]\nmicro_batch_tokens = 2048\nmini_batch_episodes = 4\n[train]\nlr = {}\nweight_decay = 0.0\nseed = {}\n{}",
            // The versions the sidecar records belong to this policy (lag in the report).
            if o.lora { "policy = \"demo\"\n" } else { "" },
            o.lr,
            o.seed,
            if o.lora {
                "[train.lora]\nrank = 16\nalpha = 32\n"
            } else {
                ""
            }
        ),
    )?;
    let mut children = Children::default();
    let policy_port = free_port()?;
    let policy = format!("http://127.0.0.1:{policy_port}");
    if o.lora {
        // Each LoRA run publishes its adapter to the policy server as the next version.
        let mut text = std::fs::read_to_string(&config)?;
        text.push_str(&format!(
            "[publish]\npolicy = \"demo\"\nservers = [\"{policy}\"]\nkeep_loaded = 2\n"
        ));
        std::fs::write(&config, text)?;
    }

    spawn(
        "policy-server",
        Command::new(bin("tapline-policy-server"))
            .arg("--model")
            .arg(&model)
            .args(["--listen", &format!("127.0.0.1:{policy_port}")])
            .args([
                "--served-model-name",
                "policy",
                "--seed",
                &o.seed.to_string(),
            ]),
        &logs,
        &mut children,
    )?;
    let sidecar_port = free_port()?;
    let sidecar = format!("http://127.0.0.1:{sidecar_port}");
    spawn(
        "sidecar",
        sidecar_command(
            root,
            sidecar_port,
            &policy,
            "vllm",
            &store,
            &dir.join("spool"),
            "demo",
        )
        .args(if o.lora {
            // The harness keeps asking for "policy"; the sidecar follows the versions.
            &[
                "--policy",
                "demo",
                "--policy-alias",
                "policy",
                "--policy-poll-secs",
                "0.5",
            ][..]
        } else {
            &[][..]
        }),
        &logs,
        &mut children,
    )?;
    {
        let (_, c) = &mut children.0[0];
        wait_healthy(
            "policy server",
            &format!("{policy}/health"),
            c,
            Duration::from_secs(120),
        )?;
        let (_, c) = &mut children.0[1];
        wait_healthy(
            "sidecar",
            &format!("{sidecar}/tapline/v1/health"),
            c,
            Duration::from_secs(30),
        )?;
    }
    println!(
        "demo: SmolLM2-135M-Instruct served by the policy server at {policy}, sidecar at {sidecar}, records in {store}"
    );
    println!(
        "demo: {} iterations x {} tasks x {} episodes (2 calls each), {}lr {:.1e}, seed {}",
        o.iterations,
        o.tasks,
        o.group_size,
        if o.lora { "LoRA r 16, " } else { "" },
        o.lr,
        o.seed
    );

    let start_sha = sha256_file(&model.join("model.safetensors"))?;
    let (_, start_fingerprint) = fingerprint(&policy, "policy")?;
    let mut current = model.clone();
    let mut rewards: Vec<f64> = Vec::new();
    let mut total_steps = 0;
    for k in 0..o.iterations {
        ensure!(!interrupted(), "interrupted");
        let iteration_started = Instant::now();
        let served_by = if o.lora {
            let (_, _, h) = http("GET", &format!("{sidecar}/tapline/v1/health"), None)?;
            h["policy"]["served_model"]
                .as_str()
                .unwrap_or("the base model")
                .to_owned()
        } else {
            current
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        };
        let out = Command::new(&python)
            .arg(root.join("examples/loop_harness.py"))
            .args(["--sidecar", &sidecar, "--iteration", &k.to_string()])
            .args([
                "--tasks",
                &o.tasks.to_string(),
                "--group-size",
                &o.group_size.to_string(),
            ])
            .args([
                "--max-tokens",
                &o.max_tokens.to_string(),
                "--seed",
                &o.seed.to_string(),
            ])
            .stderr(Stdio::inherit())
            .output()
            .context("run examples/loop_harness.py")?;
        ensure!(
            out.status.success(),
            "the harness exited with {}",
            out.status
        );
        let summary: Value = serde_json::from_slice(
            out.stdout
                .split(|b| *b == b'\n')
                .find(|l| l.starts_with(b"{"))
                .unwrap_or_default(),
        )
        .context("the harness printed no summary line")?;
        let reward = summary["mean_reward"].as_f64().unwrap_or(f64::NAN);
        rewards.push(reward);
        let mut line = format!(
            "iteration {k}: mean reward {reward:.3}, served by {served_by}, episodes {}, completion tokens {}, harness {:.0}s",
            summary["episodes"],
            summary["completion_tokens"],
            summary["seconds"].as_f64().unwrap_or(0.0)
        );
        if k + 1 < o.iterations {
            // Every record uploaded before the trainer reads.
            wait_uploaded(&sidecar)?;
            let ckpt = checkpoints.join(format!("iter-{k:03}"));
            let mut train = Command::new(bin("tapline-trainer"));
            train.args(["train", "--store", &store, "--model"]);
            if o.lora {
                // The base model stays; each run continues the previous run's adapter.
                train.arg(&model);
                if current != model {
                    train.arg("--adapter").arg(&current);
                }
            } else {
                train.arg(&current);
            }
            let trained = train
                .arg("--out")
                .arg(&ckpt)
                .arg("--tensorboard")
                .arg("--track-dir")
                .arg(&track)
                .arg("--config")
                .arg(&config)
                .output()
                .context("run tapline-trainer train")?;
            std::fs::write(
                logs.join(format!("train-{k:03}.log")),
                [&trained.stdout[..], &trained.stderr[..]].concat(),
            )?;
            ensure!(
                trained.status.success(),
                "tapline-trainer train failed (log: {}): {}",
                logs.join(format!("train-{k:03}.log")).display(),
                String::from_utf8_lossy(&trained.stderr)
            );
            let manifest: Value =
                serde_json::from_slice(&std::fs::read(ckpt.join("manifest.json"))?)?;
            let steps = manifest["steps"].as_array().map_or(0, Vec::len);
            total_steps += steps;
            if o.lora {
                // The trainer published it; wait until the sidecar follows the new version.
                let version = k as u64 + 1;
                let wait = Instant::now();
                loop {
                    let (_, _, h) = http("GET", &format!("{sidecar}/tapline/v1/health"), None)?;
                    if h["policy"]["version"].as_u64() == Some(version) {
                        break;
                    }
                    ensure!(
                        wait.elapsed() < Duration::from_secs(30),
                        "the sidecar does not follow version {version} after 30 s: {h}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            } else {
                let (status, _, v) = http(
                    "POST",
                    &format!("{policy}/v1/reload"),
                    Some(&json!({"path": ckpt})),
                )?;
                ensure!(status == 200, "policy server refused the checkpoint: {v}");
            }
            current = ckpt;
            line.push_str(&format!(
                ", trained {} steps on {} tokens in {:.0}s",
                steps,
                manifest["tokens_trained"],
                manifest["compute"]["wall_clock_seconds"]
                    .as_f64()
                    .unwrap_or(0.0)
            ));
        }
        line.push_str(&format!(
            ", iteration {:.0}s",
            iteration_started.elapsed().as_secs_f64()
        ));
        println!("{line}");
    }

    let chart = dir.join("reward.svg");
    let points: Vec<Value> = rewards
        .iter()
        .enumerate()
        .map(|(i, r)| json!([i, r]))
        .collect();
    let mut plot = Command::new(bin("tapline-trainer"))
        .args([
            "plot",
            "--title",
            "tapline demo: SmolLM2-135M-Instruct, two-turn arithmetic",
            "--out",
        ])
        .arg(&chart)
        .stdin(Stdio::piped())
        .spawn()?;
    {
        use std::io::Write as _;
        let mut stdin = plot.stdin.take().context("plot stdin")?;
        stdin.write_all(
            json!({"panels": [{"title": "mean reward per iteration", "x_label": "iteration",
                   "series": [{"name": "mean reward", "points": points}]}]})
            .to_string()
            .as_bytes(),
        )?;
    }
    ensure!(plot.wait()?.success(), "plot failed");

    if o.smoke {
        // What the short loop must show.
        let segments = walk(&dir.join("store"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "tlseg"))
            .count();
        ensure!(segments > 0, "no segment reached the store");
        let first: Value =
            serde_json::from_slice(&std::fs::read(checkpoints.join("iter-000/manifest.json"))?)?;
        ensure!(
            first["steps"].as_array().is_some_and(|s| !s.is_empty()),
            "the trainer made no batch from the first iteration: {}",
            first["report"]
        );
        // A LoRA run writes an adapter (new by construction); a full run new weights.
        let weights = if o.lora {
            "adapter_model.safetensors"
        } else {
            "model.safetensors"
        };
        let sha = sha256_file(&checkpoints.join("iter-000").join(weights))?;
        ensure!(
            sha != start_sha,
            "the checkpoint equals the starting weights"
        );
        let expected = if o.lora { "demo@v1" } else { "iter-000" };
        let (version, served) = fingerprint(&policy, expected)?;
        ensure!(
            version == expected,
            "the policy server serves version {version:?}, not {expected}"
        );
        ensure!(
            served != start_fingerprint,
            "the policy server's log-probs did not change after the reload"
        );
        if o.lora {
            // The second iteration's calls went to version 1 and were recorded with it.
            let look = dir.join("versions");
            let out = Command::new(bin("tapline-trainer"))
                .args(["prepare", "--no-cursor", "--store", &store, "--model"])
                .arg(&model)
                .arg("--out")
                .arg(&look)
                .arg("--config")
                .arg(&config)
                .output()?;
            ensure!(
                out.status.success(),
                "prepare failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let report: Value = serde_json::from_slice(&std::fs::read(look.join("report.json"))?)?;
            let lags = &report["policy"]["calls_by_lag"];
            ensure!(
                lags["0"].as_u64().is_some_and(|n| n > 0)
                    && lags["unversioned"].as_u64().is_some_and(|n| n > 0),
                "expected calls of the base model (iteration 0) and of version 1 (iteration 1): {}",
                report["policy"]
            );
        }
        // The store opened to data tools: the Parquet export holds exactly what `dump`
        // reads, checked with pyarrow and DuckDB (trainer/tests/export_check.py).
        let export_dir = dir.join("export");
        let out = Command::new(bin("tapline-trainer"))
            .args(["export", "--store", &store, "--out"])
            .arg(&export_dir)
            .output()?;
        ensure!(
            out.status.success(),
            "export failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        print!("{}", String::from_utf8_lossy(&out.stdout));
        let dump = Command::new(bin("tapline-sidecar"))
            .args(["dump", "--store", &store])
            .output()?;
        ensure!(
            dump.status.success(),
            "dump failed: {}",
            String::from_utf8_lossy(&dump.stderr)
        );
        let dump_file = dir.join("dump.jsonl");
        std::fs::write(&dump_file, &dump.stdout)?;
        let check = Command::new(&python)
            .arg(root.join("trainer/tests/export_check.py"))
            .arg(&export_dir)
            .arg("--against-dump")
            .arg(&dump_file)
            .status()?;
        ensure!(
            check.success(),
            "the export differs from the store's records"
        );
        // The last run's report.html as a person opens it: in a browser.
        crate::browser::check_report(&current.join("report.html"), &logs.join("report.png"))?;
        println!(
            "demo smoke: {segments} segments, {} steps, checkpoint {}, policy server serves {version}",
            first["steps"].as_array().map_or(0, Vec::len),
            sha.get(..12).unwrap_or(&sha)
        );
    }
    let tracked = tracked_steps(&track)?;
    ensure!(
        tracked.len() == total_steps && tracked.windows(2).all(|w| w[0] < w[1]),
        "{}: steps {tracked:?}, not the {total_steps} trained, counting on from one iteration to the next",
        track.join("metrics.jsonl").display()
    );
    println!(
        "demo: metrics in {} ({} steps); watch them with `tensorboard --logdir {}`",
        track.join("metrics.jsonl").display(),
        tracked.len(),
        track.display()
    );
    let report = current.join("report.html");
    if report.is_file() {
        println!("demo: the last run's report: {}", report.display());
    }
    println!(
        "demo: chart {}, logs {}, {:.0}s in all",
        chart.display(),
        logs.display(),
        started.elapsed().as_secs_f64()
    );
    println!(
        "demo: mean reward first={:.3} last={:.3}",
        rewards[0],
        rewards[rewards.len() - 1]
    );
    drop(children);
    Ok(())
}

/// The global steps of `metrics.jsonl`'s step lines, in file order.
fn tracked_steps(track: &Path) -> anyhow::Result<Vec<u64>> {
    let path = track.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let mut steps = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{}: not JSON: {line}", path.display()))?;
        if v["event"] == "step" {
            steps.push(v["step"].as_u64().context("a step line without its step")?);
        }
    }
    Ok(steps)
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}
