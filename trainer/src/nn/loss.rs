//! The policy-gradient loss of one micro-batch, on flat per-token tensors (one entry per
//! loss token, in the order `nn::train` gathers them).
//!
//! Per token `t` with advantage `A`, weight `w` (from the pipeline's schedule, already
//! normalized for the whole mini-batch), current log-prob `lp`, old log-prob `lp_old`
//! (the weights at the start of the run, before any update) and, when recorded, the
//! inference server's log-prob `lp_inf`:
//!
//! - ratio `r = exp(lp − lp_old)`; with GSPO, one ratio per sequence,
//!   `s = exp(mean over the sequence's tokens of (lp − lp_old))`, applied per token as
//!   `sg(s) · exp(lp − sg(lp))` (GSPO-token; its gradient is GSPO's when the advantage is
//!   the same on every token of the sequence);
//! - `ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))`; with dual clip `c`, for `A < 0`,
//!   `ℓ = min(ℓ, −A·c)`;
//! - truncated importance sampling: `ℓ ← ℓ · min(exp(lp_old − lp_inf), C)` where `lp_inf`
//!   exists (detached);
//! - KL penalty to the starting weights: `ℓ ← ℓ + β·k3`, `k3 = exp(lp_old − lp) − (lp_old − lp) − 1`;
//! - the micro-batch loss is `Σ w·ℓ`. Summed over micro-batches it is the mini-batch loss,
//!   whatever the split.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Which ratio the surrogate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyLoss {
    /// Token-level ratio (PPO / GRPO / DAPO).
    Ppo,
    /// Sequence-level ratio (GSPO).
    Gspo,
}

/// Settings of the loss (section `[train]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossOptions {
    /// Token or sequence ratio.
    pub policy_loss: PolicyLoss,
    /// `ε_low`.
    pub clip_ratio_low: f64,
    /// `ε_high`.
    pub clip_ratio_high: f64,
    /// Dual-clip constant `c` (> 1), or none.
    pub dual_clip: Option<f64>,
    /// Truncated importance sampling cap `C`, or none to ignore inference log-probs.
    pub tis_cap: Option<f64>,
    /// `β` of the KL penalty to the starting weights (0: none).
    pub kl_coef: f64,
}

/// The per-token inputs of one micro-batch.
#[derive(Debug)]
pub struct TokenInputs<'a> {
    /// Old log-probs `[n]` (no gradient).
    pub old: &'a Tensor,
    /// Inference log-probs `[n]`, NaN where not recorded.
    pub inference: &'a Tensor,
    /// Advantages `[n]`.
    pub advantages: &'a Tensor,
    /// Loss weights `[n]`.
    pub weights: &'a Tensor,
    /// Index of each token's sequence `[n]` (int64, `0..sequences`).
    pub sequence: &'a Tensor,
    /// Number of sequences.
    pub sequences: i64,
}

/// Sums over the tokens of a micro-batch, for the step metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct LossStats {
    /// Tokens.
    pub tokens: f64,
    /// `Σ w·ℓ`.
    pub loss: f64,
    /// Tokens where the clipped branch was taken.
    pub clipped: f64,
    /// Tokens where the dual clip was taken.
    pub dual_clipped: f64,
    /// `Σ r`.
    pub ratio_sum: f64,
    /// Smallest `r`.
    pub ratio_min: f64,
    /// Largest `r`.
    pub ratio_max: f64,
    /// `Σ k3`.
    pub kl_sum: f64,
    /// Tokens with an inference log-prob.
    pub inference_tokens: f64,
    /// `Σ (lp_old − lp_inf)` over those.
    pub inference_gap_sum: f64,
    /// `Σ |lp_old − lp_inf|` over those.
    pub inference_abs_gap_sum: f64,
    /// Tokens whose importance weight hit the cap.
    pub tis_capped: f64,
}

impl LossStats {
    /// Adds another micro-batch's sums.
    pub fn merge(&mut self, o: &LossStats) {
        if o.tokens == 0.0 {
            return;
        }
        let first = self.tokens == 0.0;
        self.tokens += o.tokens;
        self.loss += o.loss;
        self.clipped += o.clipped;
        self.dual_clipped += o.dual_clipped;
        self.ratio_sum += o.ratio_sum;
        self.ratio_min = if first {
            o.ratio_min
        } else {
            self.ratio_min.min(o.ratio_min)
        };
        self.ratio_max = if first {
            o.ratio_max
        } else {
            self.ratio_max.max(o.ratio_max)
        };
        self.kl_sum += o.kl_sum;
        self.inference_tokens += o.inference_tokens;
        self.inference_gap_sum += o.inference_gap_sum;
        self.inference_abs_gap_sum += o.inference_abs_gap_sum;
        self.tis_capped += o.tis_capped;
    }
}

fn scalar(t: &Tensor) -> f64 {
    t.double_value(&[])
}

/// The micro-batch loss (a scalar with a graph to `lp`) and its statistics.
// `a = a * b` on purpose: tch's `*=` is in place, which autograd may refuse.
#[allow(clippy::assign_op_pattern)]
pub fn policy_loss(lp: &Tensor, x: &TokenInputs<'_>, o: &LossOptions) -> (Tensor, LossStats) {
    let n = lp.size()[0];
    let kind = Kind::Float;
    let log_ratio = match o.policy_loss {
        PolicyLoss::Ppo => lp - x.old,
        PolicyLoss::Gspo => {
            let diff = (lp - x.old).detach();
            let zeros = Tensor::zeros([x.sequences], (kind, lp.device()));
            let sums = zeros.index_add(0, x.sequence, &diff);
            let counts = zeros.index_add(0, x.sequence, &diff.ones_like());
            let seq_mean = (sums / counts.clamp_min(1.0)).index_select(0, x.sequence);
            seq_mean + lp - lp.detach()
        }
    };
    // exp of a large log-ratio overflows; the clip makes anything past e^20 irrelevant.
    let ratio = log_ratio.clamp_max(20.0).exp();
    let (low, high) = (1.0 - o.clip_ratio_low, 1.0 + o.clip_ratio_high);
    let neg_adv = -x.advantages;
    let pg1 = &neg_adv * &ratio;
    let pg2 = &neg_adv * ratio.clamp(low, high);
    let clipped_taken = pg2.gt_tensor(&pg1);
    let mut per_token = pg1.maximum(&pg2);
    let mut dual_taken = Tensor::zeros_like(&per_token).to_kind(Kind::Bool);
    if let Some(c) = o.dual_clip {
        let pg3 = &neg_adv * c;
        let negative = x.advantages.lt(0.0);
        dual_taken = negative.logical_and(&per_token.gt_tensor(&pg3));
        per_token = per_token.minimum(&pg3).where_self(&negative, &per_token);
    }
    let has_inf = x.inference.isnan().logical_not();
    let gap = (x.old - x.inference).where_self(&has_inf, &x.old.zeros_like());
    let mut tis_capped = Tensor::zeros_like(&per_token).to_kind(Kind::Bool);
    if let Some(cap) = o.tis_cap {
        let w = gap.exp();
        tis_capped = w.gt(cap).logical_and(&has_inf);
        let w = w.clamp_max(cap).where_self(&has_inf, &w.ones_like());
        per_token = per_token * w.detach();
    }
    let k3 = {
        let d = x.old - lp;
        d.exp() - &d - 1.0
    };
    if o.kl_coef != 0.0 {
        per_token = per_token + &k3 * o.kl_coef;
    }
    let loss = (per_token * x.weights).sum(kind);
    let stats = if n == 0 {
        LossStats::default()
    } else {
        tch::no_grad(|| LossStats {
            tokens: n as f64,
            loss: scalar(&loss),
            clipped: scalar(&clipped_taken.to_kind(kind).sum(kind)),
            dual_clipped: scalar(&dual_taken.to_kind(kind).sum(kind)),
            ratio_sum: scalar(&ratio.sum(kind)),
            ratio_min: scalar(&ratio.min()),
            ratio_max: scalar(&ratio.max()),
            kl_sum: scalar(&k3.sum(kind)),
            inference_tokens: scalar(&has_inf.to_kind(kind).sum(kind)),
            inference_gap_sum: scalar(&gap.sum(kind)),
            inference_abs_gap_sum: scalar(&gap.abs().sum(kind)),
            tis_capped: scalar(&tis_capped.to_kind(kind).sum(kind)),
        })
    };
    (loss, stats)
}
