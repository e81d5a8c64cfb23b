"""Compiled MoE at tp 1: ``torch.compile(pm)`` against ``torch.compile(model)`` (HF's own module), the
same tiny Mixtral, forward + backward; graphs and graph breaks counted by dynamo.

    python benchmarks/moe_compile.py --steps 60 --out benchmarks/moe_compile.md
    python benchmarks/moe_compile.py --family llama    # the dense path, the same widths without experts
    python benchmarks/moe_compile.py --head-dim 8 --seq 8 --steps 200   # tiny: the host's work per step
    python benchmarks/moe_compile.py --control      # HF against a second HF module: the harness's spread
    python benchmarks/moe_compile.py --default-malloc   # glibc's heap as it comes (thresholds adapting)

One process, a gloo world of one rank. Both are compiled with inductor (``fullgraph=False``, so
that a break would be counted, not raised); the experts run transformers' ``grouped_mm`` (float32
on CPU: its ``grouped_mm_fallback`` op, opaque to inductor in both programs). The two modules
alternate step for step, in ABBA order (which one runs first in a pair alternates too); each
step is timed by the wall clock and by the process's CPU time (one thread: what the step
computed, less what a loaded machine's other processes took from it). Reported: medians and
best steps, and the median of the step pairs' autotp / HF ratios with its spread (the pairs'
quartiles, and a 95% bootstrap interval of the median), with the minor page faults of a step.

Both arms run under the same allocator conditions: by default the process runs with glibc's trim
and mmap thresholds fixed (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_`` at 1 GB), so
that neither module's step buffers are handed back to the system and faulted in again. Under
glibc's adapting thresholds the faults follow where each module's parameters were allocated
(HF's before any large free, in mappings of their own; ``parallelize``'s copies after the
capture's frees, in the heap: ``moe_compile_heap.md``), not either program; the module must own
copies of its parameters (docs/architecture.md section 9), so the benchmark fixes the heap for
both rather than pricing that history into one arm. ``--default-malloc`` measures it anyway.
``--control`` replaces autotp's arm by a second HF module (its parameters copied, as
``parallelize``'s are): the ratio the harness itself reports for two equal programs.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTHS = dict(layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1024)
#: family -> its config's extra fields (Mixtral's experts; the zoo's Llama has an MLP of 2 x hidden + 8)
FAMILIES = {"mixtral": dict(experts=8, top_k=2, intermediate_size=512), "llama": {}}
BATCH, SEQ, WARMUP = 2, 64, 3


#: glibc's heap kept, never trimmed, no per-allocation mmap (--pin-malloc): 1 GB thresholds
PINNED_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}


def _spread(ratios: list[float], draws: int = 2000) -> tuple[float, float, float, float]:
    """The step pairs' ratios: (25th percentile, 75th, and a 95% bootstrap interval of their
    median: the median of ``draws`` resamples, a fixed seed)."""
    import random

    quartiles = statistics.quantiles(ratios, n=4)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return quartiles[0], quartiles[2], medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _step(module, batch) -> tuple[float, float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    wall, cpu = time.perf_counter(), time.process_time()
    module(**batch).loss.backward()
    return (time.perf_counter() - wall, time.process_time() - cpu,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="mixtral", choices=sorted(FAMILIES))
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each module")
    parser.add_argument("--head-dim", type=int, default=WIDTHS["head_dim"], help="hidden = 4 heads of it")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's adapting trim and mmap thresholds (default: both fixed, for both arms)")
    parser.add_argument("--pin-malloc", action="store_true", help="the default now (kept: earlier commands run)")
    parser.add_argument("--control", action="store_true", help="a second HF module in place of autotp's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    pinned = not args.default_malloc
    if pinned and any(os.environ.get(k) != v for k, v in PINNED_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED_MALLOC})
    import autotp
    from autotp import zoo
    from torch._dynamo.utils import counters

    started, load_before = time.time(), os.getloadavg()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29517")
    extra = FAMILIES[args.family]
    widths = {**WIDTHS, "head_dim": args.head_dim}
    config = zoo.tiny_config(args.family, positions=max(args.seq, 8), **widths, **extra)
    experts = "experts" in extra
    if experts:
        config._experts_implementation = "grouped_mm"
    model = zoo.build(args.family, config, seed=0)
    batch = zoo.example_batch(args.family, config, batch=BATCH, seq=args.seq, seed=1)
    if args.control:   # HF's module again, its parameters copied after the first, as parallelize copies
        pm = zoo.build(args.family, config, seed=0)
        pm(**batch).loss.backward()
        pm.zero_grad()
        for p in pm.parameters():
            p.data = p.data.clone()
    else:
        pm = autotp.parallelize(zoo.build(args.family, config, seed=0), 1, batch=BATCH, seq=args.seq)
        pm(**batch)   # eager first: the call's program is captured and built
    from autotp.testing.work import WorkCounter

    names = ("HF compiled", "HF compiled (control)" if args.control else "autotp tp=1 compiled")
    work = {}
    for name, module in zip(names, (model, pm)):   # eager, counted
        with WorkCounter() as counted:
            module(**batch).loss.backward()
        module.zero_grad()
        work[name] = (counted.flops, counted.bytes)
    # dynamo's graphs and breaks, counted per arm over every one of its steps (a recompile on a
    # later step counts as a graph); one reset before both: a reset between the arms would drop
    # the first arm's compiled code, and it would compile again on its next step
    torch._dynamo.reset()
    counters.clear()
    graphs, breaks = {name: 0 for name in names}, {name: {} for name in names}

    def counted_step(name: str, compiled) -> tuple[float, float, int]:
        before, broken = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        timed = _step(compiled, batch)
        graphs[name] += counters["stats"]["unique_graphs"] - before
        for reason, n in counters["graph_break"].items():
            if n > broken.get(reason, 0):
                breaks[name][reason] = breaks[name].get(reason, 0) + n - broken.get(reason, 0)
        return timed

    runs = {}
    for name, module in zip(names, (model, pm)):
        compiled = torch.compile(module)
        start = time.perf_counter()
        counted_step(name, compiled)
        runs[name] = {"compiled": compiled, "first_s": time.perf_counter() - start, "wall": [], "cpu": [],
                      "faults": []}
    for step in range(WARMUP + args.steps):
        for name in (names if step % 4 in (0, 3) else names[::-1]):   # ABBA: either may run first
            run = runs[name]
            wall, cpu, faults = counted_step(name, run["compiled"])
            if step >= WARMUP:
                run["wall"].append(wall)
                run["cpu"].append(cpu)
                run["faults"].append(faults)
    dist.destroy_process_group()
    hf, ours = runs[names[0]], runs[names[1]]
    pairs = {k: [a / b for a, b in zip(ours[k], hf[k])] for k in ("wall", "cpu")}
    paired = {k: statistics.median(v) for k, v in pairs.items()}
    spread = {k: _spread(v) for k, v in pairs.items()}
    what = (f"Mixtral, {WIDTHS['layers']} layers, hidden {widths['heads'] * widths['head_dim']}, {extra['experts']} "
            f"experts of {extra['intermediate_size']} features, top-{extra['top_k']}" if experts else
            f"Llama (dense), {WIDTHS['layers']} layers, hidden {widths['heads'] * widths['head_dim']}, MLP of "
            f"{config.intermediate_size} features")
    flags = "" if args.family == "mixtral" else f" --family {args.family}"
    flags += "" if args.head_dim == WIDTHS["head_dim"] else f" --head-dim {args.head_dim}"
    flags += "" if args.seq == SEQ else f" --seq {args.seq}"
    flags += "" if args.steps == 40 else f" --steps {args.steps}"
    flags += " --default-malloc" if args.default_malloc else ""
    flags += " --control" if args.control else ""
    lines = [
        f"# Compiled {'MoE' if experts else 'dense model'} at tp 1: autotp's program against HF's module, both "
        "under torch.compile",
        "",
        f"Command: `python benchmarks/moe_compile.py{flags} --out ...`",
        "",
        machine() + " Load average at the start: {:.1f}, {:.1f}, {:.1f}; at the end: {:.1f}, {:.1f}, {:.1f}.".format(
            *load_before, *os.getloadavg()) + f" Wall time {time.time() - started:.0f} s.",
        "",
        f"{what}, vocab {WIDTHS['vocab']}, float32{', experts `grouped_mm`' if experts else ''}; batch {BATCH} x "
        f"seq {args.seq}; a step is forward + backward; one thread; inductor; {WARMUP} warm-up steps after the "
        f"compiling one, {args.steps} timed, alternating. Wall: the step's wall-clock time; CPU: the process's "
        "CPU time over the step; faults: the minor page faults of a step; graphs and graph breaks: dynamo's, "
        "over every step of the arm (a recompile counts as a graph)."
        + (" Both arms under one fixed heap: " + ", ".join(f"{k}={v}" for k, v in PINNED_MALLOC.items()) + "."
           if pinned else " glibc's adapting thresholds (--default-malloc).")
        + (" Control: the second arm is a second HF module, its parameters copied after one step." if args.control
           else ""),
        "",
        "Work: one eager forward + backward counted (`autotp/testing/work.py`): FLOPs of products, bytes written "
        "by the rest.",
        "",
        "| module | first call s (compiles) | wall ms median | wall ms best | CPU ms median | CPU ms best | "
        "faults median | graphs | graph breaks | GFLOP (eager) | MB written (eager) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['first_s']:.1f} | {statistics.median(run['wall']) * 1e3:.1f} | "
                     f"{min(run['wall']) * 1e3:.1f} | {statistics.median(run['cpu']) * 1e3:.1f} | "
                     f"{min(run['cpu']) * 1e3:.1f} | {statistics.median(run['faults']):.0f} | "
                     f"{graphs[name]} | {sum(breaks[name].values())} | {work[name][0] / 1e9:.3f} | "
                     f"{work[name][1] / 1e6:.2f} |")
    ratio = lambda k, f: f(ours[k]) / f(hf[k])   # noqa: E731
    lines += ["", f"| {'control / HF' if args.control else 'autotp / HF'} | median | best | median of the step "
              "pairs' ratios | pairs' quartiles | 95% interval of that median (bootstrap) |",
              "|---|---|---|---|---|---|"]
    for k, label in (("wall", "wall"), ("cpu", "CPU")):
        q1, q3, lo, hi = spread[k]
        lines.append(f"| {label} | {ratio(k, statistics.median):.3f} | {ratio(k, min):.3f} | {paired[k]:.3f} | "
                     f"{q1:.3f}-{q3:.3f} | {lo:.3f}-{hi:.3f} |")
    for name, found in breaks.items():
        if found:
            lines += ["", f"{name}'s graph breaks:"] + [f"- {reason}: {n}" for reason, n in found.items()]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
