"""A tiny Mixtral's training step: serial, its experts replicated, expert-parallel and expert-TP,
at tp 2 and 4 on gloo, each plan's predicted step beside the measured one.

    python benchmarks/moe.py --out benchmarks/moe.md

Serial runs in this process (one thread); each tp is one launch of gloo ranks (one thread each)
that builds the three plans from the same weights and times them alternating, so load hits all
alike. The plans pin the experts' stacks and leave everything else to the solver: 'experts
replicated' (``"replicate"``, autotp's layout before experts were split), 'expert-parallel'
(``"expert"``: whole experts per rank, uneven where tp does not divide them), 'expert-TP'
(``"expert_column"``/``"expert_row"``: every expert's gate|up and down split). 'solver' says which
of the last two the solver picks unpinned, and why (its plan note). Predicted: the plan's step
time under the cpu-gloo profile (``plan.cost["step_s"]``: compute + communication + the
optimizer step); serial's is the tp=1 plan's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import machine, publish, timed_step

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: the measured model: hidden 128, 4 experts of 2 picked per token, experts' features 256
SMALL = dict(layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512, experts=4, top_k=2, intermediate_size=256)
IMPL = "grouped_mm"
BATCH, SEQ, WARMUP, STEPS = 4, 64, 2, 6
LAYOUTS = {
    "experts replicated": {"*.experts.*": "replicate"},
    "expert-parallel": {"*.experts.*": "expert"},
    "expert-TP": {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"},
}


def _model(device: str = "cpu"):
    from autotp import zoo

    config = zoo.tiny_config("mixtral", positions=SEQ, **SMALL)
    config._experts_implementation = IMPL
    return zoo.build("mixtral", config, seed=0, device=device), config


def serial() -> dict:
    import autotp
    from autotp import zoo

    torch.set_num_threads(1)
    model, config = _model()
    batch = zoo.example_batch("mixtral", config, batch=BATCH, seq=SEQ, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = [timed_step(model, opt, batch) for _ in range(WARMUP + STEPS)][WARMUP:]
    plan = autotp.plan(_model("meta")[0], 1, batch=BATCH, seq=SEQ, profile="cpu-gloo")
    return {"median": statistics.median(times), "best": min(times), "predicted": plan.cost["step_s"]}


def measure_rank(tp: int) -> dict:
    import logging

    import autotp
    from autotp import zoo

    logging.getLogger("autotp").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    _, config = _model("meta")
    batch = zoo.example_batch("mixtral", config, batch=BATCH, seq=SEQ, seed=1)
    runs = {}
    for name, layout in LAYOUTS.items():
        pm = autotp.parallelize(_model()[0], tp, layout=layout, batch=BATCH, seq=SEQ)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4))
    chosen = autotp.plan(_model("meta")[0], tp, batch=BATCH, seq=SEQ, profile="cpu-gloo")
    times = {name: [] for name in runs}
    for step in range(WARMUP + STEPS):
        for name, (pm, opt) in runs.items():
            torch.distributed.barrier()
            elapsed = timed_step(pm, opt, batch)
            if step >= WARMUP:
                times[name].append(elapsed)
    out = {name: {"median": statistics.median(t), "best": min(t), "predicted": runs[name][0].plan.cost["step_s"],
                  "gate_up": repr(runs[name][0].plan.params["model.layers.0.mlp.experts.gate_up_proj"])}
           for name, t in times.items()}
    out["solver"] = {"roles": sorted({r for n, r in chosen.roles.items() if ".experts." in n}),
                     "notes": [n for n in chosen.notes if n.startswith("experts ")],
                     "predicted": chosen.cost["step_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp", default="2,4")
    args = parser.parse_args()
    from autotp.testing import launch

    started = time.time()
    base = serial()
    results = {tp: launch(measure_rank, tp, tp, timeout=900) for tp in map(int, args.tp.split(","))}
    hidden = SMALL["heads"] * SMALL["head_dim"]
    lines = [
        "# Mixture of experts: experts replicated, expert-parallel and expert-TP, predicted and measured",
        "",
        "Command: `python benchmarks/moe.py --out benchmarks/moe.md` (run through the repository's test "
        "wrapper, one process group at a time on this machine)",
        "",
        machine() + " Load average at the end: {:.1f}, {:.1f}, {:.1f}.".format(*os.getloadavg())
        + f" Wall time {time.time() - started:.0f} s.",
        "",
        f"Mixtral, {SMALL['layers']} layers, hidden {hidden}, {SMALL['experts']} experts of "
        f"{SMALL['intermediate_size']} features, top-{SMALL['top_k']}, vocab {SMALL['vocab']}, float32, experts "
        f"implementation `{IMPL}`; batch {BATCH} x seq {SEQ}; a step is forward, backward and AdamW; "
        f"{WARMUP} warm-up steps, {STEPS} timed, the plans of one tp alternating. gloo ranks, one thread "
        "each, on 2 cores: tp=4 runs 4 ranks on 2 cores (oversubscribed: its measured times are not a "
        "speed-up, only a comparison of its plans). Predicted: the plan's step under the cpu-gloo profile.",
        "",
        "| tp | plan | experts gate_up placement | predicted step ms | measured ms (median, slowest rank) | "
        "measured ms (best) |",
        "|---|---|---|---|---|---|",
        f"| 1 | serial | - | {base['predicted'] * 1e3:.2f} | {base['median'] * 1e3:.1f} | {base['best'] * 1e3:.1f} |",
    ]
    for tp, ranks in results.items():
        for name in LAYOUTS:
            median = max(r[name]["median"] for r in ranks)
            best = max(r[name]["best"] for r in ranks)
            lines.append(f"| {tp} | {name} | `{ranks[0][name]['gate_up']}` | {ranks[0][name]['predicted'] * 1e3:.2f} "
                         f"| {median * 1e3:.1f} | {best * 1e3:.1f} |")
    lines += ["", "## The solver's own choice (nothing pinned)", ""]
    for tp, ranks in results.items():
        solver = ranks[0]["solver"]
        lines.append(f"- tp={tp}: experts {', '.join(solver['roles'])}; predicted {solver['predicted'] * 1e3:.2f} ms.")
        lines += [f"  {note}" for note in solver["notes"]]
    lines += ["", "## Ratios (medians, measured side by side in one launch per tp)", ""]
    for tp, ranks in results.items():
        med = {name: max(r[name]["median"] for r in ranks) for name in LAYOUTS}
        pred = {name: ranks[0][name]["predicted"] for name in LAYOUTS}
        lines.append(f"- tp={tp}: expert-TP / expert-parallel measured "
                     f"{med['expert-TP'] / med['expert-parallel']:.2f}x, "
                     f"predicted {pred['expert-TP'] / pred['expert-parallel']:.2f}x; expert-parallel / experts "
                     f"replicated measured {med['expert-parallel'] / med['experts replicated']:.2f}x, predicted "
                     f"{pred['expert-parallel'] / pred['experts replicated']:.2f}x.")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
