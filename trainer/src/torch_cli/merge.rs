//! `merge-lora`: an adapter folded into its base model's weights.

use tapline_trainer::ingest;
use tapline_trainer::nn::{self, checkpoint};

use crate::cli::*;

pub(crate) fn merge_lora(args: &MergeArgs) -> anyhow::Result<()> {
    let config = nn::TransformerConfig::load(&args.model)?;
    let dtype = args
        .dtype
        .clone()
        .or(config.dtype.clone())
        .unwrap_or_else(|| "float32".into());
    let kind = match dtype.as_str() {
        "float32" | "fp32" => tch::Kind::Float,
        "bfloat16" | "bf16" => tch::Kind::BFloat16,
        "float16" | "fp16" => tch::Kind::Half,
        other => anyhow::bail!("dtype {other:?}: expected float32, bfloat16 or float16"),
    };
    checkpoint::prepare_dir(&args.out)?;
    let (mut model, lora) =
        nn::lora::load_with_adapter(&args.model, &args.adapter, tch::Device::Cpu, kind)?;
    model.merge_lora();
    let global_step = checkpoint::global_step(&args.adapter);
    let sha256 = checkpoint::save(&model, &args.model, &args.out, global_step)?;
    let adapter_bytes = std::fs::read(args.adapter.join(nn::lora::ADAPTER_WEIGHTS))?;
    let manifest = serde_json::json!({
        "format": "tapline.merge_lora.v1",
        "tapline_version": env!("CARGO_PKG_VERSION"),
        "git_commit": nn::manifest::GIT_COMMIT,
        "base_model": args.model.display().to_string(),
        "adapter": args.adapter.display().to_string(),
        "adapter_model_safetensors_sha256": ingest::sha256_hex(&adapter_bytes),
        "lora": lora,
        "dtype": format!("{kind:?}"),
        "model_safetensors_sha256": sha256,
    });
    let tmp = args.out.join("manifest.json.partial");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&manifest)?)?;
    std::fs::rename(&tmp, args.out.join("manifest.json"))?;
    println!(
        "merge-lora: {} + {} (r {}, alpha {}) -> {} ({kind:?})",
        args.model.display(),
        args.adapter.display(),
        lora.rank,
        lora.alpha,
        args.out.display()
    );
    Ok(())
}
