"""Where the compiled MoE step's page faults come from: glibc's heap, step by step, for HF's
module, HF's module with its parameters copied after a step (as ``parallelize`` copies a rank's
parameters after the capture), and autotp's program at tp 1.

    python benchmarks/moe_compile_heap.py --out benchmarks/moe_compile_heap.md

The model and batch of ``benchmarks/moe_compile.py`` (Mixtral, experts ``grouped_mm``, one
thread, inductor). Each module runs in a process of its own (the heap's history is the thing
measured): built, compiled, 3 warm-up steps, then ``--steps`` steps of forward + backward (no
zero_grad, as moe_compile.py). A step's minor page faults (``getrusage``) and glibc's
``mallinfo2`` after it: the heap's size (``arena``, brk), the bytes and chunks in mappings of
their own (``hblkhd``, ``hblks``: allocations over the dynamic mmap threshold when made) and the
heap's releasable top (``keepcost``). A step whose backward ends with the heap smaller trimmed
its top (glibc's trim threshold: twice the dynamic mmap threshold); the next step touches those
pages again.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"hf": "HF compiled", "hf-copied": "HF compiled, parameters copied after a step",
         "autotp": "autotp tp=1 compiled"}
WARMUP = 3


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap() -> dict:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap MB": info.arena / 2**20, "mapped MB": info.hblkhd / 2**20, "mapped chunks": info.hblks,
            "top MB": info.keepcost / 2**20}


def run_one(mode: str, steps: int) -> dict:
    """One module in this process: each step's faults and the heap after it."""
    import torch
    import torch.distributed as dist

    import autotp
    from autotp import zoo
    from moe_compile import BATCH, FAMILIES, SEQ, WIDTHS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{29700 + os.getpid() % 200}")
    config = zoo.tiny_config("mixtral", positions=SEQ, **WIDTHS, **FAMILIES["mixtral"])
    config._experts_implementation = "grouped_mm"
    batch = zoo.example_batch("mixtral", config, batch=BATCH, seq=SEQ, seed=1)
    if mode == "autotp":
        module = autotp.parallelize(zoo.build("mixtral", config, seed=0), 1, batch=BATCH, seq=SEQ)
        module(**batch)   # eager first: the call's program is built
    else:
        module = zoo.build("mixtral", config, seed=0)
        if mode == "hf-copied":
            module(**batch).loss.backward()
            module.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p in module.parameters():
                    p.data = p.data.clone()
    compiled = torch.compile(module)
    rows = []
    for step in range(WARMUP + steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        compiled(**batch).loss.backward()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        if step >= WARMUP:
            rows.append({"faults": faults, **_heap()})
    dist.destroy_process_group()
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", type=int, default=2, help="processes per module")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a child: one module
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.steps)))
        return
    from common import machine, publish

    started, load = time.time(), os.getloadavg()
    results = {mode: [] for mode in MODES}
    for _ in range(args.runs):   # alternating, a process each
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1])["rows"])
    lines = [
        "# Compiled MoE at tp 1: glibc's heap step by step (`benchmarks/moe_compile_heap.py`)", "",
        f"Command: `python benchmarks/moe_compile_heap.py --steps {args.steps} --runs {args.runs} --out ...`", "",
        machine() + " Load average at the start: {:.1f}, {:.1f}, {:.1f}; at the end: {:.1f}, {:.1f}, {:.1f}.".format(
            *load, *os.getloadavg()) + f" Wall time {time.time() - started:.0f} s.", "",
        f"The model and batch of `benchmarks/moe_compile.py` (Mixtral); each module in a process of its own, "
        f"{WARMUP} warm-up steps, then {args.steps} steps counted, {args.runs} processes per module, alternating.", "",
        "| module | faults a step, median (each run) | steps that faulted | heap MB (min-max) | "
        "mapped MB, chunks (last step) |", "|---|---|---|---|---|"]
    for mode, runs in results.items():
        steps = [row for run in runs for row in run]
        per_run = ", ".join("{:.0f}".format(statistics.median(r["faults"] for r in run)) for run in runs)
        lines.append(
            f"| {MODES[mode]} | {statistics.median(r['faults'] for r in steps):.0f} ({per_run}) | "
            f"{sum(r['faults'] > 256 for r in steps)} of {len(steps)} | "
            f"{min(r['heap MB'] for r in steps):.0f}-{max(r['heap MB'] for r in steps):.0f} | "
            + "; ".join(f"{run[-1]['mapped MB']:.0f}, {run[-1]['mapped chunks']}" for run in runs) + " |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
