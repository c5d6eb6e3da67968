//! The run report: what was read, what was dropped and why, where ids came from, how
//! much drift was seen, how calls merged, and what was written. Written as
//! `report.json` and printed as a table ([`Report::table`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// How many examples of each drop reason the report keeps.
const EXAMPLES_PER_REASON: usize = 3;

/// Counts of records and episodes read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InputCounts {
    /// New segments read.
    pub segments: u64,
    /// Pending segments read again.
    pub reread_segments: u64,
    /// Segments skipped as unreadable (with `ingest.skip_unreadable_segments`).
    pub unreadable_segments: u64,
    /// Records passed over as larger than the segment reader's limit (64 MiB); the other
    /// records of their segments were read.
    pub oversized_records: u64,
    /// Records read, duplicates included.
    pub records: u64,
    /// Records dropped as duplicates of an earlier one (same id).
    pub duplicate_records: u64,
    /// Episodes seen.
    pub episodes: u64,
    /// Episodes not ended yet, left for the next run.
    pub pending_episodes: u64,
    /// Calls seen in episodes.
    pub calls: u64,
}

/// Drops by unit and reason.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Dropped {
    /// Calls, by reason.
    pub calls: BTreeMap<String, u64>,
    /// Episodes, by reason.
    pub episodes: BTreeMap<String, u64>,
    /// Sequences, by reason.
    pub sequences: BTreeMap<String, u64>,
    /// Groups dropped whole, by reason (their episodes are also counted).
    pub groups: BTreeMap<String, u64>,
    /// The first ids or messages seen for each reason.
    pub examples: BTreeMap<String, Vec<String>>,
}

/// Where ids came from, and the drift between recorded ids and text.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TokenizeCounts {
    /// Calls tokenized.
    pub calls: u64,
    /// Prompts taken from recorded ids.
    pub prompts_recorded: u64,
    /// Prompts rendered and tokenized here.
    pub prompts_from_text: u64,
    /// Completions taken from recorded ids.
    pub completions_recorded: u64,
    /// Completions tokenized here.
    pub completions_from_text: u64,
    /// Recorded prompts compared with their render.
    pub prompts_compared: u64,
    /// ... of which differed, by kind.
    pub prompt_drift: BTreeMap<String, u64>,
    /// Recorded completions compared with their text.
    pub completions_compared: u64,
    /// ... of which differed, by kind.
    pub completion_drift: BTreeMap<String, u64>,
}

/// How calls merged into sequences.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MergeCounts {
    /// Calls merged (after tokenization).
    pub calls: u64,
    /// Sequences made.
    pub sequences: u64,
    /// Calls that extended the previous call's sequence.
    pub merged: u64,
    /// `merged / (calls - episodes)`: the share of possible joins that held.
    pub merge_rate: f64,
    /// Why a call started a new sequence, by kind (`other`: the history changed).
    pub breaks: BTreeMap<String, u64>,
    /// Number of episodes per sequence count.
    pub sequences_per_episode: BTreeMap<u64, u64>,
}

/// Rewards and advantages.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AdvantageCounts {
    /// The estimator used.
    pub estimator: String,
    /// Groups trained on.
    pub groups: u64,
    /// Episodes trained on.
    pub episodes: u64,
    /// Mean episode reward.
    pub reward_mean: f64,
    /// Smallest episode reward.
    pub reward_min: f64,
    /// Largest episode reward.
    pub reward_max: f64,
    /// Mean absolute advantage over sampled tokens.
    pub advantage_abs_mean: f64,
    /// Each named episode-level reward component (unweighted) over the episodes trained
    /// on that have it.
    pub reward_components: BTreeMap<String, ComponentStats>,
}

/// One named reward component over the episodes that reported it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ComponentStats {
    /// Episodes with it.
    pub episodes: u64,
    /// Its mean.
    pub mean: f64,
    /// Its smallest value.
    pub min: f64,
    /// Its largest value.
    pub max: f64,
}

/// What was written.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BatchCounts {
    /// Loss aggregation mode.
    pub loss_agg_mode: String,
    /// Mini-batches (optimizer steps).
    pub mini_batches: u64,
    /// Micro-batches in all.
    pub micro_batches: u64,
    /// Sequences in all.
    pub sequences: u64,
    /// Tokens in all.
    pub tokens: u64,
    /// Tokens with loss (sampled by the model).
    pub loss_tokens: u64,
    /// Sampled tokens with a recorded inference log-probability.
    pub tokens_with_logprobs: u64,
}

/// Policy versions of the calls trained on (`[clean] policy`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PolicyCounts {
    /// The policy.
    pub policy: Option<String>,
    /// Its version announced when the run started.
    pub latest_version: Option<u64>,
    /// `[clean] max_policy_lag`.
    pub max_lag: Option<u64>,
    /// Calls of the episodes kept, by lag (`latest − version`; `unversioned` for calls
    /// without a version).
    pub calls_by_lag: BTreeMap<String, u64>,
    /// Calls of the episodes dropped as `stale_policy`.
    pub stale_calls: u64,
}

/// Everything a run reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// What was read.
    pub input: InputCounts,
    /// What was dropped.
    pub dropped: Dropped,
    /// Tokenization.
    pub tokenize: TokenizeCounts,
    /// Merging.
    pub merge: MergeCounts,
    /// Advantages.
    pub advantages: AdvantageCounts,
    /// Output.
    pub batches: BatchCounts,
    /// Policy versions and lags.
    pub policy: PolicyCounts,
}

fn bump(map: &mut BTreeMap<String, u64>, key: &str, n: u64) {
    *map.entry(key.to_owned()).or_default() += n;
}

impl Report {
    fn example(&mut self, reason: &str, what: &str) {
        let list = self.dropped.examples.entry(reason.to_owned()).or_default();
        if list.len() < EXAMPLES_PER_REASON {
            list.push(what.to_owned());
        }
    }

    /// Counts a dropped call.
    pub fn drop_call(&mut self, reason: &str, example: &str) {
        bump(&mut self.dropped.calls, reason, 1);
        self.example(reason, example);
    }

    /// Counts `n` dropped calls without examples.
    pub fn drop_calls(&mut self, reason: &str, n: u64) {
        if n > 0 {
            bump(&mut self.dropped.calls, reason, n);
        }
    }

    /// Counts a dropped episode.
    pub fn drop_episode(&mut self, reason: &str, example: &str) {
        bump(&mut self.dropped.episodes, reason, 1);
        self.example(reason, example);
    }

    /// Counts a dropped sequence.
    pub fn drop_sequence(&mut self, reason: &str, example: &str) {
        bump(&mut self.dropped.sequences, reason, 1);
        self.example(reason, example);
    }

    /// Counts a dropped group.
    pub fn drop_group(&mut self, reason: &str, example: &str) {
        bump(&mut self.dropped.groups, reason, 1);
        self.example(reason, example);
    }

    /// Counts a drift of a recorded prompt.
    pub fn prompt_drift(&mut self, kind: &str) {
        bump(&mut self.tokenize.prompt_drift, kind, 1);
    }

    /// Counts a drift of a recorded completion.
    pub fn completion_drift(&mut self, kind: &str) {
        bump(&mut self.tokenize.completion_drift, kind, 1);
    }

    /// Counts a merge break.
    pub fn merge_break(&mut self, kind: &str) {
        bump(&mut self.merge.breaks, kind, 1);
    }

    /// The report as a readable table.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let row = |t: &mut String, k: &str, v: String| {
            let _ = writeln!(t, "  {k:<34} {v:>12}");
        };
        let i = &self.input;
        let _ = writeln!(t, "input");
        row(
            &mut t,
            "segments (new / re-read)",
            format!("{} / {}", i.segments, i.reread_segments),
        );
        if i.unreadable_segments > 0 {
            row(
                &mut t,
                "unreadable segments skipped",
                i.unreadable_segments.to_string(),
            );
        }
        if i.oversized_records > 0 {
            row(
                &mut t,
                "oversized records skipped",
                i.oversized_records.to_string(),
            );
        }
        row(&mut t, "records", i.records.to_string());
        row(&mut t, "duplicate records", i.duplicate_records.to_string());
        row(&mut t, "episodes", i.episodes.to_string());
        row(
            &mut t,
            "pending episodes (not ended yet)",
            i.pending_episodes.to_string(),
        );
        row(&mut t, "calls", i.calls.to_string());
        let p = &self.policy;
        if let (Some(name), Some(latest)) = (&p.policy, p.latest_version) {
            let _ = writeln!(t, "policy {name} (announced v{latest})");
            for (lag, n) in &p.calls_by_lag {
                row(&mut t, &format!("calls at lag {lag}"), n.to_string());
            }
            if p.stale_calls > 0 {
                row(&mut t, "calls of stale episodes", p.stale_calls.to_string());
            }
        }
        let d = &self.dropped;
        for (unit, map) in [
            ("calls", &d.calls),
            ("episodes", &d.episodes),
            ("sequences", &d.sequences),
            ("groups", &d.groups),
        ] {
            if !map.is_empty() {
                let _ = writeln!(t, "dropped {unit}");
                for (reason, n) in map {
                    row(&mut t, reason, n.to_string());
                }
            }
        }
        let k = &self.tokenize;
        let _ = writeln!(t, "tokenize");
        row(&mut t, "calls", k.calls.to_string());
        row(
            &mut t,
            "prompts recorded / from text",
            format!("{} / {}", k.prompts_recorded, k.prompts_from_text),
        );
        row(
            &mut t,
            "completions recorded / from text",
            format!("{} / {}", k.completions_recorded, k.completions_from_text),
        );
        let drifted = |m: &BTreeMap<String, u64>| m.values().sum::<u64>();
        row(
            &mut t,
            "prompt drift (of compared)",
            format!("{} / {}", drifted(&k.prompt_drift), k.prompts_compared),
        );
        for (kind, n) in &k.prompt_drift {
            row(&mut t, &format!("  {kind}"), n.to_string());
        }
        row(
            &mut t,
            "completion drift (of compared)",
            format!(
                "{} / {}",
                drifted(&k.completion_drift),
                k.completions_compared
            ),
        );
        for (kind, n) in &k.completion_drift {
            row(&mut t, &format!("  {kind}"), n.to_string());
        }
        let m = &self.merge;
        let _ = writeln!(t, "merge");
        row(
            &mut t,
            "calls -> sequences",
            format!("{} -> {}", m.calls, m.sequences),
        );
        row(&mut t, "merge rate", format!("{:.3}", m.merge_rate));
        let episodes: u64 = m.sequences_per_episode.values().sum();
        if episodes > 0 {
            row(
                &mut t,
                "sequences per episode (mean)",
                format!("{:.2}", m.sequences as f64 / episodes as f64),
            );
        }
        for (kind, n) in &m.breaks {
            row(&mut t, &format!("break: {kind}"), n.to_string());
        }
        let a = &self.advantages;
        let _ = writeln!(t, "advantages ({})", a.estimator);
        row(
            &mut t,
            "groups / episodes",
            format!("{} / {}", a.groups, a.episodes),
        );
        row(
            &mut t,
            "reward mean [min, max]",
            format!(
                "{:.4} [{:.4}, {:.4}]",
                a.reward_mean, a.reward_min, a.reward_max
            ),
        );
        row(
            &mut t,
            "mean |advantage| per token",
            format!("{:.4}", a.advantage_abs_mean),
        );
        let b = &self.batches;
        let _ = writeln!(t, "batches ({})", b.loss_agg_mode);
        row(
            &mut t,
            "mini-batches / micro-batches",
            format!("{} / {}", b.mini_batches, b.micro_batches),
        );
        row(&mut t, "sequences", b.sequences.to_string());
        row(
            &mut t,
            "tokens (with loss)",
            format!("{} ({})", b.tokens, b.loss_tokens),
        );
        row(
            &mut t,
            "loss tokens with logprobs",
            b.tokens_with_logprobs.to_string(),
        );
        t
    }
}
