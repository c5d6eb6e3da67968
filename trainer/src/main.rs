//! `tapline-trainer`: turns captured records into training batches.
//!
//! - `prepare --store URL --model DIR --out DIR`: reads the segments after the run's
//!   cursor, cleans, tokenizes, merges, computes advantages and loss weights, writes the
//!   batches and the report (format: `tapline_trainer::output`), prints the report as a
//!   table, then advances the cursor.
//! - `train --store URL --model DIR --out DIR [--device cpu|cuda]`: the same, then the
//!   policy-gradient update with libtorch, an HF checkpoint in `--out`, `manifest.json`
//!   and `chart.png`; the cursor advances only once the checkpoint is complete.
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

use std::io::Read as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use tapline_trainer::config::RunConfig;
use tapline_trainer::{Model, ModelOptions, ingest, output, tokenize};

#[cfg(feature = "torch")]
mod torch_cli;

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
    Train(TrainArgs),
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
    /// Line chart PNG from JSON on stdin: `{"panels": [{"title", "x_label",
    /// "series": [{"name", "points": [[x, y], ...]}]}]}`.
    Plot(PlotArgs),
    /// One chat request on stdin → `{"ids": [...]}`, the prompt ids `prepare` would use.
    Tokenize(TokenizeArgs),
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// Model directory: tokenizer.json, tokenizer_config.json, optionally
    /// chat_template.jinja and generation_config.json.
    #[arg(long, env = "TAPLINE_MODEL")]
    model: PathBuf,
    /// Chat template file to use instead of the model directory's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Stop tokens to use instead of EOS and the known end-of-turn tokens (repeatable).
    #[arg(long = "stop-token")]
    stop_tokens: Vec<String>,
    /// TOML run configuration (see `tapline_trainer::config`); flags win over it.
    #[arg(long, env = "TAPLINE_TRAINER_CONFIG")]
    config: Option<PathBuf>,
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<(Model, RunConfig)> {
        let config = match &self.config {
            Some(path) => RunConfig::load(path)?,
            None => RunConfig::default(),
        };
        let model = Model::load(
            &self.model,
            &ModelOptions {
                chat_template_file: self.chat_template.clone(),
                stop_tokens: self.stop_tokens.clone(),
            },
        )?;
        Ok((model, config))
    }
}

#[derive(Args, Clone)]
struct PrepareArgs {
    /// Store URL (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    store: String,
    /// Output directory: the batches and the report (`prepare`), the checkpoint (`train`).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// Name of the run's cursor (config `run`). Under torchrun, put `--` before the
    /// trainer's path (torchrun's parser takes `--run` for its `--run-path`) or set
    /// TAPLINE_RUN.
    #[arg(long, env = "TAPLINE_RUN")]
    run: Option<String>,
    /// Read every segment and leave the cursor alone (for inspection).
    #[arg(long)]
    no_cursor: bool,
    /// Advantage estimator: grpo, dr_grpo, rloo, reinforce_plus_plus_baseline.
    #[arg(long)]
    estimator: Option<String>,
    /// Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    /// seq-mean-token-sum-norm, episode-mean.
    #[arg(long)]
    loss_agg_mode: Option<String>,
    /// Longest sequence trained on, in tokens.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Token budget of a micro-batch.
    #[arg(long)]
    micro_batch_tokens: Option<usize>,
    /// Episodes per mini-batch (0: one mini-batch).
    #[arg(long)]
    mini_batch_episodes: Option<usize>,
    /// Seconds an unended episode may stay quiet before it is dropped.
    #[arg(long)]
    grace_period_secs: Option<u64>,
    /// Ignore recorded token ids and tokenize every call from text.
    #[arg(long)]
    ignore_recorded_ids: bool,
    /// Segments fetched and decoded at once ([ingest] concurrent_reads, default 32: suited
    /// to S3's latency; memory in flight is this many segment objects).
    #[arg(long)]
    concurrent_reads: Option<usize>,
    /// Treat this Unix time (seconds) as now, for the grace period.
    #[arg(long)]
    now_unix_secs: Option<i64>,
}

#[derive(Args, Clone)]
struct TrainArgs {
    #[command(flatten)]
    prepare: PrepareArgs,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Peak learning rate (config `train.lr`).
    #[arg(long)]
    lr: Option<f64>,
    /// Passes over the mini-batches (config `train.epochs`).
    #[arg(long)]
    epochs: Option<u32>,
    /// Seed of the update (config `train.seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Training dtype: auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16 (config
    /// `train.dtype`).
    #[arg(long)]
    dtype: Option<String>,
    /// Continue an earlier run: its output directory (a full checkpoint, or a LoRA
    /// adapter) gives the weights and the optimizer state, which must be there.
    #[arg(long, conflicts_with = "adapter")]
    resume: Option<PathBuf>,
    /// Train this LoRA adapter (a PEFT directory) on top of `--model`; its optimizer
    /// state is resumed when present.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Start with a new optimizer state even when the weights come with one.
    #[arg(long)]
    fresh_optimizer: bool,
    /// Train continuously: wait for --min-episodes new ended episodes, train on them
    /// into `--out/NNNNNN` (each run continuing from the one before, optimizer state
    /// included), publish when the config has `[publish]`, repeat. SIGTERM or Ctrl-C
    /// while waiting exits; during a run it stops after the current step and drops the
    /// run (trained again on the next start); a second signal exits at once.
    #[arg(long)]
    follow: bool,
    /// With --follow: episodes ready to train on before a run starts [default: the
    /// config's schedule.mini_batch_episodes].
    #[arg(long, requires = "follow")]
    min_episodes: Option<usize>,
    /// With --follow: seconds between two looks at the store while waiting.
    #[arg(long, default_value_t = 10.0, requires = "follow")]
    poll_secs: f64,
    /// Distributed runs (RANK / WORLD_SIZE set by torchrun or a PyTorchJob): seconds
    /// every collective may take, the rendezvous included; when a rank dies or stalls,
    /// the others exit non-zero after at most this long, writing nothing.
    #[arg(long, env = "TAPLINE_DIST_TIMEOUT_SECS", default_value_t = 600)]
    dist_timeout_secs: u64,
}

#[derive(Args)]
struct ScoreArgs {
    /// Model directory (config.json, safetensors).
    #[arg(long, env = "TAPLINE_MODEL")]
    model: PathBuf,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// A LoRA adapter (PEFT directory) to apply on top of the model.
    #[arg(long)]
    adapter: Option<PathBuf>,
}

#[derive(Args)]
struct PublishArgs {
    /// Store URL the sidecars follow (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    store: String,
    /// Policy name (the sidecars' --policy).
    #[arg(long)]
    policy: String,
    /// The adapter directory (`train` with `[train.lora]` writes one).
    #[arg(long)]
    from: PathBuf,
    /// Base URL of an inference server (repeat for each; every one must load it).
    #[arg(long = "server", required = true)]
    servers: Vec<String>,
    /// The servers' API.
    #[arg(long, value_enum, default_value = "vllm")]
    server_kind: tapline_trainer::publish::ServerKind,
    /// The adapter directory as the servers see it [default: --from, absolute].
    #[arg(long)]
    path_on_server: Option<String>,
    /// Versions kept loaded, the new one included; older ones are unloaded.
    #[arg(long, default_value_t = 2)]
    keep_loaded: u64,
    /// Seconds allowed for one server request.
    #[arg(long, default_value_t = 120.0)]
    timeout_secs: f64,
}

#[derive(Args)]
struct MergeArgs {
    /// The base model directory (config.json, safetensors, tokenizer).
    #[arg(long)]
    model: PathBuf,
    /// The adapter (PEFT directory: adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    adapter: PathBuf,
    /// Output directory for the merged checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// dtype of the merged weights: float32 or bfloat16 [default: the dtype the base
    /// model's config.json declares, else float32].
    #[arg(long)]
    dtype: Option<String>,
}

#[derive(Args)]
struct BenchArgs {
    /// Model shape: tiny, smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, qwen2.5-1.5b, qwen3-1.7b,
    /// qwen2.5-7b, qwen3-8b.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    preset: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Sequences per optimizer step (one per micro-batch).
    #[arg(long, default_value_t = 8)]
    sequences: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Steps before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Recompute layers in the backward pass.
    #[arg(long)]
    recompute: bool,
    /// Peak FLOP/s of the device in TFLOP/s, for MFU (known GPUs are looked up by name).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Train a LoRA adapter (all seven projections) instead of every weight.
    #[arg(long)]
    lora: bool,
    /// Rank of the adapter with `--lora`.
    #[arg(long, default_value_t = 16)]
    lora_rank: i64,
    /// Under torchrun: keep the whole AdamW state on every rank instead of sharding it.
    #[arg(long)]
    replicate_optimizer: bool,
}

#[derive(Args)]
struct PlotArgs {
    /// The PNG to write.
    #[arg(long)]
    out: PathBuf,
    /// Title of the chart.
    #[arg(long, default_value = "")]
    title: String,
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Also print the rendered prompt text as "text".
    #[arg(long)]
    text: bool,
}

/// Reads a config enum from its name as written in TOML.
fn parse_name<T: serde::de::DeserializeOwned>(flag: &str, name: &str) -> anyhow::Result<T> {
    serde_json::from_value(Value::String(name.to_owned()))
        .map_err(|e| anyhow::anyhow!("--{flag} {name:?}: {e}"))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Prepare(args) => prepare(args),
        Command::Publish(args) => publish(&args),
        Command::Plot(args) => plot(&args),
        Command::Tokenize(args) => tokenize_stdin(&args),
        #[cfg(feature = "torch")]
        Command::Train(args) => torch_cli::train(args),
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

/// What `prepare` and `train` share: the config with the flags applied, the store read
/// after the cursor and the prepared batches.
struct Loaded {
    model: Model,
    config: RunConfig,
    location: tapline_proto::store::StoreLocation,
    runtime: tokio::runtime::Runtime,
    run: Option<String>,
    read: ingest::StoreRead,
    prepared: tapline_trainer::Prepared,
    now: i64,
    ingest_seconds: f64,
    prepare_seconds: f64,
    /// This run's id in the cursor it writes (`written_by`).
    writer: String,
    /// The policy version announced when the run read the store (the trainer's
    /// manifest records it; `prepare` has it in its report's lag counts).
    #[cfg_attr(not(feature = "torch"), allow(dead_code))]
    latest_policy_version: Option<u64>,
}

/// What rank 0 of a distributed run read, for the other ranks to read the same.
#[derive(serde::Serialize, serde::Deserialize)]
struct RankPlan {
    read: ingest::ReadPlan,
    latest_policy_version: Option<u64>,
}

fn load_and_prepare(
    args: &PrepareArgs,
    adjust: impl FnOnce(&mut RunConfig),
    plan: Option<&RankPlan>,
) -> anyhow::Result<Loaded> {
    let (model, mut config) = args.model.load()?;
    if let Some(run) = &args.run {
        config.run = run.clone();
    }
    if let Some(name) = &args.estimator {
        config.advantages.estimator = parse_name("estimator", name)?;
    }
    if let Some(name) = &args.loss_agg_mode {
        config.schedule.loss_agg_mode = parse_name("loss-agg-mode", name)?;
    }
    if let Some(n) = args.max_seq_len {
        config.clean.max_seq_len = n;
    }
    if let Some(n) = args.micro_batch_tokens {
        config.schedule.micro_batch_tokens = n;
    }
    if let Some(n) = args.mini_batch_episodes {
        config.schedule.mini_batch_episodes = n;
    }
    if let Some(n) = args.grace_period_secs {
        config.clean.grace_period_secs = n;
    }
    if args.ignore_recorded_ids {
        config.tokenize.use_recorded_ids = false;
    }
    if let Some(n) = args.concurrent_reads {
        config.ingest.concurrent_reads = n;
    }
    adjust(&mut config);
    config.validate()?;
    let now = match (plan, args.now_unix_secs) {
        (Some(plan), _) => plan.read.now_unix_nanos,
        (None, Some(secs)) => secs.saturating_mul(1_000_000_000),
        (None, None) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
            .unwrap_or(0),
    };

    let location = tapline_proto::store::open_store(&args.store)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let run = (!args.no_cursor).then(|| config.run.clone());
    let started = Instant::now();
    let mut read = runtime.block_on(ingest::read_store_planned(
        &location,
        run.as_deref(),
        &config.ingest,
        now,
        plan.map(|p| &p.read),
    ))?;
    let ingest_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut ingested = std::mem::take(&mut read.ingested);
    if let Some(plan) = plan {
        ingested.latest_policy_version = plan.latest_policy_version;
    } else if let Some(policy) = &config.clean.policy {
        // The version announced now: the lag of every call is counted from it.
        ingested.latest_policy_version = runtime
            .block_on(tapline_trainer::publish::announced(&location, policy))?
            .map(|a| a.version);
    }
    let latest_policy_version = ingested.latest_policy_version;
    let mut prepared = tapline_trainer::prepare(ingested, &model, &config, now);
    let prepare_seconds = started.elapsed().as_secs_f64();
    let r = &mut prepared.report.input;
    r.segments = read.new_segments.len() as u64;
    r.reread_segments = read.reread_segments.len() as u64;
    r.unreadable_segments = read.unreadable_segments.len() as u64;
    for (key, reason) in &read.unreadable_segments {
        tracing::warn!(key, reason, "segment skipped as unreadable");
    }
    r.oversized_records = read.oversized_records.len() as u64;
    for (key, skipped) in &read.oversized_records {
        tracing::warn!(
            key,
            record = skipped.index,
            bytes = skipped.bytes,
            "record skipped: larger than the segment reader's limit; the rest of the segment was read"
        );
    }
    Ok(Loaded {
        writer: run_id(),
        model,
        config,
        location,
        runtime,
        run,
        read,
        prepared,
        now,
        ingest_seconds,
        prepare_seconds,
        latest_policy_version,
    })
}

impl Loaded {
    /// Moves the run's cursor past what was read (pending episodes stay pending).
    /// A conditional write: it fails with [`ingest::IngestError::CursorMoved`] when
    /// another run advanced the cursor since this one read it.
    fn advance_cursor(&self) -> Result<(), ingest::IngestError> {
        if let Some(run) = &self.run {
            self.runtime.block_on(ingest::write_cursor(
                &self.location,
                run,
                &self.next_cursor(),
                &self.read.cursor_version,
            ))?;
        }
        Ok(())
    }

    /// The cursor after this run.
    fn next_cursor(&self) -> ingest::Cursor {
        ingest::Cursor {
            written_by: self.writer.clone(),
            ..ingest::next_cursor(
                &self.read,
                &self.prepared.pending,
                self.config.ingest.lookback_hours,
                &self.location.prefix,
            )
        }
    }

    fn segments(&self) -> Vec<String> {
        self.read
            .reread_segments
            .iter()
            .chain(&self.read.new_segments)
            .cloned()
            .collect()
    }
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
    if let Err(e) = loaded.advance_cursor() {
        if matches!(e, ingest::IngestError::CursorMoved { .. }) {
            mark_incomplete(&args.out, &e.to_string())?;
        }
        return Err(e.into());
    }
    Ok(())
}

/// An id for this run: process id, start time and a random number.
fn run_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}-{random:016x}", std::process::id())
}

/// Where a run records what it commits to its cursor (see `torch_cli::CursorCommit`)
/// until the cursor is written; then it is renamed [`CURSOR_COMMITTED_FILE`], so a
/// restart never takes a committed run for one to finish.
const CURSOR_COMMIT_FILE: &str = "cursor-commit.json";
/// [`CURSOR_COMMIT_FILE`] once the commit is in the store.
#[cfg_attr(not(feature = "torch"), allow(dead_code))]
const CURSOR_COMMITTED_FILE: &str = "cursor-committed.json";

/// The file that marks an output directory whose run did not commit (its cursor write
/// lost to another trainer's): it says why, and the directory has no `manifest.json`.
const INCOMPLETE_FILE: &str = "INCOMPLETE";

/// Marks `dir` incomplete: no `manifest.json` (so `--follow` never continues from it),
/// no cursor commit to finish, and an `INCOMPLETE` file with `reason`.
fn mark_incomplete(dir: &std::path::Path, reason: &str) -> anyhow::Result<()> {
    for name in ["manifest.json", CURSOR_COMMIT_FILE] {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("remove {}/{name}", dir.display()));
            }
        }
    }
    let path = dir.join(INCOMPLETE_FILE);
    std::fs::write(&path, format!("{reason}\n"))
        .with_context(|| format!("write {}", path.display()))?;
    eprintln!("tapline-trainer: {} is marked incomplete", dir.display());
    Ok(())
}

fn plot(args: &PlotArgs) -> anyhow::Result<()> {
    use tapline_trainer::chart::{Panel, Series};
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
    tapline_trainer::chart::write_png(&args.out, &args.title, &panels)
        .with_context(|| format!("write {}", args.out.display()))
}
