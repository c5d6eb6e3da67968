//! `train`: one run (read the store, prepare, load, update, checkpoint, manifest, report,
//! publish); `--follow` repeats it (`follow.rs`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use serde_json::Value;
use tapline_trainer::ingest;
use tapline_trainer::nn::{self, Transformer, checkpoint};

use crate::cli::*;

use super::{STOP, stop_requested};

pub(crate) fn train(args: TrainArgs) -> anyhow::Result<()> {
    let launch = tapline_c10d::Launch::from_env()?.filter(|l| l.world_size > 1);
    if args.follow {
        anyhow::ensure!(
            launch.is_none(),
            "--follow runs in one process: run distributed training as one job per batch (a Kubernetes Job or CronJob starting torchrun, see examples/deploy/README.md), or unset WORLD_SIZE"
        );
        return super::follow::follow(args);
    }
    if let Some(done) = train_once(&args, None)? {
        done.publish()?;
    }
    Ok(())
}

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

/// A finished run (manifest written, cursor advanced) and where it is published.
pub(super) struct Finished {
    pub(super) out: PathBuf,
    pub(super) location: tapline_proto::store::StoreLocation,
    pub(super) publish: Option<tapline_trainer::publish::PublishConfig>,
    /// Where the run's metrics went: a publish adds the version there (`None`: the run
    /// tracked nothing, or a restarted follower could not read its manifest's tracking).
    pub(super) track: Option<tapline_trainer::track::TrackedRun>,
}

impl Finished {
    /// Publishes the run per its `[publish]` section (nothing without one).
    pub(super) fn publish(&self) -> anyhow::Result<()> {
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

/// Written into a run directory once its adapter was published (`train --follow`
/// publishes a run that lacks it when it starts again).
pub(super) const PUBLISHED_FILE: &str = "published.json";

/// What a run committed to its cursor: written before the manifest, so that a stop
/// between the manifest and the cursor write can be finished on restart.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct CursorCommit {
    pub(super) run: String,
    pub(super) before: ingest::Cursor,
    pub(super) after: ingest::Cursor,
}

/// Renames the cursor commit of `dir` to say it is in the store.
pub(super) fn committed(dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::rename(
        dir.join(CURSOR_COMMIT_FILE),
        dir.join(CURSOR_COMMITTED_FILE),
    )
    .with_context(|| format!("rename {}/{CURSOR_COMMIT_FILE}", dir.display()))
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
    key: &str,
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
    // A key per check: a second check under the first one's key would read the other
    // ranks' earlier digests.
    let all = group.exchange(key, digest.as_bytes())?;
    if let Some(r) = all.iter().position(|d| d != digest.as_bytes()) {
        anyhow::bail!(
            "rank {r} prepared other mini-batches than rank {} (digest {} vs {digest}): the ranks must run the same trainer and configuration on the same store",
            group.rank(),
            String::from_utf8_lossy(&all[r])
        );
    }
    Ok(())
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
    estimate.packed = options.packing;
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
pub(super) fn train_once(
    args: &TrainArgs,
    min_episodes: Option<usize>,
) -> anyhow::Result<Option<Finished>> {
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
        check_same_batches(g, "batches/prepared", &loaded.prepared.mini_batches)?;
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
        check_same_batches(g, "batches/fitted", &loaded.prepared.mini_batches)?;
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

    // Trainer against engine on the loss tokens with an engine log-prob (rank 0 holds
    // every rank's).
    let gaps = tapline_trainer::fidelity::gaps(&loaded.prepared.mini_batches, &result.old_logprobs);
    let fidelity = tapline_trainer::fidelity::measure(&gaps, options.tis_cap);
    if let Some(w) = fidelity.as_ref().and_then(|f| f.warning.as_ref()) {
        eprintln!("train: warning: {w}");
    }
    let wall = started.elapsed().as_secs_f64();
    let tracking = tracker.as_mut().map(|t| {
        track_summary(
            t,
            &loaded.prepared,
            &result,
            fidelity.as_ref(),
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
        packing: serde_json::json!({
            "packed": options.packing,
            "tokens_computed": result.computed_tokens,
            "padding_tokens": result.computed_tokens.saturating_sub(result.tokens),
        }),
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
        fidelity,
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
    fidelity: Option<&tapline_trainer::fidelity::Fidelity>,
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
    summary["fidelity"] = serde_json::to_value(fidelity).unwrap_or_default();
    // π_trainer_old / π_inference of each loss token with a recorded engine log-prob.
    let ratios = tapline_trainer::fidelity::gaps(&prepared.mini_batches, &result.old_logprobs)
        .iter()
        .map(|g| g.exp())
        .collect();
    t.summary(
        global_step,
        &summary,
        &[
            ("run/advantages", advantages),
            ("run/importance_ratios", ratios),
        ],
    );
}
