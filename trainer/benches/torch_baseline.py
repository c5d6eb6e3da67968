"""The baseline for `tapline-trainer bench-update`: the same training step in PyTorch.

Random weights of SmolLM2-135M's shape (transformers' LlamaForCausalLM), the same batch
shape (`--sequences` x `--seq-len` random ids, loss on the second half of each), one
sequence per micro-batch, forward + backward + AdamW step; prints the median tokens/s
over the measured steps, like bench-update. Run both in one command for a ratio:

    target/release/tapline-trainer bench-update --preset smollm2-135m --sequences 4 --seq-len 256 \
      && .cache/venv/bin/python trainer/benches/torch_baseline.py --sequences 4 --seq-len 256
"""
import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.randint(0, config.vocab_size, (a.sequences, a.seq_len))
    half = a.seq_len // 2
    times = []
    for step in range(a.warmup + a.steps):
        started = time.perf_counter()
        opt.zero_grad()
        for s in range(a.sequences):
            x = ids[s : s + 1]
            logits = model(x).logits[0, half - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(1, x[0, half:, None]).squeeze(1)
            (-(lp.exp() / lp.exp().detach()) * (1.0 if s % 2 == 0 else -1.0)).sum().div(a.sequences * half).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        secs = time.perf_counter() - started
        tag = "warmup" if step < a.warmup else "step"
        print(f"  {tag} {step}: {secs:.2f}s ({a.sequences * a.seq_len / secs:.0f} tok/s)", flush=True)
        if step >= a.warmup:
            times.append(secs)
    median = statistics.median(times)
    print(f"torch baseline: {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median {a.sequences * a.seq_len / median:.0f} tokens/s")


if __name__ == "__main__":
    main()
