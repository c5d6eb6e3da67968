//! Mini-batches from the pipeline → optimizer steps on a [`Transformer`].
//!
//! One mini-batch is one optimizer step; its micro-batches each run forward and backward
//! and accumulate gradients (the pipeline's weights already normalize the whole
//! mini-batch, so nothing is divided here). For each micro-batch:
//!
//! 1. the trunk runs over the ids laid out by [`super::packing`]: packed into one row
//!    (`[1, Σ len]`, positions restarting at each sequence, attention kept inside each,
//!    [`super::attention`]) or right-padded (`[b, t]`; causal attention keeps padding
//!    out of every real position), with a graph, or without one when `recompute` is on
//!    for the run or for this micro-batch (the memory fit, `nn::memory`; then only each
//!    layer's input is kept);
//! 2. the hidden states of the positions that predict a loss token are gathered;
//! 3. with a token-level loss (PPO / GRPO / DAPO), the head (final norm + `lm_head` +
//!    log-softmax) runs over them `logprob_chunk` rows at a time with a graph, and each
//!    chunk's loss ([`super::loss`]: each token's term needs only its own log-prob) is
//!    back-propagated at once, so at most one chunk's `[rows, vocab]` fp32 logits exist;
//! 4. with GSPO (a sequence's tokens share its ratio) the head runs first without a
//!    graph for every log-prob and the entropy, the loss is built on those as a leaf and
//!    its backward gives `∂L/∂lp` per token, then the head runs again chunk by chunk with
//!    a graph and `Σ lp·∂L/∂lp` is back-propagated per chunk;
//! 5. the gradient reaching the trunk's output is back-propagated through the trunk, or,
//!    with `recompute`, layer by layer from the top, each layer recomputed from its saved
//!    input.
//!
//! The old log-probs of the surrogate are those of the weights at the start of the run:
//! the first mini-batch takes them from its own forward pass (nothing has changed yet),
//! later ones from a pass without a graph before the first update.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::dist::{self, Comm, Optimizer};
use super::loss::{self, LossStats, TokenInputs};
use super::model::Transformer;
use super::optim::{AdamW, learning_rate};
use super::options::PolicyLoss;
use super::packing::{Layout, computed, pack};
use crate::batch::{MicroBatch, MiniBatch};
use tapline_c10d::{Group, ReduceOp};

pub use super::options::TrainOptions;

impl TrainOptions {
    /// A new optimizer for the model's trainable parameters (the adapters under LoRA),
    /// with gradients turned on for them.
    pub fn optimizer(&self, model: &mut Transformer) -> AdamW {
        model.set_requires_grad(true);
        AdamW::new(
            model.trainable_parameters(),
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
        )
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// Global step (continues the step count of the checkpoint trained from).
    pub step: u64,
    /// Epoch of this run.
    pub epoch: u32,
    /// Index of the mini-batch.
    pub mini_batch: usize,
    /// Learning rate used.
    pub lr: f64,
    /// The mini-batch loss `Σ w·ℓ`.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the step was skipped (non-finite gradient norm).
    pub skipped: bool,
    /// Fraction of loss tokens where the clip was active.
    pub clip_fraction: f64,
    /// Fraction of loss tokens where the dual clip was active.
    pub dual_clip_fraction: f64,
    /// Mean, min and max of the importance ratio.
    pub ratio_mean: f64,
    /// Smallest ratio.
    pub ratio_min: f64,
    /// Largest ratio.
    pub ratio_max: f64,
    /// Mean k3 estimate of KL(start ‖ current) over loss tokens.
    pub kl: f64,
    /// Mean entropy of the policy at loss tokens (nats).
    pub entropy: f64,
    /// Mean of `lp_train_old − lp_inference` over tokens with inference log-probs
    /// (`null` when none has one).
    pub inference_logprob_gap: Option<f64>,
    /// Mean of `|lp_train_old − lp_inference|` over those tokens.
    pub inference_logprob_abs_gap: Option<f64>,
    /// Fraction of those tokens whose importance weight hit the cap.
    pub tis_capped_fraction: Option<f64>,
    /// Loss tokens.
    pub loss_tokens: u64,
    /// All tokens run through the model (prompt and completion).
    pub tokens: u64,
    /// Tokens the model computed, padding included (`tokens` when packed, up to the
    /// padding of an empty micro-batch).
    pub computed_tokens: u64,
    /// Sequences.
    pub sequences: u64,
    /// Episodes.
    pub episodes: u64,
    /// Mean reward of the mini-batch's episodes.
    pub reward_mean: f64,
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// `tokens / seconds`.
    pub tokens_per_second: f64,
    /// Distributed runs: what this rank sent into collectives during the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<Comm>,
}

impl StepMetrics {
    /// One readable line: `index` of `total` steps in this run.
    pub fn line(&self, index: usize, total: usize) -> String {
        format!(
            "step {index}/{total} (global {}) loss {:+.4} grad_norm {:.3}{} clip {:.3} ratio {:.3} [{:.3}, {:.3}] kl {:.2e} entropy {:.3} reward {:.3} lr {:.2e} tokens {} ({:.0} tok/s)",
            self.step,
            self.loss,
            self.grad_norm,
            if self.skipped { " (skipped)" } else { "" },
            self.clip_fraction,
            self.ratio_mean,
            self.ratio_min,
            self.ratio_max,
            self.kl,
            self.entropy,
            self.reward_mean,
            self.lr,
            self.tokens,
            self.tokens_per_second,
        )
    }
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A sequence holds an id outside the vocabulary.
    #[error("sequence of episode {episode}: {message}")]
    BadIds {
        /// Its episode.
        episode: String,
        /// What is wrong.
        message: String,
    },
    /// libtorch refused an operation (out of memory, ...).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A collective failed: another rank died or the timeout passed.
    #[error(transparent)]
    Distributed(#[from] tapline_c10d::Error),
}

/// One micro-batch as tensors on the model's device.
#[derive(Debug)]
pub struct Gathered {
    /// The ids `[rows, t]`: right-padded `[b, t]`, or packed `[1, Σ len]`.
    pub ids: Tensor,
    /// How the rows hold the sequences.
    pub layout: Layout,
    /// Tokens the model computes (`rows · t`, padding included).
    pub computed_tokens: u64,
    /// Row of `[rows·t]` whose hidden state predicts each loss token `[n]`.
    pub rows: Tensor,
    /// The loss tokens `[n]`.
    pub targets: Tensor,
    /// Advantages `[n]`.
    pub advantages: Tensor,
    /// Weights `[n]`.
    pub weights: Tensor,
    /// Inference log-probs `[n]` (NaN where absent).
    pub inference: Tensor,
    /// Policy version of the call that sampled each token `[n]` (−1 when it has none).
    pub version: Tensor,
    /// Sequence of each token `[n]`.
    pub sequence: Tensor,
    /// Sequences.
    pub sequences: i64,
    /// Loss tokens.
    pub n: i64,
    /// All tokens (unpadded).
    pub tokens: u64,
    /// Run with recompute (the micro-batch's own flag, see `nn::memory`).
    pub recompute: bool,
}

/// Builds the tensors of a micro-batch, its sequences `packed` into one row or padded
/// ([`super::packing`]). Position `j` (≥ 1) of a sequence, with loss mask 1, is
/// predicted by the hidden state at flat index `start + j − 1`.
pub fn gather(mb: &MicroBatch, device: Device, packed: bool) -> Gathered {
    let b = mb.sequences.len();
    let packing = pack(
        mb.sequences.iter().map(|s| s.sequence.token_ids.as_slice()),
        packed,
    );
    let (mut rows, mut targets, mut adv, mut w, mut inf, mut seq) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut version = vec![];
    let mut tokens = 0u64;
    for (i, s) in mb.sequences.iter().enumerate() {
        let q = &s.sequence;
        tokens += q.len() as u64;
        let version_at = |j: usize| {
            q.spans
                .iter()
                .find(|c| (c.start..c.end).contains(&j))
                .and_then(|c| c.policy_version.parse::<i64>().ok())
                .unwrap_or(-1)
        };
        let start = packing.starts[i];
        for j in 1..q.len() {
            if q.loss_mask[j] == 0 {
                continue;
            }
            rows.push((start + j - 1) as i64);
            targets.push(i64::from(q.token_ids[j]));
            adv.push(s.advantages[j] as f32);
            w.push(s.weights[j] as f32);
            inf.push(q.logprobs[j].map_or(f32::NAN, |x| x as f32));
            seq.push(i as i64);
            version.push(version_at(j));
        }
    }
    let f = |v: &[f32]| Tensor::from_slice(v).to_device(device);
    let l = |v: &[i64]| Tensor::from_slice(v).to_device(device);
    Gathered {
        ids: l(&packing.ids).view([packing.rows as i64, packing.columns as i64]),
        computed_tokens: packing.computed_tokens(),
        layout: packing.layout,
        n: rows.len() as i64,
        rows: l(&rows),
        targets: l(&targets),
        advantages: f(&adv),
        weights: f(&w),
        inference: f(&inf),
        version: l(&version),
        sequence: l(&seq),
        sequences: b as i64,
        tokens,
        recompute: mb.recompute,
    }
}

/// Log-probs of a micro-batch's loss tokens under the current weights, no graph.
pub fn micro_logprobs(model: &Transformer, g: &Gathered, chunk: i64) -> Tensor {
    tch::no_grad(|| {
        let d = model.config.hidden_size;
        let top = model.trunk_in(&g.ids, &g.layout).reshape([-1, d]);
        let h = top.index_select(0, &g.rows);
        model.head_logprobs(&h, &g.targets, chunk, false).0
    })
}

/// Forward and backward of one micro-batch (gradients accumulate in the parameters).
/// `old` are the old log-probs, or `None` to take them from this forward pass.
/// Returns the loss statistics and the summed entropy.
pub fn micro_step(
    model: &Transformer,
    g: &Gathered,
    old: Option<&Tensor>,
    options: &TrainOptions,
) -> (LossStats, f64) {
    micro_step_with(model, g, old, options, |_| {})
}

/// [`micro_step`], handing the old log-probs it used (`[n]`, no graph) to `on_old`.
pub fn micro_step_with(
    model: &Transformer,
    g: &Gathered,
    old: Option<&Tensor>,
    options: &TrainOptions,
    on_old: impl FnOnce(&Tensor),
) -> (LossStats, f64) {
    if g.n == 0 {
        return (LossStats::default(), 0.0);
    }
    let d = model.config.hidden_size;
    let layers = model.num_layers();
    let recompute = options.recompute || g.recompute;
    let positions = model.positions(&g.layout, g.ids.size()[1]);
    // 1. trunk
    let mut saved = Vec::new();
    let top = if recompute {
        tch::no_grad(|| {
            let mut x = model.embed(&g.ids);
            for i in 0..layers {
                let next = model.layers_forward(&x, &positions, i..i + 1);
                saved.push(x);
                x = next;
            }
            x
        })
    } else {
        model.layers_forward(&model.embed(&g.ids), &positions, 0..layers)
    };
    let top_leaf = top.detach().set_requires_grad(true);
    let flat = top_leaf.reshape([-1, d]);
    let (stats, entropy_sum) = if options.policy_loss == PolicyLoss::Ppo {
        head_one_pass(model, g, &flat, old, options, on_old)
    } else {
        head_two_passes(model, g, &flat, old, options, on_old)
    };
    // 5. trunk
    let mut grad = top_leaf.grad();
    if recompute {
        for i in (0..layers).rev() {
            let input = saved[i].detach().set_requires_grad(true);
            let out = model.layers_forward(&input, &positions, i..i + 1);
            (out * &grad).sum(Kind::Float).backward();
            grad = input.grad();
        }
        let embedded = model.embed(&g.ids);
        if embedded.requires_grad() {
            (embedded * &grad).sum(Kind::Float).backward();
        }
    } else {
        (top * &grad).sum(Kind::Float).backward();
    }
    (stats, entropy_sum)
}

/// Phases 2–4 for a loss that couples tokens (GSPO's sequence ratio): the head without a
/// graph for every loss token's log-prob, the loss on those as a leaf, then the head
/// again chunk by chunk with a graph, back-propagating `Σ lp·∂L/∂lp`. Returns the loss
/// statistics and the summed entropy; the gradient reaching the trunk is in `flat`'s
/// leaf.
fn head_two_passes(
    model: &Transformer,
    g: &Gathered,
    flat: &Tensor,
    old: Option<&Tensor>,
    options: &TrainOptions,
    on_old: impl FnOnce(&Tensor),
) -> (LossStats, f64) {
    let chunk = options.logprob_chunk as i64;
    // 2. head without a graph
    let (lp, entropy) = tch::no_grad(|| {
        let h = flat.index_select(0, &g.rows);
        model.head_logprobs(&h, &g.targets, chunk, true)
    });
    let entropy_sum = entropy.map_or(0.0, |e| e.sum(Kind::Float).double_value(&[]));
    // 3. loss on a leaf
    let lp_leaf = lp.detach().set_requires_grad(true);
    let old = old.map_or_else(|| lp.detach(), Tensor::shallow_clone);
    on_old(&old);
    let inputs = TokenInputs {
        old: &old,
        inference: &g.inference,
        advantages: &g.advantages,
        weights: &g.weights,
        sequence: &g.sequence,
        sequences: g.sequences,
    };
    let (loss, stats) = loss::policy_loss(&lp_leaf, &inputs, &options.loss());
    loss.backward();
    let dlp = lp_leaf.grad();
    // 4. head with a graph, chunk by chunk
    let mut start = 0;
    while start < g.n {
        let len = chunk.min(g.n - start);
        let h = flat.index_select(0, &g.rows.narrow(0, start, len));
        let (lp_c, _) = model.head_logprobs(&h, &g.targets.narrow(0, start, len), len, false);
        (lp_c * dlp.narrow(0, start, len))
            .sum(Kind::Float)
            .backward();
        start += len;
    }
    (stats, entropy_sum)
}

/// Phases 2–4 for a token-level loss (PPO / GRPO / DAPO: each token's term depends on
/// its own log-prob only): one pass of the head, chunk by chunk with a graph, each
/// chunk's loss back-propagated at once, so the head runs forward once instead of twice
/// and at most one chunk's `[rows, vocab]` logits exist. The loss and its gradient are
/// those of [`head_two_passes`] (the sum over chunks of the same per-token terms).
fn head_one_pass(
    model: &Transformer,
    g: &Gathered,
    flat: &Tensor,
    old: Option<&Tensor>,
    options: &TrainOptions,
    on_old: impl FnOnce(&Tensor),
) -> (LossStats, f64) {
    let chunk = options.logprob_chunk as i64;
    let loss_options = options.loss();
    let mut stats = LossStats::default();
    let mut entropy_sum = 0.0;
    let mut olds = Vec::new();
    let mut start = 0;
    while start < g.n {
        let len = chunk.min(g.n - start);
        let h = flat.index_select(0, &g.rows.narrow(0, start, len));
        let logp = model.logits(&h).log_softmax(-1, Kind::Float);
        let targets = g.targets.narrow(0, start, len).unsqueeze(1);
        let lp = logp.gather(1, &targets, false).squeeze_dim(1);
        entropy_sum += tch::no_grad(|| {
            let l = logp.detach();
            -(l.exp() * &l).sum(Kind::Float).double_value(&[])
        });
        let old = old.map_or_else(|| lp.detach(), |o| o.narrow(0, start, len));
        let inputs = TokenInputs {
            old: &old,
            inference: &g.inference.narrow(0, start, len),
            advantages: &g.advantages.narrow(0, start, len),
            weights: &g.weights.narrow(0, start, len),
            sequence: &g.sequence.narrow(0, start, len),
            sequences: g.sequences,
        };
        let (loss, s) = loss::policy_loss(&lp, &inputs, &loss_options);
        loss.backward();
        stats.merge(&s);
        olds.push(old);
        start += len;
    }
    on_old(&Tensor::cat(&olds, 0));
    (stats, entropy_sum)
}

/// What [`train`] did.
#[derive(Debug, Clone, Serialize)]
pub struct TrainResult {
    /// One entry per optimizer step.
    pub steps: Vec<StepMetrics>,
    /// Loss tokens trained on (all epochs).
    pub loss_tokens: u64,
    /// Tokens run through the model in training steps (all epochs).
    pub tokens: u64,
    /// Tokens computed in those steps, padding included.
    pub computed_tokens: u64,
    /// Seconds computing the old log-probs.
    pub old_logprob_seconds: f64,
    /// Seconds of the whole update.
    pub seconds: f64,
    /// Mean importance ratio `π_trainer_old / π_inference` of the tokens with an
    /// inference log-prob, by the lag of the policy version that sampled them
    /// (`latest − version`, or `unversioned`); empty when no version was announced.
    /// Off-policy drift shows as a mean that moves away from 1 as the lag grows.
    pub importance_by_lag: std::collections::BTreeMap<String, LagRatio>,
    /// Distributed runs: what this rank sent into collectives in the whole update.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<Comm>,
    /// The trainer's old log-prob of each loss token (the policy before this run's
    /// first update, as the ratio's denominator uses it), by (mini-batch, micro-batch,
    /// sequence), in the order of the sequence's loss tokens; first epoch, at most
    /// [`MAX_RECORDED_LOGPROBS`] in all (distributed: every rank's micro-batches, each
    /// rank keeping its share of the cap, gathered on rank 0; other ranks keep none).
    /// For the run report and the importance-ratio histogram.
    #[serde(skip)]
    pub old_logprobs: std::collections::HashMap<(usize, usize, usize), Vec<f32>>,
}

/// Old log-probs [`TrainResult::old_logprobs`] keeps at most (16 MiB).
pub const MAX_RECORDED_LOGPROBS: usize = 4 << 20;

type OldLogprobs = std::collections::HashMap<(usize, usize, usize), Vec<f32>>;

/// Keeps the old log-probs `old` (`[n]`, the loss tokens of micro-batch `(k, m)` in
/// sequence order) per sequence, while fewer than `cap` are kept.
fn record_old_logprobs(
    into: &mut OldLogprobs,
    (k, m): (usize, usize),
    micro: &MicroBatch,
    old: &Tensor,
    cap: usize,
) {
    let kept: usize = into.values().map(Vec::len).sum();
    if kept + old.numel() > cap {
        return;
    }
    let Ok(values) = Vec::<f32>::try_from(&old.to_device(Device::Cpu).to_kind(Kind::Float)) else {
        return;
    };
    let mut rest = values.as_slice();
    for (i, s) in micro.sequences.iter().enumerate() {
        // The loss tokens `gather` takes: positions ≥ 1 with loss mask 1.
        let n = s
            .sequence
            .loss_mask
            .iter()
            .skip(1)
            .filter(|m| **m != 0)
            .count();
        let (mine, after) = rest.split_at(n.min(rest.len()));
        into.insert((k, m, i), mine.to_vec());
        rest = after;
    }
}

/// Importance ratios of the tokens at one lag.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LagRatio {
    /// Tokens with an inference log-prob.
    pub tokens: u64,
    /// Their mean ratio (first epoch only: later epochs see their own updates).
    pub mean_ratio: f64,
}

/// Adds one micro-batch's ratios to `by_lag`.
fn add_lag_ratios(
    by_lag: &mut std::collections::BTreeMap<String, LagRatio>,
    latest: u64,
    g: &Gathered,
    old: &Tensor,
) {
    let ratio = (old - &g.inference)
        .exp()
        .to_device(Device::Cpu)
        .to_kind(Kind::Double);
    let versions = g.version.to_device(Device::Cpu);
    let (Ok(ratio), Ok(versions)) = (
        Vec::<f64>::try_from(&ratio),
        Vec::<i64>::try_from(&versions),
    ) else {
        return;
    };
    for (r, v) in ratio.into_iter().zip(versions) {
        if !r.is_finite() {
            continue; // no inference log-prob
        }
        let key = u64::try_from(v).map_or_else(
            |_| "unversioned".to_owned(),
            |v| latest.saturating_sub(v).to_string(),
        );
        let e = by_lag.entry(key).or_default();
        // Running mean, so no sum grows without bound.
        e.tokens += 1;
        e.mean_ratio += (r - e.mean_ratio) / e.tokens as f64;
    }
}

/// Runs every mini-batch `epochs` times with `optimizer` (made by
/// [`TrainOptions::optimizer`], possibly resumed); `first_step` is the global step count
/// so far (for the schedule); `on_step` sees each step's metrics as they happen.
pub fn train(
    model: &mut Transformer,
    optimizer: &mut AdamW,
    mini_batches: &[MiniBatch],
    options: &TrainOptions,
    first_step: u64,
    on_step: impl FnMut(&StepMetrics),
) -> Result<TrainResult, TrainError> {
    train_with(
        model,
        optimizer,
        mini_batches,
        options,
        first_step,
        None,
        on_step,
    )
}

/// [`train`] with any [`Optimizer`], on one rank of `group` when given: this rank runs
/// its share of each mini-batch's micro-batches ([`dist::assign`]), the optimizer sums
/// the gradients across ranks, and the step metrics are those of the whole mini-batch
/// on every rank. Every rank must call it with the same mini-batches and options.
pub fn train_with(
    model: &mut Transformer,
    optimizer: &mut (impl Optimizer + ?Sized),
    mini_batches: &[MiniBatch],
    options: &TrainOptions,
    first_step: u64,
    group: Option<&Group>,
    mut on_step: impl FnMut(&StepMetrics),
) -> Result<TrainResult, TrainError> {
    let started = Instant::now();
    tch::manual_seed(options.seed as i64);
    for mb in mini_batches {
        for micro in &mb.micro_batches {
            for s in &micro.sequences {
                model
                    .check_ids(&s.sequence.token_ids)
                    .map_err(|message| TrainError::BadIds {
                        episode: s.episode_id.clone(),
                        message,
                    })?;
            }
        }
    }
    let group = group.filter(|g| g.size() > 1);
    // This rank's micro-batches of each mini-batch.
    let mine: Vec<Vec<bool>> = mini_batches
        .iter()
        .map(|mb| match group {
            None => vec![true; mb.micro_batches.len()],
            Some(g) => {
                let tokens: Vec<u64> = mb
                    .micro_batches
                    .iter()
                    .map(|m| m.sequences.iter().map(|s| s.sequence.len() as u64).sum())
                    .collect();
                let mut flags = vec![false; tokens.len()];
                for i in &dist::assign(&tokens, g.size())[g.rank()] {
                    flags[*i] = true;
                }
                flags
            }
        })
        .collect();
    let device = model.device();
    let chunk = options.logprob_chunk as i64;
    // Old log-probs of every mini-batch after the first (the first uses its own pass).
    let old_started = Instant::now();
    let mut old: Vec<Vec<Option<Tensor>>> = Vec::with_capacity(mini_batches.len());
    for (k, mb) in mini_batches.iter().enumerate() {
        let compute = k > 0 || options.epochs > 1;
        old.push(
            mb.micro_batches
                .iter()
                .zip(&mine[k])
                .map(|(micro, &mine)| {
                    (compute && mine).then(|| {
                        micro_logprobs(model, &gather(micro, device, options.packing), chunk)
                    })
                })
                .collect(),
        );
    }
    let old_logprob_seconds = old_started.elapsed().as_secs_f64();

    model.set_requires_grad(true);
    let run_steps = mini_batches.len() as u64 * u64::from(options.epochs);
    let total_steps = options.total_steps.unwrap_or(first_step + run_steps);
    let mut result = TrainResult {
        steps: Vec::new(),
        loss_tokens: 0,
        tokens: 0,
        computed_tokens: 0,
        old_logprob_seconds,
        seconds: 0.0,
        importance_by_lag: Default::default(),
        comm: None,
        old_logprobs: Default::default(),
    };
    let mut step = first_step;
    'epochs: for epoch in 0..options.epochs {
        for (k, mb) in mini_batches.iter().enumerate() {
            let step_started = Instant::now();
            let comm_before = optimizer.comm();
            optimizer.clear_grads();
            let mut stats = LossStats::default();
            let mut entropy = 0.0;
            let mut tokens = 0;
            let mut computed_tokens = 0;
            let mut sequences = 0;
            let mut rewards = std::collections::BTreeMap::new();
            for (m, micro) in mb.micro_batches.iter().enumerate() {
                // The whole mini-batch's counts on every rank; the model runs on this
                // rank's share.
                tokens += micro
                    .sequences
                    .iter()
                    .map(|s| s.sequence.len() as u64)
                    .sum::<u64>();
                computed_tokens += computed(
                    micro.sequences.iter().map(|s| s.sequence.len()),
                    options.packing,
                );
                sequences += micro.sequences.len() as u64;
                for s in &micro.sequences {
                    rewards.insert(s.episode_id.clone(), s.reward);
                }
                if !mine[k][m] {
                    continue;
                }
                let g = gather(micro, device, options.packing);
                let by_lag = &mut result.importance_by_lag;
                let recorded = &mut result.old_logprobs;
                let cap = MAX_RECORDED_LOGPROBS / group.map_or(1, Group::size);
                let (s, e) = micro_step_with(model, &g, old[k][m].as_ref(), options, |old| {
                    if let (Some(latest), 0) = (options.latest_policy_version, epoch) {
                        add_lag_ratios(by_lag, latest, &g, old);
                    }
                    if epoch == 0 {
                        record_old_logprobs(recorded, (k, m), micro, old, cap);
                    }
                });
                stats.merge(&s);
                entropy += e;
            }
            let mut stop = options
                .stop
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst));
            if let Some(group) = group {
                // The mini-batch's sums over every rank, and whether any was asked to
                // stop (all stop after the same step).
                (stats, entropy, stop) = reduce_stats(group, &stats, entropy, stop)?;
            }
            let grad_norm = optimizer.reduce_and_clip(options.max_grad_norm, group)?;
            let lr = learning_rate(
                options.lr_schedule,
                options.lr,
                options.warmup_steps,
                total_steps,
                options.min_lr_ratio,
                step,
            );
            let skipped = !grad_norm.is_finite();
            if !skipped {
                optimizer.apply(lr, group)?;
            }
            optimizer.clear_grads();
            let seconds = step_started.elapsed().as_secs_f64();
            let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
            let inf = stats.inference_tokens;
            let metrics = StepMetrics {
                step: step + 1,
                epoch,
                mini_batch: k,
                lr,
                loss: stats.loss,
                grad_norm,
                skipped,
                clip_fraction: per(stats.clipped, stats.tokens),
                dual_clip_fraction: per(stats.dual_clipped, stats.tokens),
                ratio_mean: per(stats.ratio_sum, stats.tokens),
                ratio_min: stats.ratio_min,
                ratio_max: stats.ratio_max,
                kl: per(stats.kl_sum, stats.tokens),
                entropy: per(entropy, stats.tokens),
                inference_logprob_gap: (inf > 0.0).then(|| stats.inference_gap_sum / inf),
                inference_logprob_abs_gap: (inf > 0.0).then(|| stats.inference_abs_gap_sum / inf),
                tis_capped_fraction: (inf > 0.0).then(|| stats.tis_capped / inf),
                loss_tokens: stats.tokens as u64,
                tokens,
                computed_tokens,
                sequences,
                episodes: rewards.len() as u64,
                reward_mean: per(rewards.values().sum(), rewards.len() as f64),
                seconds,
                tokens_per_second: per(tokens as f64, seconds),
                comm: group.map(|_| {
                    let now = optimizer.comm();
                    Comm {
                        bytes: now.bytes - comm_before.bytes,
                        seconds: now.seconds - comm_before.seconds,
                        calls: now.calls - comm_before.calls,
                    }
                }),
            };
            result.loss_tokens += metrics.loss_tokens;
            result.tokens += tokens;
            result.computed_tokens += computed_tokens;
            on_step(&metrics);
            result.steps.push(metrics);
            step += 1;
            // One process also sees a signal that came during the step; ranks keep the
            // decision they all agreed on.
            if stop
                || (group.is_none()
                    && options
                        .stop
                        .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst)))
            {
                break 'epochs;
            }
        }
    }
    if let Some(group) = group {
        result.importance_by_lag = merge_lag_ratios(group, &result.importance_by_lag)?;
        result.old_logprobs = gather_old_logprobs(group, std::mem::take(&mut result.old_logprobs))?;
        result.comm = Some(optimizer.comm());
    }
    model.set_requires_grad(false);
    result.seconds = started.elapsed().as_secs_f64();
    Ok(result)
}

/// Sums (and min / max) of one step's loss statistics and entropy over every rank, and
/// whether any rank was asked to stop.
fn reduce_stats(
    group: &Group,
    stats: &LossStats,
    entropy: f64,
    stop: bool,
) -> Result<(LossStats, f64, bool), TrainError> {
    let sums = Tensor::from_slice(&[
        stats.tokens,
        stats.loss,
        stats.clipped,
        stats.dual_clipped,
        stats.ratio_sum,
        stats.kl_sum,
        stats.inference_tokens,
        stats.inference_gap_sum,
        stats.inference_abs_gap_sum,
        stats.tis_capped,
        entropy,
        f64::from(u8::from(stop)),
    ]);
    let empty = stats.tokens == 0.0;
    let extremes = Tensor::from_slice(&[
        if empty {
            f64::NEG_INFINITY
        } else {
            stats.ratio_max
        },
        if empty {
            f64::NEG_INFINITY
        } else {
            -stats.ratio_min
        },
    ]);
    group.all_reduce(&sums, ReduceOp::Sum)?;
    group.all_reduce(&extremes, ReduceOp::Max)?;
    let s = Vec::<f64>::try_from(&sums)?;
    let e = Vec::<f64>::try_from(&extremes)?;
    let any = s[0] > 0.0;
    let out = LossStats {
        tokens: s[0],
        loss: s[1],
        clipped: s[2],
        dual_clipped: s[3],
        ratio_sum: s[4],
        kl_sum: s[5],
        inference_tokens: s[6],
        inference_gap_sum: s[7],
        inference_abs_gap_sum: s[8],
        tis_capped: s[9],
        ratio_max: if any { e[0] } else { 0.0 },
        ratio_min: if any { -e[1] } else { 0.0 },
    };
    Ok((out, s[10], s[11] > 0.0))
}

/// Every rank's recorded old log-probs, on rank 0 (the others get none back): each rank
/// other than 0 puts its entries into the store (k, m, i, n as u32 LE, then n f32 LE),
/// rank 0 reads them; nothing is fetched by the ranks that drop it.
fn gather_old_logprobs(group: &Group, mine: OldLogprobs) -> Result<OldLogprobs, TrainError> {
    let mut bytes = Vec::new();
    for ((k, m, i), values) in &mine {
        for x in [*k, *m, *i, values.len()] {
            bytes.extend_from_slice(&(x as u32).to_le_bytes());
        }
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    let mut merged = OldLogprobs::new();
    if group.rank() != 0 {
        group.store_set(&format!("old_logprobs/{}", group.rank()), &bytes)?;
        return Ok(merged);
    }
    let mut all = Vec::with_capacity(group.size());
    for r in 1..group.size() {
        all.push(group.store_get(&format!("old_logprobs/{r}"))?);
    }
    merged.extend(mine);
    for value in all {
        let mut rest = value.as_slice();
        let u32s = |rest: &mut &[u8], n: usize| -> Option<Vec<u32>> {
            let (head, tail) = rest.split_at_checked(4 * n)?;
            *rest = tail;
            Some(
                head.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        };
        while let Some(h) = u32s(&mut rest, 4) {
            let Some(v) = u32s(&mut rest, h[3] as usize) else {
                break;
            };
            let values = v.into_iter().map(f32::from_bits).collect();
            merged.insert((h[0] as usize, h[1] as usize, h[2] as usize), values);
        }
    }
    Ok(merged)
}

/// Every rank's importance ratios by lag, merged (token-weighted means), on every rank.
fn merge_lag_ratios(
    group: &Group,
    mine: &std::collections::BTreeMap<String, LagRatio>,
) -> Result<std::collections::BTreeMap<String, LagRatio>, TrainError> {
    let bytes = serde_json::to_vec(mine).unwrap_or_default();
    let mut merged: std::collections::BTreeMap<String, LagRatio> = Default::default();
    for value in group.exchange("importance_by_lag", &bytes)? {
        let theirs: std::collections::BTreeMap<String, LagRatio> =
            serde_json::from_slice(&value).unwrap_or_default();
        for (lag, r) in theirs {
            let e = merged.entry(lag).or_default();
            let tokens = e.tokens + r.tokens;
            if tokens > 0 {
                e.mean_ratio = (e.mean_ratio * e.tokens as f64 + r.mean_ratio * r.tokens as f64)
                    / tokens as f64;
            }
            e.tokens = tokens;
        }
    }
    Ok(merged)
}
