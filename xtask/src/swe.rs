//! `cargo xtask swe [--smoke] [--samples N] [--step-limit N] [--max-tokens N]`: the SWE
//! recipe (`examples/swe`) on this machine. mini-swe-agent (PyPI, unmodified, in its own
//! venv `.cache/swe-venv`) works on the recipe's tasks in a bubblewrap sandbox, its model
//! SmolLM2-135M-Instruct behind the policy server and a sidecar; then the records go
//! through `prepare` and one LoRA training step.
//!
//! 1. the recipe's guards without a model (`examples/swe/test_swe.py`: the sandbox hides
//!    the hidden tests and the host, has no network and no package index; grading
//!    ignores a planted conftest; every task fails exactly its FAIL_TO_PASS untouched and
//!    passes with its gold patch);
//! 2. `samples` rollouts of every task through the sidecar (`swe.py rollout`), and one
//!    more by a scripted expert (`examples/swe/expert.py`: read, patch, check, submit)
//!    through a second sidecar, so the records hold real bash actions and observations
//!    and each group a resolved task;
//! 3. `examples/swe/check.py`: the records equal the agent's own trajectories, every call
//!    is in its rollout's episode, the recorded rewards are the grader's; bytes per
//!    call, compression, the sidecar's share of the wall time;
//! 4. `tapline-trainer prepare` (merge rate, drift kinds, tokens) and `train` (one step).
//!
//! A 135M model will not fix these bugs: this proves the plumbing, not the learning.
//! `--smoke` (what `cargo xtask test` runs) is 2 samples of each task, 3 steps of at most
//! 48 tokens each.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use crate::assets::{ensure_smollm2, ensure_venv, install_sdk};
use crate::demo::{
    Children, build_binaries, free_port, http_raw, sidecar_command, spawn, wait_healthy,
};

struct Options {
    samples: usize,
    step_limit: usize,
    max_tokens: usize,
    smoke: bool,
}

impl Options {
    fn parse(args: &[String]) -> anyhow::Result<Self> {
        let smoke = args.iter().any(|a| a == "--smoke");
        let mut o = Options {
            samples: if smoke { 2 } else { 4 },
            step_limit: if smoke { 3 } else { 8 },
            max_tokens: if smoke { 48 } else { 128 },
            smoke,
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = |name: &str| -> anyhow::Result<usize> {
                let v = it.next().with_context(|| format!("{name} needs a value"))?;
                v.parse()
                    .with_context(|| format!("{name} {v:?} is not a number"))
            };
            match arg.as_str() {
                "--smoke" => {}
                "--samples" => o.samples = value("--samples")?,
                "--step-limit" => o.step_limit = value("--step-limit")?,
                "--max-tokens" => o.max_tokens = value("--max-tokens")?,
                other => bail!(
                    "unknown flag {other:?} for `cargo xtask swe` (--smoke --samples N --step-limit N --max-tokens N)"
                ),
            }
        }
        ensure!(
            o.samples >= 2,
            "--samples must be at least 2 (GRPO compares the samples of a task)"
        );
        Ok(o)
    }
}

/// The harness's own environment: mini-swe-agent, pytest and the tapline SDK's wheel.
fn ensure_swe_venv(root: &Path, wheel: &Path) -> anyhow::Result<PathBuf> {
    let requirements = root.join("examples/swe/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)?;
    let base = || Ok(PathBuf::from("python3"));
    let python = crate::assets::stamped_venv(root, "swe-venv", &wanted, base, |python| {
        crate::assets::pip_install_requirements(python, &requirements)
    })?;
    crate::assets::pip_install_wheel(&python, wheel)?;
    Ok(python)
}

pub fn swe(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let o = Options::parse(args)?;
    let started = Instant::now();
    let python = ensure_venv(root)?;
    let model = ensure_smollm2(root, &python)?;
    let wheel = install_sdk(root, &python)?;
    let swe_python = ensure_swe_venv(root, &wheel)?;
    // bubblewrap, the sandbox of the agent's commands.
    crate::ensure_debian("bwrap", "bubblewrap", "")?;
    build_binaries(&python)?;
    let bin = |name: &str| root.join("target/debug").join(name);
    let recipe = root.join("examples/swe");

    eprintln!("swe: the recipe's guards (sandbox, grading, tasks)");
    crate::run(
        Command::new(&swe_python)
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "test_swe.py",
            ])
            .current_dir(&recipe),
    )?;

    let dir = root
        .join(".cache")
        .join(if o.smoke { "swe-smoke" } else { "swe" });
    let _ = std::fs::remove_dir_all(&dir);
    let logs = dir.join("logs");
    let rollouts = dir.join("rollouts");
    for d in [&logs, &rollouts] {
        std::fs::create_dir_all(d)?;
    }
    let store_dir = dir.join("store");
    let store = format!("file://{}", store_dir.display());
    let mut children = Children::default();
    let policy_port = free_port()?;
    let policy = format!("http://127.0.0.1:{policy_port}");
    spawn(
        "policy-server",
        Command::new(bin("tapline-policy-server"))
            .arg("--model")
            .arg(&model)
            .args(["--listen", &format!("127.0.0.1:{policy_port}")])
            .args(["--served-model-name", "policy", "--seed", "0"]),
        &logs,
        &mut children,
    )?;
    let sidecar_port = free_port()?;
    let sidecar = format!("http://127.0.0.1:{sidecar_port}");
    spawn(
        "sidecar",
        &mut sidecar_command(
            root,
            sidecar_port,
            &policy,
            "vllm",
            &store,
            &dir.join("spool"),
            "swe",
        ),
        &logs,
        &mut children,
    )?;
    wait_healthy(
        "policy server",
        &format!("{policy}/health"),
        &mut children.0[0].1,
        Duration::from_secs(120),
    )?;
    wait_healthy(
        "sidecar",
        &format!("{sidecar}/tapline/v1/health"),
        &mut children.0[1].1,
        Duration::from_secs(30),
    )?;

    // The scripted expert (examples/swe/expert.py) behind a sidecar of its own, writing
    // to the same store: one rollout per task beside the policy's samples.
    let expert_port = free_port()?;
    let expert = format!("http://127.0.0.1:{expert_port}");
    spawn(
        "expert",
        Command::new(&swe_python)
            .arg(recipe.join("expert.py"))
            .args(["--port", &expert_port.to_string()]),
        &logs,
        &mut children,
    )?;
    let expert_sidecar_port = free_port()?;
    let expert_sidecar = format!("http://127.0.0.1:{expert_sidecar_port}");
    spawn(
        "sidecar-expert",
        &mut sidecar_command(
            root,
            expert_sidecar_port,
            &expert,
            "openai",
            &store,
            &dir.join("spool-expert"),
            "swe-expert",
        ),
        &logs,
        &mut children,
    )?;
    wait_healthy(
        "expert",
        &format!("{expert}/health"),
        &mut children.0[2].1,
        Duration::from_secs(30),
    )?;
    wait_healthy(
        "expert sidecar",
        &format!("{expert_sidecar}/tapline/v1/health"),
        &mut children.0[3].1,
        Duration::from_secs(30),
    )?;

    let mut tasks: Vec<PathBuf> = std::fs::read_dir(recipe.join("tasks"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("task.json").is_file())
        .collect();
    tasks.sort();
    eprintln!(
        "swe: {} tasks x {} samples, mini-swe-agent with SmolLM2-135M-Instruct (at most {} steps of {} tokens)",
        tasks.len(),
        o.samples,
        o.step_limit,
        o.max_tokens
    );
    for task in &tasks {
        // The policy's samples, then the expert's (the last sample of the group).
        for sample in 0..=o.samples {
            let (model, via) = if sample < o.samples {
                ("policy", &sidecar)
            } else {
                ("expert", &expert_sidecar)
            };
            let out = Command::new(&swe_python)
                .arg(recipe.join("swe.py"))
                .arg("rollout")
                .arg("--task")
                .arg(task)
                .args(["--sample", &sample.to_string(), "--model", model])
                .arg("--out")
                .arg(&rollouts)
                .args(["--sidecar", via])
                // The expert needs four steps (read, patch, check, submit).
                .args([
                    "--step-limit",
                    &if model == "expert" { 6 } else { o.step_limit }.to_string(),
                ])
                .args(["--max-tokens", &o.max_tokens.to_string()])
                .args(["--command-timeout", "20"])
                .stderr(Stdio::inherit())
                .output()?;
            ensure!(
                out.status.success(),
                "rollout of {} (sample {sample}) failed",
                task.display()
            );
            let name = task.file_name().map(|n| n.to_string_lossy().into_owned());
            let file = rollouts
                .join(format!("{}-{sample}", name.unwrap_or_default()))
                .join("result.json");
            let result: Value = serde_json::from_slice(&std::fs::read(&file)?)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            eprintln!(
                "swe: {} #{sample} ({model}): {}, reward {} ({:.1}s)",
                result["task"].as_str().unwrap_or("?"),
                result["exit_status"].as_str().unwrap_or("?"),
                result["reward"],
                result["seconds"].as_f64().unwrap_or(0.0)
            );
        }
    }
    // The policy sidecar's added latency, against the policy rollouts' wall time.
    let (status, _, metrics) = http_raw("GET", &format!("{sidecar}/metrics"), None)?;
    ensure!(status == 200, "GET /metrics answered {status}");
    std::fs::write(dir.join("metrics.txt"), metrics)?;
    // Stopping the sidecar uploads what its spool still holds.
    drop(children);

    let out = Command::new(&swe_python)
        .arg(recipe.join("check.py"))
        .arg("--sidecar-bin")
        .arg(bin("tapline-sidecar"))
        .args(["--store", &store])
        .arg("--store-dir")
        .arg(&store_dir)
        .arg("--rollouts")
        .arg(&rollouts)
        .arg("--metrics")
        .arg(dir.join("metrics.txt"))
        .args(["--metrics-model", "policy"])
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(
        out.status.success(),
        "the records differ from what mini-swe-agent sent and got"
    );
    let checked: Value = serde_json::from_slice(&out.stdout)?;

    let config = dir.join("trainer.toml");
    std::fs::write(
        &config,
        // Every sample of a 135M model scores alike on these tasks: keep the groups
        // (zero advantages), so the training step still runs on the real records. The
        // trajectories' lengths depend on the CPU that sampled them (an 8k-token
        // micro-batch needs ~11 GiB without recompute): the trainer fits them to a fixed
        // budget, and the step is checked to stay inside it.
        "run = \"swe\"\n[clean]\nmax_seq_len = 8192\ndrop_zero_variance_groups = false\n\
         [schedule]\nmicro_batch_tokens = 8192\n[train]\nlr = 1e-5\nmax_memory = \"6GiB\"\n\
         [train.lora]\nrank = 8\nalpha = 16\n",
    )?;
    let prepared = dir.join("prepare");
    crate::run(
        Command::new(bin("tapline-trainer"))
            .args(["prepare", "--no-cursor", "--store", &store, "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&prepared)
            .arg("--config")
            .arg(&config),
    )?;
    let report: Value = serde_json::from_slice(&std::fs::read(prepared.join("report.json"))?)?;
    // The GPU recipe's configuration stays one the trainer accepts (same records).
    crate::run(
        Command::new(bin("tapline-trainer"))
            .args(["prepare", "--no-cursor", "--store", &store, "--model"])
            .arg(&model)
            .arg("--out")
            .arg(dir.join("prepare-gpu-config"))
            .arg("--config")
            .arg(recipe.join("gpu/run.toml"))
            .stdout(Stdio::null()),
    )?;
    let trained = dir.join("train");
    crate::run(
        Command::new(bin("tapline-trainer"))
            .args(["train", "--store", &store, "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&trained)
            .arg("--config")
            .arg(&config),
    )?;
    let manifest: Value = serde_json::from_slice(&std::fs::read(trained.join("manifest.json"))?)?;
    let steps = manifest["steps"].as_array().map_or(0, Vec::len);
    ensure!(
        steps >= 1,
        "the trainer took no step: {}",
        manifest["report"]
    );
    let memory = &manifest["memory"];
    let (peak, budget) = (
        memory["peak_measured_bytes"].as_u64().unwrap_or(u64::MAX),
        memory["budget_bytes"].as_u64().unwrap_or(0),
    );
    ensure!(
        peak <= budget,
        "the training step's peak memory ({peak} bytes) exceeded its budget: {memory}"
    );

    let merge = &report["merge"];
    let tokenize = &report["tokenize"];
    let summary = serde_json::json!({
        "records": checked,
        "merge": {
            "calls": merge["calls"],
            "sequences": merge["sequences"],
            "calls_per_sequence": merge["calls"].as_f64().unwrap_or(0.0)
                / merge["sequences"].as_f64().unwrap_or(1.0).max(1.0),
            "breaks": merge["breaks"],
        },
        "drift": {"prompt": tokenize["prompt_drift"], "completion": tokenize["completion_drift"]},
        "tokens": report["batches"]["tokens"],
        "loss_tokens": report["batches"]["loss_tokens"],
        "dropped": report["dropped"],
        "train_steps": steps,
        "memory": memory,
        "seconds": started.elapsed().as_secs_f64(),
    });
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    println!(
        "swe: {} rollouts, {} calls, {:.2} calls per merged sequence, rewards {}, one training step: ok in {:.0}s",
        checked["rollouts"],
        checked["calls"],
        summary["merge"]["calls_per_sequence"]
            .as_f64()
            .unwrap_or(0.0),
        checked["rewards"],
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
