"""Peak resident memory per rank when autotp.from_pretrained loads gpt2-large at tp=4.

    .venv/bin/python benchmarks/checkpoint_memory.py        # writes benchmarks/checkpoint_memory.md

The test process builds a randomly initialized gpt2-large (774M parameters, float32) and saves it
with save_pretrained to a temporary folder, then frees it. Four local gloo ranks each call
``autotp.from_pretrained(folder, tp=4)``: the model is built and captured on the meta device and
each rank reads only its slices. Each rank reports its resident set size (RSS) before the call
(after importing torch and transformers), its peak RSS (``VmHWM``) after it, and the bytes
of the parameters it holds.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine, publish, status_mb

TP = 4
CONFIG = dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257)   # gpt2-large


def load_on_rank(folder: str) -> dict:
    import transformers  # noqa: F401  (part of the baseline, as in any user's process)

    import autotp

    before = status_mb("VmRSS")
    start = time.perf_counter()
    pm = autotp.from_pretrained(folder, tp=TP)
    seconds = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in pm.local_parameters().values()) / 1e6
    peak = status_mb("VmHWM")
    return {"rank": pm.mesh.tp_rank, "before": before, "peak": peak, "after": status_mb("VmRSS"), "held": held,
            "seconds": seconds}


def main() -> int:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from autotp.testing import launch

    hf_logging.set_verbosity_error()
    folder = tempfile.mkdtemp(prefix="autotp-gpt2-large-")
    try:
        model = GPT2LMHeadModel(GPT2Config(**CONFIG))
        full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        model.save_pretrained(folder)
        del model
        results = launch(load_on_rank, TP, folder, timeout=1200.0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = [
        "# Peak memory per rank: autotp.from_pretrained, gpt2-large, tp=4",
        "",
        "Command: `.venv/bin/python benchmarks/checkpoint_memory.py` (writes this file).",
        f"{machine()} 4 local gloo ranks on the CPU, float32.",
        "",
        f"Full model: {full_mb:.0f} MB of parameters; 1/tp of it: {full_mb / TP:.0f} MB.",
        "*before*: RSS after importing torch, transformers and autotp; *peak*: the process's maximum RSS",
        "(VmHWM) after from_pretrained returned; *held*: bytes of the parameters the rank holds;",
        "*peak - before - held*: what loading cost beyond the shards (capture on the meta device, the",
        "mapped pages of the largest column-sliced tensor, allocator slack).",
        "",
        "| rank | before MB | peak MB | held MB | peak - before - held MB | peak / full model | load s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["rank"]):
        extra = r["peak"] - r["before"] - r["held"]
        lines.append(f"| {r['rank']} | {r['before']:.0f} | {r['peak']:.0f} | {r['held']:.0f} | {extra:.0f} | "
                     f"{r['peak'] / full_mb:.2f} | {r['seconds']:.1f} |")
    publish(lines, Path(__file__).with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
