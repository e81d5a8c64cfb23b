"""How long a hybrid's captures take: a tiny Qwen3-Next (Gated DeltaNet over 64-token chunks: export
fixes the length) and a tiny Bamba (Mamba2's chunked scan: named dims refused, traced unnamed),
2 layers, float64, captured at the synthesized length 11 and then at 8, as
``tests/e2e/test_hybrids.py`` builds them.

``after``: autotp's capture as it is. ``before``: the same code with FakeTensorMode's dispatch cache
on for the whole export (``capture.export._repeats_blocks`` answering True) and the memo of refused
dims emptied before each capture (``_NARROWED``), as the capture was before they were changed.
Each row: process CPU seconds of each capture (wall seconds move with the other jobs on the
machine) and how many torch.export calls it made.

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_capture.py --out benchmarks/hybrid_capture.md
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from autotp import zoo
from autotp.capture import export as capture_export


def captures(family: str, mode: str) -> list[tuple[int, float, int]]:
    """(length, CPU s, exports) of a capture at 11 and one at 8 of a fresh tiny ``family`` model."""
    config = zoo.tiny_config(family, layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    model = zoo.build(family, config, dtype=torch.float64)
    capture_export._NARROWED.clear()
    real_repeats, real_export = capture_export._repeats_blocks, torch.export.export
    calls = []
    torch.export.export = lambda *a, **k: calls.append(1) or real_export(*a, **k)
    if mode == "before":
        capture_export._repeats_blocks = lambda model: True
    out = []
    try:
        for length in (11, 8):
            if mode == "before":
                capture_export._NARROWED.clear()
            kwargs = zoo.example_batch(family, config, batch=2, seq=length)
            before, start = len(calls), time.process_time()
            capture_export.capture(model, example_kwargs=kwargs)
            out.append((length, time.process_time() - start, len(calls) - before))
    finally:
        capture_export._repeats_blocks, torch.export.export = real_repeats, real_export
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="qwen3-next,bamba")
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = ["| family | capture | CPU s at 11 | exports | CPU s at 8 | exports |", "|---|---|---|---|---|---|"]
    for family in args.families.split(","):
        for mode in ("after", "before", "after", "before"):
            (_, a, na), (_, b, nb) = captures(family, mode)
            lines.append(f"| {family} | {mode} | {a:.1f} | {na} | {b:.1f} | {nb} |")
            print(lines[-1], flush=True)
    load = os.getloadavg()
    text = "\n".join(lines) + (f"\n\nMachine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
                               f"torch {torch.__version__}; load average {load[0]:.1f} at the end.\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Hybrid capture\n\n" + (__doc__ or "") + "\n" + text)
    print(text)


if __name__ == "__main__":
    main()
