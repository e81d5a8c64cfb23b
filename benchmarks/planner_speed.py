"""How long planning and rewriting take after capture, and how that grows with depth.

Planning = ``build_plan`` (graph index, exact solve, plan with costs and b,s expressions);
rewriting = one rank's ``rewrite``. Capture (torch.export) is excluded and done once per model.
Models are GPT-2 configurations on the meta device, planned at batch 8, seq 1024, tp 8 on the
h100-dgx profile. Each figure is the best of ``--repeats`` runs (the median and the CPU time
are also shown): other processes share this machine's cores.

    .venv/bin/python benchmarks/planner_speed.py --out benchmarks/planner_speed.md
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from common import cpu_model, publish


def gpt2_capture(hidden: int, heads: int, layers: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from autotp.capture import capture

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab))
    return capture(model)


def measure(cap, tp: int, repeats: int) -> dict:
    from autotp.api import build_plan
    from autotp.passes.rewrite import rewrite

    plans, rewrites, cpu = [], [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        plan, index, prop = build_plan(cap, tp, batch=8, seq=1024, profile="h100-dgx")
        t1 = time.perf_counter()
        rewrite(index, prop, 0, None, torch.device("cpu"))
        t2, c2 = time.perf_counter(), time.process_time()
        plans.append(t1 - t0)
        rewrites.append(t2 - t1)
        cpu.append(c2 - c0)
    totals = [p + r for p, r in zip(plans, rewrites)]
    return {"plan": min(plans), "rewrite": min(rewrites), "total": min(totals),
            "median": statistics.median(totals), "cpu": min(cpu), "nodes": len(cap.graph.nodes),
            "megatron": plan.comm_counts()}


CONFIGS = [
    # name, hidden, heads, layers, vocab
    ("gpt2-xl", 1600, 25, 48, 50257),
    ("8.3B x12", 3072, 32, 12, 51200),
    ("8.3B x24", 3072, 32, 24, 51200),
    ("8.3B x48", 3072, 32, 48, 51200),
    ("8.3B", 3072, 32, 72, 51200),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--out", help="write the markdown result here too")
    args = ap.parse_args()
    rows = []
    for name, hidden, heads, layers, vocab in CONFIGS:
        t = time.perf_counter()
        cap = gpt2_capture(hidden, heads, layers, vocab)
        capture_s = time.perf_counter() - t
        r = measure(cap, args.tp, args.repeats)
        rows.append((name, hidden, heads, layers, r, capture_s))
        print(f"{name}: {r}", file=sys.stderr)
    base = next(row[4] for row in rows if row[0] == "8.3B x12")
    lines = [
        "# Planner speed (after capture)",
        "",
        f"Command: `{' '.join(['.venv/bin/python'] + sys.argv)}`",
        "",
        f"Machine: {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores (`nproc`), "
        f"{cpu_model()}; torch {torch.__version__}; Python {platform.python_version()}. "
        f"Other jobs shared the cores (load average {os.getloadavg()[0]:.1f} at the end): wall-clock figures are "
        "the best of the repeats, with the median beside it; CPU seconds (this process) are less disturbed "
        "by the sharing, and the growth with depth is given in them.",
        "",
        f"Workload: batch 8, seq 1024, tp {args.tp}, profile h100-dgx, meta-device GPT-2 models.",
        "",
        "| model | hidden | heads | layers | graph nodes | plan s | rewrite s | plan + rewrite s (best) | median "
        "| CPU s (best) | CPU vs 12 layers | capture s (excluded) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, hidden, heads, layers, r, capture_s in rows:
        growth = f"{r['cpu'] / base['cpu']:.2f}x" if name.startswith("8.3B") else ""
        lines.append(f"| {name} | {hidden} | {heads} | {layers} | {r['nodes']} | {r['plan']:.3f} | {r['rewrite']:.3f} | "
                     f"{r['total']:.3f} | {r['median']:.3f} | {r['cpu']:.3f} | {growth} | {capture_s:.1f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
