//! Records → batches throughput on synthetic multi-turn agent traces (real Qwen3
//! tokenizer), with and without recorded token ids.
//!
//! `cargo bench -p tapline-trainer --bench pipeline [-- EPISODES TURNS]` (defaults 64 and
//! 8). Measured: decoding the segments, joining, cleaning, tokenizing, merging,
//! advantages, scheduling and serializing every mini-batch file (in memory; no store
//! or disk IO). Needs the test tokenizers: run `cargo xtask test` once.

#[path = "../tests/common/traces.rs"]
mod traces;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use tapline_proto::Outcome;
use tapline_proto::segment::{Limits, decode_segment, encode_segment};
use tapline_trainer::config::RunConfig;
use tapline_trainer::ingest::assemble;
use tapline_trainer::output::mini_batch_json;
use tapline_trainer::tokenize::{ChatRequest, prompt_ids};
use tapline_trainer::{Model, ModelOptions, prepare};
use traces::{Trace, agent_tools, agent_turn, tool_result};

const T0: i64 = 1_796_204_942_000_000_000;

fn model_dir() -> PathBuf {
    let assets = std::env::var_os("TAPLINE_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/assets"));
    let dir = assets.join("qwen3");
    if !dir.join("tokenizer.json").is_file() {
        eprintln!(
            "bench: {} is missing: run `cargo xtask test` once (it fetches the test tokenizers)",
            dir.display()
        );
        std::process::exit(2);
    }
    dir
}

/// Segments of `episodes` agent episodes of `turns` calls each, in groups of 8.
fn segments(model: &Model, episodes: usize, turns: usize, with_ids: bool) -> Vec<Vec<u8>> {
    let mut trace = Trace::new("bench", T0);
    for e in 0..episodes {
        let episode = format!("ep-{e:05}");
        let task = format!("task-{}", e / 8);
        trace.start(&episode, &task, "");
        let mut messages = vec![
            json!({"role": "system", "content": "You are a careful coding agent. Work step by step."}),
            json!({"role": "user", "content": format!("Fix issue #{e}: the parser drops trailing comments in module {e}.")}),
        ];
        for k in 0..turns {
            let turn = agent_turn(k, k + 1 == turns);
            let request = json!({"model": "m", "messages": messages, "tools": agent_tools()});
            let (prompt, completion) = if with_ids {
                let req = ChatRequest::from_json(&request).expect("request");
                let prompt = prompt_ids(model, &req, &serde_json::Map::new()).expect("render");
                let ids = model.encode(&turn.qwen3_generated_text()).expect("encode");
                let logprobs = vec![-0.5; ids.len()];
                (prompt, turn.completion(ids, logprobs))
            } else {
                (Vec::new(), turn.completion(Vec::new(), Vec::new()))
            };
            trace.chat_call(
                &episode,
                &task,
                k as u32,
                &request,
                completion,
                prompt,
                Outcome::Ok,
            );
            messages.push(turn.history_message(true));
            if !turn.tool_calls.is_empty() {
                messages.push(tool_result(k));
            }
        }
        trace.reward(&episode, "", "", (e % 3) as f64 / 2.0);
        trace.end(&episode, &task, "", false);
    }
    trace
        .records
        .chunks(256)
        .map(|chunk| encode_segment(chunk, 3).expect("encode").0)
        .collect()
}

struct Measured {
    episodes: u64,
    calls: u64,
    tokens: u64,
    elapsed: Duration,
}

fn run_once(model: &Model, segments: &[Vec<u8>], config: &RunConfig) -> Measured {
    let started = Instant::now();
    let decoded: Vec<(String, Vec<tapline_proto::Record>)> = segments
        .iter()
        .enumerate()
        .map(|(i, s)| {
            (
                format!("s{i}"),
                decode_segment(s, Limits::default()).expect("decode"),
            )
        })
        .collect();
    let ingested = assemble(decoded);
    let prepared = prepare(ingested, model, config, T0 + 3_600_000_000_000);
    let mut bytes = 0usize;
    for (i, batch) in prepared.mini_batches.iter().enumerate() {
        bytes += mini_batch_json(i, config.schedule.loss_agg_mode.name(), batch).len();
    }
    let elapsed = started.elapsed();
    assert!(bytes > 0);
    let r = &prepared.report;
    Measured {
        episodes: r.advantages.episodes,
        calls: r.tokenize.calls,
        tokens: r.batches.tokens,
        elapsed,
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let episodes = args.first().copied().unwrap_or(64);
    let turns = args.get(1).copied().unwrap_or(8);
    let model = Model::load(&model_dir(), &ModelOptions::default()).expect("load qwen3");
    let with_ids = segments(&model, episodes, turns, true);
    let without_ids = segments(&model, episodes, turns, false);
    let mut no_drift = RunConfig::default();
    no_drift.tokenize.measure_drift = false;
    let default = RunConfig::default();
    println!(
        "records -> batches, {episodes} episodes x {turns} calls (Qwen3 tokenizer, best of 3)"
    );
    println!(
        "{:<44} {:>8} {:>7} {:>9} {:>9} {:>11} {:>12}",
        "variant", "episodes", "calls", "tokens", "seconds", "episodes/s", "tokens/s"
    );
    for (name, segs, config) in [
        ("recorded ids (drift not measured)", &with_ids, &no_drift),
        (
            "recorded ids + drift measured (default)",
            &with_ids,
            &default,
        ),
        (
            "no recorded ids (template + tokenizer)",
            &without_ids,
            &default,
        ),
    ] {
        let best = (0..3)
            .map(|_| run_once(&model, segs, config))
            .min_by_key(|o| o.elapsed)
            .expect("three runs");
        let secs = best.elapsed.as_secs_f64();
        println!(
            "{name:<44} {:>8} {:>7} {:>9} {:>9.3} {:>11.1} {:>12.0}",
            best.episodes,
            best.calls,
            best.tokens,
            secs,
            best.episodes as f64 / secs,
            best.tokens as f64 / secs
        );
    }
}
