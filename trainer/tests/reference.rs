//! Advantages and loss normalizers against a straightforward reference computation,
//! and the split-invariance of the loss weights as a property test.

// The reference is written with plain index loops on purpose: it should read like the
// formulas, not like the code under test.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;

use proptest::prelude::*;
use tapline_trainer::advantages::{
    AdvantageOptions, EpisodeInput, Estimator, StdKind, group_values, token_advantages,
};
use tapline_trainer::merge::{CallSpan, Sequence};
use tapline_trainer::schedule::{LossAggMode, SeqShape, loss_weights, pack};

const ESTIMATORS: [Estimator; 4] = [
    Estimator::Grpo,
    Estimator::DrGrpo,
    Estimator::Rloo,
    Estimator::ReinforcePlusPlusBaseline,
];

const MODES: [LossAggMode; 5] = [
    LossAggMode::TokenMean,
    LossAggMode::SeqMeanTokenSum,
    LossAggMode::SeqMeanTokenMean,
    LossAggMode::SeqMeanTokenSumNorm,
    LossAggMode::EpisodeMean,
];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

/// The textbook formulas, one group at a time, with plain loops.
fn reference_group(rewards: &[f64], estimator: Estimator, eps: f64) -> Vec<f64> {
    let n = rewards.len();
    if n < 2 {
        return vec![0.0; n];
    }
    let mut sum = 0.0;
    for r in rewards {
        sum += r;
    }
    let mean = sum / n as f64;
    let mut sq = 0.0;
    for r in rewards {
        sq += (r - mean) * (r - mean);
    }
    let std = (sq / (n as f64 - 1.0)).sqrt();
    let mut out = Vec::new();
    for (i, r) in rewards.iter().enumerate() {
        out.push(match estimator {
            Estimator::Grpo => (r - mean) / (std + eps),
            Estimator::DrGrpo | Estimator::ReinforcePlusPlusBaseline => r - mean,
            Estimator::Rloo => {
                let mut others = 0.0;
                for (j, o) in rewards.iter().enumerate() {
                    if j != i {
                        others += o;
                    }
                }
                r - others / (n as f64 - 1.0)
            }
        });
    }
    out
}

#[test]
fn known_values() {
    let opts = |estimator| AdvantageOptions {
        estimator,
        ..AdvantageOptions::default()
    };
    let a = group_values(&[1.0, 0.0, 0.0, 1.0], &opts(Estimator::Grpo));
    // Sample std of [1, 0, 0, 1] is sqrt(1/3).
    let std = (1.0f64 / 3.0).sqrt();
    assert!(close(a[0], 0.5 / (std + 1e-6)), "{a:?}");
    assert!(close(a[1], -a[0]));
    let a = group_values(&[1.0, 0.0, 0.0, 1.0], &opts(Estimator::Rloo));
    // 1 - (0 + 0 + 1) / 3 and 0 - (1 + 0 + 1) / 3.
    assert!(close(a[0], 2.0 / 3.0) && close(a[1], -2.0 / 3.0), "{a:?}");
    let a = group_values(&[3.0, 1.0], &opts(Estimator::DrGrpo));
    assert_eq!(a, [1.0, -1.0]);
    assert_eq!(group_values(&[5.0], &opts(Estimator::Grpo)), [0.0]);
    let population = AdvantageOptions {
        std: StdKind::Population,
        epsilon: 0.0,
        ..AdvantageOptions::default()
    };
    assert_eq!(group_values(&[1.0, 0.0], &population), [1.0, -1.0]);
}

/// A random episode: its group, its reward, its sequences' loss masks.
#[derive(Debug, Clone)]
struct Ep {
    group: usize,
    reward: f64,
    masks: Vec<Vec<u8>>,
}

fn episodes() -> impl Strategy<Value = Vec<Ep>> {
    let mask = prop::collection::vec(prop_oneof![Just(0u8), Just(1u8)], 1..24);
    let ep = (0usize..3, -2.0f64..2.0, prop::collection::vec(mask, 1..4)).prop_map(
        |(group, reward, masks)| Ep {
            group,
            reward,
            masks,
        },
    );
    prop::collection::vec(ep, 1..10)
}

/// Sequences where each run of loss tokens belongs to one call.
fn sequences(ep: &Ep) -> Vec<Sequence> {
    let mut call = 0;
    ep.masks
        .iter()
        .map(|mask| {
            let mut spans = Vec::new();
            let mut t = 0;
            while t < mask.len() {
                if mask[t] == 1 {
                    let start = t;
                    while t < mask.len() && mask[t] == 1 {
                        t += 1;
                    }
                    spans.push(CallSpan {
                        span_id: format!("c{call}"),
                        call_index: call,
                        start,
                        end: t,
                        policy_version: String::new(),
                    });
                    call += 1;
                } else {
                    t += 1;
                }
            }
            Sequence {
                token_ids: vec![7; mask.len()],
                loss_mask: mask.clone(),
                logprobs: vec![None; mask.len()],
                spans,
            }
        })
        .collect()
}

proptest! {
    #[test]
    fn advantages_equal_the_reference(eps in episodes(), which in 0usize..4, per_call in any::<bool>(), gamma in 0.0f64..1.0) {
        let estimator = ESTIMATORS[which];
        let opts = AdvantageOptions {
            estimator,
            per_call_rewards: per_call,
            per_call_discount: gamma,
            per_call_weight: 0.5,
            ..AdvantageOptions::default()
        };
        let seqs: Vec<Vec<Sequence>> = eps.iter().map(sequences).collect();
        let calls: Vec<usize> = seqs.iter().map(|s| s.iter().map(|q| q.spans.len()).sum()).collect();
        let spans: Vec<Vec<String>> = calls.iter().map(|n| (0..*n).map(|c| format!("c{c}")).collect()).collect();
        // Per-call reward of call c of episode e: (e + c) % 3 - 1, on every other call.
        let call_rewards: Vec<HashMap<String, f64>> = calls
            .iter()
            .enumerate()
            .map(|(e, n)| (0..*n).filter(|c| c % 2 == 0).map(|c| (format!("c{c}"), ((e + c) % 3) as f64 - 1.0)).collect())
            .collect();
        let inputs: Vec<EpisodeInput<'_>> = eps
            .iter()
            .enumerate()
            .map(|(i, e)| EpisodeInput {
                group: e.group,
                reward: e.reward,
                call_rewards: &call_rewards[i],
                calls: calls[i],
                call_spans: &spans[i],
                sequences: &seqs[i],
            })
            .collect();
        let got = token_advantages(&inputs, &opts);

        // Reference: episode term per group, per-call term per group, then whitening.
        let mut ep_adv = vec![0.0; eps.len()];
        let mut call_adv: Vec<Vec<f64>> = calls.iter().map(|n| vec![0.0; *n]).collect();
        for g in 0..3 {
            let members: Vec<usize> = (0..eps.len()).filter(|i| eps[*i].group == g).collect();
            let rewards: Vec<f64> = members.iter().map(|i| eps[*i].reward).collect();
            for (k, a) in reference_group(&rewards, estimator, 1e-6).into_iter().enumerate() {
                ep_adv[members[k]] = a;
            }
            if per_call {
                let mut returns = Vec::new();
                let mut owner = Vec::new();
                for &i in &members {
                    for c in 0..calls[i] {
                        let mut g_c = 0.0;
                        for k in c..calls[i] {
                            let r = call_rewards[i].get(&format!("c{k}")).copied().unwrap_or(0.0);
                            g_c += gamma.powi((k - c) as i32) * r;
                        }
                        returns.push(g_c);
                        owner.push((i, c));
                    }
                }
                for (k, a) in reference_group(&returns, estimator, 1e-6).into_iter().enumerate() {
                    call_adv[owner[k].0][owner[k].1] = a;
                }
            }
        }
        let mut want: Vec<Vec<Vec<f64>>> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let mut per_seq = Vec::new();
            for q in s {
                let mut adv = vec![0.0; q.len()];
                for span in &q.spans {
                    for t in span.start..span.end {
                        adv[t] = ep_adv[i] + 0.5 * call_adv[i][span.call_index];
                    }
                }
                per_seq.push(adv);
            }
            want.push(per_seq);
        }
        if estimator == Estimator::ReinforcePlusPlusBaseline {
            let mut values = Vec::new();
            for (s, w) in seqs.iter().zip(&want) {
                for (q, a) in s.iter().zip(w) {
                    for t in 0..q.len() {
                        if q.loss_mask[t] == 1 {
                            values.push(a[t]);
                        }
                    }
                }
            }
            let n = values.len() as f64;
            let mean = values.iter().sum::<f64>() / n;
            let std = if values.len() > 1 {
                (values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0)).sqrt()
            } else {
                0.0
            };
            for (s, w) in seqs.iter().zip(want.iter_mut()) {
                for (q, a) in s.iter().zip(w.iter_mut()) {
                    for t in 0..q.len() {
                        if q.loss_mask[t] == 1 {
                            a[t] = (a[t] - mean) / (std + 1e-6);
                        }
                    }
                }
            }
        }
        for (g, w) in got.iter().flatten().flatten().zip(want.iter().flatten().flatten()) {
            prop_assert!(close(*g, *w), "{g} != {w}");
        }
        prop_assert_eq!(got.iter().flatten().flatten().count(), want.iter().flatten().flatten().count());
    }

    #[test]
    fn loss_weights_equal_the_reference_and_do_not_depend_on_the_split(
        eps in episodes(),
        which in 0usize..5,
        losses_seed in any::<u64>(),
        budgets in (0usize..60, 0usize..60),
    ) {
        let mode = MODES[which];
        let constant = 17.0;
        let mut shapes = Vec::new();
        for (e, ep) in eps.iter().enumerate() {
            for mask in &ep.masks {
                shapes.push(SeqShape { episode: e, loss_mask: mask });
            }
        }
        // Arbitrary per-token losses.
        let mut state = losses_seed;
        let losses: Vec<Vec<f64>> = shapes
            .iter()
            .map(|s| {
                s.loss_mask
                    .iter()
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((state >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
                    })
                    .collect()
            })
            .collect();
        let (weights, _) = loss_weights(mode, &shapes, constant);

        // Reference: the mini-batch loss with the mode's formula.
        let seq_sum = |i: usize| -> f64 {
            let mut s = 0.0;
            for (t, m) in shapes[i].loss_mask.iter().enumerate() {
                if *m == 1 { s += losses[i][t]; }
            }
            s
        };
        let seq_n = |i: usize| shapes[i].loss_mask.iter().filter(|m| **m == 1).count() as f64;
        let with_loss: Vec<usize> = (0..shapes.len()).filter(|i| seq_n(*i) > 0.0).collect();
        let s_count = with_loss.len() as f64;
        let reference = if with_loss.is_empty() {
            0.0
        } else {
            match mode {
                LossAggMode::TokenMean => {
                    with_loss.iter().map(|i| seq_sum(*i)).sum::<f64>()
                        / with_loss.iter().map(|i| seq_n(*i)).sum::<f64>()
                }
                LossAggMode::SeqMeanTokenSum => with_loss.iter().map(|i| seq_sum(*i)).sum::<f64>() / s_count,
                LossAggMode::SeqMeanTokenMean => {
                    with_loss.iter().map(|i| seq_sum(*i) / seq_n(*i)).sum::<f64>() / s_count
                }
                LossAggMode::SeqMeanTokenSumNorm => {
                    with_loss.iter().map(|i| seq_sum(*i) / constant).sum::<f64>() / s_count
                }
                LossAggMode::EpisodeMean => {
                    let mut per_episode = Vec::new();
                    for e in 0..eps.len() {
                        let members: Vec<usize> = with_loss.iter().copied().filter(|i| shapes[*i].episode == e).collect();
                        if members.is_empty() { continue; }
                        let sum: f64 = members.iter().map(|i| seq_sum(*i)).sum();
                        let n: f64 = members.iter().map(|i| seq_n(*i)).sum();
                        per_episode.push(sum / n);
                    }
                    per_episode.iter().sum::<f64>() / per_episode.len() as f64
                }
            }
        };

        // Any two splits: every sequence exactly once, within budget, same total.
        let lengths: Vec<usize> = shapes.iter().map(|s| s.loss_mask.len()).collect();
        let longest = lengths.iter().copied().max().unwrap_or(1);
        let mut totals = Vec::new();
        for budget in [longest + budgets.0, longest + budgets.1, longest] {
            let bins = pack(&lengths, budget);
            let mut seen: Vec<usize> = bins.concat();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..shapes.len()).collect::<Vec<_>>());
            let mut total = 0.0;
            for bin in &bins {
                prop_assert!(bin.iter().map(|i| lengths[*i]).sum::<usize>() <= budget);
                let mut micro = 0.0;
                for &i in bin {
                    for (w, l) in weights[i].iter().zip(&losses[i]) {
                        micro += w * l;
                    }
                }
                total += micro;
            }
            totals.push(total);
        }
        for total in &totals {
            prop_assert!(close(*total, reference), "{total} != {reference} ({mode:?})");
        }
    }
}
