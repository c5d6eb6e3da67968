//! What the commands of `tapline-trainer` share, below both `main.rs` (the command line
//! and the torch-free commands) and `torch_cli.rs` (the commands that need libtorch):
//! the arguments, the store read with its prepared batches ([`Loaded`]) and how a run
//! commits its cursor or marks its output directory incomplete.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use serde_json::Value;
use tapline_trainer::config::RunConfig;
use tapline_trainer::{Model, ModelOptions, ingest};

#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// Model directory: tokenizer.json, tokenizer_config.json, optionally
    /// chat_template.jinja and generation_config.json.
    #[arg(long, env = "TAPLINE_MODEL")]
    pub(crate) model: PathBuf,
    /// Chat template file to use instead of the model directory's.
    #[arg(long)]
    pub(crate) chat_template: Option<PathBuf>,
    /// Stop tokens to use instead of EOS and the known end-of-turn tokens (repeatable).
    #[arg(long = "stop-token")]
    pub(crate) stop_tokens: Vec<String>,
    /// TOML run configuration (see `tapline_trainer::config`); flags win over it.
    #[arg(long, env = "TAPLINE_TRAINER_CONFIG")]
    pub(crate) config: Option<PathBuf>,
}

impl ModelArgs {
    pub(crate) fn load(&self) -> anyhow::Result<(Model, RunConfig)> {
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
pub(crate) struct PrepareArgs {
    /// Store URL (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    pub(crate) store: String,
    /// Output directory: the batches and the report (`prepare`), the checkpoint (`train`).
    #[arg(long)]
    pub(crate) out: PathBuf,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Name of the run's cursor (config `run`). Under torchrun, put `--` before the
    /// trainer's path (torchrun's parser takes `--run` for its `--run-path`) or set
    /// TAPLINE_RUN.
    #[arg(long, env = "TAPLINE_RUN")]
    pub(crate) run: Option<String>,
    /// Read every segment and leave the cursor alone (for inspection).
    #[arg(long)]
    pub(crate) no_cursor: bool,
    /// Advantage estimator: grpo, dr_grpo, rloo, reinforce_plus_plus_baseline.
    #[arg(long)]
    pub(crate) estimator: Option<String>,
    /// Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    /// seq-mean-token-sum-norm, episode-mean.
    #[arg(long)]
    pub(crate) loss_agg_mode: Option<String>,
    /// Longest sequence trained on, in tokens.
    #[arg(long)]
    pub(crate) max_seq_len: Option<usize>,
    /// Token budget of a micro-batch.
    #[arg(long)]
    pub(crate) micro_batch_tokens: Option<usize>,
    /// Episodes per mini-batch (0: one mini-batch).
    #[arg(long)]
    pub(crate) mini_batch_episodes: Option<usize>,
    /// Seconds an unended episode may stay quiet before it is dropped.
    #[arg(long)]
    pub(crate) grace_period_secs: Option<u64>,
    /// Ignore recorded token ids and tokenize every call from text.
    #[arg(long)]
    pub(crate) ignore_recorded_ids: bool,
    /// Segments fetched and decoded at once ([ingest] concurrent_reads, default 32: suited
    /// to S3's latency; memory in flight is this many segment objects).
    #[arg(long)]
    pub(crate) concurrent_reads: Option<usize>,
    /// Treat this Unix time (seconds) as now, for the grace period.
    #[arg(long)]
    pub(crate) now_unix_secs: Option<i64>,
}

#[derive(Args, Clone)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) prepare: PrepareArgs,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Peak learning rate (config `train.lr`).
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    /// Passes over the mini-batches (config `train.epochs`).
    #[arg(long)]
    pub(crate) epochs: Option<u32>,
    /// Seed of the update (config `train.seed`).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Training dtype: auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16 (config
    /// `train.dtype`).
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// The memory the update may use, e.g. 16GiB (config `train.max_memory`; default
    /// 80% of what the process can have, of the GPU's on CUDA): micro-batches are split
    /// or run with recompute to fit, and a sequence that cannot fit fails the run
    /// before its first step.
    #[arg(long)]
    pub(crate) max_memory: Option<String>,
    /// Continue an earlier run: its output directory (a full checkpoint, or a LoRA
    /// adapter) gives the weights and the optimizer state, which must be there.
    #[arg(long, conflicts_with = "adapter")]
    pub(crate) resume: Option<PathBuf>,
    /// Train this LoRA adapter (a PEFT directory) on top of `--model`; its optimizer
    /// state is resumed when present.
    #[arg(long)]
    pub(crate) adapter: Option<PathBuf>,
    /// Start with a new optimizer state even when the weights come with one.
    #[arg(long)]
    pub(crate) fresh_optimizer: bool,
    /// Train continuously: wait for --min-episodes new ended episodes, train on them
    /// into `--out/NNNNNN` (each run continuing from the one before, optimizer state
    /// included), publish when the config has `[publish]`, repeat. SIGTERM or Ctrl-C
    /// while waiting exits; during a run it stops after the current step and drops the
    /// run (trained again on the next start); a second signal exits at once.
    #[arg(long)]
    pub(crate) follow: bool,
    /// With --follow: episodes ready to train on before a run starts [default: the
    /// config's schedule.mini_batch_episodes].
    #[arg(long, requires = "follow")]
    pub(crate) min_episodes: Option<usize>,
    /// With --follow: seconds between two looks at the store while waiting.
    #[arg(long, default_value_t = 10.0, requires = "follow")]
    pub(crate) poll_secs: f64,
    /// Distributed runs (RANK / WORLD_SIZE set by torchrun or a PyTorchJob): seconds
    /// every collective may take, the rendezvous included; when a rank dies or stalls,
    /// the others exit non-zero after at most this long, writing nothing.
    #[arg(long, env = "TAPLINE_DIST_TIMEOUT_SECS", default_value_t = 600)]
    pub(crate) dist_timeout_secs: u64,
    /// Also write TensorBoard event files (config `track.tensorboard`) beside
    /// metrics.jsonl: `tensorboard --logdir <the track directory>`.
    #[arg(long)]
    pub(crate) tensorboard: bool,
    /// Where metrics.jsonl and the event files go (config `track.dir`) [default: --out;
    /// with --follow the --out root, one series for all its runs].
    #[arg(long)]
    pub(crate) track_dir: Option<std::path::PathBuf>,
    /// `train --follow`: the track directory when neither --track-dir nor the config
    /// names one (the --out root).
    #[arg(skip)]
    #[cfg_attr(not(feature = "torch"), allow(dead_code))]
    pub(crate) series_dir: Option<std::path::PathBuf>,
}

#[derive(Args)]
pub(crate) struct ScoreArgs {
    /// Model directory (config.json, safetensors).
    #[arg(long, env = "TAPLINE_MODEL")]
    pub(crate) model: PathBuf,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16.
    #[arg(long, default_value = "auto")]
    pub(crate) dtype: String,
    /// A LoRA adapter (PEFT directory) to apply on top of the model.
    #[arg(long)]
    pub(crate) adapter: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// Store URL (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    pub(crate) store: String,
    /// Output directory (created if missing): calls.parquet, episodes.parquet,
    /// rewards.parquet; files of an earlier export there are replaced.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Only episodes that started at or after this time: RFC 3339
    /// (`2026-12-01T09:00:00Z`) or a UTC date (`2026-12-01`).
    #[arg(long, value_parser = parse_time)]
    pub(crate) since: Option<i64>,
    /// Only episodes that started before this time (same forms as --since).
    #[arg(long, value_parser = parse_time)]
    pub(crate) until: Option<i64>,
    /// Only episodes of this task (repeatable: any of them).
    #[arg(long = "task")]
    pub(crate) tasks: Vec<String>,
    /// Only this episode (repeatable: any of them).
    #[arg(long = "episode")]
    pub(crate) episodes: Vec<String>,
    /// Export without the segments that fail their checks and exit 0 (they are still
    /// named: on stderr, or in the summary with --json); without it the rest is exported
    /// and the command fails.
    #[arg(long)]
    pub(crate) skip_damaged: bool,
    /// Segments fetched at once (memory holds this many segment objects; the sidecar
    /// cuts them at 8 MiB by default).
    #[arg(long, default_value_t = 4)]
    pub(crate) concurrent_reads: usize,
    /// Print the summary as one JSON object instead of lines.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The long help of `export`: what it does and every column of every file.
pub(crate) fn export_long_help() -> String {
    use tapline_trainer::export::{
        CALL_COLUMNS, EPISODE_COLUMNS, REWARD_COLUMNS, SCHEMA_VERSION, SCHEMA_VERSION_KEY,
    };
    let mut help = format!(
        "Records in the store -> Parquet files for DuckDB, pandas, Polars or Spark: calls.parquet (one row per LLM call), episodes.parquet (one per episode), rewards.parquet (one per reward). Needs no libtorch.\n\n\
         Duplicates (at-least-once delivery) are dropped by record id; episodes are resolved as the trainer resolves them. Filters select episodes, and each file then holds the rows of those episodes. Segments are decoded one at a time: memory holds one decoded segment, the segments fetched ahead, the rows of one batch, a 16-byte key per record id seen and a small summary per episode, never the store's records. With a filter the store is read twice.\n\n\
         Each file's key-value metadata holds {SCHEMA_VERSION_KEY} = {SCHEMA_VERSION}. Columns (`?`: nullable):\n"
    );
    for (file, columns) in [
        ("calls.parquet", CALL_COLUMNS),
        ("episodes.parquet", EPISODE_COLUMNS),
        ("rewards.parquet", REWARD_COLUMNS),
    ] {
        help.push_str(&format!("\n{file}:\n"));
        for (name, ty, meaning) in columns {
            help.push_str(&format!("  {name} ({ty}): {meaning}\n"));
        }
    }
    help
}

/// A time on the command line: RFC 3339, or a date (midnight UTC); Unix nanoseconds.
pub(crate) fn parse_time(text: &str) -> Result<i64, String> {
    let parsed = chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&chrono::Utc))
        .or_else(|_| {
            chrono::NaiveDate::parse_from_str(text, "%Y-%m-%d")
                .map(|d| d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc())
        })
        .map_err(|_| {
            format!(
                "{text:?} is not a time: use RFC 3339 (2026-12-01T09:00:00Z) or a date (2026-12-01)"
            )
        })?;
    parsed
        .timestamp_nanos_opt()
        .ok_or_else(|| format!("{text:?} is outside the years 1678 to 2261"))
}

#[derive(Args)]
pub(crate) struct PublishArgs {
    /// Store URL the sidecars follow (file:///dir, s3://bucket/prefix, gs://, az://, memory://).
    #[arg(long, env = "TAPLINE_STORE")]
    pub(crate) store: String,
    /// Policy name (the sidecars' --policy).
    #[arg(long)]
    pub(crate) policy: String,
    /// The adapter directory (`train` with `[train.lora]` writes one).
    #[arg(long)]
    pub(crate) from: PathBuf,
    /// Base URL of an inference server (repeat for each; every one must load it).
    #[arg(long = "server", required = true)]
    pub(crate) servers: Vec<String>,
    /// The servers' API.
    #[arg(long, value_enum, default_value = "vllm")]
    pub(crate) server_kind: tapline_trainer::publish::ServerKind,
    /// The adapter directory as the servers see it [default: --from, absolute].
    #[arg(long)]
    pub(crate) path_on_server: Option<String>,
    /// Versions kept loaded, the new one included; older ones are unloaded.
    #[arg(long, default_value_t = 2)]
    pub(crate) keep_loaded: u64,
    /// Seconds allowed for one server request.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) timeout_secs: f64,
}

#[derive(Args)]
pub(crate) struct MergeArgs {
    /// The base model directory (config.json, safetensors, tokenizer).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// The adapter (PEFT directory: adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    pub(crate) adapter: PathBuf,
    /// Output directory for the merged checkpoint.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// dtype of the merged weights: float32 or bfloat16 [default: the dtype the base
    /// model's config.json declares, else float32].
    #[arg(long)]
    pub(crate) dtype: Option<String>,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Model shape: tiny, smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, qwen2.5-1.5b, qwen3-1.7b,
    /// qwen2.5-7b, qwen3-8b.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    pub(crate) preset: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16.
    #[arg(long, default_value = "auto")]
    pub(crate) dtype: String,
    /// Sequences per optimizer step (one per micro-batch).
    #[arg(long, default_value_t = 8)]
    pub(crate) sequences: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    pub(crate) seq_len: usize,
    /// Measure peak memory at each of these sequence lengths (e.g.
    /// 1024,2048,4096,8192,16384), each in a process of its own (a peak is a
    /// process's), and print a table of measured and estimated peaks; a length whose
    /// estimate exceeds the memory available is reported, not run.
    #[arg(long, value_delimiter = ',', conflicts_with = "seq_len")]
    pub(crate) seq_lens: Vec<usize>,
    /// A length distribution instead of `--sequences` x `--seq-len`: a comma-separated
    /// list (4096,512,128) or `agent` (a built-in agent-trace-like mix of 16 sequences,
    /// 40 to 512 tokens). The sequences go into micro-batches of `--micro-batch-tokens`
    /// as the scheduler packs them; without `--layout`, the step runs padded and packed,
    /// each in a process of its own, and a table compares them.
    #[arg(long, conflicts_with_all = ["seq_len", "seq_lens"])]
    pub(crate) lengths: Option<String>,
    /// Token budget of a micro-batch with `--lengths` (`[schedule] micro_batch_tokens`).
    #[arg(long, default_value_t = 4096)]
    pub(crate) micro_batch_tokens: usize,
    /// `packed` (one row of sequences end to end, `[train] packing`, the default) or
    /// `padded` (one right-padded row per sequence).
    #[arg(long)]
    pub(crate) layout: Option<String>,
    /// Steps before measuring.
    #[arg(long, default_value_t = 2)]
    pub(crate) warmup: usize,
    /// Measured steps.
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
    /// Recompute layers in the backward pass.
    #[arg(long)]
    pub(crate) recompute: bool,
    /// Peak FLOP/s of the device in TFLOP/s, for MFU (known GPUs are looked up by name).
    #[arg(long)]
    pub(crate) peak_tflops: Option<f64>,
    /// Train a LoRA adapter (all seven projections) instead of every weight.
    #[arg(long)]
    pub(crate) lora: bool,
    /// Rank of the adapter with `--lora`.
    #[arg(long, default_value_t = 16)]
    pub(crate) lora_rank: i64,
    /// Under torchrun: keep the whole AdamW state on every rank instead of sharding it.
    #[arg(long)]
    pub(crate) replicate_optimizer: bool,
}

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// The run's output directory (its --out, or one NNNNNN run of --follow).
    #[arg(long)]
    pub(crate) run: PathBuf,
}

#[derive(Args)]
pub(crate) struct PlotArgs {
    /// The SVG to write.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Title of the chart.
    #[arg(long, default_value = "")]
    pub(crate) title: String,
}

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Also print the rendered prompt text as "text".
    #[arg(long)]
    pub(crate) text: bool,
}

/// Reads a config enum from its name as written in TOML.
pub(crate) fn parse_name<T: serde::de::DeserializeOwned>(
    flag: &str,
    name: &str,
) -> anyhow::Result<T> {
    serde_json::from_value(Value::String(name.to_owned()))
        .map_err(|e| anyhow::anyhow!("--{flag} {name:?}: {e}"))
}

/// What `prepare` and `train` share: the config with the flags applied, the store read
/// after the cursor and the prepared batches.
pub(crate) struct Loaded {
    pub(crate) model: Model,
    pub(crate) config: RunConfig,
    pub(crate) location: tapline_proto::store::StoreLocation,
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) run: Option<String>,
    pub(crate) read: ingest::StoreRead,
    pub(crate) prepared: tapline_trainer::Prepared,
    pub(crate) now: i64,
    pub(crate) ingest_seconds: f64,
    pub(crate) prepare_seconds: f64,
    /// This run's id in the cursor it writes (`written_by`).
    pub(crate) writer: String,
    /// The policy version announced when the run read the store (the trainer's
    /// manifest records it; `prepare` has it in its report's lag counts).
    #[cfg_attr(not(feature = "torch"), allow(dead_code))]
    pub(crate) latest_policy_version: Option<u64>,
}

/// What rank 0 of a distributed run read, for the other ranks to read the same.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct RankPlan {
    pub(crate) read: ingest::ReadPlan,
    pub(crate) latest_policy_version: Option<u64>,
}

pub(crate) fn load_and_prepare(
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
    pub(crate) fn advance_cursor(&self) -> Result<(), ingest::IngestError> {
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

    /// Advances the cursor once `out` is written; when another run advanced it first,
    /// marks `out` incomplete and fails (see [`mark_incomplete`]).
    pub(crate) fn commit(&self, out: &std::path::Path) -> anyhow::Result<()> {
        match self.advance_cursor() {
            Ok(()) => Ok(()),
            Err(e @ ingest::IngestError::CursorMoved { .. }) => {
                mark_incomplete(out, &e.to_string())?;
                Err(e.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The cursor after this run.
    pub(crate) fn next_cursor(&self) -> ingest::Cursor {
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

    pub(crate) fn segments(&self) -> Vec<String> {
        self.read
            .reread_segments
            .iter()
            .chain(&self.read.new_segments)
            .cloned()
            .collect()
    }
}

/// An id for this run: process id, start time and a random number.
pub(crate) fn run_id() -> String {
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
pub(crate) const CURSOR_COMMIT_FILE: &str = "cursor-commit.json";
/// [`CURSOR_COMMIT_FILE`] once the commit is in the store.
#[cfg_attr(not(feature = "torch"), allow(dead_code))]
pub(crate) const CURSOR_COMMITTED_FILE: &str = "cursor-committed.json";

/// The file that marks an output directory whose run did not commit (its cursor write
/// lost to another trainer's): it says why, and the directory has no `manifest.json`.
pub(crate) const INCOMPLETE_FILE: &str = "INCOMPLETE";

/// Marks `dir` incomplete: no `manifest.json` (so `--follow` never continues from it),
/// no cursor commit to finish, and an `INCOMPLETE` file with `reason`.
pub(crate) fn mark_incomplete(dir: &std::path::Path, reason: &str) -> anyhow::Result<()> {
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
