//! How far the trainer's log-probs are from the engine's on the tokens a run trained:
//! for every loss token with a recorded engine log-prob (vLLM's, SGLang's, the policy
//! server's) and the trainer's log-prob before the run's first update
//! (`nn::train::TrainResult::old_logprobs`), the gap `log p_trainer − log p_engine` and the
//! importance ratio `exp(gap)` (π_trainer_old / π_inference, the ratio truncated
//! importance sampling caps). Torch-free: it reads the batches and the recorded values.
//!
//! Invariants:
//! - Only tokens with both log-probs count (and finite gaps: a token whose log-prob is
//!   -inf on either side is left out rather than turned into a NaN mean); a run without engine log-probs has no
//!   [`Fidelity`] (`None`), not one of zeros.
//! - The warning is decided here, from [`WARN_MEAN_ABS_GAP`] and
//!   [`WARN_MEDIAN_LOG_RATIO`], so the manifest, the run report and the console say the
//!   same thing.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::batch::MiniBatch;

/// The mean |log p_trainer − log p_engine| above which a run warns. Same weights in bf16
/// on the engine and fp32 in the trainer differ by rounding: 0.037 nats on average
/// measured on vLLM 0.32 (bf16, CPU) with SmolLM2 (BENCHMARKS.md); a tenth means another
/// model, adapter, chat template or sampling transform (a temperature, top-p
/// renormalized log-probs) than the trainer's.
pub const WARN_MEAN_ABS_GAP: f64 = 0.1;
/// The |log| of the median importance ratio above which a run warns (a ratio below 0.95
/// or above 1.05 on the typical token is a bias, not rounding).
pub const WARN_MEDIAN_LOG_RATIO: f64 = 0.05;

/// Trainer against engine over a run's loss tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fidelity {
    /// Loss tokens with both log-probs.
    pub tokens: u64,
    /// Mean of log p_trainer − log p_engine.
    pub mean_logprob_gap: f64,
    /// Mean |log p_trainer − log p_engine|.
    pub mean_abs_logprob_gap: f64,
    /// Largest |log p_trainer − log p_engine|.
    pub max_abs_logprob_gap: f64,
    /// Quantiles of the importance ratio π_trainer_old / π_inference: p1, p10, p50, p90,
    /// p99 (nearest rank).
    pub ratio_quantiles: RatioQuantiles,
    /// The truncated-importance-sampling cap of the run (`train.tis_cap`; 0: off).
    pub tis_cap: f64,
    /// Share of the tokens whose ratio is above the cap (the ones TIS clips).
    pub tis_clipped_share: f64,
    /// Why the gap is beyond rounding, when it is.
    pub warning: Option<String>,
}

/// Quantiles of the importance ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RatioQuantiles {
    /// 1st percentile.
    pub p1: f64,
    /// 10th.
    pub p10: f64,
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
}

/// The gap `log p_trainer − log p_engine` of every loss token that has both, batch by
/// batch in order; `old` holds the trainer's log-probs by (mini-batch, micro-batch,
/// sequence), one per loss token after the first position.
pub fn gaps(
    mini_batches: &[MiniBatch],
    old: &HashMap<(usize, usize, usize), Vec<f32>>,
) -> Vec<f64> {
    let mut keys: Vec<_> = old.keys().copied().collect();
    keys.sort_unstable();
    let mut out = Vec::new();
    for (k, m, i) in keys {
        let Some(s) = mini_batches
            .get(k)
            .and_then(|mb| mb.micro_batches.get(m))
            .and_then(|micro| micro.sequences.get(i))
        else {
            continue;
        };
        let q = &s.sequence;
        let engine = (1..q.len())
            .filter(|&j| q.loss_mask.get(j).is_some_and(|m| *m != 0))
            .map(|j| q.logprobs.get(j).copied().flatten());
        for (trainer, engine) in old[&(k, m, i)].iter().zip(engine) {
            if let Some(e) = engine {
                let gap = f64::from(*trainer) - e;
                if gap.is_finite() {
                    out.push(gap);
                }
            }
        }
    }
    out
}

/// The fidelity of a run from its tokens' gaps ([`gaps`]) and its TIS cap; `None` when no
/// token has an engine log-prob.
pub fn measure(gaps: &[f64], tis_cap: f64) -> Option<Fidelity> {
    if gaps.is_empty() {
        return None;
    }
    let n = gaps.len() as f64;
    let mut ratios: Vec<f64> = gaps.iter().map(|g| g.exp()).collect();
    ratios.sort_unstable_by(f64::total_cmp);
    let q = |p: f64| ratios[((p * n).ceil() as usize).clamp(1, ratios.len()) - 1];
    let ratio_quantiles = RatioQuantiles {
        p1: q(0.01),
        p10: q(0.10),
        p50: q(0.50),
        p90: q(0.90),
        p99: q(0.99),
    };
    let mean_abs = gaps.iter().map(|g| g.abs()).sum::<f64>() / n;
    let clipped = if tis_cap > 0.0 {
        ratios.iter().filter(|r| **r > tis_cap).count() as f64 / n
    } else {
        0.0
    };
    let median_log = ratio_quantiles.p50.ln();
    let warning = if mean_abs > WARN_MEAN_ABS_GAP {
        Some(format!(
            "the trainer's log-probs differ from the engine's by {mean_abs:.3} nats per token on average (more than {WARN_MEAN_ABS_GAP}, beyond bf16 rounding): check that the engine serves the same model, adapter and chat template, and that it returns raw log-probs (vLLM: --logprobs-mode raw_logprobs, the default)"
        ))
    } else if median_log.abs() > WARN_MEDIAN_LOG_RATIO {
        Some(format!(
            "the median importance ratio trainer/engine is {:.3}, a bias beyond bf16 rounding: check the engine's model, adapter and sampling (a temperature or top-p applied to its log-probs)",
            ratio_quantiles.p50
        ))
    } else {
        None
    };
    Some(Fidelity {
        tokens: gaps.len() as u64,
        mean_logprob_gap: gaps.iter().sum::<f64>() / n,
        mean_abs_logprob_gap: mean_abs,
        max_abs_logprob_gap: gaps.iter().map(|g| g.abs()).fold(0.0, f64::max),
        ratio_quantiles,
        tis_cap,
        tis_clipped_share: clipped,
        warning,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{MicroBatch, TrainSequence};
    use crate::merge::Sequence;

    fn sequence(logprobs: Vec<Option<f64>>, mask: Vec<u8>) -> TrainSequence {
        let n = mask.len();
        TrainSequence {
            episode_id: "e".into(),
            task_id: "t".into(),
            group_id: String::new(),
            reward: 1.0,
            sequence: Sequence {
                token_ids: vec![1; n],
                loss_mask: mask,
                logprobs,
                spans: Vec::new(),
            },
            advantages: vec![0.0; n],
            weights: vec![0.0; n],
        }
    }

    #[test]
    fn gaps_pair_each_loss_token_with_its_engine_logprob() {
        // Loss tokens at 2, 3 and 5; the one at 3 has no engine log-prob.
        let s = sequence(
            vec![None, None, Some(-1.0), None, None, Some(-2.0)],
            vec![0, 0, 1, 1, 0, 1],
        );
        let batches = vec![MiniBatch {
            micro_batches: vec![MicroBatch {
                sequences: vec![s],
                recompute: false,
            }],
            normalizer: crate::schedule::Normalizer {
                loss_tokens: 3,
                sequences: 1,
                episodes: 1,
                constant: 1.0,
            },
        }];
        let old = HashMap::from([((0, 0, 0), vec![-0.5f32, -9.0, -2.25])]);
        assert_eq!(gaps(&batches, &old), vec![0.5, -0.25]);
        // A key for a sequence that is not there is skipped, not a panic.
        let stray = HashMap::from([((3, 0, 0), vec![-0.5f32])]);
        assert!(gaps(&batches, &stray).is_empty());
    }

    #[test]
    fn rounding_passes_and_a_bias_or_a_wide_gap_warns() {
        assert_eq!(measure(&[], 2.0), None);
        let small: Vec<f64> = (0..100).map(|i| (i as f64 - 50.0) * 1e-3).collect();
        let f = measure(&small, 2.0).unwrap();
        assert_eq!(f.tokens, 100);
        assert_eq!(f.warning, None);
        assert!(
            (f.ratio_quantiles.p50 - (-0.001f64).exp()).abs() < 1e-12,
            "{f:?}"
        );
        assert!(f.ratio_quantiles.p1 < f.ratio_quantiles.p99);
        assert_eq!(f.tis_clipped_share, 0.0);
        // Every token 0.08 nats above: a bias, under the mean-gap bound.
        let f = measure(&[0.08; 10], 2.0).unwrap();
        assert!(f.warning.unwrap().contains("median importance ratio"));
        // One token in four far off: the mean gap warns, TIS clips that quarter.
        let wide = [0.0, 0.0, 0.0, 1.0];
        let f = measure(&wide, 2.0).unwrap();
        assert_eq!(f.max_abs_logprob_gap, 1.0);
        assert_eq!(f.tis_clipped_share, 0.25);
        assert!(f.warning.unwrap().contains("0.250 nats"));
        assert_eq!(measure(&wide, 0.0).unwrap().tis_clipped_share, 0.0);
    }
}
