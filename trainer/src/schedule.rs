//! Stage 6: episodes → mini-batches (one optimizer step each) → micro-batches (one
//! forward/backward each), with per-token loss weights.
//!
//! The loss of a mini-batch is `L = Σ_t w_t · ℓ_t` over all its tokens, with `ℓ_t` the
//! backend's per-token loss and `w_t` the weight written here. The weights are fixed for
//! the whole mini-batch *before* it is split, so summing the micro-batch losses
//! `Σ_{t ∈ micro} w_t · ℓ_t` gives `L` whatever the split (property-tested). With `m_t`
//! the loss mask, `S` the sequences with loss, `n_s` the loss tokens of sequence `s`,
//! `T = Σ n_s`, `E` the episodes with loss, `N_e` the loss tokens of episode `e` (all its
//! sequences) and `C` the normalization constant:
//!
//! | mode | `w_t` for token `t` of sequence `s` of episode `e` |
//! |---|---|
//! | `token-mean` | `m_t / T` |
//! | `seq-mean-token-sum` | `m_t / S` |
//! | `seq-mean-token-mean` | `m_t / (S · n_s)` |
//! | `seq-mean-token-sum-norm` | `m_t / (S · C)` (Dr. GRPO; `C` defaults to `max_seq_len`) |
//! | `episode-mean` | `m_t / (E · N_e)`: every episode weighs the same, however many sequences and tokens it has |
//!
//! Mini-batches: the episodes are shuffled with the seed and cut into mini-batches of
//! `mini_batch_episodes` (0: one mini-batch). Micro-batches: sequences sorted by length
//! (longest first) are packed first-fit into micro-batches of at most
//! `micro_batch_tokens` tokens (the sum of their lengths).

use serde::{Deserialize, Serialize};

/// How per-token losses aggregate into the mini-batch loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Mean over all loss tokens of the mini-batch.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Mean over sequences of each sequence's token sum.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Mean over sequences of each sequence's token mean.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Mean over sequences of each sequence's token sum divided by a constant.
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
    /// Mean over episodes of each episode's token mean.
    #[serde(rename = "episode-mean")]
    EpisodeMean,
}

impl LossAggMode {
    /// The name used in configs and outputs.
    pub fn name(self) -> &'static str {
        match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
            LossAggMode::EpisodeMean => "episode-mean",
        }
    }
}

/// Settings of the schedule stage (section `[schedule]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleOptions {
    /// Loss aggregation (default `token-mean`).
    pub loss_agg_mode: LossAggMode,
    /// `C` of `seq-mean-token-sum-norm` (default: `clean.max_seq_len`).
    pub norm_constant: Option<f64>,
    /// Token budget of a micro-batch (default 65536; at least `clean.max_seq_len`).
    pub micro_batch_tokens: usize,
    /// Episodes per mini-batch; 0 puts every episode in one (default 0).
    pub mini_batch_episodes: usize,
    /// Seed of the episode shuffle (default 0).
    pub seed: u64,
}

impl Default for ScheduleOptions {
    fn default() -> Self {
        ScheduleOptions {
            loss_agg_mode: LossAggMode::TokenMean,
            norm_constant: None,
            micro_batch_tokens: 65536,
            mini_batch_episodes: 0,
            seed: 0,
        }
    }
}

/// What the weights need to know about one sequence of a mini-batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqShape<'a> {
    /// Index of the sequence's episode within the mini-batch.
    pub episode: usize,
    /// Its loss mask.
    pub loss_mask: &'a [u8],
}

/// The normalizers of one mini-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Normalizer {
    /// Loss tokens `T`.
    pub loss_tokens: u64,
    /// Sequences with loss `S`.
    pub sequences: u64,
    /// Episodes with loss `E`.
    pub episodes: u64,
    /// The constant `C` (used by `seq-mean-token-sum-norm`).
    pub constant: f64,
}

/// Per-token weights of a whole mini-batch; see the module documentation.
pub fn loss_weights(
    mode: LossAggMode,
    sequences: &[SeqShape<'_>],
    constant: f64,
) -> (Vec<Vec<f64>>, Normalizer) {
    let n_s: Vec<usize> = sequences
        .iter()
        .map(|s| s.loss_mask.iter().filter(|m| **m != 0).count())
        .collect();
    let episodes = sequences.iter().map(|s| s.episode + 1).max().unwrap_or(0);
    let mut n_e = vec![0usize; episodes];
    for (s, n) in sequences.iter().zip(&n_s) {
        n_e[s.episode] += n;
    }
    let total: usize = n_s.iter().sum();
    let seqs_with_loss = n_s.iter().filter(|n| **n > 0).count();
    let eps_with_loss = n_e.iter().filter(|n| **n > 0).count();
    let normalizer = Normalizer {
        loss_tokens: total as u64,
        sequences: seqs_with_loss as u64,
        episodes: eps_with_loss as u64,
        constant,
    };
    let weights = sequences
        .iter()
        .zip(&n_s)
        .map(|(s, &n)| {
            let w = if n == 0 {
                0.0
            } else {
                match mode {
                    LossAggMode::TokenMean => 1.0 / total as f64,
                    LossAggMode::SeqMeanTokenSum => 1.0 / seqs_with_loss as f64,
                    LossAggMode::SeqMeanTokenMean => 1.0 / (seqs_with_loss as f64 * n as f64),
                    LossAggMode::SeqMeanTokenSumNorm => 1.0 / (seqs_with_loss as f64 * constant),
                    LossAggMode::EpisodeMean => {
                        1.0 / (eps_with_loss as f64 * n_e[s.episode] as f64)
                    }
                }
            };
            s.loss_mask
                .iter()
                .map(|m| if *m != 0 { w } else { 0.0 })
                .collect()
        })
        .collect();
    (weights, normalizer)
}

/// Packs sequences of the given lengths into micro-batches of at most `budget` tokens:
/// longest first, each into the first micro-batch it fits in. A sequence longer than
/// the budget gets a micro-batch of its own. Returns indexes into `lengths`.
pub fn pack(lengths: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|a, b| lengths[*b].cmp(&lengths[*a]).then(a.cmp(b)));
    let mut bins: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        let len = lengths[i];
        match bins.iter_mut().find(|(used, _)| used + len <= budget) {
            Some((used, members)) => {
                *used += len;
                members.push(i);
            }
            None => bins.push((len, vec![i])),
        }
    }
    bins.into_iter().map(|(_, m)| m).collect()
}

/// Splits `n` episodes into mini-batches of `size` (0: one), after a seeded shuffle.
pub fn mini_batches(n: usize, size: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed;
    // Fisher–Yates with splitmix64: deterministic for a seed, on every platform.
    for i in (1..n).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let j = (z % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    if n == 0 {
        return Vec::new();
    }
    let size = if size == 0 { n } else { size };
    order.chunks(size).map(<[usize]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_is_first_fit_decreasing() {
        let bins = pack(&[3, 9, 4, 2, 7, 12], 10);
        assert_eq!(bins, vec![vec![5], vec![1], vec![4, 0], vec![2, 3]]);
    }

    #[test]
    fn mini_batches_cover_every_episode_once() {
        let batches = mini_batches(10, 3, 7);
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            [3, 3, 3, 1]
        );
        let mut all: Vec<usize> = batches.concat();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(mini_batches(10, 3, 7), batches, "seeded");
        assert_eq!(mini_batches(4, 0, 1).len(), 1);
    }
}
