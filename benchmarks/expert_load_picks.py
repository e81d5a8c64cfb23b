"""The experts layout the planner picks at a router's load, at the published widths (planning only).

Each model is built on the meta device at its published width (``--layers`` of them), planned at
tp ``--tp`` on profile ``--profile`` for ``--batch`` x ``--seq`` tokens: the default plan at a
balanced router, then at a load where rank 0's experts get ``skew`` times a balanced share of every
MoE layer's rows and the other ranks' experts an even rest (``--skew model=x``: the H200 router's
measured skew of rank 0, ``../shared/measurements/h200-2026-11-28/``), and each experts layout
forced at that load (whole experts per rank, with and without the all-to-all dispatch; expert-TP),
so that the pick can be read against the alternatives' predicted steps. Nothing runs a model:
every figure is the cost model's forward + backward on the profile.

    python benchmarks/expert_load_picks.py      # benchmarks/expert_load_picks.md: a run before and after, joined
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402

_EP = {"*.experts.gate_up_proj": "expert", "*.experts.down_proj": "expert"}
#: the experts layouts forced at the load, as planning arguments (benchmarks/rank_efficiency.py's)
FORCED = {"expert-parallel, tokens gathered": dict(layout=_EP, expert_dispatch=False),
          "expert-parallel, all-to-all dispatch": dict(layout=_EP, sequence_parallel=True, expert_dispatch=True),
          "expert-TP": dict(layout={"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"})}


def skewed_load(model, tp: int, skew: float):
    """Every MoE layer's rows per expert: rank 0's experts (its contiguous run under Shard(0))
    ``skew / tp`` of them, evenly among its experts, the other experts an even rest."""
    from autotp.placements import Shard, local_ranges
    from autotp.plan.expert_load import ExpertLoad
    from autotp.planner.expert_load import expert_modules

    layers = {}
    for name, _, experts in expert_modules(model):
        (lo, hi), = local_ranges(experts, Shard(0), tp, 0)
        mine, rest = skew / tp, 1 - skew / tp
        layers[name] = [mine / (hi - lo) if lo <= e < hi else rest / (experts - (hi - lo)) for e in range(experts)]
    return ExpertLoad(layers, f"rank 0 at {skew:.2f}x, an even rest")


def experts_layout(plan) -> str:
    """The experts' layout a plan picked (its roles), and whether its rows go by the all-to-all
    (the dispatch) and come back by the reverse one (the combine; else the g sums them)."""
    roles = sorted({role for name, role in plan.roles.items() if ".experts." in name})
    dispatch = any(c.kind == "all_to_all" and c.src.startswith("P(tokens") for c in plan.comms)
    combine = any(c.kind == "all_to_all" and c.src.startswith("P(sent") for c in plan.comms)
    return ", ".join(roles) + (" + all-to-all dispatch" if dispatch else "") + (" and combine" if combine else "")


def step_ms(plan) -> float:
    return (plan.compute_s + plan.comm_s) * 1e3


def rows(size: str, layers: int, skew: float, args) -> list[str]:
    import autotp
    from autotp import zoo

    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=layers), device="meta")
    kw = dict(tp=args.tp, batch=args.batch, seq=args.seq, profile=args.profile)
    load = skewed_load(model, args.tp, skew)
    out = []
    for label, extra in [("default, balanced router", {}), (f"default, at {skew:.2f}x", dict(expert_load=load))] + [
            (f"{name}, at {skew:.2f}x", dict(extra, expert_load=load)) for name, extra in FORCED.items()]:
        start = time.perf_counter()
        plan = autotp.plan(model, **kw, **extra)
        out.append(f"| {size} | {label} | {experts_layout(plan)} | {step_ms(plan):.2f} | {plan.compute_s * 1e3:.2f} | "
                   f"{plan.comm_s * 1e3:.2f} | {time.perf_counter() - start:.0f} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mixtral-8x7b=3.12", "qwen3-30b-a3b=2.05"],
                   help="published size=rank 0's skew (its rows over a balanced share)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--profile", default="h200")
    p.add_argument("--out")
    args = p.parse_args()
    lines = [f"| model | plan | experts layout | step ms | compute ms | comm ms | planning s |",
             "|---|---|---|---|---|---|---|"]
    for item in args.models:
        size, skew = item.split("=")
        lines += rows(size, args.layers, float(skew), args)
    text = "\n".join([machine(), "", *lines, ""])
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
