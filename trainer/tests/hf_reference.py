"""Reference models and log-probabilities for the trainer's model tests, from transformers.

The Rust tests run this with the test venv's Python (`TAPLINE_PYTHON`). Everything runs on
the CPU in float32 and is deterministic for a given seed.

    python hf_reference.py tiny --arch qwen2|qwen3|llama --out DIR [--seed N] [--tie]
                                [--shards] [--legacy-rope]

writes a tiny random model (vocabulary 320, hidden size 64, 4 attention heads over 2 KV
heads, MLP 128) as a Hugging Face directory (config.json, generation_config.json,
model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json
with `--shards`). Weights are drawn with a larger spread than a real initialisation
(std 0.1; RMSNorm weights 1 + 0.2 N(0, 1); biases 0.1 N(0, 1)) so that log-probabilities
are far from uniform and a mistake in any part of the forward pass shows. The archs
differ where implementations tend to go wrong:

- qwen2: 2 layers, q/k/v projection biases, rope_theta 1e4;
- qwen3: 3 layers, head_dim 32 (not hidden/heads = 16), q/k RMSNorm, rope_theta 1e6;
- llama: 2 layers, Llama 3 rope scaling (rope_type "llama3", factor 8, low/high frequency
  factors 1 and 4, original_max_position_embeddings 64, rope_theta 5e5): with head_dim 16
  the rotary frequencies fall in all three bands of the scaling (kept, interpolated,
  divided by 8); it changes log-probabilities from the third token on (by 0.01 to 0.07
  nats over the first ones for seed 0).

`--tie` ties the output projection to the embedding (tie_word_embeddings). transformers 5
writes the rope settings as `rope_parameters` ({"rope_type", "rope_theta", ...}) and no
top-level `rope_theta` or `rope_scaling`; `--legacy-rope` rewrites config.json the way
transformers 4 wrote it (and most checkpoints on the Hub still are): top-level
`rope_theta`, plus `rope_scaling` when the rope type is not "default".

    python hf_reference.py logprobs --model DIR < {"sequences": [[id, ...], ...]}

prints {"logprobs": [[...], ...]}: for each sequence of n ids, the n - 1 values
log_softmax(logits[t - 1])[ids[t]] for t = 1 .. n - 1 (float32 model in eval mode, default
attention implementation, one sequence at a time without padding; the log-softmax is taken
in float64 of the float32 logits). Nothing else is written on stdout.

LoRA adapters, with PEFT as the reference (float32 throughout):

    python hf_reference.py peft-random --model DIR --out ADIR --rank R --alpha A
                                       [--targets q_proj,v_proj,...] [--rslora] [--seed N]

writes a PEFT adapter for the model in DIR with `save_pretrained`, both A and B drawn at
random (A ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT initialises it, B ~ 0.05 N(0, 1) instead of
PEFT's zeros, so that the adapter changes the model).

    python hf_reference.py peft-logprobs --model DIR --adapter ADIR < {"sequences": [...]}

prints the log-probabilities (as `logprobs`) of `PeftModel.from_pretrained(model, ADIR)`.

    python hf_reference.py peft-grads --model DIR --adapter ADIR
        < {"sequences": [[id, ...]], "coefficients": [[c_1, ..., c_{n-1}], ...]}

prints {"grads": {name: [flattened values]}}: the gradient of
-sum_s sum_t c_s[t - 1] * log p(ids_s[t] | ids_s[..t]) with respect to every adapter
tensor, under the names PEFT saves them with.

    python hf_reference.py peft-merge --model DIR --adapter ADIR --out MDIR

writes `merge_and_unload()` of the adapter on the model as a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

VOCAB = 320
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128
WEIGHT_STD = 0.1
NORM_STD = 0.2
BIAS_STD = 0.1


def log(message: str) -> None:
    print(f"hf_reference: {message}", file=sys.stderr, flush=True)


def tiny_config(arch: str, tie: bool, like: dict | None = None):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if like is not None:
        # The vocabulary and special tokens of a real model, so its tokenizer fits.
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            if like.get(key) is not None:
                common[key] = like[key]
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(
            num_hidden_layers=2,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            num_hidden_layers=3,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    raise SystemExit(f"unknown arch {arch!r}")


def randomize(model, seed: int) -> None:
    """Redraws every parameter from a generator seeded with `seed`, in name order, so the
    weights depend on the seed only (not on how transformers initialises)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied weight once.
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith(".bias"):
                param.copy_(BIAS_STD * noise)
            elif "norm" in name:
                param.copy_(1.0 + NORM_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def legacy_rope(config_file: Path) -> None:
    config = json.loads(config_file.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_tokenizer(source: Path, out: Path) -> None:
    """Copies the tokenizer and chat-template files of model directory `source`."""
    import shutil

    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def tiny(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(args.seed)
    like = None
    if args.tokenizer_from:
        like = json.loads((args.tokenizer_from / "config.json").read_text())
    config = tiny_config(args.arch, args.tie, like)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, args.seed)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    # A shard limit below one layer's size (about 150 kB) gives a few shards.
    max_shard_size = "200KB" if args.shards else "50GB"
    model.save_pretrained(args.out, max_shard_size=max_shard_size)
    if args.legacy_rope:
        legacy_rope(args.out / "config.json")
    if args.tokenizer_from:
        copy_tokenizer(args.tokenizer_from, args.out)
    for file in args.out.iterdir():
        file.chmod(0o644)  # transformers writes the weights through 0600 temporary files
    params = sum(p.numel() for p in model.parameters())
    log(f"wrote a {args.arch} model ({params} parameters, seed {args.seed}) to {args.out}")


def logprobs(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    request = json.load(sys.stdin)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map="cpu")
    model.eval()
    started = time.monotonic()
    out = []
    with torch.no_grad():
        for ids in request["sequences"]:
            if len(ids) < 2:
                out.append([])
                continue
            input_ids = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=input_ids).logits[0, :-1].to(torch.float64)
            picked = logits.log_softmax(-1).gather(-1, input_ids[0, 1:, None])[:, 0]
            out.append(picked.tolist())
    tokens = sum(len(ids) for ids in request["sequences"])
    log(
        f"{len(out)} sequences, {tokens} tokens in {time.monotonic() - started:.2f}s "
        f"({model.config._attn_implementation} attention)"
    )
    return {"logprobs": out}


def load_base(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")


def peft_random(args) -> None:
    import math
    import torch
    from peft import LoraConfig, get_peft_model

    base = load_base(args.model)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=args.targets.split(","),
        use_rslora=args.rslora,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name:
                bound = 1.0 / math.sqrt(param.shape[1])
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
            elif "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(args.out)
    log(f"wrote a random adapter (r {args.rank}, alpha {args.alpha}) to {args.out}")


def peft_model(args, trainable: bool = False):
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(args.model), args.adapter, is_trainable=trainable)
    model.eval()
    return model


def sequence_logprobs(model, ids):
    import torch

    input_ids = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=input_ids).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, input_ids[0, 1:, None])[:, 0]


def peft_logprobs(args):
    import torch

    request = json.load(sys.stdin)
    model = peft_model(args)
    out = []
    with torch.no_grad():
        for ids in request["sequences"]:
            out.append([] if len(ids) < 2 else sequence_logprobs(model, ids).double().tolist())
    return {"logprobs": out}


def peft_grads(args):
    import torch

    request = json.load(sys.stdin)
    model = peft_model(args, trainable=True)
    loss = 0.0
    for ids, coefficients in zip(request["sequences"], request["coefficients"]):
        lp = sequence_logprobs(model, ids)
        loss = loss - (lp * torch.tensor(coefficients, dtype=torch.float32)).sum()
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None and "lora_" in name:
            grads[name.replace(".default.", ".")] = param.grad.flatten().tolist()
    return {"grads": grads}


def peft_merge(args) -> None:
    model = peft_model(args).merge_and_unload()
    model.save_pretrained(args.out)
    for file in args.out.iterdir():
        file.chmod(0o644)
    log(f"wrote the merged model to {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("tiny", help="write a tiny random model")
    p.add_argument("--arch", choices=["qwen2", "qwen3", "llama"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie", action="store_true", help="tie_word_embeddings")
    p.add_argument("--shards", action="store_true", help="save in several safetensors shards")
    p.add_argument("--legacy-rope", action="store_true", help="transformers 4 rope keys in config.json")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        help="take the vocabulary size and special tokens from this model's config.json and copy its tokenizer files",
    )
    p = commands.add_parser("logprobs", help="log-probabilities of sequences read from stdin")
    p.add_argument("--model", type=Path, required=True)
    p = commands.add_parser("peft-random", help="write a random PEFT LoRA adapter")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument(
        "--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    for name in ["peft-logprobs", "peft-grads", "peft-merge"]:
        p = commands.add_parser(name)
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--adapter", type=Path, required=True)
        if name == "peft-merge":
            p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    torch.use_deterministic_algorithms(True)
    hf_logging.disable_progress_bar()
    # Whatever transformers or torch print goes to stderr: stdout carries only the answer.
    with contextlib.redirect_stdout(sys.stderr):
        result = {
            "tiny": tiny,
            "logprobs": logprobs,
            "peft-random": peft_random,
            "peft-logprobs": peft_logprobs,
            "peft-grads": peft_grads,
            "peft-merge": peft_merge,
        }[args.command](args)
    if result is not None:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
