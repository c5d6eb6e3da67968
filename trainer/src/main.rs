//! `tapline-trainer`: turns captured records into training batches.
//!
//! - `prepare --store URL --model DIR --out DIR`: reads the segments after the run's
//!   cursor, cleans, tokenizes, merges, computes advantages and loss weights, writes the
//!   batches and the report (format: `tapline_trainer::output`), prints the report as a
//!   table, then advances the cursor.
//! - `train --store URL --model DIR --out DIR [--device cpu|cuda]`: the same, then the
//!   policy-gradient update with libtorch, an HF checkpoint in `--out`, `manifest.json`
//!   and `chart.svg`; the cursor advances only once the checkpoint is complete.
//!   With `[train.lora]` in the config (or `--adapter DIR`) it trains a LoRA adapter and
//!   writes a PEFT adapter directory instead; the optimizer state (fp32 moments and
//!   masters) is saved beside either and resumed from `--resume DIR`, `--adapter DIR`
//!   or the `--model` directory when it is there.
//! - `merge-lora --model BASE --adapter DIR --out DIR`: the adapter folded into the base
//!   weights, as a full HF checkpoint.
//! - `score --model DIR [--adapter DIR]`: reads `{"ids": [...]}` on stdin and prints
//!   `{"logprobs": [...]}` through the model code the update uses.
//! - `tokenize --model DIR`: reads one chat request as JSON on stdin and prints
//!   `{"ids": [...]}`, the prompt ids `prepare` would use for it.
//! - `export --store URL --out DIR [--since T] [--until T] [--task ID] [--episode ID]`:
//!   the records as Parquet files (`tapline_trainer::export`).

use std::io::Read as _;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use serde_json::Value;
use tapline_trainer::{output, tokenize};

mod cli;
#[cfg(feature = "torch")]
mod torch_cli;

use cli::*;

#[derive(Parser)]
#[command(
    name = "tapline-trainer",
    version = VERSION,
    about = "Turns captured records into training batches."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text or as one JSON object per line.
    #[arg(
        long,
        global = true,
        env = "TAPLINE_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
}
/// `--version`: the crate version and the commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TAPLINE_GIT_COMMIT_SHORT"),
    ")"
);

/// How log lines are written (`--log-format`, `TAPLINE_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `message` and the event's
    /// fields), for log collectors.
    Json,
}

/// Logs to stderr at `TAPLINE_LOG` (default `warn`) in `format`.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TAPLINE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Records in the store → batches, report and table; then advance the run's cursor.
    Prepare(PrepareArgs),
    /// Records in the store → policy-gradient update → HF checkpoint, manifest, chart.
    Train(Box<TrainArgs>),
    /// `{"ids": [...]}` on stdin → `{"logprobs": [...]}` of each token after the first.
    Score(ScoreArgs),
    /// A LoRA adapter merged into its base model → a full HF checkpoint (for servers
    /// that do not take adapters).
    MergeLora(MergeArgs),
    /// A LoRA adapter → loaded by every inference server as the policy's next version
    /// (`NAME@vN`), then announced in the store for the sidecars (`--policy NAME`).
    Publish(PublishArgs),
    /// Update throughput (tokens/s, MFU) on random weights of a real model's shape.
    BenchUpdate(BenchArgs),
    /// Line chart SVG from JSON on stdin: `{"panels": [{"title", "x_label",
    /// "series": [{"name", "points": [[x, y], ...]}]}]}`.
    Plot(PlotArgs),
    /// One chat request on stdin → `{"ids": [...]}`, the prompt ids `prepare` would use.
    Tokenize(TokenizeArgs),
    /// Records in the store → calls.parquet, episodes.parquet and rewards.parquet.
    #[command(long_about = export_long_help())]
    Export(ExportArgs),
    /// A finished run's directory → its report.html again (from manifest.json and
    /// samples.json, which `train` wrote there).
    Report(ReportArgs),
}

/// glibc's variable that fixes malloc's mmap threshold (mallopt(3)).
#[cfg(feature = "torch")]
const MMAP_THRESHOLD_VAR: &str = "MALLOC_MMAP_THRESHOLD_";

/// Makes the update's peak memory that of its live tensors: glibc's malloc raises its
/// mmap threshold to the size of each large block freed (up to 32 MiB), and from then
/// on tensors up to that size come from the heap, which fragments; a step's peak RSS
/// was 45% above its tensors (and the step 20% slower: BENCHMARKS.md, "Memory of an
/// update step"). A fixed threshold of 1 MiB returns every large tensor to the system
/// when it is freed. glibc reads it when the process starts, so `train` and
/// `bench-update` exec themselves once with it set (same process id, same arguments);
/// a value the user set is kept.
#[cfg(feature = "torch")]
fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os(MMAP_THRESHOLD_VAR).is_none() {
        use std::os::unix::process::CommandExt as _;
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_default();
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let error = std::process::Command::new(exe)
            .arg0(arg0)
            .args(args)
            .env(MMAP_THRESHOLD_VAR, "1048576")
            .exec();
        eprintln!(
            "tapline-trainer: warning: cannot restart with {MMAP_THRESHOLD_VAR} set ({error}); the update's memory may exceed its estimate"
        );
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    #[cfg(feature = "torch")]
    if matches!(cli.command, Command::Train(_) | Command::BenchUpdate(_)) {
        fix_mmap_threshold();
    }
    init_logging(cli.log_format);
    match cli.command {
        Command::Prepare(args) => prepare(args),
        Command::Publish(args) => publish(&args),
        Command::Plot(args) => plot(&args),
        Command::Tokenize(args) => tokenize_stdin(&args),
        Command::Export(args) => export(&args),
        Command::Report(args) => {
            let page = tapline_trainer::html::write_from_dir(&args.run)?;
            println!("report: {}", page.display());
            Ok(())
        }
        #[cfg(feature = "torch")]
        Command::Train(args) => torch_cli::train(*args),
        #[cfg(feature = "torch")]
        Command::Score(args) => torch_cli::score(&args),
        #[cfg(feature = "torch")]
        Command::MergeLora(args) => torch_cli::merge_lora(&args),
        #[cfg(feature = "torch")]
        Command::BenchUpdate(args) => torch_cli::bench_update(&args),
        #[cfg(not(feature = "torch"))]
        Command::Train(_) => needs_torch("train"),
        #[cfg(not(feature = "torch"))]
        Command::Score(_) => needs_torch("score"),
        #[cfg(not(feature = "torch"))]
        Command::MergeLora(_) => needs_torch("merge-lora"),
        #[cfg(not(feature = "torch"))]
        Command::BenchUpdate(_) => needs_torch("bench-update"),
    }
}

/// The answer of a command that needs libtorch in a build without it.
#[cfg(not(feature = "torch"))]
fn needs_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`tapline-trainer {command}` needs libtorch, and this binary was built without the `torch` feature (it prepares batches, tokenizes and publishes only). Use a build with it: `cargo build --release -p tapline-trainer` (the feature is on by default; libtorch comes from the torch wheel, see README), or the tapline-trainer image"
    )
}

fn publish(args: &PublishArgs) -> anyhow::Result<()> {
    if !(args.timeout_secs.is_finite() && args.timeout_secs > 0.0) {
        anyhow::bail!(
            "--timeout-secs {} is not a positive number of seconds",
            args.timeout_secs
        );
    }
    let location = tapline_proto::store::open_store(&args.store)?;
    let options = tapline_trainer::publish::PublishOptions {
        policy: args.policy.clone(),
        from: args.from.clone(),
        servers: args.servers.clone(),
        server_kind: args.server_kind,
        path_on_server: args.path_on_server.clone(),
        keep_loaded: args.keep_loaded,
        timeout: std::time::Duration::from_secs_f64(args.timeout_secs),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let published = runtime.block_on(tapline_trainer::publish::publish(&location, &options))?;
    println!("{}", serde_json::to_string(&published)?);
    Ok(())
}

fn tokenize_stdin(args: &TokenizeArgs) -> anyhow::Result<()> {
    let (model, config) = args.model.load()?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("read the request from stdin")?;
    let body: Value = serde_json::from_str(&input).context("stdin is not JSON")?;
    let request = tokenize::ChatRequest::from_json(&body)?;
    let text = tokenize::render_prompt(&model, &request, &config.tokenize.chat_template_kwargs)?;
    let ids = model
        .encode(&text)
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let mut out = serde_json::json!({ "ids": ids });
    if args.text {
        out["text"] = Value::String(text);
    }
    println!("{out}");
    Ok(())
}

fn prepare(args: PrepareArgs) -> anyhow::Result<()> {
    let loaded = load_and_prepare(&args, |_| {}, None)?;
    let provenance = output::Provenance {
        store: loaded.location.display.clone(),
        model_dir: loaded.model.dir().display().to_string(),
        run: loaded.run.clone(),
        segments: loaded.segments(),
        created_unix_nanos: loaded.now,
    };
    output::write(&args.out, &loaded.prepared, &loaded.config, &provenance)?;
    print!("{}", loaded.prepared.report.table());
    println!(
        "wrote {} mini-batches to {} (read in {:.1}s, prepared in {:.1}s)",
        loaded.prepared.mini_batches.len(),
        args.out.display(),
        loaded.ingest_seconds,
        loaded.prepare_seconds,
    );
    loaded.commit(&args.out)
}

fn export(args: &ExportArgs) -> anyhow::Result<()> {
    use tapline_trainer::export::{ExportError, ExportOptions, ExportSummary};
    if let (Some(since), Some(until)) = (args.since, args.until)
        && since >= until
    {
        anyhow::bail!("--since is not before --until: no episode can match");
    }
    let location = tapline_proto::store::open_store(&args.store)?;
    let options = ExportOptions {
        since: args.since,
        until: args.until,
        tasks: args.tasks.clone(),
        episodes: args.episodes.clone(),
        skip_damaged: args.skip_damaged,
        concurrent_reads: args.concurrent_reads.max(1),
        progress: true,
        ..ExportOptions::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = std::time::Instant::now();
    let result = runtime.block_on(tapline_trainer::export::export(
        &location, &args.out, &options,
    ));
    let print = |summary: &ExportSummary| -> anyhow::Result<()> {
        let seconds = started.elapsed().as_secs_f64();
        if args.json {
            let mut value = serde_json::to_value(summary)?;
            value["seconds"] = seconds.into();
            println!("{value}");
            return Ok(());
        }
        for (key, error) in &summary.damaged_segments {
            eprintln!("damaged segment {key}: {error}");
        }
        for (key, what) in &summary.oversized_records {
            eprintln!("segment {key}: {what}");
        }
        println!(
            "exported {} calls, {} episodes, {} rewards from {} segments ({} read, {} pass{}) in {seconds:.1}s",
            summary.calls,
            summary.episodes,
            summary.rewards,
            summary.segments,
            human_bytes(summary.bytes_read),
            summary.passes,
            if summary.passes == 1 { "" } else { "es" },
        );
        if summary.duplicate_records > 0 {
            println!("{} duplicate records dropped", summary.duplicate_records);
        }
        for (file, bytes) in &summary.files {
            println!(
                "  {} ({:.1} MB)",
                args.out.join(file).display(),
                *bytes as f64 / 1e6
            );
        }
        Ok(())
    };
    match result {
        Ok(summary) => print(&summary),
        Err(ExportError::Damaged {
            damaged,
            out,
            summary,
        }) => {
            print(&summary)?;
            Err(ExportError::Damaged {
                damaged,
                out,
                summary,
            }
            .into())
        }
        Err(e) => Err(e.into()),
    }
}

/// `bytes` in kB, MB or GB (powers of 1000).
fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b < 1_000_000 => format!("{:.1} kB", b as f64 / 1e3),
        b if b < 1_000_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b => format!("{:.2} GB", b as f64 / 1e9),
    }
}

fn plot(args: &PlotArgs) -> anyhow::Result<()> {
    use tapline_trainer::chart::{Panel, Series};
    if args
        .out
        .extension()
        .is_some_and(|e| !e.eq_ignore_ascii_case("svg"))
    {
        anyhow::bail!(
            "--out {}: plot writes SVG (which any browser opens); name the file .svg",
            args.out.display()
        );
    }
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("read the chart from stdin")?;
    let body: Value = serde_json::from_str(&input).context("stdin is not JSON")?;
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or("").to_owned();
    let panels = body
        .get("panels")
        .and_then(Value::as_array)
        .context("stdin has no \"panels\" array")?
        .iter()
        .map(|p| Panel {
            title: text(p, "title"),
            x_label: text(p, "x_label"),
            series: p
                .get("series")
                .and_then(Value::as_array)
                .map(|series| {
                    series
                        .iter()
                        .map(|s| Series {
                            name: text(s, "name"),
                            points: s
                                .get("points")
                                .and_then(Value::as_array)
                                .map(|pts| {
                                    pts.iter()
                                        .filter_map(|xy| {
                                            let x = xy.get(0)?.as_f64()?;
                                            let y = xy
                                                .get(1)
                                                .and_then(Value::as_f64)
                                                .unwrap_or(f64::NAN);
                                            Some((x, y))
                                        })
                                        .collect()
                                })
                                .unwrap_or_default(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect::<Vec<_>>();
    tapline_trainer::chart::write_svg(&args.out, &args.title, &panels)
        .with_context(|| format!("write {}", args.out.display()))
}
