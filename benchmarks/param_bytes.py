"""Per-rank parameter bytes of every GPT-2 size at every tp from 1 to 8, planned on the meta device.

    .venv/bin/python benchmarks/param_bytes.py            # writes benchmarks/param_bytes.md

For each published GPT-2 configuration (random weights never exist: the model is built on the
meta device) and each tp, ``autotp.plan`` chooses the layout and reports each rank's parameter
bytes. The *ideal* per rank is what a perfectly even split of the same plan would give: the
bytes of the sharded parameters / tp + the bytes of the replicated ones. The table shows the
largest and smallest rank against it, the heads each rank holds in layer 0, and, at tp=8, the
bytes sent per rank per step with full logits (gathered) and with vocab-sharded logits.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from common import machine, publish

SIZES = {  # name: (layers, heads, hidden)
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
VOCAB = 50257


def meta_gpt2(layers: int, heads: int, hidden: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=VOCAB))


def ideal_bytes(plan) -> float:
    from autotp import Shard

    total = 0.0
    for name, shape in plan.shapes.items():
        n = 1
        for s in shape:
            n *= s
        total += n / plan.tp if isinstance(plan.params[name], Shard) else n
    return total * plan.dtype_bytes


def main() -> int:
    from autotp.passes.attention import check_heads
    from autotp.planner import build_plan
    from autotp.capture import capture

    rows, logits_rows = [], []
    for name, (layers, heads, hidden) in SIZES.items():
        model = meta_gpt2(layers, heads, hidden)
        start = time.perf_counter()
        cap = capture(model)
        capture_s = time.perf_counter() - start
        for tp in range(1, 9):
            check_heads(model, tp, uneven=True)
            start = time.perf_counter()
            plan, _, _ = build_plan(cap, tp, batch=8, seq=1024, profile="h100-dgx")
            plan_s = time.perf_counter() - start
            per_rank = plan.param_bytes_per_rank()
            ideal = ideal_bytes(plan)
            worst = max(abs(b - ideal) / ideal for b in per_rank)
            heads_l0 = plan.heads_per_rank().get("transformer.h.0.attn.c_attn.weight", [heads] * tp)
            roles = sorted(set(plan.roles.values()) - {"replicate"})
            rows.append((name, tp, max(per_rank) / 1e6, min(per_rank) / 1e6, ideal / 1e6, 100 * worst,
                         heads_l0, ",".join(roles) or "replicate", capture_s, plan_s))
            print(f"{name} tp={tp}: max {max(per_rank) / 1e6:.1f} MB, min {min(per_rank) / 1e6:.1f} MB, "
                  f"ideal {ideal / 1e6:.1f} MB ({100 * worst:.2f}% off), heads {heads_l0}, plan {plan_s:.1f} s",
                  flush=True)
        for gather in (True, False):
            plan, _, _ = build_plan(cap, 8, batch=8, seq=1024, profile="h100-dgx", gather_logits=gather,
                                    layout={"lm_head.weight": "vocab"})
            logits_rows.append((name, gather, plan.cost["comm_bytes_per_step"] / 1e6, plan.cost["comm_s"] * 1e3))

    out = [
        "# Per-rank parameter bytes, every GPT-2 size at tp 1..8",
        "",
        f"Command: `.venv/bin/python benchmarks/param_bytes.py` (writes this file).",
        f"{machine()} Models on the meta device "
        "(no weights allocated), float32 parameters, planned with the h100-dgx profile at batch 8, seq 1024.",
        "",
        "*ideal* = bytes of sharded parameters / tp + bytes of replicated parameters, for the same plan.",
        "*off* = the largest |rank - ideal| / ideal over the ranks. *heads (layer 0)* = attention heads",
        "each rank holds in layer 0 (layers rotate which ranks take the extra heads).",
        "",
        "| model | tp | max MB/rank | min MB/rank | ideal MB | off % | heads (layer 0) | split roles | capture s | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, tp, hi, lo, ideal, off, h, roles, cs, ps in rows:
        out.append(f"| {name} | {tp} | {hi:.1f} | {lo:.1f} | {ideal:.1f} | {off:.2f} | {h} | {roles} | {cs:.1f} | {ps:.1f} |")
    out += [
        "",
        "## Logits: gathered (a call without labels, or `gather_logits=True`) or kept vocab-sharded (the default in a call with labels, or `gather_logits=False`), tp=8",
        "",
        "lm_head pinned vocab-parallel; the loss is vocab-parallel cross-entropy either way. Bytes each rank",
        "sends per training step (forward + backward) and the predicted communication time.",
        "",
        "| model | logits | MB sent per rank per step | comm ms |",
        "|---|---|---|---|",
    ]
    for name, gather, mb, ms in logits_rows:
        out.append(f"| {name} | {'gathered (b x s x V all-gather)' if gather else 'vocab-sharded'} | {mb:.1f} | {ms:.2f} |")
    publish(out, Path(__file__).with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
