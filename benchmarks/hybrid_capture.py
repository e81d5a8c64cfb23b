"""What a hybrid's capture holds and costs: each hybrid family of the zoo (tiny, 2 layers, float64,
as ``tests/e2e/test_hybrids.py`` builds them) captured at the synthesized length 11, then a call
at 8 served as ``ParallelModule`` serves it: by the first program where its guards and fixed
dims allow (``capture.fits_call``), else by a capture of its own.

``after``: autotp's capture as it is. ``before``: the same code with a pin torch's solver forced
from guards it could not prove (``seq = 11``: Gated DeltaNet's and lightning attention's chunk
padding) taken as torch suggests (``capture.export._forced_pin`` answering False), as capture
did before. Each row: process CPU seconds of the capture at 11 (wall seconds move with the other
jobs on the machine), its torch.export calls, the lengths in 2..32 (the tiny configs' position
limit) its program serves, and what the call at 8 cost (0 exports: the first program served it).

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
from autotp.capture import fits_call

FAMILIES = "qwen3-next,qwen3.5-moe,minimax,jamba,bamba,falcon-h1,granitemoehybrid,mamba"


def _runs(lengths: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    out, start = [], None
    for i, n in enumerate(lengths):
        if start is None:
            start = n
        if i + 1 == len(lengths) or lengths[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out) or "none"


def captures(family: str, mode: str) -> tuple:
    """(CPU s, exports, lengths served) of a capture at 11 of a fresh tiny ``family`` model, and
    (CPU s, exports) of what a call at 8 then needs."""
    config = zoo.tiny_config(family, layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    model = zoo.build(family, config, dtype=torch.float64)
    capture_export._NARROWED.clear()
    real_forced, real_export = capture_export._forced_pin, torch.export.export
    calls = []
    torch.export.export = lambda *a, **k: calls.append(1) or real_export(*a, **k)
    if mode == "before":
        capture_export._forced_pin = lambda text: False
    try:
        kwargs = zoo.example_batch(family, config, batch=2, seq=11)
        start = time.process_time()
        cap = capture_export.capture(model, example_kwargs=kwargs)
        first = (time.process_time() - start, len(calls))
        served = [n for n in range(2, 33) if fits_call(cap, zoo.example_batch(family, config, batch=2, seq=n))]
        call = zoo.example_batch(family, config, batch=2, seq=8)
        before, start = len(calls), time.process_time()
        if not fits_call(cap, call):
            capture_export.capture(model, example_kwargs=call)
        return (*first, _runs(served), time.process_time() - start, len(calls) - before)
    finally:
        capture_export._forced_pin, torch.export.export = real_forced, real_export


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=FAMILIES)
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = ["| family | capture | CPU s at 11 | exports | lengths served (2..32) | CPU s for 8 | exports |",
             "|---|---|---|---|---|---|---|"]
    for family in args.families.split(","):
        for mode in ("after", "before"):
            a, na, served, b, nb = captures(family, mode)
            lines.append(f"| {family} | {mode} | {a:.1f} | {na} | {served} | {b:.1f} | {nb} |")
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
