"""One rank of tp=N against serial/N for two MoE shapes: expert-parallel with the tokens gathered
(the combine a g), expert-parallel with the all-to-all dispatch, and expert-TP, each predicted
(the cost model on a profile calibrated on this machine) beside measured, and the solver's pick
beside the fastest measured.

    python benchmarks/moe_rank.py --out benchmarks/moe_rank.md
    python benchmarks/moe_rank.py --predicted-only  # the versions planned at the GPU workload, nothing run

The rank runs on torch's ``fake`` process-group backend (rank 0 of tp=N in this one process: its
collectives return at once and move nothing), so its time is its own compute at the model's
size, timed by the thread's CPU time (a shared machine's load puts waiting for a core into the
wall clock) and, call by call, at each ATen call's least time over the repeats
(``benchmarks/op_timer.py``): where the rank's time above serial/N goes, by kind and by call; the peers' routing, which the dispatch needs real-sized, is emulated by mirroring the rank
(``benchmarks/fake_peers.py`` says exactly what is emulated). Sequence parallelism is forced in
every version (the all-to-all dispatch exists only where the tokens arrive split along the
sequence) and attention pinned Megatron's way (ATTENTION), so the versions differ in the experts'
path alone:

* expert-parallel, g combine: whole experts per rank, the tokens gathered whole before the
  router, a rank's rows cut from them (``expert_dispatch=False``);
* expert-parallel, all-to-all dispatch: whole experts per rank, each (token, expert) row sent
  from its token's rank to its expert's (``expert_dispatch=True``; where the router runs, on the
  rank's own tokens or on every token, is the solver's choice);
* expert-TP: every expert's gate|up column, down row (the router where the solver puts it);
* expert-TP, weights on the output rows: the same, with the planner offering no move of the
  routing weights to the down product's input (``autotp/passes/row_scales.py``): each version's
  line of collectives says whether its plan moved them.

The combine is the one g in all three. The shapes are Mixtral-8x7B's and Qwen3-30B-A3B's expert
counts, top-k and heads-to-width ratios with the widths cut to fit a shared 2-core CPU (SHAPES),
2 layers. Predicted: the cost model's forward + backward for the rank (products, attention,
memory-bound, host reads: ``cost_model/symbolic.step_breakdown``) at the measured workload, on a
profile ``calibrate()`` measures at the start of the run (one thread, as the steps run). The
plans are solved at the measured workload on that profile; the solver picks by its whole step
(compute + the collectives the fake backend does not run), so the pick is also given by the
predicted compute alone, the part measured here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine, publish  # noqa: E402
from benchmarks.fake_peers import EMULATED, mirrored_peers  # noqa: E402
from benchmarks.op_timer import (ATTENTION_OPS, CATEGORIES, PRODUCT_OPS, by_category, category,  # noqa: E402
                                 module_step, op_times)

#: (family, tiny_config arguments): the published models' experts, top-k and heads, narrower
SHAPES = {
    # 4096 wide, 32 heads of 128 (8 kv), 8 experts of 14336, top-2: widths / 8, heads / 4
    "Mixtral-8x7B / 8": ("mixtral", dict(heads=8, kv_heads=2, head_dim=64, experts=8, top_k=2,
                                         intermediate_size=1792, vocab=4096)),
    # 2048 wide, 32 heads of 128 (4 kv), 128 experts of 768, top-8: widths / 4, heads / 4
    "Qwen3-30B-A3B / 4": ("qwen3-moe", dict(heads=8, kv_heads=1, head_dim=64, experts=128, top_k=8,
                                            moe_intermediate_size=192, vocab=4096)),
}
LAYERS, IMPL = 2, "grouped_mm"
#: the models' dtype (``--dtype``): bfloat16 runs Mixtral's float32 combine cast back to it (reduce-scattered into the rank's tokens there)
DTYPE = torch.float32
#: attention's query heads pinned split in every version (and the solver's own plan), its output
#: row-parallel: that meets the residual add, so sequence parallelism always has a region to split,
#: whatever the profile calibrated under the machine's load finds cheapest around it (the 2 and 1
#: key/value heads left to the planner: they do not split 8 ways)
ATTENTION = {"*.q_proj.weight": "column", "*.o_proj.weight": "row"}
EP = {**ATTENTION, "*.experts.*": "expert"}
ETP = {**ATTENTION, "*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}


#: name -> (layout pinned, expert_dispatch: how expert parallelism's rows reach their experts,
#: may the plan move the routing weights to the down product's input: autotp/passes/row_scales.py)
VERSIONS = {
    "expert-parallel, g combine": (EP, False, True),
    "expert-parallel, all-to-all dispatch": (EP, True, True),
    "expert-TP": (ETP, None, True),
    "expert-TP, weights on the output rows": (ETP, None, False),
}


@contextlib.contextmanager
def _row_scales(allowed: bool):
    """The planner offers no per-row scale moved to a product's input where not ``allowed``
    (the routing weights stay on the down product's output rows, as before it could move them)."""
    from autotp.planner import planner

    offered = planner.narrower_scales
    if not allowed:
        planner.narrower_scales = lambda index, prop: []
    try:
        yield
    finally:
        planner.narrower_scales = offered


@contextlib.contextmanager
def _sent_back(allowed: bool):
    """No op is offered rows the dispatch sent as the same rows back on their tokens' ranks where
    not ``allowed`` (the reverse all-to-all as a conversion, after an op on the experts' ranks:
    gpt-oss's down product adds its biases after the product): such rows are summed by a g, as
    before the conversion was built."""
    from autotp.passes.rules import routed

    offered = routed._sent_back
    if not allowed:
        routed._sent_back = lambda info, placements, rule: []
    try:
        yield
    finally:
        routed._sent_back = offered


def _moved_note(plan) -> str:
    return next((n for n in plan.notes if n.startswith("per-row scales")), "routing weights on the output rows")


def _model(family: str, extra: dict, seq: int, device: str = "cpu"):
    from autotp import zoo

    config = zoo.tiny_config(family, layers=LAYERS, positions=seq, **extra)
    config._experts_implementation = IMPL
    return zoo.build(family, config, seed=0, device=device, dtype=DTYPE), config


def _fwd_bwd(module, batch: dict) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of a forward + backward. The thread's time is
    the step's own compute: on two cores shared by several jobs the wall time also holds the
    time the step waited for a core (at a load average of 16, most of it)."""
    step = module_step(module, batch)
    wall, cpu = time.perf_counter(), time.thread_time()
    step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _counted(module, batch: dict):
    from autotp.testing.work import WorkCounter

    with WorkCounter() as work:
        module(**batch).loss.backward()
    module.zero_grad(set_to_none=True)
    return work


def _kind(plan) -> str:
    """Which version a plan is: its experts' roles and whether it holds the all-to-all."""
    roles = {r for n, r in plan.roles.items() if ".experts." in n}
    # the dispatch's all-to-all (of token rows), not a reshard of one split to another (S -> S)
    a2a = any(c.kind == "all_to_all" and str(c.src).startswith("P(tokens") for c in plan.comms)
    if roles == {"expert"}:
        return "expert-parallel, all-to-all dispatch" if a2a else "expert-parallel, g combine"
    if roles == {"expert_column", "expert_row"}:
        return "expert-TP"
    return "other (" + ", ".join(sorted(roles)) + ")"


def _moe_comms(plan) -> str:
    """The collectives of the first MoE block (forward kind, what they move)."""
    first = next((c.module for c in plan.comms if ".mlp" in c.module), "")
    block = first.split(".mlp")[0] + ".mlp"
    return ", ".join(f"{c.kind} {c.src}->{c.dst}" for c in plan.comms if c.module.startswith(block))


def _predicted(model, example: dict, tp: int, batch: int, seq: int, profile, layout, dispatch=None):
    """(the plan, the rank's predicted forward + backward split, predicted communication s) of the
    call ``example``, as ``parallelize`` plans it on CPU (no product padded)."""
    from autotp.capture import capture
    from autotp.cost_model.symbolic import step_breakdown
    from autotp.planner import build_plan

    plan, index, prop = build_plan(capture(model, (), example), tp, batch=batch, seq=seq, profile=profile,
                                   layout=layout, sequence_parallel=True if tp > 1 else None, align=None,
                                   expert_dispatch=dispatch)
    return plan, step_breakdown(index, prop, profile), prop.comm_s


def _compute(parts: dict) -> float:
    return parts["products"] + parts["attention"] + parts["memory"] + parts["host_reads"]


def measure(family: str, extra: dict, tp: int, batch_size: int, seq: int, steps: int, profile) -> dict:
    from autotp import zoo
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, config = _model(family, extra, seq)
    batch = zoo.example_batch(family, config, batch=batch_size, seq=seq, seed=1)
    serial_parts = _predicted(model, batch, 1, batch_size, seq, profile, None)[1]
    runs = {"serial": {"module": model, "work": _counted(model, batch), "times": [],
                       "predicted": _compute(serial_parts) / tp, "comm": 0.0, "by_op": serial_parts["by_op"], "split": serial_parts}}
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    with mirrored_peers():   # the programs are written under it; their all-to-alls run under it
        out = _measure_ranks(model, family, extra, batch, runs, tp, batch_size, seq, steps, profile)
    dist.destroy_process_group()
    return out


def _measure_ranks(model, family: str, extra: dict, batch: dict, runs: dict, tp: int, batch_size: int, seq: int,
                   steps: int, profile) -> dict:
    import autotp

    for name, (layout, dispatch, moves) in VERSIONS.items():
        with _row_scales(moves):
            plan, parts, comm = _predicted(model, batch, tp, batch_size, seq, profile, layout, dispatch)
            if not name.startswith(_kind(plan)):
                raise RuntimeError(f"{name}: the solver's plan at this workload is {_kind(plan)}")
            pm = autotp.parallelize(_model(family, extra, seq)[0], tp, layout=layout, batch=batch_size, seq=seq,
                                    profile=profile, sequence_parallel=True, example_kwargs=batch,
                                    expert_dispatch=dispatch)
        EMULATED["scatters"] = 0
        work = _counted(pm, batch)   # the first call: its program is written here, under the emulation
        if len(pm._programs) != 1 or [c.kind for c in pm.plan.comms] != [c.kind for c in plan.comms]:
            raise RuntimeError(f"{name}: ran {len(pm._programs)} programs, or not the plan predicted")
        runs[name] = {"module": pm, "work": work, "times": [], "predicted": _compute(parts), "comm": comm,
                      "by_op": parts["by_op"], "split": parts, "emulated": EMULATED["scatters"],
                      "moe_comms": _moe_comms(plan), "scales": _moved_note(pm.plan)}
    chosen = _predicted(model, batch, tp, batch_size, seq, profile, ATTENTION)[0]
    for run in runs.values():   # warm-up
        _fwd_bwd(run["module"], batch)
    for _ in range(steps):   # alternating, so that load on the machine hits all alike
        for run in runs.values():
            run["times"].append(_fwd_bwd(run["module"], batch))
    for run in runs.values():
        run["ops"] = op_times(module_step(run["module"], batch), repeats=3)   # each call at its least CPU time
    return {"runs": runs, "chosen": _kind(chosen), "chosen_step_s": chosen.cost["step_s"],
            "notes": [n for n in chosen.notes if n.startswith("experts ")]}


def _measured_split(ops) -> dict[str, float]:
    out = {"products": 0.0, "attention": 0.0, "memory": 0.0}
    for op, t in ops.by_op.items():
        kind = ("products" if "grouped_mm" in op or op in PRODUCT_OPS else
                "attention" if op.startswith(ATTENTION_OPS) else "memory")
        out[kind] += t
    return out


def _short(op: str) -> str:
    """``aten.mul.Tensor`` -> ``mul``, ``transformers.grouped_mm_fallback.default`` ->
    ``transformers.grouped_mm_fallback``: the predicted op (priced forward + backward under its
    forward's name) by the name the dispatch mode gives its forward call."""
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) > 1:
        return parts[1]
    return ".".join(parts[:2]) if len(parts) > 2 else op


def _expert_flops(work) -> int:
    return sum(f for name, f in work.by_op.items() if "grouped_mm" in name)


def _split_table(runs: dict, names: list[str]) -> list[str]:
    """Predicted beside measured forward + backward, split by kind."""
    lines = ["| version | products ms (predicted / measured) | attention | memory-bound and the rest | "
             "host reads (predicted) | outside ATen ops (measured) |", "|---|---|---|---|---|---|"]
    for n in names:
        run, measured = runs[n], _measured_split(runs[n]["ops"])
        cells = [f"{run['split'][k] * 1e3:.1f} / {measured[k] * 1e3:.1f}" for k in ("products", "attention", "memory")]
        outside = max(0.0, runs[n]["ops"].step - runs[n]["ops"].total)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {run['split']['host_reads'] * 1e3:.2f} | "
                     f"{outside * 1e3:.1f} |")
    return lines


def _op_table(runs: dict, names: list[str]) -> list[str]:
    """Predicted beside measured per ATen op (a prediction holds its op's backward too, the
    dispatch mode sees backward calls under their own names): the ops where the two part most."""
    lines = ["| aten op | " + " | ".join(f"{n}: predicted / measured ms" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    predicted = {n: {} for n in names}
    for n in names:
        for op, t in runs[n]["by_op"].items():
            predicted[n][_short(op)] = predicted[n].get(_short(op), 0.0) + t
    gaps: dict[str, float] = {}
    for n in names:
        measured = runs[n]["ops"].by_op
        for op in set(predicted[n]) | set(measured):
            gap = abs(predicted[n].get(op, 0.0) - measured.get(op, 0.0))
            gaps[op] = max(gaps.get(op, 0.0), gap)
    for op in sorted(gaps, key=lambda o: -gaps[o])[:12]:
        cells = [f"{predicted[n].get(op, 0.0) * 1e3:.2f} / {runs[n]['ops'].by_op.get(op, 0.0) * 1e3:.2f}"
                 for n in names]
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return lines


def _excess_tables(runs: dict, tp: int) -> list[str]:
    """Where each rank's time above serial/tp goes: by category, then the op calls (op, output
    shape) with the most time above serial's same calls / tp."""
    serial = runs["serial"]["ops"]
    s_cat = by_category(serial)
    lines = ["| where (CPU ms, each call at its least of the repeats) | serial / tp | "
             + " | ".join(f"{n}: rank (over serial/tp)" for n in VERSIONS) + " |",
             "|---|---|" + "---|" * len(VERSIONS)]
    cats = {n: by_category(runs[n]["ops"]) for n in VERSIONS}
    for c in CATEGORIES:
        cells = [f"{cats[n][c] * 1e3:.1f} ({(cats[n][c] - s_cat[c] / tp) * 1e3:+.1f})" for n in VERSIONS]
        lines.append(f"| {c} | {s_cat[c] / tp * 1e3:.1f} | " + " | ".join(cells) + " |")
    totals = [f"**{runs[n]['ops'].step * 1e3:.1f}** ({(runs[n]['ops'].step - serial.step / tp) * 1e3:+.1f})"
              for n in VERSIONS]
    lines.append(f"| the step (least thread time) | **{serial.step / tp * 1e3:.1f}** | " + " | ".join(totals) + " |")
    lines.append(f"| ATen op calls per step | {len(serial.calls)} (whole) | "
                 + " | ".join(str(len(runs[n]["ops"].calls)) for n in VERSIONS) + " |")
    s_shape = serial.by_op_shape()
    for n in VERSIONS:
        lines += ["", f"{n}: the 10 op calls (op, output shape; not the experts' products) most over serial's same "
                  "calls / tp, CPU ms:", "",
                  "| op | output shape | calls | rank | serial / tp | over |", "|---|---|---|---|---|---|"]
        rank = runs[n]["ops"].by_op_shape()
        over = {key: t - s_shape.get(key, (0.0, 0))[0] / tp for key, (t, _) in rank.items()
                if category(key[0]) != CATEGORIES[0]}
        for key in sorted(over, key=lambda k: -over[k])[:10]:
            op, shape = key
            lines.append(f"| `{op}` | {list(shape)} | {rank[key][1]} | {rank[key][0] * 1e3:.2f} | "
                         f"{s_shape.get(key, (0.0, 0))[0] / tp * 1e3:.2f} | {over[key] * 1e3:+.2f} |")
    return lines


#: the published models at the H200 measurements' workload (``../shared/measurements/h200-2026-11-28/``)
REAL = (("Mixtral-8x7B", "mixtral-8x7b"), ("Qwen3-30B-A3B", "qwen3-30b-a3b"), ("gpt-oss-20b", "gpt-oss-20b"))
#: the dispatch planned with no reverse all-to-all after an op on the experts' ranks (``_sent_back``)
NO_SENT_BACK = "expert-parallel, all-to-all dispatch, no reverse all-to-all after the product"


def predicted_at_real_size(tp: int, profile_name: str, batch: int = 2, seq: int = 4096) -> list[str]:
    """Each version planned for the published model (2 layers, meta, bfloat16) at the GPU workload:
    the rank's predicted compute (the solver's bound: every op on its largest rank), communication
    and step, the solver's own pick with the experts free, and its notes (which each MoE layer got
    and by how much); and the dispatching version with no reverse all-to-all after an op on the
    experts' ranks (:data:`NO_SENT_BACK`: what gpt-oss's plan was before it, its down product adding
    its biases after the product). Nothing is run."""
    from autotp import zoo
    from autotp.capture import capture
    from autotp.cost_model.devices import get_profile
    from autotp.planner import build_plan

    profile = get_profile(profile_name)
    lines = [f"## Predicted at the GPU workload ({profile_name}, bfloat16, tp={tp}, {LAYERS} layers, "
             f"{batch} x {seq}, meta models)", "",
             "Attention pinned and sequence parallelism forced in every version, as in the measured runs below; "
             "the solver's pick has the experts free. Compute is the solver's bound (every op on its largest rank).",
             "", "| model | version | compute ms | communication ms | step ms | over the pick |",
             "|---|---|---|---|---|---|"]
    notes = []
    for label, name in REAL:
        model = zoo.build(zoo.family_of(name).name, zoo.published_config(name, layers=LAYERS), device="meta",
                          dtype=torch.bfloat16)
        cap = capture(model)
        steps = {}
        for version, (layout, dispatch, moves) in VERSIONS.items():
            with _row_scales(moves):
                plan, _, prop = build_plan(cap, tp, batch=batch, seq=seq, profile=profile, layout=layout,
                                           sequence_parallel=True, expert_dispatch=dispatch)
            steps[version] = (_kind(plan), prop.compute_s, prop.comm_s)
        with _sent_back(False):   # what the dispatching version was before the conversion (its own rows summed by a g)
            plan, _, prop = build_plan(cap, tp, batch=batch, seq=seq, profile=profile, layout=EP,
                                       sequence_parallel=True, expert_dispatch=True)
        steps[NO_SENT_BACK] = (_kind(plan), prop.compute_s, prop.comm_s)
        plan, _, prop = build_plan(cap, tp, batch=batch, seq=seq, profile=profile, layout=ATTENTION,
                                   sequence_parallel=True)
        pick = prop.compute_s + prop.comm_s
        for version, (kind, compute, comm) in steps.items():
            got = "" if kind == version or version.startswith(kind) else f" (planned as {kind})"
            lines.append(f"| {label} | {version}{got} | {compute * 1e3:.2f} | {comm * 1e3:.2f} | "
                         f"{(compute + comm) * 1e3:.2f} | {(compute + comm) / pick:.3f}x |")
        lines.append(f"| {label} | **solver's pick: {_kind(plan)}** | {prop.compute_s * 1e3:.2f} | "
                     f"{prop.comm_s * 1e3:.2f} | {pick * 1e3:.2f} | 1.000x |")
        notes += [f"- {label}: {n}" for n in plan.notes if n.startswith("experts ")]
        notes.append(f"- {label}: the pick's collectives in its first MoE block: {_moe_comms(plan)}")
    return lines + ["", "The pick's notes:", ""] + notes + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--only", default=None, help="run the shapes whose label holds this")
    parser.add_argument("--versions", default=None, help="run the versions whose name holds this (and serial)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--profile", default=None,
                        help="plan and predict on this named profile, not one calibrated here (runs compared by "
                             "their plans and counts: a calibration under load moves the plans between runs)")
    parser.add_argument("--predicted-only", action="store_true",
                        help="only each version planned for the published models at the GPU workload (--profile, "
                             "default h200; meta models, nothing run)")
    args = parser.parse_args()
    if args.predicted_only:
        started = time.time()
        lines = ["# MoE experts layouts and the all-to-all dispatch at the GPU workload: predicted", "",
                 "Command: `python benchmarks/moe_rank.py " + " ".join(sys.argv[1:]) + "`", "",
                 machine() + " Load average at the start: {:.1f}.".format(os.getloadavg()[0]), ""]
        lines += predicted_at_real_size(args.tp, args.profile or "h200")
        publish(lines + [f"Planning wall time {time.time() - started:.0f} s (meta models: no step is run)."],
                args.out)
        return
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    for name in [n for n in VERSIONS if args.versions and args.versions not in n]:
        del VERSIONS[name]
    from autotp.cost_model import calibrate

    started = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.profile:
        from autotp.cost_model.devices import get_profile

        profile = get_profile(args.profile)
    else:
        profile = calibrate("cpu-calibrated")
    tp = args.tp
    lines = [
        f"# One rank of tp={tp} against serial/{tp}: MoE experts layouts and the all-to-all dispatch, predicted "
        "and measured",
        "",
        "Command: `python benchmarks/moe_rank.py " + " ".join(sys.argv[1:]) + "`",
        "",
        machine() + " Load average at the start: {:.1f}, {:.1f}, {:.1f}; at the end: {{:.1f}}, {{:.1f}}, "
        "{{:.1f}}.".format(*os.getloadavg()),
        "",
        f"{LAYERS} layers, batch {args.batch} x seq {args.seq}, {args.dtype}, experts implementation `{IMPL}`, one "
        f"thread. Timed: forward + backward, 1 warm-up, then {args.steps} of each version in turn (median, best). "
        "Measured is the step's thread CPU time (`time.thread_time`: the step's own compute; the wall time "
        "beside it also holds the time the step waited for one of the two shared cores). "
        f"The rank is rank 0 of tp={tp} on the `fake` backend (its collectives move nothing: its own compute), "
        "sequence parallelism forced in every version; the peers' routing mirrored "
        "(`benchmarks/fake_peers.py`). Predicted: the rank's forward + backward compute on profile "
        f"`{profile.name}`, {'named (--profile), not calibrated' if args.profile else 'calibrated at the start of this run'} "
        f"({profile.flops / 1e9:.0f} GFLOP/s products, "
        f"{profile.mem_bw / 1e9:.1f} GB/s memory, {profile.link_bw / 1e9:.2f} GB/s link, "
        f"a grouped product's experts' weights streamed at {profile.grouped_bw / 1e9:.2f} GB/s, one thread); "
        "communication predicted but not run. Efficiency: (serial / tp) / rank, by CPU time. Against its own rows: "
        "serial / tp with its experts' products scaled to the rows the router gave this rank's experts (their "
        "FLOPs against their share), over the rank: what the rank would measure with a balanced router, "
        "everything else alike.",
        "",
        "| shape | version | predicted compute ms | measured CPU ms (median) | (best) | wall ms (median) | "
        "predicted efficiency | measured efficiency | against its own rows | predicted comm ms | "
        "experts' FLOPs / share | FLOPs / (serial/tp) | bytes moved / (serial/tp) | token-row tensors mirrored |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    picks, notes, op_tables, comms = [], [], [], []
    for label, (family, extra) in SHAPES.items():
        if args.only and args.only not in label:
            continue
        result = measure(family, extra, tp, args.batch, args.seq, args.steps, profile)
        runs = result["runs"]
        serial = runs["serial"]
        cpu = {n: [c for _, c in r["times"]] for n, r in runs.items()}
        wall = {n: [w for w, _ in r["times"]] for n, r in runs.items()}
        s_med = statistics.median(cpu["serial"]) / tp
        s_flops, s_moved = serial["work"].flops / tp, serial["work"].moved / tp
        s_expert_flops = _expert_flops(serial["work"]) / tp
        s_expert_s = by_category(serial["ops"])[CATEGORIES[0]] / tp
        lines.append(f"| {label} | serial / {tp} | {serial['predicted'] * 1e3:.1f} | {s_med * 1e3:.1f} | "
                     f"{min(cpu['serial']) / tp * 1e3:.1f} | {statistics.median(wall['serial']) / tp * 1e3:.1f} | "
                     "1.00 | 1.00 | 1.00 | - | 1.00 | 1.00 | 1.00 | - |")
        for name in VERSIONS:
            run = runs[name]
            med = statistics.median(cpu[name])
            share = _expert_flops(run["work"]) / s_expert_flops
            own = s_med + s_expert_s * (share - 1)
            lines.append(f"| {label} | {name} | {run['predicted'] * 1e3:.1f} | {med * 1e3:.1f} | "
                         f"{min(cpu[name]) * 1e3:.1f} | {statistics.median(wall[name]) * 1e3:.1f} | "
                         f"{serial['predicted'] / run['predicted']:.2f} | {s_med / med:.2f} | {own / med:.2f} | "
                         f"{run['comm'] * 1e3:.1f} | {share:.2f} | {run['work'].flops / s_flops:.2f} | "
                         f"{run['work'].moved / s_moved:.2f} | {run['emulated']} |")
        pick, by_compute = result["chosen"], min(VERSIONS, key=lambda n: runs[n]["predicted"])
        cells = []
        for stat in (statistics.median, min):   # the median, and the best step (load only adds to a step)
            measured = {n: stat(cpu[n]) for n in VERSIONS}
            fastest = min(measured, key=measured.get)
            cells += [fastest, f"{measured[pick] / measured[fastest]:.2f}x" if pick in measured else "not measured"]
        picks.append(f"| {label} | {pick} ({result['chosen_step_s'] * 1e3:.1f} ms predicted step) | {by_compute} | "
                     + " | ".join(cells) + " |")
        notes += [f"- {label}: {n}" for n in result["notes"]]
        comms += [f"- {label}, {name}: {runs[name]['moe_comms']}; {runs[name]['scales']}" for name in VERSIONS]
        op_tables += ["", f"### {label}: where the rank's time above its share goes", ""]
        op_tables += _excess_tables(runs, tp)
        op_tables += ["", f"### {label}: predicted and measured (each op call's least CPU time of 3 forward + "
                      "backward steps; serial whole, not / tp)", ""]
        op_tables += _split_table(runs, ["serial", *VERSIONS])
        op_tables += ["", "The 12 ATen ops where prediction and measurement part most:", ""]
        op_tables += _op_table(runs, ["serial", *VERSIONS])
    lines[4] = lines[4].format(*os.getloadavg()) + f" Wall time {time.time() - started:.0f} s."
    lines += ["", "## The solver's pick (the experts free, attention pinned, sequence parallelism forced) against the "
              "fastest measured (CPU time)", "",
              "| shape | solver's pick (whole step: compute + communication) | pick by predicted compute alone | "
              "fastest measured (median) | the pick's median over the fastest's | fastest measured (best step) | "
              "the pick's best over the fastest's |", "|---|---|---|---|---|---|---|"] + picks
    lines += ["", "The plan's notes:", ""] + notes
    lines += ["", "The collectives of each version's first MoE block (the plan's, kind and placements):", ""] + comms
    lines += op_tables
    publish(lines, args.out)


if __name__ == "__main__":
    main()
