//! `tapline-policy-server`: an OpenAI-compatible chat completions server over the
//! trainer's own model code, for local training loops and tests (not a vLLM
//! replacement; see README.md).
//!
//! - [`api`] — requests checked field by field, OpenAI-shaped errors;
//! - [`engine`] — the inference thread: prompt rendering, KV-cache generation, reloads;
//! - [`sampling`] — greedy / temperature / top-p with a seeded PRNG, logprobs;
//! - [`text`] — the stable text of a growing generation, stop strings;
//! - [`response`] — completion JSON and stream chunks in vLLM's shapes;
//! - [`server`] — hyper: listener and routes;
//! - [`watch`] — `--watch DIR`: load new checkpoints as the trainer writes them.

mod api;
mod engine;
mod response;
mod sampling;
mod server;
mod text;
mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "tapline-policy-server",
    version = VERSION,
    about = "OpenAI-compatible chat completions over the tapline trainer's model code, for local loops and tests."
)]
struct Cli {
    /// Hugging Face model directory (config.json, safetensors, tokenizer, chat template),
    /// or a LoRA adapter directory (PEFT format, as `tapline-trainer train` writes it
    /// with `[train.lora]`), served on its base model.
    #[arg(long)]
    model: PathBuf,
    /// Base model of adapter directories [default: their `base_model_name_or_path`].
    #[arg(long)]
    base_model: Option<PathBuf>,
    /// Address to listen on (port 0: any free port; the first log line says which).
    #[arg(long, default_value = "127.0.0.1:8300")]
    listen: SocketAddr,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights dtype: `auto` (fp32 on CPU, bf16 on CUDA), `float32` or `bfloat16`.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// The name in responses' `model` and in `/v1/models` [default: the --model path].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Load new checkpoints (subdirectories with manifest.json) from this directory.
    #[arg(long)]
    watch: Option<PathBuf>,
    /// `max_tokens` of requests that give none (capped by the context left).
    #[arg(long, default_value_t = 256)]
    max_tokens_default: u32,
    /// Seed of requests that bring none (combined with a request counter).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// CPU threads for libtorch [default: libtorch's choice].
    #[arg(long)]
    threads: Option<i32>,
    /// Seconds to let open requests finish on SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    drain_secs: f64,
    /// Log lines as text or as one JSON object per line.
    #[arg(long, env = "TAPLINE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
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

/// Logs to stderr at `TAPLINE_LOG` (default `info`) in `format`.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TAPLINE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    if cli.max_tokens_default == 0 {
        anyhow::bail!("--max-tokens-default must be at least 1");
    }
    if !(cli.drain_secs.is_finite() && cli.drain_secs >= 0.0) {
        anyhow::bail!("--drain-secs must be a number of seconds");
    }
    let device = tapline_trainer::nn::parse_device(&cli.device)?;
    let kind = tapline_trainer::nn::parse_dtype(&cli.dtype, device)?;
    if let Some(n) = cli.threads {
        anyhow::ensure!(n >= 1, "--threads must be at least 1");
        tch::set_num_threads(n);
    }
    let load_started = Instant::now();
    let (engine, inference) = engine::start(
        &cli.model,
        engine::Settings {
            device,
            kind,
            max_tokens_default: cli.max_tokens_default,
            seed: cli.seed,
            base_model: cli.base_model.clone(),
        },
    )?;
    let load_secs = load_started.elapsed().as_secs_f64();
    let served = cli
        .served_model_name
        .clone()
        .unwrap_or_else(|| cli.model.display().to_string());

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(cli.listen)
            .await
            .with_context(|| format!("cannot listen on {}", cli.listen))?;
        let addr = listener.local_addr()?;
        let loaded = engine.loaded();
        tracing::info!(
            "tapline-policy-server {} listening on http://{addr}, serving {} as {served:?} (version {}) on {} in {:?}",
            env!("CARGO_PKG_VERSION"),
            loaded.dir.display(),
            loaded.version,
            cli.device,
            kind,
        );
        tracing::debug!(load_secs, "model load time");
        let app = Arc::new(server::App::new(engine.clone(), served));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let watcher = cli.watch.clone().map(|dir| {
            tracing::info!(dir = %dir.display(), "watching for checkpoints");
            tokio::spawn(watch::run(
                dir,
                engine.clone(),
                Duration::from_secs(1),
                stop_rx.clone(),
            ))
        });
        let serving = tokio::spawn(server::serve(
            listener,
            app,
            stop_rx,
            Duration::from_secs_f64(cli.drain_secs),
        ));
        shutdown_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
        let _ = serving.await;
        if let Some(watcher) = watcher {
            let _ = watcher.await;
        }
        anyhow::Ok(())
    })?;
    // Dropping the runtime drops every open request (their event channels close, so the
    // generation stops) and the last job sender, which ends the inference thread.
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(engine);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !inference.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if inference.is_finished() {
        let _ = inference.join();
    } else {
        tracing::warn!("the inference thread did not stop in time");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
