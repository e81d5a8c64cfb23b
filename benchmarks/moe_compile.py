"""Compiled MoE at tp 1: ``torch.compile(pm)`` against ``torch.compile(model)`` (HF's own module), the
same tiny Mixtral, forward + backward; graph breaks counted by dynamo.

    python benchmarks/moe_compile.py --out benchmarks/moe_compile.md

One process, a gloo world of one rank. Both are compiled with inductor (``fullgraph=False``, so
that a break would be counted, not raised); the experts run transformers' ``grouped_mm`` (float32
on CPU: its ``grouped_mm_fallback`` op, opaque to inductor in both programs). Times are medians
of the timed steps, the two modules alternating.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1024, experts=8, top_k=2, intermediate_size=512)
BATCH, SEQ, WARMUP, STEPS = 2, 64, 3, 40


def _step(module, batch) -> float:
    start = time.perf_counter()
    module(**batch).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import autotp
    from autotp import zoo
    from torch._dynamo.utils import counters

    started = time.time()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29517")
    config = zoo.tiny_config("mixtral", positions=SEQ, **SHAPE)
    config._experts_implementation = "grouped_mm"
    model = zoo.build("mixtral", config, seed=0)
    batch = zoo.example_batch("mixtral", config, batch=BATCH, seq=SEQ, seed=1)
    pm = autotp.parallelize(zoo.build("mixtral", config, seed=0), 1, batch=BATCH, seq=SEQ)
    pm(**batch)   # eager first: the call's program is captured and built
    from autotp.testing.work import WorkCounter

    work = {}
    for name, module in (("HF compiled", model), ("autotp tp=1 compiled", pm)):   # eager, counted
        with WorkCounter() as counted:
            module(**batch).loss.backward()
        module.zero_grad()
        work[name] = (counted.flops, counted.bytes)
    runs, breaks = {}, {}
    for name, module in (("HF compiled", model), ("autotp tp=1 compiled", pm)):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(module)
        start = time.perf_counter()
        _step(compiled, batch)
        runs[name] = {"compiled": compiled, "first_s": time.perf_counter() - start, "times": []}
        breaks[name] = dict(counters["graph_break"])
    for step in range(WARMUP + STEPS):
        for name, run in runs.items():
            elapsed = _step(run["compiled"], batch)
            if step >= WARMUP:
                run["times"].append(elapsed)
    dist.destroy_process_group()
    hf = statistics.median(runs["HF compiled"]["times"])
    lines = [
        "# Compiled MoE at tp 1: autotp's program against HF's module, both under torch.compile",
        "",
        "Command: `python benchmarks/moe_compile.py --out benchmarks/moe_compile.md`",
        "",
        machine() + " Load average at the end: {:.1f}, {:.1f}, {:.1f}.".format(*os.getloadavg())
        + f" Wall time {time.time() - started:.0f} s.",
        "",
        f"Mixtral, {SHAPE['layers']} layers, hidden {SHAPE['heads'] * SHAPE['head_dim']}, {SHAPE['experts']} experts "
        f"of {SHAPE['intermediate_size']} features, top-{SHAPE['top_k']}, vocab {SHAPE['vocab']}, float32, experts "
        f"`grouped_mm`; batch {BATCH} x seq {SEQ}; a step is forward + backward; one thread; inductor; {WARMUP} "
        f"warm-up steps after the compiling one, {STEPS} timed, alternating.",
        "",
        "Work: one eager forward + backward counted (`autotp/testing/work.py`): FLOPs of products, bytes written "
        "by the rest (HF's eager experts call torch's grouped kernel, autotp's captured program transformers' "
        "fallback op: the same FLOPs).",
        "",
        "| module | first call s (compiles) | step ms (median) | best ms | median / HF's | best / HF's | "
        "graph breaks | GFLOP (eager) | MB written (eager) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    hf_best = min(runs["HF compiled"]["times"])
    for name, run in runs.items():
        med = statistics.median(run["times"])
        count = sum(breaks[name].values())
        lines.append(f"| {name} | {run['first_s']:.1f} | {med * 1e3:.1f} | {min(run['times']) * 1e3:.1f} | "
                     f"{med / hf:.2f} | {min(run['times']) / hf_best:.2f} | {count} | {work[name][0] / 1e9:.3f} | "
                     f"{work[name][1] / 1e6:.2f} |")
    for name, found in breaks.items():
        if found:
            lines += ["", f"{name}'s graph breaks:"] + [f"- {reason}: {n}" for reason, n in found.items()]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
