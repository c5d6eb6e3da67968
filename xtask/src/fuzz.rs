//! `cargo xtask fuzz`: builds the cargo-fuzz targets in `sidecar/fuzz` with libFuzzer's
//! coverage instrumentation (the flags `cargo fuzz build` passes, so neither cargo-fuzz
//! nor a nightly toolchain is needed; `--sanitizer address` uses nightly) and runs each
//! for a fixed time, seeded from the committed corpus.
//!
//! New inputs the fuzzer finds go to `target/fuzz-corpus/<target>/` and crashes to
//! `target/fuzz-artifacts/<target>/`; a crash fails the command, naming the input and
//! the line that replays it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

/// Every target, in the order they run.
pub const TARGETS: &[&str] = &[
    "segment_reader",
    "spool_reader",
    "sse_framer",
    "rebuild_complete",
    "json_tree",
    "control_request",
    "chat_template",
];

const TRIPLE: &str = "x86_64-unknown-linux-gnu";

/// How one fuzzing run is built and how long each target runs.
#[derive(Debug, Clone)]
pub struct FuzzRun {
    /// Seconds per target.
    pub secs: u64,
    /// Only these targets (all when empty).
    pub only: Vec<String>,
    /// Cargo profile of the fuzz crate: `release` (cargo-fuzz's) or `quick`.
    pub profile: String,
    /// Build with AddressSanitizer (nightly).
    pub address_sanitizer: bool,
}

const USAGE: &str = "usage: cargo xtask fuzz [--secs N] [--target NAME]... [--sanitizer address] [--quick]

Builds the fuzz targets in sidecar/fuzz and runs each for N seconds (default 60).
Targets: segment_reader spool_reader sse_framer rebuild_complete json_tree control_request chat_template";

/// Parses `cargo xtask fuzz` flags.
pub fn parse(args: &[String]) -> anyhow::Result<FuzzRun> {
    let mut run = FuzzRun {
        secs: 60,
        only: Vec::new(),
        profile: "release".into(),
        address_sanitizer: false,
    };
    let mut it = args.iter().filter(|a| *a != "--");
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{flag} needs a value\n\n{USAGE}"))
        };
        match arg.as_str() {
            "--secs" => {
                let v = value("--secs")?;
                run.secs =
                    v.parse().ok().filter(|s| *s > 0).with_context(|| {
                        format!("--secs {v:?} is not a positive number of seconds")
                    })?;
            }
            "--target" => {
                let t = value("--target")?;
                if !TARGETS.contains(&t.as_str()) {
                    bail!(
                        "no fuzz target {t:?}; the targets are {}",
                        TARGETS.join(", ")
                    );
                }
                run.only.push(t);
            }
            "--sanitizer" => match value("--sanitizer")?.as_str() {
                "address" => run.address_sanitizer = true,
                "none" => run.address_sanitizer = false,
                other => bail!("--sanitizer {other:?}: use address or none"),
            },
            "--quick" => run.profile = "quick".into(),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?}\n\n{USAGE}"),
        }
    }
    Ok(run)
}

/// Builds and runs the targets; `assets` holds the tokenizer packages (chat templates).
pub fn fuzz(root: &Path, assets: &Path, run: &FuzzRun) -> anyhow::Result<()> {
    let fuzz_dir = root.join("sidecar/fuzz");
    let target_dir = root.join("target/fuzz");
    let targets: Vec<&str> = if run.only.is_empty() {
        TARGETS.to_vec()
    } else {
        run.only.iter().map(String::as_str).collect()
    };
    // cargo-fuzz's flags (`cargo fuzz build -O`, coverage level 4), with `--target` given
    // so they stay off build scripts and proc macros.
    let mut rustflags = [
        "-Cpasses=sancov-module",
        "-Cllvm-args=-sanitizer-coverage-level=4",
        "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
        "-Cllvm-args=-sanitizer-coverage-pc-table",
        "-Cllvm-args=-sanitizer-coverage-trace-compares",
        "--cfg",
        "fuzzing",
        "-Cdebug-assertions",
        "-Coverflow-checks",
    ]
    .join(" ");
    let mut cargo = Command::new("cargo");
    if run.address_sanitizer {
        rustflags.push_str(" -Zsanitizer=address");
        cargo.arg("+nightly");
    }
    let started = Instant::now();
    crate::run(
        cargo
            .current_dir(&fuzz_dir)
            .args(["build", "--profile", &run.profile, "--target", TRIPLE])
            .args(targets.iter().flat_map(|t| ["--bin", t]))
            .env("RUSTFLAGS", &rustflags)
            .env("CARGO_TARGET_DIR", &target_dir),
    )
    .context("building the fuzz targets")?;
    eprintln!(
        "xtask fuzz: built {} targets in {:.0?}",
        targets.len(),
        started.elapsed()
    );
    let bin_dir = target_dir.join(TRIPLE).join(&run.profile);
    let mut failed = Vec::new();
    for target in &targets {
        let found = root.join("target/fuzz-corpus").join(target);
        let seeds = fuzz_dir.join("corpus").join(target);
        let artifacts = root.join("target/fuzz-artifacts").join(target);
        for dir in [&found, &artifacts] {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        }
        eprintln!("xtask fuzz: {target} for {} s", run.secs);
        let status = Command::new(bin_dir.join(target))
            .arg(&found)
            .arg(&seeds)
            .arg(format!("-max_total_time={}", run.secs))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            // A slow input is a finding too, and memory is bounded.
            .args(["-timeout=10", "-rss_limit_mb=3072", "-print_final_stats=1"])
            .env("TAPLINE_ASSETS", assets)
            .status()
            .with_context(|| format!("cannot start the {target} fuzz target"))?;
        if !status.success() {
            let crashes: Vec<PathBuf> = std::fs::read_dir(&artifacts)
                .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
                .unwrap_or_default();
            eprintln!(
                "xtask fuzz: {target} FAILED ({status}); inputs: {crashes:?}; replay one with\n  TAPLINE_ASSETS={} {} <input>",
                assets.display(),
                bin_dir.join(target).display()
            );
            failed.push(*target);
        }
    }
    if !failed.is_empty() {
        bail!("fuzz targets failed: {}", failed.join(", "));
    }
    Ok(())
}
