//! The HTML run report: `report.html` beside a run's `manifest.json`, one self-contained
//! page (inline CSS and SVG, no script, no network) that shows what the run trained on.
//!
//! It holds the curves of every step, the cleaning table (kept, dropped per reason),
//! merge outcomes, the tokenizer's sources and drift, the manifest (commit, config,
//! inputs with SHA-256, compute), policy versions and lag, and a sample of the trained
//! episodes with each token coloured by loss mask and advantage (the inference
//! log-prob on hover where it was recorded). `train` writes it with the samples it
//! took while holding the batches (`samples.json`, [`Samples`]); `tapline-trainer
//! report --run DIR` renders it again from those two files.
//!
//! Invariant: every string from a record, the config or the manifest is escaped
//! ([`escape`]): a prompt holding `<script>` shows as text.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Episodes sampled into the report at most.
pub const MAX_EPISODES: usize = 64;
/// Tokens shown per sampled sequence at most (the rest is counted).
pub const MAX_TOKENS: usize = 4096;
/// The samples file beside the manifest.
pub const SAMPLES_FILE: &str = "samples.json";

/// One token as the report shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Token {
    /// Its text.
    pub text: String,
    /// Trained on (the model sampled it).
    pub loss: bool,
    /// Its advantage (0 where not trained).
    pub advantage: f64,
    /// The inference log-prob, when recorded.
    pub logprob: Option<f64>,
    /// The trainer's log-prob of it before the update (loss tokens the trainer kept).
    #[serde(default)]
    pub trainer_logprob: Option<f64>,
}

/// One sampled sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Its episode.
    pub episode_id: String,
    /// The episode's task.
    pub task_id: String,
    /// The episode's combined reward.
    pub reward: f64,
    /// The calls merged into it.
    pub calls: usize,
    /// Its tokens, at most [`MAX_TOKENS`].
    pub tokens: Vec<Token>,
    /// Tokens left out after [`MAX_TOKENS`].
    pub tokens_left_out: usize,
}

/// The samples of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Samples {
    /// Episodes trained on in all.
    pub episodes: usize,
    /// The sampled sequences (every sequence of at most [`MAX_EPISODES`] episodes, spread
    /// over the run).
    pub samples: Vec<Sample>,
}

impl Samples {
    /// Samples the sequences of `mini_batches`: up to [`MAX_EPISODES`] episodes, evenly
    /// spaced over the run; `decode` turns token ids into text; `trainer` gives the
    /// trainer's old log-probs of a sequence's loss tokens by (mini-batch, micro-batch,
    /// sequence), where it kept them (`nn::train::TrainResult::old_logprobs`).
    pub fn take<'a>(
        mini_batches: &[crate::batch::MiniBatch],
        decode: impl Fn(&[u32]) -> String,
        trainer: impl Fn((usize, usize, usize)) -> Option<&'a [f32]>,
    ) -> Self {
        let sequences: Vec<((usize, usize, usize), &crate::batch::TrainSequence)> = mini_batches
            .iter()
            .enumerate()
            .flat_map(|(k, mb)| {
                mb.micro_batches
                    .iter()
                    .enumerate()
                    .flat_map(move |(m, micro)| {
                        micro
                            .sequences
                            .iter()
                            .enumerate()
                            .map(move |(i, s)| ((k, m, i), s))
                    })
            })
            .collect();
        let mut episodes: Vec<&str> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (_, s) in &sequences {
            if seen.insert(s.episode_id.as_str()) {
                episodes.push(&s.episode_id);
            }
        }
        let every = episodes.len().div_ceil(MAX_EPISODES).max(1);
        let chosen: std::collections::HashSet<&str> =
            episodes.iter().step_by(every).copied().collect();
        let samples = sequences
            .iter()
            .filter(|(_, s)| chosen.contains(s.episode_id.as_str()))
            .map(|(at, s)| {
                let q = &s.sequence;
                let ids = &q.token_ids;
                let shown = ids.len().min(MAX_TOKENS);
                let old = trainer(*at);
                let mut loss_index = 0;
                let tokens = (0..shown)
                    .map(|i| {
                        let loss = q.loss_mask.get(i).is_some_and(|m| *m != 0);
                        let trainer_logprob = if loss && i > 0 {
                            loss_index += 1;
                            old.and_then(|o| o.get(loss_index - 1))
                                .map(|v| f64::from(*v))
                        } else {
                            None
                        };
                        Token {
                            text: token_text(ids, i, &decode),
                            loss,
                            advantage: s.advantages.get(i).copied().unwrap_or(0.0),
                            logprob: q.logprobs.get(i).copied().flatten(),
                            trainer_logprob,
                        }
                    })
                    .collect();
                Sample {
                    episode_id: s.episode_id.clone(),
                    task_id: s.task_id.clone(),
                    reward: s.reward,
                    calls: q.spans.len(),
                    tokens,
                    tokens_left_out: ids.len() - shown,
                }
            })
            .collect();
        Samples {
            episodes: episodes.len(),
            samples,
        }
    }
}

/// The text of token `i`: what it adds to the token before it (so a character split
/// over two byte-level tokens shows whole on the second), else its own decoding.
fn token_text(ids: &[u32], i: usize, decode: &impl Fn(&[u32]) -> String) -> String {
    if i > 0 {
        let before = decode(&ids[i - 1..i]);
        let both = decode(&ids[i - 1..=i]);
        if let Some(rest) = both.strip_prefix(&before)
            && !before.ends_with('\u{FFFD}')
        {
            return rest.to_owned();
        }
    }
    decode(&ids[i..=i])
}

/// `s` with `& < > " '` escaped for HTML text and attributes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.2em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:1em}.chart{border:1px solid #ddd;padding:.3em;max-width:100%}
.chart svg{display:block;max-width:100%;height:auto}
pre{background:#f7f7f7;padding:.6em;overflow:auto;max-height:30em}
.seq{font:12px/1.6 ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;border:1px solid #ddd;padding:.5em;margin:.3em 0 1em}
.seq span.p{color:#777}.seq span.l{border-radius:2px}
.legend span{padding:0 .4em;margin-right:.5em}
.warn{background:#fff3cd;border:1px solid #e0c060;padding:.4em .6em}";

/// The size of a curve in the page, drawn 1:1 (two side by side on a wide screen).
const CHART_SIZE: (u32, u32) = (480, 300);

/// One curve of the run as inline SVG (plotters, through [`crate::chart`]).
fn chart(title: &str, points: &[(f64, f64)]) -> String {
    let panel = crate::chart::Panel {
        title: title.to_owned(),
        x_label: "step".into(),
        series: vec![crate::chart::Series {
            name: title.to_owned(),
            points: points.to_vec(),
        }],
    };
    let svg = crate::chart::render_svg_sized("", &[panel], CHART_SIZE);
    format!("<div class=\"chart\">{svg}</div>")
}

/// A two-column table of a JSON object's entries (nested objects as `a.b`).
fn kv_table(value: &Value) -> String {
    let mut out = String::from("<table>");
    for (k, v) in crate::flatten::leaves("", '.', value) {
        let v = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let _ = write!(
            out,
            "<tr><th>{}</th><td>{}</td></tr>",
            escape(&k),
            escape(&v)
        );
    }
    out.push_str("</table>");
    out
}

/// The background of a trained token: green for a positive advantage, red for a
/// negative one, stronger with its size (relative to `scale`).
fn token_style(t: &Token, scale: f64) -> String {
    let a = (t.advantage / scale).clamp(-1.0, 1.0);
    let alpha = 0.15 + 0.6 * a.abs();
    if a >= 0.0 {
        format!("background:rgba(40,160,60,{alpha:.2})")
    } else {
        format!("background:rgba(220,50,40,{alpha:.2})")
    }
}

/// The whole page for a run's `manifest` and `samples`.
pub fn render(manifest: &Value, samples: &Samples) -> String {
    let mut out = String::new();
    let run = manifest["run"].as_str().unwrap_or("(no cursor)");
    let dir = manifest["checkpoint"]["dir"].as_str().unwrap_or("");
    let _ = write!(
        out,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tapline run {r}</title><style>{STYLE}</style></head><body><h1>tapline run {r}</h1><p>{d} · tapline {v} · commit <code>{c}</code> · {m} training of {model}</p>",
        r = escape(run),
        d = escape(dir),
        v = escape(manifest["tapline_version"].as_str().unwrap_or("")),
        c = escape(manifest["git_commit"].as_str().unwrap_or("")),
        m = escape(manifest["mode"].as_str().unwrap_or("")),
        model = escape(manifest["model"]["dir"].as_str().unwrap_or("")),
    );

    // Curves.
    let steps = manifest["steps"].as_array().cloned().unwrap_or_default();
    out.push_str("<h2 id=\"curves\">Curves</h2><div class=\"charts\">");
    for (field, title) in [
        ("reward_mean", "mean reward"),
        ("loss", "loss"),
        ("grad_norm", "gradient norm (before clipping)"),
        ("kl", "KL to the start"),
        ("entropy", "entropy"),
        ("clip_fraction", "clip fraction"),
        ("ratio_mean", "importance ratio (mean)"),
        (
            "inference_logprob_abs_gap",
            "|log p trainer − log p engine|",
        ),
        ("tokens_per_second", "tokens / s"),
    ] {
        let points: Vec<(f64, f64)> = steps
            .iter()
            .filter_map(|s| Some((s["step"].as_f64()?, s[field].as_f64()?)))
            .collect();
        out.push_str(&chart(title, &points));
    }
    out.push_str("</div>");

    // Cleaning, tokenization, merge.
    let report = &manifest["report"];
    let input = &report["input"];
    let _ = write!(
        out,
        "<h2 id=\"cleaning\">Cleaning</h2><table><tr><th>read</th><td class=\"n\">{} records, {} episodes, {} calls</td></tr><tr><th>trained on</th><td class=\"n\">{} sequences, {} tokens ({} with loss)</td></tr></table>",
        input["records"],
        input["episodes"],
        input["calls"],
        report["batches"]["sequences"],
        report["batches"]["tokens"],
        report["batches"]["loss_tokens"],
    );
    out.push_str("<table><tr><th>dropped</th><th>reason</th><th>count</th><th>examples</th></tr>");
    let mut any = false;
    for unit in ["calls", "episodes", "sequences", "groups"] {
        if let Some(reasons) = report["dropped"][unit].as_object() {
            for (reason, n) in reasons {
                any = true;
                let examples = report["dropped"]["examples"][reason]
                    .as_array()
                    .map(|e| {
                        e.iter()
                            .filter_map(Value::as_str)
                            .map(escape)
                            .collect::<Vec<_>>()
                            .join("<br>")
                    })
                    .unwrap_or_default();
                let _ = write!(
                    out,
                    "<tr><td>{unit}</td><td>{}</td><td class=\"n\">{n}</td><td>{examples}</td></tr>",
                    escape(reason)
                );
            }
        }
    }
    if !any {
        out.push_str("<tr><td colspan=\"4\">nothing dropped</td></tr>");
    }
    out.push_str("</table>");
    out.push_str("<h2 id=\"rewards\">Rewards and advantages</h2>");
    out.push_str(&kv_table(&report["advantages"]));
    out.push_str("<h2 id=\"merge\">Merge</h2>");
    out.push_str(&kv_table(&report["merge"]));
    out.push_str("<h2 id=\"tokens\">Token ids and drift</h2>");
    out.push_str(&kv_table(&report["tokenize"]));
    out.push_str("<h2 id=\"policy\">Policy versions and lag</h2>");
    out.push_str(&kv_table(&report["policy"]));
    out.push_str(&kv_table(
        &serde_json::json!({"importance_by_lag": manifest["importance_by_lag"]}),
    ));

    out.push_str("<h2 id=\"fidelity\">Trainer and engine log-probs</h2>");
    let fidelity = &manifest["fidelity"];
    if fidelity.is_object() {
        if let Some(w) = fidelity["warning"].as_str() {
            let _ = write!(out, "<p class=\"warn\">warning: {}</p>", escape(w));
        }
        out.push_str(&kv_table(fidelity));
    } else if fidelity.is_null() && manifest.get("fidelity").is_some() {
        out.push_str("<p>No trained token has both an engine log-prob and a kept trainer log-prob (the records carry none, e.g. text-only calls).</p>");
    } else {
        out.push_str("<p>Not measured (a manifest written before tapline measured it).</p>");
    }

    // Episodes.
    let scale = samples
        .samples
        .iter()
        .flat_map(|s| &s.tokens)
        .filter(|t| t.loss)
        .map(|t| t.advantage.abs())
        .fold(0.0, f64::max)
        .max(1e-9);
    let _ = write!(
        out,
        "<h2 id=\"episodes\">Episodes trained on</h2><p>{} of {} episodes (at most {MAX_EPISODES}, evenly spread; at most {MAX_TOKENS} tokens per sequence). <span class=\"legend\"><span class=\"p\" style=\"color:#777\">grey: not trained (prompt, tool output)</span><span style=\"background:rgba(40,160,60,.5)\">positive advantage</span><span style=\"background:rgba(220,50,40,.5)\">negative advantage</span></span> Hover a trained token for its advantage, the engine's log-prob where recorded and the trainer's before the update.</p>",
        samples
            .samples
            .iter()
            .map(|s| s.episode_id.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        samples.episodes,
    );
    for s in &samples.samples {
        let _ = write!(
            out,
            "<h3>episode <code>{}</code> · task <code>{}</code> · reward {:.4} · {} call(s)</h3><div class=\"seq\">",
            escape(&s.episode_id),
            escape(&s.task_id),
            s.reward,
            s.calls
        );
        for t in &s.tokens {
            if t.loss {
                let lp = t
                    .logprob
                    .map_or_else(|| "not recorded".to_owned(), |l| format!("{l:.4}"));
                let trainer = match (t.trainer_logprob, t.logprob) {
                    (Some(tr), Some(e)) => {
                        format!(" · trainer log-prob {tr:.4} (Δ {:+.4})", tr - e)
                    }
                    (Some(tr), None) => format!(" · trainer log-prob {tr:.4}"),
                    _ => String::new(),
                };
                let _ = write!(
                    out,
                    "<span class=\"l\" style=\"{}\" title=\"advantage {:.4} · engine log-prob {lp}{trainer}\">{}</span>",
                    token_style(t, scale),
                    t.advantage,
                    escape(&t.text)
                );
            } else {
                let _ = write!(out, "<span class=\"p\">{}</span>", escape(&t.text));
            }
        }
        if s.tokens_left_out > 0 {
            let _ = write!(out, "<em> … {} more tokens</em>", s.tokens_left_out);
        }
        out.push_str("</div>");
    }

    // The manifest.
    out.push_str("<h2 id=\"compute\">Compute</h2>");
    out.push_str(&kv_table(&manifest["compute"]));
    out.push_str("<h2 id=\"inputs\">Inputs</h2><table><tr><th>segment</th><th>SHA-256</th></tr>");
    let inputs = manifest["input_segments"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for i in inputs.iter().take(200) {
        let _ = write!(
            out,
            "<tr><td>{}</td><td><code>{}</code></td></tr>",
            escape(i["key"].as_str().unwrap_or("")),
            escape(i["sha256"].as_str().unwrap_or(""))
        );
    }
    if inputs.len() > 200 {
        let _ = write!(
            out,
            "<tr><td colspan=\"2\">… {} more (manifest.json lists every one)</td></tr>",
            inputs.len() - 200
        );
    }
    out.push_str("</table><h2 id=\"config\">Configuration</h2><pre>");
    out.push_str(&escape(
        &serde_json::to_string_pretty(&manifest["config"]).unwrap_or_default(),
    ));
    out.push_str("</pre><h2 id=\"checkpoint\">Checkpoint</h2>");
    out.push_str(&kv_table(&manifest["checkpoint"]));
    out.push_str("</body></html>\n");
    out
}

/// Writes `dir/report.html` from `dir/manifest.json` and `dir/samples.json` (no samples:
/// the page says so).
pub fn write_from_dir(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    let manifest_path = dir.join("manifest.json");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).with_context(|| {
            format!(
                "read {} (is this a finished run's directory?)",
                manifest_path.display()
            )
        })?)
        .with_context(|| format!("{} is not JSON", manifest_path.display()))?;
    let samples_path = dir.join(SAMPLES_FILE);
    let samples: Samples = match std::fs::read(&samples_path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a samples file", samples_path.display()))?,
        Err(_) => Samples::default(),
    };
    let out = dir.join("report.html");
    std::fs::write(&out, render(&manifest, &samples))
        .with_context(|| format!("write {}", out.display()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn manifest() -> Value {
        json!({
            "run": "demo", "mode": "lora", "git_commit": "abc", "tapline_version": "0.1.0",
            "model": {"dir": "/m"}, "checkpoint": {"dir": "/out", "global_step": 2},
            "steps": [{"step": 1, "loss": 0.5, "reward_mean": 0.2}, {"step": 2, "loss": 0.25, "reward_mean": 0.4}],
            "report": {"input": {"records": 10, "episodes": 4, "calls": 8},
                "dropped": {"episodes": {"zero_variance_group": 2}, "examples": {"zero_variance_group": ["ep-<b>"]}},
                "batches": {"sequences": 2, "tokens": 40, "loss_tokens": 12},
                "merge": {"merged": 1}, "tokenize": {"calls": 8}, "policy": {"latest_version": 3},
                "advantages": {"reward_mean": 0.3, "reward_components": {"tests": {"episodes": 2, "mean": 0.75}}}},
            "input_segments": [{"key": "seg/1", "sha256": "ff"}],
            "config": {"note": "</pre><script>alert(1)</script>"},
            "compute": {"device": "cpu"},
            "fidelity": {"tokens": 12, "mean_abs_logprob_gap": 0.3, "warning": "far <off>"},
        })
    }

    #[test]
    fn text_from_records_and_config_is_escaped() {
        let samples = Samples {
            episodes: 1,
            samples: vec![Sample {
                episode_id: "e\"1".into(),
                task_id: "t".into(),
                reward: 1.0,
                calls: 1,
                tokens: vec![
                    Token {
                        text: "<script>alert(2)</script>".into(),
                        loss: false,
                        advantage: 0.0,
                        logprob: None,
                        trainer_logprob: None,
                    },
                    Token {
                        text: "ok".into(),
                        loss: true,
                        advantage: 0.5,
                        logprob: Some(-0.1),
                        trainer_logprob: Some(-0.3),
                    },
                ],
                tokens_left_out: 3,
            }],
        };
        let page = render(&manifest(), &samples);
        assert!(!page.contains("<script"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(2)&lt;/script&gt;"));
        assert!(page.contains("&lt;/pre&gt;&lt;script&gt;"));
        assert!(page.contains("ep-&lt;b&gt;"));
        assert!(page.contains("e&quot;1"));
        assert!(page.contains("zero_variance_group"));
        assert!(page.contains("<th>reward_components.tests.mean</th><td>0.75</td>"));
        assert!(page.contains("<p class=\"warn\">warning: far &lt;off&gt;</p>"));
        assert!(page.contains("<th>mean_abs_logprob_gap</th><td>0.3</td>"));
        assert!(page.contains("engine log-prob -0.1000 · trainer log-prob -0.3000 (Δ -0.2000)"));
        assert!(page.contains("3 more tokens"));
        assert_eq!(
            page.matches("<div class=\"chart\"><svg").count(),
            9,
            "one chart per curve"
        );
        // Drawn at the size shown, not scaled down (its text as large as the page's).
        assert_eq!(
            page.matches("<svg width=\"480\" height=\"300\"").count(),
            9,
            "{}",
            &page[page.find("<svg").unwrap()..][..120]
        );
    }

    #[test]
    fn samples_spread_over_the_run_and_keep_masks_and_advantages() {
        use crate::batch::{MicroBatch, MiniBatch, TrainSequence};
        let seq = |i: usize| TrainSequence {
            episode_id: format!("e{i}"),
            task_id: "t".into(),
            group_id: "g".into(),
            reward: i as f64,
            sequence: crate::merge::Sequence {
                token_ids: vec![1, 2, 3],
                loss_mask: vec![0, 1, 1],
                logprobs: vec![None, Some(-0.5), None],
                spans: Vec::new(),
            },
            advantages: vec![0.0, 1.5, 1.5],
            weights: vec![0.0, 1.0, 1.0],
        };
        let mini = MiniBatch {
            micro_batches: vec![MicroBatch {
                sequences: (0..200).map(seq).collect(),
                recompute: false,
            }],
            normalizer: crate::schedule::Normalizer {
                loss_tokens: 400,
                sequences: 200,
                episodes: 200,
                constant: 1.0,
            },
        };
        let decode = |ids: &[u32]| ids.iter().map(|i| format!("<{i}>")).collect::<String>();
        let old = [-0.25f32, -0.75];
        let s = Samples::take(&[mini], decode, |at| (at == (0, 0, 0)).then_some(&old[..]));
        assert_eq!(s.episodes, 200);
        assert!(s.samples.len() <= MAX_EPISODES && s.samples.len() >= MAX_EPISODES / 2);
        assert_eq!(s.samples[0].episode_id, "e0");
        assert_ne!(s.samples[1].episode_id, "e1", "spread, not the first 64");
        let t = &s.samples[0].tokens;
        assert_eq!(t[1].text, "<2>", "what the token adds to the one before");
        assert!(!t[0].loss && t[1].loss);
        assert_eq!((t[1].advantage, t[1].logprob), (1.5, Some(-0.5)));
        assert_eq!(
            (t[1].trainer_logprob, t[2].trainer_logprob),
            (Some(-0.25), Some(-0.75))
        );
        assert_eq!(t[0].trainer_logprob, None, "not a loss token");
        assert_eq!(
            s.samples[1].tokens[1].trainer_logprob, None,
            "not kept for it"
        );
    }
}
