//! `tapline-trainer`: turns captured records into training batches.
//!
//! - `prepare --store URL --model DIR --out DIR`: reads the segments after the run's
//!   cursor, cleans, tokenizes, merges, computes advantages and loss weights, writes the
//!   batches and the report (format: `tapline_trainer::output`), prints the report as a
//!   table, then advances the cursor.
//! - `tokenize --model DIR`: reads one chat request as JSON on stdin and prints
//!   `{"ids": [...]}`, the prompt ids `prepare` would use for it.

use std::io::Read as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use tapline_trainer::config::RunConfig;
use tapline_trainer::{Model, ModelOptions, ingest, output, tokenize};

#[derive(Parser)]
#[command(
    name = "tapline-trainer",
    version,
    about = "Turns captured records into training batches."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Records in the store → batches, report and table; then advance the run's cursor.
    Prepare(PrepareArgs),
    /// One chat request on stdin → `{"ids": [...]}`, the prompt ids `prepare` would use.
    Tokenize(TokenizeArgs),
}

#[derive(Args)]
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

#[derive(Args)]
struct PrepareArgs {
    /// Store URL (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    store: String,
    /// Output directory for the batches and the report.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// Name of the run's cursor (config `run`).
    #[arg(long)]
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
    /// Treat this Unix time (seconds) as now, for the grace period.
    #[arg(long)]
    now_unix_secs: Option<i64>,
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TAPLINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Prepare(args) => prepare(args),
        Command::Tokenize(args) => tokenize_stdin(&args),
    }
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
    let (model, mut config) = args.model.load()?;
    if let Some(run) = args.run {
        config.run = run;
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
    config.validate()?;
    let now = match args.now_unix_secs {
        Some(secs) => secs.saturating_mul(1_000_000_000),
        None => std::time::SystemTime::now()
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
    let run = (!args.no_cursor).then_some(config.run.as_str());
    let mut read = runtime.block_on(ingest::read_store(&location, run, &config.ingest))?;
    let ingested = std::mem::take(&mut read.ingested);
    let mut prepared = tapline_trainer::prepare(ingested, &model, &config, now);
    let r = &mut prepared.report.input;
    r.segments = read.new_segments.len() as u64;
    r.reread_segments = read.reread_segments.len() as u64;
    r.unreadable_segments = read.unreadable_segments.len() as u64;
    for (key, reason) in &read.unreadable_segments {
        tracing::warn!(key, reason, "segment skipped as unreadable");
    }
    let provenance = output::Provenance {
        store: location.display.clone(),
        model_dir: model.dir().display().to_string(),
        run: run.map(str::to_owned),
        segments: read
            .reread_segments
            .iter()
            .chain(&read.new_segments)
            .cloned()
            .collect(),
        created_unix_nanos: now,
    };
    output::write(&args.out, &prepared, &config, &provenance)?;
    print!("{}", prepared.report.table());
    println!(
        "wrote {} mini-batches to {}",
        prepared.mini_batches.len(),
        args.out.display()
    );
    if let Some(run) = run {
        let cursor = ingest::next_cursor(
            &read,
            &prepared.pending,
            config.ingest.lookback_hours,
            &location.prefix,
        );
        runtime.block_on(ingest::write_cursor(&location, run, &cursor))?;
    }
    Ok(())
}
