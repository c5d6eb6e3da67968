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

use serde::Serialize;
use tch::{Kind, Tensor};

pub use super::options::{LossOptions, PolicyLoss};

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-token formula written out with plain floats.
    fn reference(lp: f64, old: f64, inf: Option<f64>, a: f64, o: &LossOptions) -> f64 {
        let r = (lp - old).exp();
        let (low, high) = (1.0 - o.clip_ratio_low, 1.0 + o.clip_ratio_high);
        let mut l = (-a * r).max(-a * r.clamp(low, high));
        if let (Some(c), true) = (o.dual_clip, a < 0.0) {
            l = l.min(-a * c);
        }
        if let (Some(cap), Some(inf)) = (o.tis_cap, inf) {
            l *= (old - inf).exp().min(cap);
        }
        let d = old - lp;
        l + o.kl_coef * (d.exp() - d - 1.0)
    }

    #[test]
    fn ppo_terms_match_the_reference_formula() {
        let lp = [-1.0, -0.2, -2.5, -0.7, -1.2, -3.0];
        let old = [-1.3, -0.2, -1.0, -0.9, -1.1, -1.0];
        let inf = [Some(-1.2), None, Some(-0.2), Some(-3.0), None, Some(-1.0)];
        let adv = [1.0, -1.0, -2.0, 0.5, -0.3, -1.0];
        let w = [0.1, 0.2, 0.3, 0.15, 0.05, 0.2];
        let options = [
            LossOptions {
                policy_loss: PolicyLoss::Ppo,
                clip_ratio_low: 0.2,
                clip_ratio_high: 0.28,
                dual_clip: None,
                tis_cap: None,
                kl_coef: 0.0,
            },
            LossOptions {
                policy_loss: PolicyLoss::Ppo,
                clip_ratio_low: 0.1,
                clip_ratio_high: 0.3,
                dual_clip: Some(3.0),
                tis_cap: Some(2.0),
                kl_coef: 0.05,
            },
        ];
        let f = |v: &[f64]| Tensor::from_slice(&v.iter().map(|x| *x as f32).collect::<Vec<_>>());
        let inf_t = f(&inf
            .iter()
            .map(|x| x.unwrap_or(f64::NAN))
            .collect::<Vec<_>>());
        let seq = Tensor::from_slice(&[0i64, 0, 0, 1, 1, 1]);
        for o in &options {
            let (old_t, adv_t, w_t) = (f(&old), f(&adv), f(&w));
            let x = TokenInputs {
                old: &old_t,
                inference: &inf_t,
                advantages: &adv_t,
                weights: &w_t,
                sequence: &seq,
                sequences: 2,
            };
            let (loss, stats) = policy_loss(&f(&lp), &x, o);
            let expected: f64 = (0..6)
                .map(|i| w[i] * reference(lp[i], old[i], inf[i], adv[i], o))
                .sum();
            assert!((loss.double_value(&[]) - expected).abs() < 1e-5, "{o:?}");
            assert_eq!(stats.tokens, 6.0);
            assert_eq!(stats.inference_tokens, 4.0);
            // Token 2 (ratio e^-1.5 < 1 - ε, A < 0) takes the clipped branch.
            assert!(stats.clipped >= 1.0);
        }
        // Dual clip: token 5 has A < 0 and ratio e^-2 ... and token 2 ratio e^-1.5: neither
        // exceeds c; a huge ratio with A < 0 does.
        let (lp_t, old_t) = (f(&[2.0]), f(&[-2.0]));
        let (adv_t, w_t, inf_t) = (f(&[-1.0]), f(&[1.0]), f(&[f64::NAN]));
        let seq = Tensor::from_slice(&[0i64]);
        let x = TokenInputs {
            old: &old_t,
            inference: &inf_t,
            advantages: &adv_t,
            weights: &w_t,
            sequence: &seq,
            sequences: 1,
        };
        let (loss, stats) = policy_loss(&lp_t, &x, &options[1]);
        assert!(
            (loss.double_value(&[]) - reference(2.0, -2.0, None, -1.0, &options[1])).abs() < 1e-4
        );
        assert_eq!(stats.dual_clipped, 1.0);
    }

    #[test]
    fn gspo_uses_one_ratio_per_sequence() {
        let lp = Tensor::from_slice(&[-1.0f32, -2.0, -0.5, -0.5]).set_requires_grad(true);
        let old = Tensor::from_slice(&[-1.1f32, -1.9, -0.5, -0.7]);
        let x_inf = Tensor::from_slice(&[f32::NAN; 4]);
        let adv = Tensor::from_slice(&[1.0f32, 1.0, 1.0, 1.0]);
        let w = Tensor::from_slice(&[0.25f32; 4]);
        let seq = Tensor::from_slice(&[0i64, 0, 1, 1]);
        let o = LossOptions {
            policy_loss: PolicyLoss::Gspo,
            clip_ratio_low: 3e-4,
            clip_ratio_high: 4e-4,
            dual_clip: None,
            tis_cap: None,
            kl_coef: 0.0,
        };
        let x = TokenInputs {
            old: &old,
            inference: &x_inf,
            advantages: &adv,
            weights: &w,
            sequence: &seq,
            sequences: 2,
        };
        let (_, stats) = policy_loss(&lp, &x, &o);
        // Sequence 0: mean diff 0 → ratio 1 for both tokens; sequence 1: mean 0.1, so
        // both its tokens are clipped at 1 + 4e-4 (A > 0).
        assert!((stats.ratio_min - 1.0).abs() < 1e-6);
        assert!((stats.ratio_max - 0.1f64.exp()).abs() < 1e-5);
        assert_eq!(stats.clipped, 2.0);
    }
}
