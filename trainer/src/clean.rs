//! Stage 2: drop what cannot be trained on, each with a named reason and a count.
//!
//! Episode checks, in this order (the first that applies names the drop):
//! `never_ended` (no end event and quiet for longer than the grace period; episodes
//! still within it are *pending*: neither trained nor dropped, read again next run),
//! `incomplete` (the sidecar flagged dropped records), `non_finite_reward`,
//! `no_reward` (no final reward and no weighted component), then — after the call
//! checks — `no_calls`, and last `stale_policy` (with `[clean] max_policy_lag = K`: a
//! call served by version `v` of the policy while `latest` is announced, `latest − v >
//! K`; `latest` is read once, when the run starts).
//!
//! Policy versions: a call the sidecar sent to an announced version records it as a
//! number (`--policy`, see `tapline_proto::policy`); every other call (before the first
//! announcement, another model) has no version, is never stale, and is counted as
//! `unversioned` in the report's lag histogram.
//!
//! Call checks: `call_failed` (any outcome but OK, or a non-2xx status),
//! `call_aborted` (the client went away), `capture_truncated` (request or response body
//! cut at the capture cap), `no_completion`, `duplicate_retry` (an earlier call of the
//! episode with the same prompt — recorded prompt ids, else `messages`/`tools`/`prompt`
//! of the request — is dropped and the last kept). Unattributed calls are counted by
//! ingest and reported here as `unattributed`.
//!
//! Later stages add `over_length` sequences, tokenization failures and
//! `zero_variance_group` (see [`zero_variance_groups`]).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};
use tapline_proto::{LlmCall, Outcome};

use crate::advantages::RewardOptions;
use crate::ingest::Episode;
use crate::report::Report;

/// Settings of the clean stage (section `[clean]` of the run config).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CleanOptions {
    /// An episode with no end event whose latest record is older than this many seconds
    /// is dropped as `never_ended`; a younger one waits for the next run (default
    /// 3600).
    pub grace_period_secs: u64,
    /// Longest sequence, in tokens, that is trained on (default 32768).
    pub max_seq_len: usize,
    /// Drop groups whose episodes all have the same reward: their advantages are all
    /// zero under every estimator (default true).
    pub drop_zero_variance_groups: bool,
    /// The policy the calls' versions belong to (the sidecars' `--policy`, the name
    /// `publish` announces); its announced version is read when the run starts.
    pub policy: Option<String>,
    /// Largest lag, in versions, of a call trained on: an episode with a call served
    /// more than this many versions before the announced one is dropped as
    /// `stale_policy` (default: no limit; needs `policy`).
    pub max_policy_lag: Option<u64>,
}

impl Default for CleanOptions {
    fn default() -> Self {
        CleanOptions {
            grace_period_secs: 3600,
            max_seq_len: 32768,
            drop_zero_variance_groups: true,
            policy: None,
            max_policy_lag: None,
        }
    }
}

/// An episode that passed the checks.
#[derive(Debug, Clone)]
pub struct CleanEpisode {
    /// The episode id.
    pub episode_id: String,
    /// Its task.
    pub task_id: String,
    /// Its comparison group within the task.
    pub group_id: String,
    /// The combined episode reward (see [`RewardOptions`]).
    pub reward: f64,
    /// Per-call rewards by span id, combined the same way.
    pub call_rewards: HashMap<String, f64>,
    /// The latest value of each named episode-level reward, unweighted (those without a
    /// weight too): what the combined reward is made of, for watching a run.
    pub components: BTreeMap<String, f64>,
    /// The calls that passed, in order.
    pub calls: Vec<LlmCall>,
}

/// The episodes to train on and the ids of those still pending.
#[derive(Debug, Default)]
pub struct Cleaned {
    /// Episodes that passed.
    pub episodes: Vec<CleanEpisode>,
    /// Episodes without an end event, within the grace period.
    pub pending: Vec<String>,
}

/// Applies the episode and call checks; counts every drop in `report`.
pub fn clean(
    episodes: Vec<Episode>,
    options: &CleanOptions,
    rewards: &RewardOptions,
    now_unix_nanos: i64,
    report: &mut Report,
) -> Cleaned {
    let grace = i64::try_from(options.grace_period_secs)
        .unwrap_or(i64::MAX / 1_000_000_000)
        .saturating_mul(1_000_000_000);
    let mut out = Cleaned::default();
    for episode in episodes {
        let id = episode.episode_id.clone();
        let Some(end) = &episode.end else {
            if now_unix_nanos.saturating_sub(episode.last_activity_unix_nanos) <= grace {
                out.pending.push(id);
            } else {
                report.drop_episode("never_ended", &id);
            }
            continue;
        };
        let incomplete = [episode.start.as_ref(), Some(end)]
            .into_iter()
            .flatten()
            .any(|e| e.incomplete || e.dropped_records > 0);
        if incomplete {
            report.drop_episode("incomplete", &id);
            continue;
        }
        let combined = match combine_rewards(&episode, rewards) {
            Ok(c) => c,
            Err(reason) => {
                report.drop_episode(reason, &id);
                continue;
            }
        };
        let calls = clean_calls(episode.calls, report);
        if calls.is_empty() {
            report.drop_episode("no_calls", &id);
            continue;
        }
        if let Some(latest) = report.policy.latest_version {
            let lags: Vec<Option<u64>> = calls.iter().map(|c| policy_lag(c, latest)).collect();
            let stale = options
                .max_policy_lag
                .is_some_and(|k| lags.iter().flatten().any(|lag| *lag > k));
            if stale {
                report.policy.stale_calls += calls.len() as u64;
                report.drop_episode("stale_policy", &id);
                continue;
            }
            for lag in lags {
                let key = lag.map_or_else(|| "unversioned".to_owned(), |l| l.to_string());
                *report.policy.calls_by_lag.entry(key).or_default() += 1;
            }
        }
        out.episodes.push(CleanEpisode {
            episode_id: id,
            task_id: episode.task_id,
            group_id: episode.group_id,
            reward: combined.0,
            call_rewards: combined.1,
            components: combined.2,
            calls,
        });
    }
    out
}

/// How many versions `call` is behind `latest`: `None` when the call has no version (a
/// version newer than `latest`, announced after the run started, counts as 0).
pub fn policy_lag(call: &LlmCall, latest: u64) -> Option<u64> {
    call.policy_version
        .parse::<u64>()
        .ok()
        .map(|v| latest.saturating_sub(v))
}

type Combined = (f64, HashMap<String, f64>, BTreeMap<String, f64>);

/// The episode reward, per-call rewards and the named episode-level components: for each
/// (span, name) the latest reward counts; unnamed rewards weigh `final_reward_weight`,
/// named ones their weight in `reward_weights` (names without a weight are ignored by
/// the combined reward, and still reported as components).
fn combine_rewards(episode: &Episode, options: &RewardOptions) -> Result<Combined, &'static str> {
    // Rewards are sorted by time, so later inserts win.
    let mut latest: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    for r in &episode.rewards {
        latest.insert((r.span_id.as_str(), r.name.as_str()), r.value);
    }
    let weight = |name: &str| {
        if name.is_empty() {
            Some(options.final_reward_weight)
        } else {
            options.reward_weights.get(name).copied()
        }
    };
    let mut total = 0.0;
    let mut any = false;
    let mut per_call: HashMap<String, f64> = HashMap::new();
    let mut components = BTreeMap::new();
    for ((span, name), value) in latest {
        if span.is_empty() && !name.is_empty() && value.is_finite() {
            components.insert(name.to_owned(), value);
        }
        let Some(w) = weight(name) else { continue };
        if !value.is_finite() {
            return Err("non_finite_reward");
        }
        if span.is_empty() {
            total += w * value;
            any = true;
        } else {
            *per_call.entry(span.to_owned()).or_default() += w * value;
        }
    }
    if !any {
        return Err("no_reward");
    }
    if !total.is_finite() {
        return Err("non_finite_reward");
    }
    Ok((total, per_call, components))
}

fn clean_calls(calls: Vec<LlmCall>, report: &mut Report) -> Vec<LlmCall> {
    let mut kept = Vec::with_capacity(calls.len());
    for call in calls {
        let reason = match call.outcome() {
            Outcome::Ok if (200..300).contains(&call.http_status) => None,
            Outcome::ClientAborted => Some("call_aborted"),
            _ => Some("call_failed"),
        }
        .or_else(|| {
            (call.request_truncated || call.response_truncated).then_some("capture_truncated")
        })
        .or_else(|| call.completions.is_empty().then_some("no_completion"));
        match reason {
            Some(reason) => report.drop_call(reason, &call.span_id),
            None => kept.push(call),
        }
    }
    // Duplicate retries: keep the last call of each prompt.
    let keys: Vec<u64> = kept.iter().map(prompt_key).collect();
    let mut last: HashMap<u64, usize> = HashMap::new();
    for (i, k) in keys.iter().enumerate() {
        last.insert(*k, i);
    }
    let mut out = Vec::with_capacity(kept.len());
    for (i, call) in kept.into_iter().enumerate() {
        if last.get(&keys[i]) == Some(&i) {
            out.push(call);
        } else {
            report.drop_call("duplicate_retry", &call.span_id);
        }
    }
    out
}

/// Identity of a call's prompt.
fn prompt_key(call: &LlmCall) -> u64 {
    let mut h = DefaultHasher::new();
    if call.prompt_token_ids.is_empty() {
        match serde_json::from_slice::<serde_json::Value>(&call.request_body) {
            Ok(body) => {
                for field in ["messages", "tools", "prompt", "chat_template_kwargs"] {
                    body.get(field).map(|v| v.to_string()).hash(&mut h);
                }
            }
            Err(_) => call.request_body.hash(&mut h),
        }
    } else {
        call.prompt_token_ids.hash(&mut h);
    }
    h.finish()
}

/// Indexes of groups whose rewards are all equal (a group of one included).
pub fn zero_variance_groups(rewards_by_group: &[Vec<f64>]) -> Vec<usize> {
    rewards_by_group
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            let min = r.iter().copied().fold(f64::INFINITY, f64::min);
            let max = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            r.len() <= 1 || max - min <= 1e-12 * max.abs().max(min.abs()).max(1.0)
        })
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tapline_proto::{Completion, EpisodeEvent, Reward};

    fn ok_call(span: &str, body: &str) -> LlmCall {
        LlmCall {
            span_id: span.into(),
            outcome: Outcome::Ok as i32,
            http_status: 200,
            request_body: body.as_bytes().to_vec().into(),
            completions: vec![Completion::default()],
            ..LlmCall::default()
        }
    }

    fn reward(span: &str, name: &str, value: f64, t: i64) -> Reward {
        Reward {
            reward_id: format!("{span}{name}{t}"),
            span_id: span.into(),
            name: name.into(),
            value,
            time_unix_nanos: t,
            ..Reward::default()
        }
    }

    fn ended(id: &str, calls: Vec<LlmCall>, rewards: Vec<Reward>) -> Episode {
        Episode {
            episode_id: id.into(),
            task_id: "t".into(),
            end: Some(EpisodeEvent::default()),
            calls,
            rewards,
            last_activity_unix_nanos: 0,
            ..Episode::default()
        }
    }

    #[test]
    fn every_drop_has_its_reason() {
        let mut report = Report::default();
        let mut failed = ok_call("f", "{}");
        failed.outcome = Outcome::UpstreamError as i32;
        let mut aborted = ok_call("a", "{}");
        aborted.outcome = Outcome::ClientAborted as i32;
        let mut truncated = ok_call("t", "{}");
        truncated.response_truncated = true;
        let mut empty = ok_call("e", "{}");
        empty.completions.clear();
        let retry_a = ok_call("r1", r#"{"messages": [1]}"#);
        let retry_b = ok_call("r2", r#"{"messages": [1], "temperature": 1}"#);
        let good = ok_call("g", r#"{"messages": [2]}"#);
        let mut incomplete = ended("inc", vec![good.clone()], vec![reward("", "", 1.0, 1)]);
        incomplete.end.as_mut().unwrap().incomplete = true;
        let mut open_old = ended("old", vec![good.clone()], vec![]);
        open_old.end = None;
        let mut open_new = open_old.clone();
        open_new.episode_id = "new".into();
        open_new.last_activity_unix_nanos = 10_000_000_000_000;
        let episodes = vec![
            ended(
                "main",
                vec![
                    failed,
                    aborted,
                    truncated,
                    empty,
                    retry_a,
                    retry_b,
                    good.clone(),
                ],
                vec![
                    reward("", "", 0.0, 1),
                    reward("", "", 2.0, 2),
                    reward("", "tests", 1.0, 1),
                    reward("g", "", 0.5, 1),
                ],
            ),
            ended("nan", vec![good.clone()], vec![reward("", "", f64::NAN, 1)]),
            ended(
                "none",
                vec![good.clone()],
                vec![reward("", "ignored_component", 1.0, 1)],
            ),
            ended("nocalls", vec![], vec![reward("", "", 1.0, 1)]),
            incomplete,
            open_old,
            open_new,
        ];
        let rewards = RewardOptions {
            final_reward_weight: 1.0,
            reward_weights: [("tests".to_owned(), 0.5)].into(),
        };
        let out = clean(
            episodes,
            &CleanOptions::default(),
            &rewards,
            10_000_000_000_000 + 1,
            &mut report,
        );
        assert_eq!(out.pending, ["new"]);
        assert_eq!(out.episodes.len(), 1);
        let main = &out.episodes[0];
        assert_eq!(main.reward, 2.0 + 0.5);
        assert_eq!(main.call_rewards["g"], 0.5);
        // The named component unweighted; the final reward and per-call ones are not
        // components.
        assert_eq!(main.components, [("tests".to_owned(), 1.0)].into());
        let spans: Vec<_> = main.calls.iter().map(|c| c.span_id.as_str()).collect();
        assert_eq!(spans, ["r2", "g"]);
        let d = &report.dropped;
        for (reason, n) in [
            ("call_failed", 1),
            ("call_aborted", 1),
            ("capture_truncated", 1),
            ("no_completion", 1),
            ("duplicate_retry", 1),
        ] {
            assert_eq!(d.calls.get(reason), Some(&n), "{reason}: {d:?}");
        }
        for reason in [
            "non_finite_reward",
            "no_reward",
            "no_calls",
            "incomplete",
            "never_ended",
        ] {
            assert_eq!(d.episodes.get(reason), Some(&1), "{reason}: {d:?}");
        }
    }

    #[test]
    fn episodes_with_calls_too_far_behind_the_announced_policy_are_stale() {
        let call = |span: &str, prompt: &str, version: &str| {
            let mut c = ok_call(span, prompt);
            c.policy_version = version.into();
            c
        };
        let final_reward = || vec![reward("", "", 1.0, 1)];
        let episodes = vec![
            // v2 is 3 behind v5: stale with a lag limit of 2, whatever its other calls.
            ended(
                "old",
                vec![
                    call("a", r#"{"messages":[1]}"#, "2"),
                    call("b", r#"{"messages":[2]}"#, "5"),
                ],
                final_reward(),
            ),
            ended(
                "fresh",
                vec![
                    call("c", r#"{"messages":[3]}"#, "3"),
                    call("d", r#"{"messages":[4]}"#, "5"),
                ],
                final_reward(),
            ),
            // No version (base model, another model): never stale.
            ended(
                "base",
                vec![call("e", r#"{"messages":[5]}"#, "Qwen/Qwen3-8B")],
                final_reward(),
            ),
            // Announced after the run started: lag 0.
            ended(
                "newer",
                vec![call("f", r#"{"messages":[6]}"#, "6")],
                final_reward(),
            ),
        ];
        let options = CleanOptions {
            policy: Some("coder".into()),
            max_policy_lag: Some(2),
            ..CleanOptions::default()
        };
        let mut report = Report::default();
        report.policy.latest_version = Some(5);
        let out = clean(
            episodes.clone(),
            &options,
            &RewardOptions::default(),
            0,
            &mut report,
        );
        let kept: Vec<_> = out.episodes.iter().map(|e| e.episode_id.as_str()).collect();
        assert_eq!(kept, ["fresh", "base", "newer"]);
        assert_eq!(report.dropped.episodes.get("stale_policy"), Some(&1));
        assert_eq!(report.dropped.examples["stale_policy"], ["old"]);
        assert_eq!(report.policy.stale_calls, 2);
        let lags: Vec<(&str, u64)> = report
            .policy
            .calls_by_lag
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(lags, [("0", 2), ("2", 1), ("unversioned", 1)]);

        // Without a limit nothing is stale, and the histogram counts every call.
        let mut report = Report::default();
        report.policy.latest_version = Some(5);
        let unlimited = CleanOptions {
            max_policy_lag: None,
            ..options
        };
        let out = clean(
            episodes,
            &unlimited,
            &RewardOptions::default(),
            0,
            &mut report,
        );
        assert_eq!(out.episodes.len(), 4);
        assert_eq!(report.policy.calls_by_lag["3"], 1);
    }

    #[test]
    fn zero_variance_includes_singletons() {
        let groups = vec![
            vec![1.0, 1.0],
            vec![0.0, 1.0],
            vec![3.0],
            vec![0.1 + 0.2, 0.3],
        ];
        assert_eq!(zero_variance_groups(&groups), [0, 2, 3]);
    }
}
