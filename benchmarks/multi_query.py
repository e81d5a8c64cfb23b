"""A fused multi-query projection split by query head (a tailed layout: each rank its query heads,
k and v whole) against the projection held whole, as autotp had to hold it before the tail existed.

    .venv/bin/python benchmarks/multi_query.py --out benchmarks/multi_query.md

Predicted: StarCoder-15B and Falcon-7B at tp=8 on the meta device (2 layers, default profile and
workload), planned freely (the split) and with the fused projection and the attention output
projection pinned whole (``layout=``): the predicted step, parameter bytes of the largest rank and
the collectives of one layer. Measured: a small GPT-BigCode (float32, multi-query) on 2 gloo
ranks of this machine, both plans pinned, forward + backward + AdamW per step, side by side in one
run (alternating, so load hits both alike).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FUSED = {"starcoder-15b": ("attn.c_attn", "attn.c_proj"), "falcon-7b": ("self_attention.query_key_value",
                                                                       "self_attention.dense")}
#: the measured model: hidden 512, 16 query heads of 32, one kv head, 4 layers
SMALL = dict(layers=4, heads=16, kv_heads=1, head_dim=32, vocab=4096)
BATCH, SEQ, WARMUP, STEPS = 4, 128, 2, 8


def layouts(fused: str, out: str) -> dict:
    return {"split": None, "fused projection whole": {f"*.{fused}.*": "replicate", f"*.{out}.*": "replicate"}}


def predicted(size: str) -> list[str]:
    import autotp
    from autotp import zoo

    model = zoo.build(zoo.family_of(size).name, zoo.published_config(size, layers=2), device="meta",
                      dtype=torch.bfloat16)
    rows = []
    for name, layout in layouts(*FUSED[size]).items():
        plan = autotp.plan(model, 8, layout=layout, memory_limit=float("inf"))
        fused = next(p for n, p in plan.params.items() if n.startswith("transformer.h.1.") and
                     n.endswith(FUSED[size][0] + ".weight"))
        layer = {}
        for c in plan.comms:
            if ".h.1." in c.module + ".":
                layer[c.kind] = layer.get(c.kind, 0) + 1
        heads = sorted({h for m, hs in plan.attention.items() for h in hs})
        rows.append(f"| {size} | {name} | `{fused!r}` | {heads or 'every head'} | "
                    f"{', '.join(f'{k}={v}' for k, v in sorted(layer.items()))} | "
                    f"{plan.compute_s * 1e3:.1f} + {plan.comm_s * 1e3:.1f} = {(plan.compute_s + plan.comm_s) * 1e3:.1f} | "
                    f"{max(plan.param_bytes_per_rank()) / 1e9:.2f} |")
    return rows


def measure_rank(layout_names: list[str]) -> dict:
    import logging

    import autotp
    from autotp import zoo

    logging.getLogger("autotp").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    config = zoo.tiny_config("gpt-bigcode", positions=SEQ, **SMALL)
    batch = zoo.example_batch("gpt-bigcode", config, batch=BATCH, seq=SEQ, seed=1)
    runs = {}
    for name in layout_names:
        layout = layouts("attn.c_attn", "attn.c_proj")[name] or {"*.attn.c_attn.*": "column",
                                                                  "*.attn.c_proj.weight": "row"}
        layout = dict(layout, **{"*.mlp.c_fc.*": "column", "*.mlp.c_proj.weight": "row"})
        pm = autotp.parallelize(zoo.build("gpt-bigcode", config, seed=0), 2, layout=layout)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4))
    times = {name: [] for name in layout_names}
    for step in range(WARMUP + STEPS):
        for name, (pm, opt) in runs.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            pm(**batch).loss.backward()
            opt.step()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {name: {"median": statistics.median(t), "best": min(t),
                   "fused": repr(runs[name][0].plan.params["transformer.h.0.attn.c_attn.weight"])}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from autotp.testing import launch

    names = list(layouts("", ""))
    results = launch(measure_rank, 2, names, timeout=1800)
    lines = [
        "# Multi-query attention: the fused projection split by query head vs held whole",
        "",
        "Command: `.venv/bin/python benchmarks/multi_query.py --out benchmarks/multi_query.md`",
        "",
        machine() + " Load average at the end: {:.1f}, {:.1f}, {:.1f}.".format(*os.getloadavg()),
        "",
        "## Predicted at real size (tp=8, meta device, 2 layers, default profile and workload)",
        "",
        "'fused projection whole' pins the fused q|k|v projection and the attention output projection",
        "replicated, as they were before the tailed layout; the cost model places the rest (it may still",
        "slice attention's heads out of the whole q, k and v).",
        "",
        "| model | plan | fused projection (layer 1) | attention heads per rank | collectives in layer 1 | "
        "predicted step ms (compute + comm) | parameter GB, largest rank |",
        "|---|---|---|---|---|---|---|",
        *predicted("starcoder-15b"), *predicted("falcon-7b"),
        "",
        "## Measured on this machine (2 gloo ranks, one thread each)",
        "",
        f"GPT-BigCode, {SMALL['layers']} layers, {SMALL['heads']} query heads of {SMALL['head_dim']} and one "
        f"kv head (hidden {SMALL['heads'] * SMALL['head_dim']}), vocab {SMALL['vocab']}, float32; batch {BATCH} x "
        f"seq {SEQ}; a step is forward, backward and AdamW; MLP column/row in both; {WARMUP} warm-up steps, "
        f"{STEPS} timed, the two plans alternating.",
        "",
        "| plan | fused projection | step ms (median, slowest rank) | step ms (best) |",
        "|---|---|---|---|",
    ]
    for name in names:
        median = max(r[name]["median"] for r in results)
        best = max(r[name]["best"] for r in results)
        lines.append(f"| {name} | `{results[0][name]['fused']}` | {median * 1e3:.1f} | {best * 1e3:.1f} |")
    split = max(r["split"]["median"] for r in results)
    whole = max(r["fused projection whole"]["median"] for r in results)
    lines += ["", f"split / fused projection whole: step time {split / whole:.2f}x (medians, measured side by side)."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
