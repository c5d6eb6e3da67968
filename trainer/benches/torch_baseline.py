"""The baseline for `tapline-trainer bench-update`: the same training step in PyTorch.

Random weights of SmolLM2-135M's shape (transformers' LlamaForCausalLM), the same batch
shape (`--sequences` x `--seq-len` random ids, loss on the second half of each), one
sequence per micro-batch, forward + backward + AdamW step; prints the median tokens/s
over the measured steps, like bench-update. Run both in one command for a ratio:

    target/release/tapline-trainer bench-update --preset smollm2-135m --sequences 4 --seq-len 256 \
      && .cache/venv/bin/python trainer/benches/torch_baseline.py --sequences 4 --seq-len 256

With `--lengths` (a list, or `agent`: the mix `bench-update --lengths agent` uses) the
sequences go into micro-batches of `--micro-batch-tokens` as tapline's scheduler packs
them (longest first, first fit), and each micro-batch runs as a transformers user runs
one: right-padded to its longest with an `attention_mask`, the loss masked off the
padding.
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
    p.add_argument("--lengths", default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    a = p.parse_args()
    if a.lengths is not None:
        return run_lengths(a)
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


# `AGENT_MIX` of trainer/src/nn/bench.rs.
AGENT_MIX = [
    512, 320, 224, 160, 128, 112, 96, 80, 64, 64, 64, 48, 48, 48, 40, 40,
]


def pack(lengths, budget):
    """`schedule::pack`: longest first, each into the first micro-batch it fits in."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins = []
    for i in order:
        for b in bins:
            if b[0] + lengths[i] <= budget:
                b[0] += lengths[i]
                b[1].append(i)
                break
        else:
            bins.append([lengths[i], [i]])
    return [b[1] for b in bins]


def run_lengths(a) -> None:
    lengths = AGENT_MIX if a.lengths == "agent" else [int(x) for x in a.lengths.split(",")]
    torch.manual_seed(0)
    model = LlamaForCausalLM(smollm2_config()).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,)) for n in lengths]
    groups = pack(lengths, a.micro_batch_tokens)
    total_loss = sum(n - n // 2 for n in lengths)
    tokens = sum(lengths)
    times = []
    for step in range(a.warmup + a.steps):
        started = time.perf_counter()
        opt.zero_grad()
        for g in groups:
            longest = max(lengths[i] for i in g)
            ids = torch.zeros((len(g), longest), dtype=torch.long)
            mask = torch.zeros((len(g), longest), dtype=torch.long)
            loss_mask = torch.zeros((len(g), longest))
            adv = torch.zeros((len(g), 1))
            for row, i in enumerate(g):
                n = lengths[i]
                ids[row, :n] = seqs[i]
                mask[row, :n] = 1
                loss_mask[row, n // 2 : n] = 1.0
                adv[row] = 1.0 if i % 2 == 0 else -1.0
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
            ratio = (lp - lp.detach()).exp()
            (-(ratio * adv) * loss_mask[:, 1:]).sum().div(total_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        secs = time.perf_counter() - started
        tag = "warmup" if step < a.warmup else "step"
        print(f"  {tag} {step}: {secs:.2f}s ({tokens / secs:.0f} tok/s)", flush=True)
        if step >= a.warmup:
            times.append(secs)
    median = statistics.median(times)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    print(f"torch baseline: {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{len(lengths)} sequences of {tokens} tokens in {len(groups)} micro-batches, "
          f"padded to {padded} ({padded / tokens:.3f}), median step {median:.2f} s, "
          f"{tokens / median:.0f} tokens/s")


def smollm2_config():
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
    )


if __name__ == "__main__":
    main()
