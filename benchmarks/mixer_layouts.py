"""What the planner splits of each state-space mixer at tp=8 on the published configurations (on
meta, 2 layers, bfloat16, h100-dgx, the default workload): each mixer parameter's layout in layer
0, the share of the mixers' bytes one rank holds, and the plan's predicted step; for Mamba also
Megatron's channel layout pinned (in_proj column, x_proj row, dt_proj column, out_proj row).

    python benchmarks/mixer_layouts.py --out benchmarks/mixer_layouts.md

Predictions of the cost model, not measurements: nothing runs but planning.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autotp  # noqa: E402
from autotp.placements import REPLICATE  # noqa: E402
from autotp import zoo  # noqa: E402

MEGATRON_MAMBA = {"*in_proj.weight": "column", "*x_proj.weight": "row", "*dt_proj.weight": "column",
                  "*out_proj.weight": "row"}
CASES = [("mamba-130m", None), ("mamba-130m", MEGATRON_MAMBA), ("jamba-v0.1", None), ("bamba-9b", None),
         ("granite-4.0-h-tiny", None), ("falcon-h1-0.5b", None)]
TP = 8


def row(size: str, layout: dict | None) -> str:
    config = zoo.published_config(size, layers=2)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    model = zoo.build(zoo.family_of(size).name, config, device="meta", dtype=torch.bfloat16)
    start = time.time()
    try:
        plan = autotp.plan(model, TP, layout=layout)
    except autotp.PlanError as exc:   # over the profile's memory: the fastest plan without the limit
        if not hasattr(exc, "plan_without_limit"):
            return f"| {size} | {'pinned' if layout else 'solver'} | PlanError: {str(exc)[:160]} | | | |"
        plan = exc.plan_without_limit()
    seconds = time.time() - start
    mixers = [n for n in plan.params if ".mixer." in n or ".mamba." in n]
    held = sum(torch.Size(plan.local_shape(n, r)).numel() for n in mixers for r in range(TP)) / TP
    serial = sum(torch.Size(plan.shapes[n]).numel() for n in mixers)
    first = sorted({n for n in mixers if ".0." in n and plan.params[n] != REPLICATE})
    split = "; ".join(f"`{n.split('.', 3)[-1]}` {plan.roles[n]} {plan.params[n]!r}" for n in first)
    pinned = "Megatron's, pinned" if layout else "solver's"
    return (f"| {size} | {pinned} | {split} | {held / serial:.3f} | {plan.cost['step_s'] * 1e3:.2f} | "
            f"{seconds:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = ["# The state-space mixers' layouts at tp=8, published configurations (2 layers, planned on meta)", "",
             "Command: `python benchmarks/mixer_layouts.py --out benchmarks/mixer_layouts.md`", "", machine(), "",
             "Layer 0's mixer parameters that are split (every other one whole on every rank), the share of all",
             "mixer parameters' bytes one rank holds (1/8 = 0.125 would be all split), the predicted step",
             "(h100-dgx, batch 8, the program's length: Mamba's is fixed at 11 tokens) and planning seconds.", "",
             "| model | layout | split in layer 0 | mixer bytes per rank | predicted step ms | plan s |",
             "|---|---|---|---|---|---|"]
    for size, layout in CASES:
        lines.append(row(size, layout))
    publish(lines, args.out)


if __name__ == "__main__":
    main()
