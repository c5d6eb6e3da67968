//! `score`: the log-probs a model gives a sequence's tokens.

use std::io::Read as _;

use anyhow::Context as _;
use serde_json::Value;
use tapline_trainer::nn::{self, Transformer};

use crate::cli::*;

pub(crate) fn score(args: &ScoreArgs) -> anyhow::Result<()> {
    let device = nn::parse_device(&args.device)?;
    let kind = nn::parse_dtype(&args.dtype, device)?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("read the ids from stdin")?;
    let body: Value = serde_json::from_str(&input)
        .context("stdin is not JSON (expected {\"ids\": [1, 2, ...]})")?;
    let ids: Vec<u32> = body
        .get("ids")
        .and_then(Value::as_array)
        .context("stdin has no \"ids\" array (expected {\"ids\": [1, 2, ...]})")?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| format!("ids[{i}] = {v} is not a token id"))
        })
        .collect::<anyhow::Result<_>>()?;
    let model = match &args.adapter {
        Some(adapter) => {
            nn::lora::load_with_adapter(&args.model, adapter, device, kind)
                .with_context(|| format!("apply the adapter {}", adapter.display()))?
                .0
        }
        None => Transformer::load(&args.model, device, kind)
            .with_context(|| format!("load the model from {}", args.model.display()))?,
    };
    let logprobs = model
        .sequence_logprobs(&ids, 1024)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{}", serde_json::json!({ "logprobs": logprobs }));
    Ok(())
}
