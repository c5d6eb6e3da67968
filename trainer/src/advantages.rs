//! Stage 5: rewards → per-token advantages.
//!
//! Episodes are grouped by task id and group id (or task id alone), and each episode's
//! reward `R` is compared with the others of its group (`n` episodes, mean `μ`,
//! standard deviation `σ`, sample or population as configured):
//!
//! | estimator | advantage |
//! |---|---|
//! | `grpo` | `(R − μ) / (σ + ε)` |
//! | `dr_grpo` | `R − μ` |
//! | `rloo` | `R − (Σ R_others) / (n − 1)` |
//! | `reinforce_plus_plus_baseline` | `R − μ`, then whitened over the whole batch: `(A − μ_batch) / (σ_batch + ε)` over every sampled token |
//!
//! A group of one gets advantage 0 under every estimator (there is nothing to compare
//! with). The episode's advantage reaches every sampled token of every sequence of the
//! episode; tokens the model did not sample get 0.
//!
//! Optional per-call rewards (`per_call_rewards`): call `c` of an episode has the return
//! `G_c = Σ_{k ≥ c} γ^(k−c) r_k` over the episode's calls in order (`r_k`: the
//! per-call reward of call `k`, 0 if none; `γ`: `per_call_discount`). The same
//! estimator is applied to the returns of all calls of the group, and the tokens of
//! call `c` get `A_episode + per_call_weight · A_call(c)`. For
//! `reinforce_plus_plus_baseline` the batch whitening applies to that sum.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::merge::Sequence;

/// How advantages are estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Estimator {
    /// Group mean and standard deviation.
    Grpo,
    /// Group mean only (Dr. GRPO).
    #[serde(alias = "dr-grpo")]
    DrGrpo,
    /// Leave-one-out mean.
    Rloo,
    /// Group mean, then whitened across the batch.
    #[serde(alias = "reinforce++-baseline", alias = "reinforce_pp_baseline")]
    ReinforcePlusPlusBaseline,
}

impl Estimator {
    /// The name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Estimator::Grpo => "grpo",
            Estimator::DrGrpo => "dr_grpo",
            Estimator::Rloo => "rloo",
            Estimator::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
        }
    }
}

/// Which episodes are compared with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupBy {
    /// Same task id and same group id.
    TaskAndGroup,
    /// Same task id.
    Task,
}

/// Which standard deviation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdKind {
    /// Divide by `n − 1` (as `torch.std`).
    Sample,
    /// Divide by `n`.
    Population,
}

/// How reward records combine into one reward (section `[rewards]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardOptions {
    /// Weight of the final (unnamed) reward (default 1).
    pub final_reward_weight: f64,
    /// Weights of named reward components; components not listed are ignored
    /// (default none).
    pub reward_weights: BTreeMap<String, f64>,
}

impl Default for RewardOptions {
    fn default() -> Self {
        RewardOptions {
            final_reward_weight: 1.0,
            reward_weights: BTreeMap::new(),
        }
    }
}

/// Settings of the advantage stage (section `[advantages]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdvantageOptions {
    /// The estimator (default `grpo`).
    pub estimator: Estimator,
    /// Grouping (default `task_and_group`).
    pub group_by: GroupBy,
    /// ε in the divisions (default 1e-6).
    pub epsilon: f64,
    /// Standard deviation kind (default `sample`).
    pub std: StdKind,
    /// Use per-call rewards (default false).
    pub per_call_rewards: bool,
    /// Discount of per-call rewards over later calls (default 1).
    pub per_call_discount: f64,
    /// Weight of the per-call term (default 1).
    pub per_call_weight: f64,
}

impl Default for AdvantageOptions {
    fn default() -> Self {
        AdvantageOptions {
            estimator: Estimator::Grpo,
            group_by: GroupBy::TaskAndGroup,
            epsilon: 1e-6,
            std: StdKind::Sample,
            per_call_rewards: false,
            per_call_discount: 1.0,
            per_call_weight: 1.0,
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

fn std_dev(values: &[f64], kind: StdKind) -> f64 {
    let n = values.len();
    let denom = match kind {
        StdKind::Sample if n > 1 => (n - 1) as f64,
        StdKind::Sample => return 0.0,
        StdKind::Population if n > 0 => n as f64,
        StdKind::Population => return 0.0,
    };
    let m = mean(values);
    (values.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / denom).sqrt()
}

/// The estimator applied to one group's values (before any batch whitening).
pub fn group_values(values: &[f64], options: &AdvantageOptions) -> Vec<f64> {
    let n = values.len();
    if n <= 1 {
        return vec![0.0; n];
    }
    let mu = mean(values);
    match options.estimator {
        Estimator::Grpo => {
            let sigma = std_dev(values, options.std);
            values
                .iter()
                .map(|v| (v - mu) / (sigma + options.epsilon))
                .collect()
        }
        Estimator::DrGrpo | Estimator::ReinforcePlusPlusBaseline => {
            values.iter().map(|v| v - mu).collect()
        }
        Estimator::Rloo => {
            let sum: f64 = values.iter().sum();
            values
                .iter()
                .map(|v| v - (sum - v) / (n - 1) as f64)
                .collect()
        }
    }
}

/// One episode as the advantage stage sees it.
#[derive(Debug, Clone, Copy)]
pub struct EpisodeInput<'a> {
    /// Index of its group.
    pub group: usize,
    /// Its combined reward.
    pub reward: f64,
    /// Per-call rewards by span id.
    pub call_rewards: &'a HashMap<String, f64>,
    /// Number of calls of the episode (after cleaning).
    pub calls: usize,
    /// Span ids of those calls, in order.
    pub call_spans: &'a [String],
    /// Its sequences.
    pub sequences: &'a [Sequence],
}

/// Per-token advantages: `[episode][sequence][token]`, 0 on tokens without loss.
pub fn token_advantages(
    episodes: &[EpisodeInput<'_>],
    options: &AdvantageOptions,
) -> Vec<Vec<Vec<f64>>> {
    // Episode advantages, group by group.
    let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, e) in episodes.iter().enumerate() {
        by_group.entry(e.group).or_default().push(i);
    }
    let mut episode_adv = vec![0.0; episodes.len()];
    let mut call_adv: Vec<Vec<f64>> = episodes.iter().map(|e| vec![0.0; e.calls]).collect();
    for members in by_group.values() {
        let rewards: Vec<f64> = members.iter().map(|&i| episodes[i].reward).collect();
        for (&i, a) in members.iter().zip(group_values(&rewards, options)) {
            episode_adv[i] = a;
        }
        if options.per_call_rewards {
            let mut returns = Vec::new();
            let mut owners = Vec::new();
            for &i in members {
                let e = &episodes[i];
                let mut g = 0.0;
                let mut rets = vec![0.0; e.calls];
                for c in (0..e.calls).rev() {
                    let r = e
                        .call_spans
                        .get(c)
                        .and_then(|s| e.call_rewards.get(s))
                        .copied()
                        .unwrap_or(0.0);
                    g = r + options.per_call_discount * g;
                    rets[c] = g;
                }
                for (c, g) in rets.into_iter().enumerate() {
                    returns.push(g);
                    owners.push((i, c));
                }
            }
            for ((i, c), a) in owners.into_iter().zip(group_values(&returns, options)) {
                call_adv[i][c] = a;
            }
        }
    }
    let mut out: Vec<Vec<Vec<f64>>> = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| {
            e.sequences
                .iter()
                .map(|seq| {
                    let mut adv = vec![0.0; seq.len()];
                    for span in &seq.spans {
                        let a = episode_adv[i]
                            + options.per_call_weight
                                * call_adv[i].get(span.call_index).copied().unwrap_or(0.0);
                        let range = span.start..span.end;
                        if let (Some(values), Some(mask)) =
                            (adv.get_mut(range.clone()), seq.loss_mask.get(range))
                        {
                            for (v, m) in values.iter_mut().zip(mask) {
                                if *m != 0 {
                                    *v = a;
                                }
                            }
                        }
                    }
                    adv
                })
                .collect()
        })
        .collect();
    if options.estimator == Estimator::ReinforcePlusPlusBaseline {
        whiten(episodes, &mut out, options);
    }
    out
}

/// Whitens every sampled token's advantage across the batch.
fn whiten(episodes: &[EpisodeInput<'_>], adv: &mut [Vec<Vec<f64>>], options: &AdvantageOptions) {
    let mut values = Vec::new();
    for (e, seqs) in episodes.iter().zip(adv.iter()) {
        for (seq, a) in e.sequences.iter().zip(seqs) {
            values.extend(
                seq.loss_mask
                    .iter()
                    .zip(a)
                    .filter(|(m, _)| **m != 0)
                    .map(|(_, v)| *v),
            );
        }
    }
    let mu = mean(&values);
    let sigma = std_dev(&values, options.std);
    for (e, seqs) in episodes.iter().zip(adv.iter_mut()) {
        for (seq, a) in e.sequences.iter().zip(seqs.iter_mut()) {
            for (m, v) in seq.loss_mask.iter().zip(a.iter_mut()) {
                if *m != 0 {
                    *v = (*v - mu) / (sigma + options.epsilon);
                }
            }
        }
    }
}
