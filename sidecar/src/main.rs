//! `tapline-sidecar`: see `tapline-sidecar --help`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tapline_sidecar::config::RawConfig;
use tapline_sidecar::server::Sidecar;

#[derive(Debug, Parser)]
#[command(
    name = "tapline-sidecar",
    version = VERSION,
    about = "Records an agent harness's LLM traffic for RL training.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// TOML file with settings (keys are the flag names); flags and TAPLINE_* win over it.
    #[arg(long, env = "TAPLINE_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    raw: RawConfig,
    /// Seconds to let open responses finish on SIGTERM/SIGINT.
    #[arg(long, env = "TAPLINE_DRAIN_SECS", default_value_t = 30.0)]
    drain_secs: f64,
    /// Threads that serve connections. 1 (the default) runs one event loop, which keeps
    /// every call on one thread: the least CPU and latency per call, and thousands of
    /// calls per second. Spool writes, fsyncs and segment compression have their own
    /// threads either way.
    #[arg(long, env = "TAPLINE_WORKER_THREADS", default_value_t = 1)]
    worker_threads: usize,
    /// Seconds to keep uploading queued records on SIGTERM/SIGINT.
    #[arg(long, env = "TAPLINE_FLUSH_SECS", default_value_t = 30.0)]
    flush_secs: f64,
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Proxy LLM traffic and record it (the default command).
    Serve(Box<ServeArgs>),
    /// Print every record in a store as one JSON object per line, or one episode.
    Dump {
        /// Store URL: file:///dir, s3://bucket/prefix, gs://, az://, memory://, or a directory.
        #[arg(long, env = "TAPLINE_STORE")]
        store: String,
        /// Only segments whose key starts with this, relative to the segments directory
        /// (e.g. `2026/12/02` or `2026/12/02/09/my-sidecar`).
        #[arg(long)]
        prefix: Option<String>,
        /// Only the records of this episode: its start and end, calls and rewards.
        #[arg(long)]
        episode: Option<String>,
        /// json: one record per line; pretty: the episode as a conversation (calls in
        /// order with roles, new messages, answers, tool calls, timings, token counts and
        /// rewards), with --episode.
        #[arg(long, value_enum, default_value = "json")]
        format: tapline_sidecar::dump::DumpFormat,
    },
}

fn main() -> anyhow::Result<()> {
    // Before any other thread starts (see the module): returns in the process that has
    // the settings.
    tapline_sidecar::malloc::tune();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Dump {
            store,
            prefix,
            episode,
            format,
        }) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let location = tapline_proto::store::open_store(&store)?;
                let mut out = std::io::BufWriter::new(std::io::stdout());
                let options = tapline_sidecar::dump::DumpOptions {
                    key_prefix: prefix,
                    episode,
                    format,
                };
                let summary = tapline_sidecar::dump::dump(&location, &options, &mut out).await?;
                eprintln!(
                    "dump: {} records from {} segments",
                    summary.records, summary.segments
                );
                Ok(())
            })
        }
        Some(Command::Serve(args)) => serve(*args),
        None => serve(cli.serve),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    let file = match &args.config {
        Some(path) => RawConfig::from_toml_file(path)?,
        None => RawConfig::default(),
    };
    let config = args.raw.or(file).validate()?;
    let secs = |name: &str, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(anyhow::anyhow!(
                "invalid setting `{name}`: {v} is not a number of seconds"
            ))
        }
    };
    let drain = secs("drain-secs", args.drain_secs)?;
    let flush = secs("flush-secs", args.flush_secs)?;
    if config.header_read_timeout >= drain {
        anyhow::bail!(
            "invalid setting `header-read-timeout-secs`: {:?} is not shorter than --drain-secs ({drain:?}); \
             a client that never finishes its request head would hold every shutdown that long",
            config.header_read_timeout
        );
    }
    let fds = tapline_sidecar::fds::raise(config.max_connections)?;
    tracing::debug!(
        before = ?fds.before,
        now = ?fds.now,
        needed = fds.needed,
        "RLIMIT_NOFILE"
    );
    tracing::debug!(
        mmap_threshold = ?std::env::var_os(tapline_sidecar::malloc::MMAP_THRESHOLD_VAR),
        arena_max = ?std::env::var_os(tapline_sidecar::malloc::ARENA_MAX_VAR),
        "malloc settings"
    );
    let runtime = match args.worker_threads {
        0 => anyhow::bail!(
            "invalid setting `worker-threads`: 0; give 1 or more threads (1 runs one event loop)"
        ),
        // One event loop: no hand-offs between threads on the request path.
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()?,
    };
    runtime.block_on(async move {
        // Handlers first: a SIGTERM that arrives once the port is bound (a
        // supervisor, a test that saw the port open) must drain and flush,
        // not take the default action and kill the process.
        let stop = shutdown_signal();
        let sidecar = Sidecar::start(config)
            .await
            .context("cannot start the sidecar")?;
        tracing::info!("{}", sidecar.describe());
        stop.await;
        tracing::info!(
            ?drain,
            ?flush,
            "shutting down: draining open responses, then flushing records"
        );
        sidecar.shutdown(drain, flush).await;
        tracing::info!("stopped");
        Ok(())
    })
}

/// Installs the SIGINT and SIGTERM handlers now (not when first polled) and
/// returns a future that ends at the first of them.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let int = signal(SignalKind::interrupt());
        let term = signal(SignalKind::terminate());
        async move {
            match (int, term) {
                (Ok(mut int), Ok(mut term)) => {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async move {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
