//! The stages after ingest, in order, as one pure function: [`prepare`] turns joined
//! episodes into mini-batches and a report. No IO: ingest reads the store before it,
//! `crate::output` writes the result after it.

use std::collections::{BTreeMap, BTreeSet};

use crate::advantages::{self, EpisodeInput, GroupBy};
use crate::clean::{self, CleanEpisode};
use crate::config::RunConfig;
use crate::drift::{self, DriftKind, Relation};
use crate::ingest::Ingested;
use crate::merge::{self, Sequence};
use crate::model::Model;
use crate::report::Report;
use crate::schedule::{self, SeqShape};
use crate::tokenize::{self, DriftCheck, IdSource};

pub use crate::batch::{MicroBatch, MiniBatch, TrainSequence};

/// The result of [`prepare`].
#[derive(Debug, Default)]
pub struct Prepared {
    /// The mini-batches, in training order.
    pub mini_batches: Vec<MiniBatch>,
    /// What happened.
    pub report: Report,
    /// Episodes not ended yet, with the segments holding their records.
    pub pending: BTreeMap<String, BTreeSet<String>>,
}

struct Ready {
    episode: CleanEpisode,
    call_spans: Vec<String>,
    sequences: Vec<Sequence>,
}

/// Runs clean → tokenize → merge → advantages → schedule. `now_unix_nanos` decides which
/// unended episodes are past their grace period.
pub fn prepare(
    ingested: Ingested,
    model: &Model,
    config: &RunConfig,
    now_unix_nanos: i64,
) -> Prepared {
    let mut report = Report::default();
    report.policy = crate::report::PolicyCounts {
        policy: config.clean.policy.clone(),
        latest_version: ingested.latest_policy_version,
        max_lag: config.clean.max_policy_lag,
        ..Default::default()
    };
    report.input.records = ingested.records;
    report.input.duplicate_records = ingested.duplicate_records;
    report.input.episodes = ingested.episodes.len() as u64;
    report.input.calls = ingested.episodes.iter().map(|e| e.calls.len() as u64).sum();
    report.drop_calls("unattributed", ingested.unattributed_calls);
    let segments_of: BTreeMap<String, BTreeSet<String>> = ingested
        .episodes
        .iter()
        .filter(|e| e.end.is_none())
        .map(|e| (e.episode_id.clone(), e.segments.clone()))
        .collect();

    let cleaned = clean::clean(
        ingested.episodes,
        &config.clean,
        &config.rewards,
        now_unix_nanos,
        &mut report,
    );
    report.input.pending_episodes = cleaned.pending.len() as u64;
    let pending = cleaned
        .pending
        .iter()
        .map(|e| (e.clone(), segments_of.get(e).cloned().unwrap_or_default()))
        .collect();

    // Tokenize and merge, episode by episode.
    let mut ready: Vec<Ready> = Vec::new();
    for episode in cleaned.episodes {
        let mut calls = Vec::with_capacity(episode.calls.len());
        for call in &episode.calls {
            match tokenize::tokenize_call(model, call, &config.tokenize) {
                Ok(t) => {
                    count_tokenized(&mut report, &t);
                    calls.push(t);
                }
                Err(e) => report.drop_call(e.reason(), &format!("{}: {e}", call.span_id)),
            }
        }
        if calls.is_empty() {
            report.drop_episode("no_calls", &episode.episode_id);
            continue;
        }
        let merged = merge::merge_episode(&calls, |expected, actual| {
            drift::classify(model, expected, actual, Relation::Prefix).unwrap_or(DriftKind::Other)
        });
        report.merge.calls += calls.len() as u64;
        report.merge.merged += merged.merged;
        for kind in &merged.breaks {
            report.merge_break(kind.name());
        }
        let mut sequences = merged.sequences;
        sequences.retain(|s| {
            let keep = s.len() <= config.clean.max_seq_len;
            if !keep {
                report.drop_sequence(
                    "over_length",
                    &format!("{}: {} tokens", episode.episode_id, s.len()),
                );
            }
            keep
        });
        if sequences.is_empty() {
            report.drop_episode("no_sequences", &episode.episode_id);
            continue;
        }
        report.merge.sequences += sequences.len() as u64;
        *report
            .merge
            .sequences_per_episode
            .entry(sequences.len() as u64)
            .or_default() += 1;
        ready.push(Ready {
            call_spans: calls.iter().map(|c| c.span_id.clone()).collect(),
            episode,
            sequences,
        });
    }
    let possible_joins = report.merge.calls.saturating_sub(ready.len() as u64);
    report.merge.merge_rate = if possible_joins == 0 {
        0.0
    } else {
        report.merge.merged as f64 / possible_joins as f64
    };

    // Groups; drop those without reward variance.
    let group_key = |e: &CleanEpisode| match config.advantages.group_by {
        GroupBy::TaskAndGroup => (e.task_id.clone(), e.group_id.clone()),
        GroupBy::Task => (e.task_id.clone(), String::new()),
    };
    let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    for (i, r) in ready.iter().enumerate() {
        groups.entry(group_key(&r.episode)).or_default().push(i);
    }
    let mut keep = vec![true; ready.len()];
    if config.clean.drop_zero_variance_groups {
        let keys: Vec<_> = groups.keys().cloned().collect();
        let rewards: Vec<Vec<f64>> = groups
            .values()
            .map(|m| m.iter().map(|&i| ready[i].episode.reward).collect())
            .collect();
        for g in clean::zero_variance_groups(&rewards) {
            let (task, group) = &keys[g];
            report.drop_group(
                "zero_variance_group",
                &format!("task {task:?} group {group:?}"),
            );
            for &i in &groups[&keys[g]] {
                keep[i] = false;
                report.drop_episode("zero_variance_group", &ready[i].episode.episode_id);
            }
        }
    }
    let mut index = 0;
    ready.retain(|_| {
        index += 1;
        keep[index - 1]
    });
    let mut group_of: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in &ready {
        let next = group_of.len();
        group_of.entry(group_key(&r.episode)).or_insert(next);
    }

    // Advantages.
    let inputs: Vec<EpisodeInput<'_>> = ready
        .iter()
        .map(|r| EpisodeInput {
            group: group_of[&group_key(&r.episode)],
            reward: r.episode.reward,
            call_rewards: &r.episode.call_rewards,
            calls: r.call_spans.len(),
            call_spans: &r.call_spans,
            sequences: &r.sequences,
        })
        .collect();
    let advantages = advantages::token_advantages(&inputs, &config.advantages);
    drop(inputs);
    let a = &mut report.advantages;
    a.estimator = config.advantages.estimator.name().to_owned();
    a.groups = group_of.len() as u64;
    a.episodes = ready.len() as u64;
    if !ready.is_empty() {
        let rewards: Vec<f64> = ready.iter().map(|r| r.episode.reward).collect();
        a.reward_mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
        a.reward_min = rewards.iter().copied().fold(f64::INFINITY, f64::min);
        a.reward_max = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    }
    for r in &ready {
        for (name, &value) in &r.episode.components {
            let c = a.reward_components.entry(name.clone()).or_insert_with(|| {
                crate::report::ComponentStats {
                    min: f64::INFINITY,
                    max: f64::NEG_INFINITY,
                    ..Default::default()
                }
            });
            c.episodes += 1;
            c.mean += value;
            c.min = c.min.min(value);
            c.max = c.max.max(value);
        }
    }
    for c in a.reward_components.values_mut() {
        c.mean /= c.episodes as f64;
    }
    let (mut abs_sum, mut loss_tokens) = (0.0, 0u64);
    for (r, adv) in ready.iter().zip(&advantages) {
        for (s, adv) in r.sequences.iter().zip(adv) {
            for (m, v) in s.loss_mask.iter().zip(adv) {
                if *m != 0 {
                    abs_sum += v.abs();
                    loss_tokens += 1;
                }
            }
        }
    }
    a.advantage_abs_mean = if loss_tokens == 0 {
        0.0
    } else {
        abs_sum / loss_tokens as f64
    };

    // Schedule.
    let mut episodes: Vec<Option<(Ready, Vec<Vec<f64>>)>> =
        ready.into_iter().zip(advantages).map(Some).collect();
    let s = &config.schedule;
    let mut mini_batches = Vec::new();
    for members in schedule::mini_batches(episodes.len(), s.mini_batch_episodes, s.seed) {
        let mut seqs: Vec<TrainSequence> = Vec::new();
        let mut episode_of: Vec<usize> = Vec::new();
        for (local, &i) in members.iter().enumerate() {
            let Some((r, adv)) = episodes[i].take() else {
                continue;
            };
            for (sequence, advantages) in r.sequences.into_iter().zip(adv) {
                seqs.push(TrainSequence {
                    episode_id: r.episode.episode_id.clone(),
                    task_id: r.episode.task_id.clone(),
                    group_id: r.episode.group_id.clone(),
                    reward: r.episode.reward,
                    sequence,
                    advantages,
                    weights: Vec::new(),
                });
                episode_of.push(local);
            }
        }
        let shapes: Vec<SeqShape<'_>> = seqs
            .iter()
            .zip(&episode_of)
            .map(|(t, &e)| SeqShape {
                episode: e,
                loss_mask: &t.sequence.loss_mask,
            })
            .collect();
        let (weights, normalizer) =
            schedule::loss_weights(s.loss_agg_mode, &shapes, config.norm_constant());
        drop(shapes);
        for (t, w) in seqs.iter_mut().zip(weights) {
            t.weights = w;
        }
        let lengths: Vec<usize> = seqs.iter().map(|t| t.sequence.len()).collect();
        let bins = schedule::pack(&lengths, s.micro_batch_tokens);
        let mut slots: Vec<Option<TrainSequence>> = seqs.into_iter().map(Some).collect();
        let micro_batches = bins
            .into_iter()
            .map(|bin| MicroBatch {
                sequences: bin.into_iter().filter_map(|i| slots[i].take()).collect(),
                recompute: false,
            })
            .collect();
        mini_batches.push(MiniBatch {
            micro_batches,
            normalizer,
        });
    }
    let b = &mut report.batches;
    b.loss_agg_mode = s.loss_agg_mode.name().to_owned();
    b.mini_batches = mini_batches.len() as u64;
    for mb in &mini_batches {
        b.micro_batches += mb.micro_batches.len() as u64;
        for t in mb.micro_batches.iter().flat_map(|m| &m.sequences) {
            b.sequences += 1;
            b.tokens += t.sequence.len() as u64;
            b.loss_tokens += t.sequence.loss_tokens() as u64;
            b.tokens_with_logprobs += t.sequence.logprobs.iter().flatten().count() as u64;
        }
    }
    Prepared {
        mini_batches,
        report,
        pending,
    }
}

fn count_tokenized(report: &mut Report, t: &tokenize::TokenizedCall) {
    let k = &mut report.tokenize;
    k.calls += 1;
    match t.prompt_source {
        IdSource::Recorded => k.prompts_recorded += 1,
        IdSource::Text => k.prompts_from_text += 1,
    }
    match t.completion_source {
        IdSource::Recorded => k.completions_recorded += 1,
        IdSource::Text => k.completions_from_text += 1,
    }
    match t.prompt_drift {
        DriftCheck::NotCompared => {}
        DriftCheck::Same => k.prompts_compared += 1,
        DriftCheck::Drift(kind) => {
            k.prompts_compared += 1;
            report.prompt_drift(kind.name());
        }
        DriftCheck::Failed(reason) => {
            k.prompts_compared += 1;
            report.prompt_drift(reason);
        }
    }
    let k = &mut report.tokenize;
    match t.completion_drift {
        DriftCheck::NotCompared => {}
        DriftCheck::Same => k.completions_compared += 1,
        DriftCheck::Drift(kind) => {
            k.completions_compared += 1;
            report.completion_drift(kind.name());
        }
        DriftCheck::Failed(reason) => {
            k.completions_compared += 1;
            report.completion_drift(reason);
        }
    }
}
