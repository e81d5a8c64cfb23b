"""Memory of one training step with and without activation checkpointing and bf16 autocast.

    .venv/bin/python benchmarks/activation_memory.py     # writes benchmarks/activation_memory.md

GPT-2 124M's config (12 layers, 12 heads, hidden 768, vocabulary 50257; dropout 0.1), float32
weights, tp=2 on two local gloo ranks, batch 4 x 256 tokens per step. Each mode runs in fresh
processes. Per rank 0: the bytes autograd saves for backward during the forward (what
checkpointing trades for recomputation; the rank's parameters apart, as the plan's
``activation_bytes`` leaves them to the training state), the growth of peak resident memory (VmHWM) over the
step, and the step's wall time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from common import machine, publish

MODES = [(False, False), (True, False), (False, True), (True, True)]   # (checkpointing, autocast)


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM")


def step(checkpoint: bool, autocast: bool) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    pm = autotp.parallelize(model, tp=2, gather_logits=False, activation_checkpointing=checkpoint, batch=4, seq=256)
    del model
    ids = torch.randint(0, 50257, (4, 256), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in pm.local_parameters().values()}
    saved: dict[int, int] = {}
    weights: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        (weights if ptr in params else saved)[ptr] = t.untyped_storage().nbytes()
        return t

    before = _hwm_mb()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    seconds = time.perf_counter() - start
    return {"saved_mb": sum(saved.values()) / 1e6, "weights_mb": sum(weights.values()) / 1e6, "hwm_growth_mb": _hwm_mb() - before, "seconds": seconds,
            "loss": loss.item(), "predicted_mb": pm.plan.activation_bytes / 1e6}


def main() -> int:
    from autotp.testing import launch

    rows = []
    for checkpoint, autocast in MODES:
        r = launch(step, 2, checkpoint, autocast, timeout=900.0)[0]
        rows.append((checkpoint, autocast, r))
        print(checkpoint, autocast, r, flush=True)
    base = rows[0][2]
    lines = [
        "# One training step's memory: activation checkpointing and bf16 autocast",
        "",
        "Command: `.venv/bin/python benchmarks/activation_memory.py` (writes this file).",
        f"{machine()} GPT-2 124M config, dropout 0.1, float32 weights, tp=2 on 2 local gloo "
        "ranks (CPU), batch 4 x 256 tokens, logits kept vocab-sharded. Rank 0's figures; each mode in fresh "
        "processes, all in one run.",
        "",
        "*saved for backward*: bytes of the tensors autograd keeps during the forward (storage-deduplicated),",
        "the rank's parameters left out (they are training state, held whether or not a backward keeps them; the",
        "*parameters kept* column gives what autograd's saved tensors also point at among them);",
        "*peak growth*: how much the process's peak resident memory (VmHWM) rose over forward + backward;",
        "*predicted activations*: the plan's `activation_bytes` (what the cost model says autograd keeps,",
        "per rank, the largest; with checkpointing, the layers' inputs plus one layer's activations, which",
        "backward holds while it recomputes a layer: the forward keeps the *saved* column, backward adds one",
        "layer's; autocast is not priced, so an autocast row predicts its float32 row's figure).",
        "",
        "| checkpointing | bf16 autocast | saved for backward MB | predicted activations MB | vs plain "
        "| parameters kept MB | peak growth MB | step s | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for checkpoint, autocast, r in rows:
        lines.append(f"| {'on' if checkpoint else 'off'} | {'on' if autocast else 'off'} | {r['saved_mb']:.0f} | "
                     f"{r['predicted_mb']:.0f} | {r['saved_mb'] / base['saved_mb']:.2f} | {r['weights_mb']:.0f} | "
                     f"{r['hwm_growth_mb']:.0f} | "
                     f"{r['seconds']:.2f} | {r['loss']:.4f} |")
    publish(lines, Path(__file__).with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
