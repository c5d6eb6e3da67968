//! The commands of `tapline-trainer` that need libtorch (the `torch` feature): `train`
//! (once, or `--follow`), `score`, `merge-lora` and `bench-update`. The arguments and
//! the torch-free commands are in `main.rs`.

use std::io::Read as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use serde_json::Value;
use tapline_trainer::ingest;
use tapline_trainer::nn::{self, Transformer, checkpoint};

use crate::cli::*;

/// Where a training run's weights and optimizer state come from.
struct Start {
    /// The model (a full fine-tune from `--resume`, or `--model`), LoRA attached.
    model: Transformer,
    /// The directory of the base weights.
    weights_dir: PathBuf,
    /// The LoRA settings, when training an adapter.
    lora: Option<nn::lora::LoraOptions>,
    /// The adapter trained from, if any.
    adapter_from: Option<PathBuf>,
    /// Where the optimizer state and the global step are looked for.
    state_dir: Option<PathBuf>,
}

fn load_start(
    args: &TrainArgs,
    options: &nn::train::TrainOptions,
    device: tch::Device,
    kind: tch::Kind,
) -> anyhow::Result<Start> {
    use nn::lora;
    let model_dir = &args.prepare.model.model;
    let resume_adapter = args.resume.as_ref().filter(|d| lora::is_adapter_dir(d));
    let adapter_from = args.adapter.clone().or_else(|| resume_adapter.cloned());
    let is_lora = options.lora.is_some() || adapter_from.is_some();
    if let Some(dir) = &args.resume {
        anyhow::ensure!(
            dir.is_dir(),
            "--resume {}: not a directory (the --out of an earlier run)",
            dir.display()
        );
        anyhow::ensure!(
            is_lora || !lora::is_adapter_dir(dir),
            "--resume {} is a LoRA adapter",
            dir.display()
        );
        anyhow::ensure!(
            !(is_lora && resume_adapter.is_none()),
            "--resume {} holds a full checkpoint, but the config's [train.lora] asks for a LoRA run: resume a run's adapter directory, or remove [train.lora]",
            dir.display()
        );
    }
    let weights_dir = match (&args.resume, is_lora) {
        (Some(dir), false) => dir.clone(),
        _ => model_dir.clone(),
    };
    anyhow::ensure!(
        !lora::is_adapter_dir(&weights_dir),
        "{} is a LoRA adapter, not a model: pass the base model as --model and the adapter as --adapter",
        weights_dir.display()
    );
    let mut model = Transformer::load(&weights_dir, device, kind)
        .with_context(|| format!("load the model from {}", weights_dir.display()))?;
    let lora = if let Some(dir) = &adapter_from {
        let found = lora::load(&mut model, dir)
            .with_context(|| format!("load the adapter to train from {}", dir.display()))?;
        if let Some(wanted) = &options.lora {
            anyhow::ensure!(
                *wanted == found,
                "the config's [train.lora] ({wanted:?}) differs from the adapter in {} ({found:?}): remove [train.lora] to continue that adapter, or drop --adapter to start a new one",
                dir.display()
            );
        }
        found
            .validate()
            .map_err(|e| anyhow::anyhow!("adapter {}: {e}", dir.display()))?;
        Some(found)
    } else if let Some(wanted) = &options.lora {
        lora::attach_new(&mut model, wanted, options.seed);
        Some(wanted.clone())
    } else {
        None
    };
    let state_dir = match (&lora, &adapter_from) {
        (Some(_), Some(dir)) => Some(dir.clone()),
        (Some(_), None) => None,
        (None, _) => Some(weights_dir.clone()),
    };
    Ok(Start {
        model,
        weights_dir,
        lora,
        adapter_from,
        state_dir,
    })
}

/// SIGTERM / Ctrl-C seen (`train --follow`).
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn stop_requested() -> bool {
    STOP.load(std::sync::atomic::Ordering::SeqCst)
}

/// Sets [`STOP`] on SIGTERM or SIGINT, from a thread of its own.
fn watch_signals() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::spawn(move || {
        runtime.block_on(async {
            let Ok(mut term) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            eprintln!(
                "train: stop requested; a run in progress stops after its current step and is dropped (trained again on the next start; signal again to exit at once)"
            );
            STOP.store(true, std::sync::atomic::Ordering::SeqCst);
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            // Safe at any point: a run directory without its manifest is removed on
            // restart, the manifest and the cursor are each replaced whole, and a claimed
            // version that never went live is skipped.
            eprintln!("train: second stop signal; exiting now");
            std::process::exit(130);
        });
    });
    Ok(())
}

pub(super) fn train(args: TrainArgs) -> anyhow::Result<()> {
    let launch = tapline_c10d::Launch::from_env()?.filter(|l| l.world_size > 1);
    if args.follow {
        anyhow::ensure!(
            launch.is_none(),
            "--follow runs in one process: run distributed training as one job per batch (a Kubernetes Job or CronJob starting torchrun, see examples/deploy/README.md), or unset WORLD_SIZE"
        );
        return follow(args);
    }
    if let Some(done) = train_once(&args, None)? {
        done.publish()?;
    }
    Ok(())
}

/// A finished run (manifest written, cursor advanced) and where it is published.
struct Finished {
    out: PathBuf,
    location: tapline_proto::store::StoreLocation,
    publish: Option<tapline_trainer::publish::PublishConfig>,
    /// Where the run's metrics went: a publish adds the version there (`None`: not
    /// tracked by this process, e.g. rank > 0).
    track: Option<tapline_trainer::track::TrackedRun>,
}

/// The optimizer of a run: whole on this process, or sharded across the ranks.
enum Opt {
    Whole(nn::optim::AdamW),
    Sharded(nn::dist::ShardedAdamW),
}

impl Opt {
    fn as_dyn(&mut self) -> &mut dyn nn::dist::Optimizer {
        match self {
            Opt::Whole(o) => o,
            Opt::Sharded(o) => o,
        }
    }

    fn load_state(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<nn::optim::StateInfo, nn::optim::StateError> {
        match self {
            Opt::Whole(o) => o.load_state(dir),
            Opt::Sharded(o) => o.load_state(dir),
        }
    }

    /// Writes the state into `dir` (rank 0 of a group; every rank must call it with a
    /// sharded state). `Some` where it was written.
    fn save_state(
        &mut self,
        dir: &std::path::Path,
        group: Option<&tapline_c10d::Group>,
    ) -> anyhow::Result<Option<nn::optim::StateInfo>> {
        Ok(match (self, group) {
            (Opt::Sharded(o), Some(g)) => o.save_state(dir, g)?,
            (Opt::Whole(o), g) if g.is_none_or(|g| g.rank() == 0) => Some(o.save_state(dir)?),
            _ => None,
        })
    }
}

/// This host's name (for the per-rank compute of a distributed run).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// Fails unless every rank prepared the same mini-batches (same episodes, sequences and
/// tokens, in the same order): a rank that read other data would train on another
/// gradient.
fn check_same_batches(
    group: &tapline_c10d::Group,
    mini_batches: &[tapline_trainer::batch::MiniBatch],
) -> anyhow::Result<()> {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    for mb in mini_batches {
        for micro in &mb.micro_batches {
            for s in &micro.sequences {
                hasher.update(s.episode_id.as_bytes());
                hasher.update(b":");
                for id in &s.sequence.token_ids {
                    hasher.update(id.to_le_bytes());
                }
                hasher.update(b";");
            }
            hasher.update(b"|");
        }
        hasher.update(b"\n");
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let all = group.exchange("batches", digest.as_bytes())?;
    if let Some(r) = all.iter().position(|d| d != digest.as_bytes()) {
        anyhow::bail!(
            "rank {r} prepared other mini-batches than rank {} (digest {} vs {digest}): the ranks must run the same trainer and configuration on the same store",
            group.rank(),
            String::from_utf8_lossy(&all[r])
        );
    }
    Ok(())
}

/// Written into a run directory once its adapter was published (`train --follow`
/// publishes a run that lacks it when it starts again).
const PUBLISHED_FILE: &str = "published.json";

impl Finished {
    /// Publishes the run per its `[publish]` section (nothing without one).
    fn publish(&self) -> anyhow::Result<()> {
        let Some(publish) = &self.publish else {
            return Ok(());
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("start the async runtime")?;
        let options = publish.options(&self.out);
        let published = runtime
            .block_on(tapline_trainer::publish::publish(&self.location, &options))
            .with_context(|| {
                format!(
                    "trained, but not published; retry with `tapline-trainer publish --store {} --policy {} --from {}`",
                    self.location.display,
                    publish.policy,
                    self.out.display()
                )
            })?;
        let record = self.out.join(PUBLISHED_FILE);
        std::fs::write(&record, serde_json::to_vec_pretty(&published)?)
            .with_context(|| format!("write {}", record.display()))?;
        if let Some(run) = &self.track {
            tapline_trainer::track::record_published(
                run,
                &serde_json::to_value(&published)?,
                published
                    .superseded_by
                    .is_none()
                    .then_some(published.announcement.version),
            );
        }
        match published.superseded_by {
            None => println!(
                "train: published {} as {}",
                self.out.display(),
                published.announcement.served_model
            ),
            Some(newer) => println!(
                "train: loaded {} as {}, but another publisher announced version {newer} first; it stays unannounced",
                self.out.display(),
                published.announcement.served_model
            ),
        }
        Ok(())
    }
}

/// `train --follow`: runs into `--out/000001`, `--out/000002`, ... each continuing from
/// the one before.
///
/// A stop signal ends the run in progress after its current step and drops it (nothing
/// written, the cursor not advanced: the next start trains that batch again), then the
/// follower. What a stop at any other point leaves is picked up by the next start: a run directory
/// without a manifest is removed and trained again (the cursor was not advanced); a run
/// whose manifest was written but whose cursor was not (`cursor-commit.json` says both)
/// gets its cursor written; a run not published yet (no `published.json`) is published,
/// unless a newer run is. A publish that fails is retried at every poll, and given up
/// for a newer run's, which carries the same training on.
fn follow(args: TrainArgs) -> anyhow::Result<()> {
    if !(args.poll_secs.is_finite() && args.poll_secs > 0.0) {
        anyhow::bail!(
            "--poll-secs {} is not a positive number of seconds",
            args.poll_secs
        );
    }
    anyhow::ensure!(
        !args.prepare.no_cursor,
        "--follow needs the run's cursor to know what was trained on: drop --no-cursor (with it every run would train on the same data again)"
    );
    watch_signals()?;
    let base = args.prepare.out.clone();
    std::fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
    // Continue after the runs already in --out (a restarted follower).
    let mut previous: Option<(u64, PathBuf)> = std::fs::read_dir(&base)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n: u64 = e.file_name().to_str()?.parse().ok()?;
            e.path()
                .join("manifest.json")
                .is_file()
                .then(|| (n, e.path()))
        })
        .max();
    let mut unpublished: Option<Finished> = None;
    if let Some((_, dir)) = &previous {
        let location = tapline_proto::store::open_store(&args.prepare.store)?;
        finish_cursor_commit(&location, dir)?;
        let manifest = read_manifest(dir)?;
        let publish = run_config_publish(dir, &manifest)?;
        if publish.is_some() && !dir.join(PUBLISHED_FILE).is_file() {
            unpublished = Some(Finished {
                out: dir.clone(),
                location,
                publish,
                // Its publish joins the series the run was tracked in.
                track: tapline_trainer::track::TrackedRun::from_manifest(&manifest),
            });
        }
    }
    let try_publish = |unpublished: &mut Option<Finished>| {
        if let Some(done) = unpublished.as_ref() {
            match done.publish() {
                Ok(()) => *unpublished = None,
                Err(e) => eprintln!(
                    "train: {e:#}; retrying at the next poll (or when the follower starts again)"
                ),
            }
        }
    };
    loop {
        try_publish(&mut unpublished);
        if stop_requested() {
            println!("train: stopped");
            return Ok(());
        }
        let n = previous.as_ref().map_or(1, |(n, _)| n + 1);
        let mut run = args.clone();
        run.prepare.out = base.join(format!("{n:06}"));
        // One series for all the runs: their metrics in the --out root.
        run.series_dir = Some(base.clone());
        if let Some((_, dir)) = &previous {
            run.resume = Some(dir.clone());
            run.adapter = None;
            run.fresh_optimizer = false;
        }
        if run.prepare.out.exists() {
            // A run that stopped before its manifest: start it again.
            std::fs::remove_dir_all(&run.prepare.out)
                .with_context(|| format!("remove the unfinished {}", run.prepare.out.display()))?;
        }
        let trained = train_once(&run, args.min_episodes.or(Some(0)))?;
        let waited = trained.is_none();
        if let Some(done) = trained {
            previous = Some((n, done.out.clone()));
            // A newer run carries the unpublished one's training on: publish it instead.
            unpublished = Some(done);
            try_publish(&mut unpublished);
        }
        if stop_requested() {
            println!("train: stopped");
            return Ok(());
        }
        if waited || unpublished.is_some() {
            let until = Instant::now() + std::time::Duration::from_secs_f64(args.poll_secs);
            while Instant::now() < until && !stop_requested() {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// The manifest of the finished run in `dir`.
fn read_manifest(dir: &std::path::Path) -> anyhow::Result<Value> {
    let path = dir.join("manifest.json");
    serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("read {}", path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", path.display()))
}

/// The `[publish]` section of the configuration a finished run recorded in its manifest.
fn run_config_publish(
    dir: &std::path::Path,
    manifest: &Value,
) -> anyhow::Result<Option<tapline_trainer::publish::PublishConfig>> {
    let path = dir.join("manifest.json");
    match manifest["config"].get("publish") {
        None | Some(Value::Null) => Ok(None),
        Some(p) => Ok(Some(serde_json::from_value(p.clone()).with_context(
            || format!("the [publish] section recorded in {}", path.display()),
        )?)),
    }
}

/// What a run committed to its cursor: written before the manifest, so that a stop
/// between the manifest and the cursor write can be finished on restart.
#[derive(serde::Serialize, serde::Deserialize)]
struct CursorCommit {
    run: String,
    before: ingest::Cursor,
    after: ingest::Cursor,
}

/// Renames the cursor commit of `dir` to say it is in the store.
fn committed(dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::rename(
        dir.join(CURSOR_COMMIT_FILE),
        dir.join(CURSOR_COMMITTED_FILE),
    )
    .with_context(|| format!("rename {}/{CURSOR_COMMIT_FILE}", dir.display()))
}

/// Writes the cursor a finished run in `dir` committed to, if the store still holds the
/// one it started from (the trainer stopped between its manifest and its cursor). A run
/// whose commit is already in the store (`cursor-committed.json`) is left alone,
/// whatever the cursor became since.
fn finish_cursor_commit(
    location: &tapline_proto::store::StoreLocation,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let path = dir.join(CURSOR_COMMIT_FILE);
    let Ok(bytes) = std::fs::read(&path) else {
        return Ok(());
    };
    let commit: CursorCommit = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a cursor commit", path.display()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let (now, version) = runtime.block_on(ingest::read_cursor_versioned(location, &commit.run))?;
    if now == commit.after {
        return committed(dir);
    }
    let moved = if now == commit.before {
        match runtime.block_on(ingest::write_cursor(
            location,
            &commit.run,
            &commit.after,
            &version,
        )) {
            Ok(_) => {
                println!(
                    "train: {} was finished but its cursor not written (stopped in between); wrote it now",
                    dir.display()
                );
                return committed(dir);
            }
            Err(e @ ingest::IngestError::CursorMoved { .. }) => e,
            Err(e) => return Err(e.into()),
        }
    } else {
        ingest::IngestError::CursorMoved {
            run: commit.run.clone(),
            key: ingest::cursor_key(location, &commit.run),
        }
    };
    // Another trainer advanced the cursor past what this directory was trained on: it
    // cannot be committed, nor continued from.
    mark_incomplete(dir, &moved.to_string())?;
    Err(anyhow::Error::new(moved).context(format!(
        "{} was trained but its cursor never written, and another trainer has moved the cursor since; it is marked incomplete: start again to continue from the run before it",
        dir.display()
    )))
}

/// Fits the micro-batches to the memory budget (`nn::memory`) and says what it chose;
/// the JSON for the manifest. Fails, before any step, when a sequence cannot fit. On a
/// group, every rank fits to the smallest budget and the largest static part, so all
/// split alike.
fn fit_memory(
    args: &TrainArgs,
    options: &nn::train::TrainOptions,
    model: &Transformer,
    lora: Option<&nn::lora::LoraOptions>,
    device: tch::Device,
    group: Option<&tapline_c10d::Group>,
    mini_batches: &mut [tapline_trainer::batch::MiniBatch],
) -> anyhow::Result<Value> {
    use nn::memory::{self, Size};
    let elem = match model.kind() {
        tch::Kind::Float => 4,
        tch::Kind::Double => 8,
        _ => 2,
    };
    let mut estimate = memory::MemoryModel::new(&model.config, lora, elem, options.logprob_chunk);
    // What is there already (weights, optimizer state, the records read) and the
    // gradients to come; on a GPU only the formula is known.
    if !device.is_cuda() {
        let grads = estimate.trainable * estimate.trainable_elem;
        estimate.measured_static = Some(memory::own_rss() + grads);
    }
    let (machine, what) = match device {
        tch::Device::Cuda(i) => (
            nn::manifest::gpu_memory_total(i).map(|t| (t, t)),
            format!("the memory of GPU {i}"),
        ),
        _ => (
            memory::available_memory(),
            "the memory this process could have at the start (MemAvailable, or the container's limit)".to_owned(),
        ),
    };
    let set = options.max_memory_bytes().map_err(|e| anyhow::anyhow!(e))?;
    let source = if args.max_memory.is_some() {
        "--max-memory"
    } else {
        "train.max_memory"
    };
    let (mut budget, source) = match (set, machine) {
        (Some(b), Some((_, total))) => {
            if b > total {
                eprintln!(
                    "train: warning: {source} = {} is more than {} ({}): the fit cannot keep the run from running out of memory",
                    Size(b),
                    if device.is_cuda() {
                        "the GPU's memory"
                    } else {
                        "this machine's memory"
                    },
                    Size(total)
                );
            }
            (b, source.to_owned())
        }
        (Some(b), None) => (b, source.to_owned()),
        (None, Some((can_have, _))) => memory::default_budget(can_have, &what),
        (None, None) => {
            eprintln!(
                "train: warning: the memory available is unknown ({what}); micro-batches are not fitted to a budget: set train.max_memory"
            );
            return Ok(serde_json::json!({ "budget_bytes": null }));
        }
    };
    if let Some(g) = group {
        let mine = serde_json::to_vec(&(budget, estimate.static_bytes()))?;
        let all: Vec<(u64, u64)> = g
            .exchange("memory_budget", &mine)?
            .iter()
            .map(|v| serde_json::from_slice(v).unwrap_or((budget, estimate.static_bytes())))
            .collect();
        budget = all.iter().map(|a| a.0).min().unwrap_or(budget);
        estimate.measured_static = all.iter().map(|a| a.1).max();
    }
    let mut report = memory::fit(&estimate, mini_batches, budget, options.recompute)
        .map_err(|e| anyhow::anyhow!("{e} ({source})"))?;
    report.budget_source = source;
    if group.is_none_or(|g| g.rank() == 0) {
        println!(
            "train: memory budget {} ({}): static {} + {:.2} MiB per token ({:.2} MiB with recompute); estimated peak {}; {} of {} micro-batch(es) split, {} of {} with recompute",
            Size(report.budget_bytes),
            report.budget_source,
            Size(report.static_bytes),
            report.bytes_per_token as f64 / (1u64 << 20) as f64,
            report.bytes_per_token_recompute as f64 / (1u64 << 20) as f64,
            Size(report.estimated_peak_bytes),
            report.split,
            report.micro_batches_scheduled,
            report.recompute,
            report.micro_batches,
        );
    }
    Ok(serde_json::to_value(&report)?)
}

/// One training run, not yet published. With `min_episodes` (--follow), returns `None`
/// without training when fewer episodes than that (or than a mini-batch, for `Some(0)`)
/// are ready, and `None` when a stop signal came before the last step: nothing is
/// written (the output directory is removed) and the cursor is not advanced.
fn train_once(args: &TrainArgs, min_episodes: Option<usize>) -> anyhow::Result<Option<Finished>> {
    let started = Instant::now();
    let started_unix_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let out = args.prepare.out.clone();
    let launch = tapline_c10d::Launch::from_env()?.filter(|l| l.world_size > 1);
    let rank = launch.as_ref().map_or(0, |l| l.rank);
    // Refuse a finished output directory before any work (rank 0 alone writes it).
    if rank == 0 {
        checkpoint::prepare_dir(&out)?;
    }
    let device = match (&launch, args.device.as_str()) {
        // One GPU per local rank, as torchrun lays them out.
        (Some(l), "cuda") => nn::parse_device(&format!("cuda:{}", l.local_rank))?,
        _ => nn::parse_device(&args.device)?,
    };
    let group = match &launch {
        None => None,
        Some(l) => {
            let backend = if device.is_cuda() {
                tapline_c10d::Backend::Nccl
            } else {
                tapline_c10d::Backend::Gloo
            };
            let timeout = std::time::Duration::from_secs(args.dist_timeout_secs.max(1));
            let g = tapline_c10d::Group::connect(l, backend, timeout)?;
            println!(
                "train: rank {} of {} (local rank {}), {} on {:?}, store {}:{}",
                l.rank,
                l.world_size,
                l.local_rank,
                backend.name(),
                device,
                l.master_addr,
                l.master_port
            );
            Some(g)
        }
    };
    // Rank 0 reads the store; the others read exactly what it read.
    let plan = match &group {
        Some(g) if g.rank() != 0 => Some(
            serde_json::from_slice::<RankPlan>(&g.store_get("plan")?)
                .context("rank 0's read plan")?,
        ),
        _ => None,
    };
    let mut loaded = load_and_prepare(
        &args.prepare,
        |c| {
            if let Some(lr) = args.lr {
                c.train.lr = lr;
            }
            if let Some(e) = args.epochs {
                c.train.epochs = e;
            }
            if let Some(s) = args.seed {
                c.train.seed = s;
            }
            if let Some(d) = &args.dtype {
                c.train.dtype = d.clone();
            }
            if let Some(m) = &args.max_memory {
                c.train.max_memory = Some(m.clone());
            }
            if args.tensorboard {
                c.track.tensorboard = true;
            }
            if let Some(d) = &args.track_dir {
                c.track.dir = Some(d.clone());
            }
        },
        plan.as_ref(),
    )?;
    if let Some(g) = &group {
        if g.rank() == 0 {
            let plan = RankPlan {
                read: loaded.read.plan(loaded.now),
                latest_policy_version: loaded.latest_policy_version,
            };
            g.store_set("plan", &serde_json::to_vec(&plan)?)?;
        }
        check_same_batches(g, &loaded.prepared.mini_batches)?;
    }
    if let Some(min) = min_episodes {
        let min = if min == 0 {
            loaded.config.schedule.mini_batch_episodes.max(1)
        } else {
            min
        };
        let ready: std::collections::HashSet<&str> = loaded
            .prepared
            .mini_batches
            .iter()
            .flat_map(|mb| &mb.micro_batches)
            .flat_map(|m| &m.sequences)
            .map(|s| s.episode_id.as_str())
            .collect();
        if ready.len() < min {
            println!(
                "train: {} episode(s) ready to train on, waiting for {min}",
                ready.len()
            );
            return Ok(None);
        }
        loaded.config.train.stop = Some(&STOP);
    }
    if rank == 0 {
        print!("{}", loaded.prepared.report.table());
    }
    loaded.config.train.latest_policy_version = loaded.prepared.report.policy.latest_version;
    let options = &loaded.config.train;
    let kind = nn::parse_dtype(&options.dtype, device)?;
    let model_dir = args.prepare.model.model.clone();

    let load_started = Instant::now();
    let Start {
        mut model,
        weights_dir,
        lora,
        adapter_from,
        state_dir,
    } = load_start(args, options, device, kind)?;
    let mut optimizer = match &group {
        Some(g) if options.shard_optimizer => {
            model.set_requires_grad(true);
            Opt::Sharded(nn::dist::ShardedAdamW::new(
                model.trainable_parameters(),
                options.adamw(),
                g.rank(),
                g.size(),
            ))
        }
        _ => Opt::Whole(options.optimizer(&mut model)),
    };
    let resumed = match &state_dir {
        Some(dir) if !args.fresh_optimizer && nn::optim::has_state(dir) => {
            let info = optimizer
                .load_state(dir)
                .with_context(|| format!("resume the optimizer state in {}", dir.display()))?;
            Some(serde_json::json!({
                "from": dir.display().to_string(),
                "optimizer_step": info.step,
                "optimizer_sha256": info.tensors_sha256,
            }))
        }
        _ => None,
    };
    if let Some(dir) = &args.resume
        && resumed.is_none()
    {
        anyhow::bail!(
            "--resume {}: no optimizer state there ({} and {}); it was written by an older trainer or with another mode. Train from it with --model/--adapter and --fresh-optimizer instead",
            dir.display(),
            nn::optim::STATE_INFO,
            nn::optim::STATE_TENSORS
        );
    }
    let load_model = load_started.elapsed().as_secs_f64();
    // Before any step: every micro-batch fitted to the memory budget.
    let mut memory = fit_memory(
        args,
        options,
        &model,
        lora.as_ref(),
        device,
        group.as_ref(),
        &mut loaded.prepared.mini_batches,
    )?;
    if let Some(g) = &group {
        check_same_batches(g, &loaded.prepared.mini_batches)?;
    }
    let options = &loaded.config.train;
    let first_step = state_dir.as_deref().map_or(0, checkpoint::global_step);
    let steps = loaded.prepared.mini_batches.len() * options.epochs as usize;
    let trainable: usize = model
        .trainable_parameters()
        .iter()
        .map(|(_, t)| t.numel())
        .sum();
    println!(
        "train: {} {} ({:.0}M parameters{}) on {} in {:?}, {} step(s) from global step {first_step}{}",
        model.config.arch.name(),
        weights_dir.display(),
        model.config.parameters() as f64 / 1e6,
        match &lora {
            Some(l) => format!(
                ", LoRA r {} alpha {} on {}: {:.2}M trainable",
                l.rank,
                l.alpha,
                l.target_modules.join(" "),
                trainable as f64 / 1e6
            ),
            None => String::new(),
        },
        args.device,
        kind,
        steps,
        match &resumed {
            Some(r) => format!(
                ", optimizer state resumed from {}",
                r["from"].as_str().unwrap_or("")
            ),
            None => String::new(),
        },
    );
    let bar = indicatif::ProgressBar::new(steps as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps, {elapsed} elapsed, eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if stop_requested() {
        // Stopped while loading: nothing trained yet, nothing kept.
        println!(
            "train: stopped before training; {} is dropped",
            out.display()
        );
        std::fs::remove_dir_all(&out)
            .with_context(|| format!("remove the unfinished {}", out.display()))?;
        return Ok(None);
    }
    let mut tracker = (rank == 0).then(|| {
        let track = &loaded.config.track;
        let dir = track
            .dir
            .clone()
            .or_else(|| args.series_dir.clone())
            .unwrap_or_else(|| out.clone());
        tapline_trainer::track::Tracker::open(
            track,
            &dir,
            &loaded.config.run,
            &out,
            first_step,
            &loaded.config,
        )
    });
    let gpu_memory = nn::manifest::GpuMemorySampler::start(device);
    let mut done = 0;
    let result = nn::train::train_with(
        &mut model,
        optimizer.as_dyn(),
        &loaded.prepared.mini_batches,
        options,
        first_step,
        group.as_ref(),
        |m| {
            done += 1;
            if rank == 0 {
                bar.suspend(|| println!("{}", m.line(done, steps)));
                bar.inc(1);
            }
            if let Some(t) = tracker.as_mut() {
                t.step(m.step, &serde_json::to_value(m).unwrap_or_default());
            }
        },
    )?;
    bar.finish_and_clear();
    let gpu_peak_memory_bytes_sampled = gpu_memory.finish();
    if let Some(m) = memory.as_object_mut() {
        let (peak, source) = match gpu_peak_memory_bytes_sampled {
            Some(p) => (p, "gpu memory used (nvidia-smi, sampled every second)"),
            None => (
                nn::manifest::peak_rss_bytes(),
                "peak RSS of the process (VmHWM)",
            ),
        };
        m.insert("peak_measured_bytes".into(), peak.into());
        m.insert("peak_measured".into(), source.into());
    }
    if result.steps.len() < steps {
        // Stopped by a signal: a partial run is neither kept nor published, and its data
        // stays unconsumed, so the next start trains the whole batch from the run before.
        // (Keeping the steps taken and leaving only the episodes not reached pending
        // would retrain those with other advantages: a group split by the stop comes
        // back smaller, and a member left alone is dropped as zero-variance.)
        println!(
            "train: stopped after {} of {steps} step(s); {} is dropped and the cursor not advanced",
            result.steps.len(),
            out.display()
        );
        if let Some(t) = tracker.as_mut() {
            let why = format!(
                "stopped by a signal after {} of {steps} step(s); the run is dropped",
                result.steps.len()
            );
            t.finish(tapline_trainer::track::Status::Killed, Some(&why));
        }
        if rank == 0 {
            std::fs::remove_dir_all(&out)
                .with_context(|| format!("remove the unfinished {}", out.display()))?;
        }
        return Ok(None);
    }
    // Distributed: the optimizer state is gathered (every rank takes part), each rank's
    // compute is shared, and every rank reaches the barrier having finished its steps;
    // only then does rank 0 write the checkpoint, the manifest and the cursor.
    let mut saved_state = None;
    let mut distributed = None;
    if let Some(g) = &group {
        let ckpt_started = Instant::now();
        saved_state = optimizer
            .save_state(&out, Some(g))
            .with_context(|| format!("save the optimizer state in {}", out.display()))?;
        let state_seconds = ckpt_started.elapsed().as_secs_f64();
        let wall = started.elapsed().as_secs_f64();
        let mine = serde_json::json!({
            "rank": g.rank(),
            "local_rank": launch.as_ref().map_or(0, |l| l.local_rank),
            "host": hostname(),
            "device_name": nn::manifest::device_name(device),
            "wall_clock_seconds": wall,
            "gpu_seconds": if device.is_cuda() { wall } else { 0.0 },
            "cpu_seconds": nn::manifest::cpu_seconds(),
            "peak_rss_bytes": nn::manifest::peak_rss_bytes(),
            "gpu_peak_memory_bytes_sampled": gpu_peak_memory_bytes_sampled,
            "optimizer_state_bytes": optimizer.as_dyn().state_bytes(),
            "optimizer_save_seconds": state_seconds,
            "micro_batches": loaded
                .prepared
                .mini_batches
                .iter()
                .map(|mb| {
                    let tokens: Vec<u64> = mb
                        .micro_batches
                        .iter()
                        .map(|m| m.sequences.iter().map(|s| s.sequence.len() as u64).sum())
                        .collect();
                    nn::dist::assign(&tokens, g.size())[g.rank()].len()
                })
                .sum::<usize>() * options.epochs as usize,
            "comm": result.comm,
        });
        let ranks: Vec<serde_json::Value> = g
            .exchange("compute", &serde_json::to_vec(&mine)?)?
            .iter()
            .map(|v| serde_json::from_slice(v).unwrap_or_default())
            .collect();
        g.barrier()?;
        if g.rank() != 0 {
            println!(
                "train: rank {} of {} finished its steps; rank 0 writes the checkpoint",
                g.rank(),
                g.size()
            );
            return Ok(None);
        }
        let sum = |key: &str| ranks.iter().filter_map(|r| r[key].as_f64()).sum::<f64>();
        distributed = Some(serde_json::json!({
            "world_size": g.size(),
            "backend": g.backend().name(),
            "shard_optimizer": matches!(optimizer, Opt::Sharded(_)),
            "timeout_secs": args.dist_timeout_secs,
            "gpu_seconds": sum("gpu_seconds"),
            "cpu_seconds": sum("cpu_seconds"),
            "ranks": ranks,
        }));
    }

    let ckpt_started = Instant::now();
    let global_step = first_step + result.steps.len() as u64;
    let checkpoint_info = match &lora {
        None => {
            let sha256 = checkpoint::save(&model, &weights_dir, &out, global_step)?;
            serde_json::json!({
                "dir": out.display().to_string(),
                "model_safetensors_sha256": sha256,
                "global_step": global_step,
            })
        }
        Some(l) => {
            let base = std::fs::canonicalize(&model_dir).unwrap_or_else(|_| model_dir.clone());
            let sha256 = nn::lora::save(&model, l, &base.display().to_string(), &out)?;
            checkpoint::copy_model_files(&model_dir, &out)?;
            checkpoint::write_trainer_state(&out, global_step)?;
            serde_json::json!({
                "dir": out.display().to_string(),
                "adapter_model_safetensors_sha256": sha256,
                "global_step": global_step,
            })
        }
    };
    let state = match saved_state {
        Some(state) => state,
        None => optimizer
            .save_state(&out, None)?
            .with_context(|| format!("save the optimizer state in {}", out.display()))?,
    };
    let mut checkpoint_info = checkpoint_info;
    checkpoint_info["optimizer_sha256"] = serde_json::json!(state.tensors_sha256);
    checkpoint_info["optimizer_step"] = serde_json::json!(state.step);
    let checkpoint_seconds = ckpt_started.elapsed().as_secs_f64();
    nn::manifest::write_chart(
        &out.join("chart.svg"),
        &format!("tapline-trainer run {}", loaded.config.run),
        &result,
    )
    .with_context(|| format!("write {}", out.join("chart.svg").display()))?;

    let wall = started.elapsed().as_secs_f64();
    let tracking = tracker.as_mut().map(|t| {
        track_summary(
            t,
            &loaded.prepared,
            &result,
            global_step,
            wall,
            memory.get("peak_measured_bytes"),
        );
        serde_json::json!({
            "dir": t.dir().display().to_string(),
            "backends": t.backends(),
            "failures": t.failures(),
            "mlflow": t.mlflow_run().map(|(uri, run_id)| serde_json::json!({
                "uri": uri,
                "run_id": run_id,
            })),
        })
    });
    let manifest = nn::manifest::RunManifest {
        format: nn::manifest::FORMAT,
        tapline_version: env!("CARGO_PKG_VERSION"),
        git_commit: nn::manifest::GIT_COMMIT,
        command: std::env::args().collect(),
        started_unix_secs,
        config: serde_json::to_value(&loaded.config)?,
        seed: options.seed,
        mode: if lora.is_some() { "lora" } else { "full" },
        resumed,
        model: serde_json::json!({
            "dir": weights_dir.display().to_string(),
            "arch": model.config.arch.name(),
            "parameters": model.config.parameters(),
            "trainable_parameters": trainable,
            "layers": model.config.num_hidden_layers,
            "global_step_before": first_step,
            "adapter_from": adapter_from.as_ref().map(|d| d.display().to_string()),
        }),
        store: loaded.location.display.clone(),
        run: loaded.run.clone(),
        input_segments: loaded
            .segments()
            .into_iter()
            .map(|key| nn::manifest::InputSegment {
                sha256: loaded.read.checksums.get(&key).cloned().unwrap_or_default(),
                key,
            })
            .collect(),
        report: serde_json::to_value(&loaded.prepared.report)?,
        importance_by_lag: serde_json::to_value(&result.importance_by_lag)?,
        loss_tokens_trained: result.loss_tokens,
        tokens_trained: result.tokens,
        steps: result.steps.clone(),
        compute: nn::manifest::Compute {
            device: args.device.clone(),
            device_name: nn::manifest::device_name(device),
            dtype: format!("{kind:?}"),
            wall_clock_seconds: wall,
            gpu_seconds: if device.is_cuda() { wall } else { 0.0 },
            cpu_seconds: nn::manifest::cpu_seconds(),
            peak_rss_bytes: nn::manifest::peak_rss_bytes(),
            gpu_peak_memory_bytes_sampled,
            optimizer_state_bytes: optimizer.as_dyn().state_bytes(),
            phases: nn::manifest::Phases {
                ingest: loaded.ingest_seconds,
                prepare: loaded.prepare_seconds,
                load_model,
                old_logprobs: result.old_logprob_seconds,
                update: result.seconds - result.old_logprob_seconds,
                checkpoint: checkpoint_seconds,
            },
        },
        checkpoint: checkpoint_info,
        distributed,
        memory,
        tracking,
    };
    if let Some(run) = &loaded.run {
        let commit = CursorCommit {
            run: run.clone(),
            before: loaded.read.cursor.clone(),
            after: loaded.next_cursor(),
        };
        let path = out.join(CURSOR_COMMIT_FILE);
        std::fs::write(&path, serde_json::to_vec_pretty(&commit)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    // The report page, with a sample of the episodes as the batches hold them; before
    // the manifest, which is written last.
    let samples = tapline_trainer::html::Samples::take(
        &loaded.prepared.mini_batches,
        |ids| loaded.model.decode(ids),
        |at| result.old_logprobs.get(&at).map(Vec::as_slice),
    );
    let samples_path = out.join(tapline_trainer::html::SAMPLES_FILE);
    std::fs::write(&samples_path, serde_json::to_vec(&samples)?)
        .with_context(|| format!("write {}", samples_path.display()))?;
    let page = tapline_trainer::html::render(&serde_json::to_value(&manifest)?, &samples);
    std::fs::write(out.join("report.html"), page)
        .with_context(|| format!("write {}/report.html", out.display()))?;
    manifest
        .write(&out)
        .with_context(|| format!("write {}/manifest.json", out.display()))?;
    // The commit: of two trainers that read the same cursor, one gets here first and the
    // other's directory loses its manifest (a stop right before this is finished by
    // `finish_cursor_commit` on restart).
    loaded.commit(&out)?;
    if loaded.run.is_some() {
        committed(&out)?;
    }
    if let Some(t) = tracker.as_mut() {
        t.artifact(&out.join("manifest.json"));
        t.artifact(&out.join("report.html"));
        t.artifact(&out.join("chart.svg"));
        t.finish(tapline_trainer::track::Status::Finished, None);
    }
    println!(
        "train: {} step(s), {} loss tokens of {} tokens, {:.1}s ({:.1}s updating) -> {}",
        result.steps.len(),
        result.loss_tokens,
        result.tokens,
        wall,
        result.seconds,
        out.display()
    );
    let track = tracker
        .as_ref()
        .map(|t| tapline_trainer::track::TrackedRun {
            options: loaded.config.track.clone(),
            dir: t.dir().to_owned(),
            step: global_step,
            mlflow: t.mlflow_run().and_then(|(uri, id)| Some((uri, id?))),
        });
    Ok(Some(Finished {
        out,
        location: loaded.location.clone(),
        publish: loaded.config.publish.clone(),
        track,
    }))
}

/// The run-level figures at the run's last global step: rewards and advantages of its
/// batches, policy lag, importance ratios by lag, step time, memory.
fn track_summary(
    t: &mut tapline_trainer::track::Tracker,
    prepared: &tapline_trainer::Prepared,
    result: &nn::train::TrainResult,
    global_step: u64,
    wall_clock_seconds: f64,
    peak_memory_bytes: Option<&serde_json::Value>,
) {
    let (mut summary, advantages) = tapline_trainer::track::batch_summary(&prepared.mini_batches);
    let steps = result.steps.len().max(1) as f64;
    summary["reward"]["components"] =
        serde_json::to_value(&prepared.report.advantages.reward_components).unwrap_or_default();
    let policy = &prepared.report.policy;
    summary["policy"] = serde_json::json!({
        "latest_version": policy.latest_version,
        "max_lag": policy.max_lag,
        "stale_calls": policy.stale_calls,
        "calls_by_lag": policy.calls_by_lag,
    });
    summary["importance_by_lag"] =
        serde_json::to_value(&result.importance_by_lag).unwrap_or_default();
    summary["step_seconds_mean"] =
        serde_json::json!(result.steps.iter().map(|s| s.seconds).sum::<f64>() / steps);
    summary["wall_clock_seconds"] = serde_json::json!(wall_clock_seconds);
    summary["peak_memory_bytes"] = peak_memory_bytes.cloned().unwrap_or_default();
    summary["tokens"] = serde_json::json!(result.tokens);
    summary["loss_tokens"] = serde_json::json!(result.loss_tokens);
    // π_trainer_old / π_inference of each loss token with a recorded engine log-prob.
    let mut ratios = Vec::new();
    for (&(k, m, i), old) in &result.old_logprobs {
        let Some(s) = prepared
            .mini_batches
            .get(k)
            .and_then(|mb| mb.micro_batches.get(m))
            .and_then(|micro| micro.sequences.get(i))
        else {
            continue;
        };
        let q = &s.sequence;
        let engine = (1..q.len())
            .filter(|&j| q.loss_mask[j] != 0)
            .map(|j| q.logprobs[j]);
        for (old, engine) in old.iter().zip(engine) {
            if let Some(e) = engine {
                ratios.push((f64::from(*old) - e).exp());
            }
        }
    }
    t.summary(
        global_step,
        &summary,
        &[
            ("run/advantages", advantages),
            ("run/importance_ratios", ratios),
        ],
    );
}

pub(super) fn merge_lora(args: &MergeArgs) -> anyhow::Result<()> {
    let config = nn::TransformerConfig::load(&args.model)?;
    let dtype = args
        .dtype
        .clone()
        .or(config.dtype.clone())
        .unwrap_or_else(|| "float32".into());
    let kind = match dtype.as_str() {
        "float32" | "fp32" => tch::Kind::Float,
        "bfloat16" | "bf16" => tch::Kind::BFloat16,
        "float16" | "fp16" => tch::Kind::Half,
        other => anyhow::bail!("dtype {other:?}: expected float32, bfloat16 or float16"),
    };
    checkpoint::prepare_dir(&args.out)?;
    let (mut model, lora) =
        nn::lora::load_with_adapter(&args.model, &args.adapter, tch::Device::Cpu, kind)?;
    model.merge_lora();
    let global_step = checkpoint::global_step(&args.adapter);
    let sha256 = checkpoint::save(&model, &args.model, &args.out, global_step)?;
    let adapter_bytes = std::fs::read(args.adapter.join(nn::lora::ADAPTER_WEIGHTS))?;
    let manifest = serde_json::json!({
        "format": "tapline.merge_lora.v1",
        "tapline_version": env!("CARGO_PKG_VERSION"),
        "git_commit": nn::manifest::GIT_COMMIT,
        "base_model": args.model.display().to_string(),
        "adapter": args.adapter.display().to_string(),
        "adapter_model_safetensors_sha256": ingest::sha256_hex(&adapter_bytes),
        "lora": lora,
        "dtype": format!("{kind:?}"),
        "model_safetensors_sha256": sha256,
    });
    let tmp = args.out.join("manifest.json.partial");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&manifest)?)?;
    std::fs::rename(&tmp, args.out.join("manifest.json"))?;
    println!(
        "merge-lora: {} + {} (r {}, alpha {}) -> {} ({kind:?})",
        args.model.display(),
        args.adapter.display(),
        lora.rank,
        lora.alpha,
        args.out.display()
    );
    Ok(())
}

pub(super) fn score(args: &ScoreArgs) -> anyhow::Result<()> {
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("read the ids from stdin")?;
    let body: Value = serde_json::from_str(&input)
        .context("stdin is not JSON (expected {\"ids\": [1, 2, ...]})")?;
    let ids: Vec<u32> = body
        .get("ids")
        .and_then(Value::as_array)
        .context("stdin has no \"ids\" array (expected {\"ids\": [1, 2, ...]})")?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| format!("ids[{i}] = {v} is not a token id"))
        })
        .collect::<anyhow::Result<_>>()?;
    let model = match &args.adapter {
        Some(adapter) => {
            nn::lora::load_with_adapter(&args.model, adapter, device, kind)
                .with_context(|| format!("apply the adapter {}", adapter.display()))?
                .0
        }
        None => Transformer::load(&args.model, device, kind)
            .with_context(|| format!("load the model from {}", args.model.display()))?,
    };
    let logprobs = model
        .sequence_logprobs(&ids, 1024)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{}", serde_json::json!({ "logprobs": logprobs }));
    Ok(())
}

/// `bench-update --seq-lens`: one child process per length (peak memory is per
/// process), then a table of the measured and estimated peaks.
fn bench_memory_table(args: &BenchArgs) -> anyhow::Result<()> {
    use nn::memory::{MemoryModel, Shape, Size};
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    let config = nn::bench::preset(&args.preset).with_context(|| {
        format!(
            "unknown preset {:?} (known: {})",
            args.preset,
            nn::bench::PRESETS.join(", ")
        )
    })?;
    let lora = args.lora.then(|| nn::lora::LoraOptions {
        rank: args.lora_rank,
        alpha: 2.0 * args.lora_rank as f64,
        ..Default::default()
    });
    let elem = if kind == tch::Kind::Float { 4 } else { 2 };
    let estimate = MemoryModel::new(&config, lora.as_ref(), elem, 1024);
    let available = match device {
        tch::Device::Cuda(i) => nn::manifest::gpu_memory_total(i),
        _ => nn::memory::available_memory().map(|(can_have, _)| can_have),
    };
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!(
        "bench-update: peak memory of {} {} ({kind:?}){}, one sequence per micro-batch; measured: {}",
        args.preset,
        if args.lora { "LoRA" } else { "full" },
        if args.recompute { ", recompute" } else { "" },
        if device.is_cuda() {
            "GPU memory used, sampled by nvidia-smi"
        } else {
            "peak RSS"
        }
    );
    println!(
        "| tokens | measured peak | estimated peak | estimate / measured | MiB per token, measured | MiB per token, estimated |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for &len in &args.seq_lens {
        anyhow::ensure!(len >= 2, "--seq-lens: every length must be at least 2");
        let shape = Shape {
            sequences: 1,
            longest: len as u64,
            loss_tokens: (len - len / 2) as u64,
        };
        let predicted = estimate.static_bytes() + estimate.micro_batch_bytes(shape, args.recompute);
        if let Some(avail) = available.filter(|a| predicted as f64 > *a as f64 * 0.9) {
            println!(
                "| {len} | not run | {} | | | {:.3} (over 90% of the {} available) |",
                Size(predicted),
                mib(estimate.per_token(args.recompute) as f64),
                Size(avail)
            );
            continue;
        }
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args([
            "bench-update",
            "--preset",
            &args.preset,
            "--device",
            &args.device,
        ])
        .args(["--dtype", &args.dtype, "--sequences", "1"])
        .args(["--seq-len", &len.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--lora-rank", &args.lora_rank.to_string()]);
        if args.lora {
            cmd.arg("--lora");
        }
        if args.recompute {
            cmd.arg("--recompute");
        }
        let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let result: Option<Value> = text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok());
        let Some(r) = result.filter(|_| out.status.success()) else {
            println!(
                "| {len} | failed ({}) | {} | | | |",
                out.status,
                Size(predicted)
            );
            continue;
        };
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {len} | {} | {} | {:.2} | {:.3} | {:.3} |",
            Size(f("peak_bytes") as u64),
            Size(f("estimated_peak_bytes") as u64),
            f("estimated_peak_bytes") / f("peak_bytes"),
            mib(f("bytes_per_token")),
            mib(f("estimated_bytes_per_token")),
        );
    }
    Ok(())
}

pub(super) fn bench_update(args: &BenchArgs) -> anyhow::Result<()> {
    if !args.seq_lens.is_empty() {
        return bench_memory_table(args);
    }
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    anyhow::ensure!(args.seq_len >= 2, "--seq-len must be at least 2");
    anyhow::ensure!(
        args.sequences >= 1 && args.steps >= 1,
        "--sequences and --steps must be at least 1"
    );
    let launch = tapline_c10d::Launch::from_env()?.filter(|l| l.world_size > 1);
    let device = match (&launch, args.device.as_str()) {
        (Some(l), "cuda") => nn::parse_device(&format!("cuda:{}", l.local_rank))?,
        _ => device,
    };
    let group = match &launch {
        Some(l) => Some(tapline_c10d::Group::connect(
            l,
            if device.is_cuda() {
                tapline_c10d::Backend::Nccl
            } else {
                tapline_c10d::Backend::Gloo
            },
            std::time::Duration::from_secs(600),
        )?),
        None => None,
    };
    let rank = group.as_ref().map_or(0, |g| g.rank());
    let options = nn::train::TrainOptions {
        shard_optimizer: !args.replicate_optimizer,
        recompute: args.recompute,
        lora: args.lora.then(|| nn::lora::LoraOptions {
            rank: args.lora_rank,
            alpha: 2.0 * args.lora_rank as f64,
            ..Default::default()
        }),
        ..Default::default()
    };
    if rank != 0 {
        // Rank 0 reports; the others only take part.
        nn::bench::run(
            &args.preset,
            device,
            kind,
            args.sequences,
            args.seq_len,
            args.warmup,
            args.steps,
            &options,
            None,
            group.as_ref(),
            |_, _| {},
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        return Ok(());
    }
    println!(
        "bench-update: {} {} on {} ({kind:?}), {} x {} tokens per step, {} warmup + {} measured steps{}",
        args.preset,
        if args.lora {
            format!("LoRA r {}", args.lora_rank)
        } else {
            "full".into()
        },
        nn::manifest::device_name(device),
        args.sequences,
        args.seq_len,
        args.warmup,
        args.steps,
        if args.recompute { ", recompute" } else { "" }
    );
    let result = nn::bench::run(
        &args.preset,
        device,
        kind,
        args.sequences,
        args.seq_len,
        args.warmup,
        args.steps,
        &options,
        args.peak_tflops.map(|t| t * 1e12),
        group.as_ref(),
        |i, secs| {
            let tag = if i < args.warmup { "warmup" } else { "step" };
            println!(
                "  {tag} {i}: {secs:.2}s ({:.0} tok/s)",
                (args.sequences * args.seq_len) as f64 / secs
            );
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    println!(
        "bench-update: {:.0}M parameters ({:.2}M trainable), median {:.0} tokens/s, {:.1} TFLOP/s model FLOPs, MFU {}, peak RSS {:.2} GiB, {:.1} bytes/parameter",
        result.parameters as f64 / 1e6,
        result.trainable_parameters as f64 / 1e6,
        result.tokens_per_second,
        result.model_flops / 1e12,
        result.mfu.map_or(
            "n/a (unknown peak; pass --peak-tflops)".into(),
            |m| format!("{:.1}%", m * 100.0)
        ),
        result.peak_rss_bytes as f64 / (1u64 << 30) as f64,
        result.bytes_per_parameter,
    );
    println!(
        "bench-update: peak memory {:.2} GiB ({}), estimated {:.2} GiB before the first step: {:.3} MiB per token measured, {:.3} estimated (static {:.2} GiB)",
        result.peak_bytes as f64 / (1u64 << 30) as f64,
        if result.gpu_peak_memory_bytes_sampled.is_some() {
            "GPU memory used, sampled"
        } else {
            "peak RSS"
        },
        result.estimated_peak_bytes as f64 / (1u64 << 30) as f64,
        result.bytes_per_token / (1u64 << 20) as f64,
        result.estimated_bytes_per_token / (1u64 << 20) as f64,
        result.static_bytes as f64 / (1u64 << 30) as f64,
    );
    if let (Some(bytes), Some(secs)) = (result.comm_bytes_per_step, result.comm_seconds_per_step) {
        println!(
            "bench-update: {} ranks ({}, optimizer {}), rank 0 sent {:.1} MB per step into collectives in {:.3}s (median), optimizer state {:.1} MB per rank",
            result.world_size,
            result.backend.as_deref().unwrap_or(""),
            if options.shard_optimizer {
                "sharded"
            } else {
                "replicated"
            },
            bytes as f64 / 1e6,
            secs,
            result.optimizer_state_bytes as f64 / 1e6,
        );
    }
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}
