"""The solver with and without narrow runs stepped at once (autotp/passes/segments.py), side by
side in one process: each model planned twice, op by op (``find_segments`` answering nothing) and
with segments, in alternating order per model. Per model: the seconds in the solver (every solve
the plan makes: the sibling ways, the experts' notes), the states it stepped, and the predicted
step of the plan each found (equal where neither search was cut at its state cap).

Models on the meta device, planned at batch 64, seq 4096 on ``h100-dgx``: tiny zoo configs (one
or two layers) at tp 2, and ``--published`` sizes (a period of layers: Qwen3-Next's three Gated
DeltaNet layers and one attention layer) at tp 8.

    PYTHONPATH=. .venv/bin/python benchmarks/solver_segments.py --out benchmarks/solver_segments.md
"""
from __future__ import annotations

import argparse
import logging
import time

import torch
from common import machine, publish


def _plan(model_of, tp: int, segments: bool) -> tuple[float, int, float]:
    import autotp
    from autotp.passes import solve as solve_module

    saved_find, saved_solve = solve_module.find_segments, solve_module._Solver.solve
    spent, stepped = [0.0], [0]

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return saved_solve(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
            stepped[0] += self.stepped

    solve_module._Solver.solve = timed
    if not segments:
        solve_module.find_segments = lambda *args, **kwargs: {}
    try:
        plan = autotp.plan(model_of(), tp=tp, batch=64, seq=4096, profile="h100-dgx")
    finally:
        solve_module.find_segments, solve_module._Solver.solve = saved_find, saved_solve
    return spent[0], stepped[0], plan.compute_s + plan.comm_s


def _tiny(family: str):
    from autotp import zoo

    def build():
        if family == "qwen3-next":   # one Gated DeltaNet layer, a dense MLP
            config = zoo.tiny_config(family, layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64)
            config.layer_types, config.mlp_only_layers = ["linear_attention"], [0]
        else:
            config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=None if family == "gpt2" else 2,
                                     head_dim=8, vocab=64)
        return zoo.build(family, config, device="meta")
    return build


def _published(size: str, layers: int):
    from autotp import zoo

    def build():
        config = zoo.published_config(size, layers=layers)
        return zoo.build(zoo.family_of(size).name, config, device="meta", dtype=torch.bfloat16)
    return build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", default="gpt2,llama,mixtral,deepseek-v3,t5,mamba,bamba,jamba,falcon-h1,qwen3-next")
    ap.add_argument("--published", default="qwen3-next-80b-a3b:4", help="size:layers, comma-separated")
    ap.add_argument("--out")
    args = ap.parse_args()
    logging.getLogger("autotp").setLevel(logging.ERROR)
    cases = [(f"{f} (tiny, tp 2)", _tiny(f), 2) for f in args.tiny.split(",") if f]
    for item in filter(None, args.published.split(",")):
        size, layers = item.split(":")
        cases.append((f"{size} x{layers} (tp 8)", _published(size, int(layers)), 8))
    rows = []
    for i, (name, model_of, tp) in enumerate(cases):
        order = (False, True) if i % 2 == 0 else (True, False)
        found = {seg: _plan(model_of, tp, seg) for seg in order}
        (s0, n0, c0), (s1, n1, c1) = found[False], found[True]
        rows.append(f"| {name} | {s0:.2f} / {s1:.2f} ({s1 / s0:.2f}x) | {n0} / {n1} | {c0 * 1e3:.4f} / {c1 * 1e3:.4f} |")
        print(rows[-1], flush=True)
    lines = ["# Solver: narrow runs stepped at once", "",
             "    PYTHONPATH=. .venv/bin/python benchmarks/solver_segments.py --out benchmarks/solver_segments.md", "",
             machine(), "",
             "| model | solver s: op by op / segments | states stepped: op by op / segments "
             "| predicted step ms: op by op / segments |", "|---|---|---|---|", *rows]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
