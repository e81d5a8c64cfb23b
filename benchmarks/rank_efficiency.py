"""One rank of tp=N at real widths: does it do its 1/N of the serial step?

One process joins torch's ``fake`` process-group backend as rank 0 of N
(``dist.init_process_group("fake", rank=0, world_size=N, store=FakeStore())``: collectives return at
once and move nothing), so the rank's own compute runs at its real size on one device. For each
model (published widths, fewer layers) it measures, side by side in one run:

* **efficiency**: (serial step / N) / rank step, forward + backward, eager (and ``--compile``:
  both under ``torch.compile`` too, beside eager). On CPU by two clocks: the thread's CPU time (the
  least of ``--repeats`` steps after a warm-up: the step's own compute, steady on a shared machine, where
  waiting for a core is not counted) and the wall clock (their median, for comparison); on CUDA
  the wall clock, the device synchronized;
* **counts that do not depend on the device**: the products' FLOPs and every other op's bytes
  read and written (a dispatch mode over forward and backward), rank against serial/N, and the
  copies and casts each step makes, by where they were made (``autotp.testing.work.CopyCounter``);
  where the ops with the most bytes over the share were made, rank beside serial (a program node,
  a backward formula, the model's own code: ``autotp.testing.work.op_site``);
* **time per ATen op** beside serial/N, the largest first: on CPU each call at its least thread
  time over the repeats (``benchmarks/op_timer.py``, shared with ``benchmarks/moe_rank.py``), by
  op and by kind; on CUDA the profiler's device time, and the share of the step the device is
  busy;
* **predicted**: the cost model's forward + backward for the rank and for serial/N at the
  measured workload, on ``--profile``. Serial is priced as the model runs (``fuse_activations=False,
  fuse_norms=False, fuse_products=False``: HF's GPT-2 runs its tanh-GELU as eight pointwise ops, Llama
  its RMSNorm statistic as five and its q, k, v as three products), the rank as autotp runs it (its
  activations, norms and sibling products fused, ``autotp/passes/activations.py``,
  ``autotp/passes/norms.py``, ``autotp/passes/products.py``); the planning table also gives
  the ratio against a serial fused the same way.

Mixtures of experts run each experts layout the planner weighs (``--layouts``: the default plan,
expert-parallel, expert-TP, and expert-parallel with the all-to-all dispatch under sequence
parallelism, the peers' routing mirrored: ``benchmarks/fake_peers.py``), predicted and measured
side by side. Under expert parallelism a rank's step follows its experts' load, and a random
router's is far from even: the serial model's routing on the batch is counted first
(``benchmarks/moe_load.py``: rows per expert and per rank's experts, max ÷ mean), every version
runs as a rank whose load is nearest a balanced share (what a balanced router's step costs; the
fake world can be any rank, ``fake_peers.fake_rank``) and, with ``--busiest-rank on``, the
expert-parallel ones as the most loaded rank too (what this router's step waits for). Each row
gives the rows the rank's experts ran (its grouped products' FLOPs against serial's ÷ N, over a
balanced share) and the prediction with the experts' part scaled to that load beside the
balanced one. The fake world's rows are not the count: its all-reduces leave a rank's own part
(the g after a head-split attention or after the experts), so from the first such g on the rank
routes values of its own, and under the dispatch its peers route as it does. So ``--rank-by
probe`` (the default here) counts one step of every rank and picks by the rows each ran;
``count`` picks by the serial count (``run_model``'s default where ``args`` has no ``rank_by``,
as the device round's ``benchmarks/gpu_parts.py`` passes none).
``--plan-load`` (default ``both``) adds the default plan made at the routing load measured on the
benchmark batch (``autotp.measure_expert_load``: the planner prices each MoE layer's experts at its
busiest rank's rows) beside the balanced router's, and a table of the layout each picked.
``benchmarks/moe_rank.py`` does the same on CPU at narrower widths; ``--tiny`` runs each family at
tiny widths (the rows and counts, not a timing at the published widths).

    python benchmarks/rank_efficiency.py --models gpt2-xl:2 llama-3-8b:1 --seq 256   # CPU: rank_efficiency.md
    python benchmarks/rank_efficiency.py --models gpt2-xl:2 --seq 256 --copies-only --out /tmp/copies.md  # copies alone
    python benchmarks/rank_efficiency.py --predicted-only  # the planning table alone (meta models, no run)
    python benchmarks/rank_efficiency.py --tiny --models mixtral-8x7b:2 qwen3-30b-a3b:2 --batch 2 --seq 64 \\
        --plan-batch 2 --plan-seq 64 --out benchmarks/rank_efficiency_moe_load.md   # the experts' load rows
    python benchmarks/rank_efficiency.py --tiny --models mixtral-8x7b:2 qwen3-30b-a3b:2 --batch 2 --seq 64 \\
        --plan-batch 2 --plan-seq 64 --layouts --out benchmarks/rank_efficiency_plan_load.md   # the pick at both loads
    python benchmarks/rank_efficiency.py --device cuda --dtype bfloat16 --batch 8 --seq 1024 \\
        --models gpt2-xl:12 --out benchmarks/rank_efficiency_gpu.md   # on a GPU
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, publish  # noqa: E402
from benchmarks.fake_peers import fake_rank, mirrored_peers  # noqa: E402
from benchmarks.moe_load import at_load, expert_rows_share, experts_seconds, load_lines, routing_load  # noqa: E402
from benchmarks.op_timer import CATEGORIES, by_category, module_step, op_times  # noqa: E402

#: experts layouts pinned (the expert stacks' names in transformers' MoE blocks), as planning
#: arguments; the all-to-all dispatch needs the tokens split along the sequence, and on the fake
#: backend the peers' routing mirrored (benchmarks/fake_peers.py)
_EP = {"*.experts.gate_up_proj": "expert", "*.experts.down_proj": "expert"}
EXPERTS = {"expert-parallel": dict(layout=_EP),
           "expert-TP": dict(layout={"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}),
           "expert-parallel, all-to-all dispatch": dict(layout=_EP, sequence_parallel=True, expert_dispatch=True)}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def timed(module, batch: dict, device: str, repeats: int) -> float:
    """Median wall seconds of forward + backward (the device synchronized), after a warm-up."""
    step = module_step(module, batch)
    step()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compiled_time(module, batch: dict, device: str, repeats: int) -> dict:
    """A compiled step's seconds, after a warm-up (which compiles it): ``clock`` (median wall)
    and, on CPU, ``thread`` (the least thread CPU time, as ``measured`` reads an eager step's: one
    torch thread, so inductor's kernels run on the calling thread too); on CUDA ``busy``, the
    share of a step the device is busy (:func:`device_busy`)."""
    step = module_step(module, batch)
    step()
    _sync(device)
    clocks, threads = [], []
    for _ in range(repeats):
        _sync(device)
        start, clock = time.thread_time(), time.perf_counter()
        step()
        _sync(device)
        clocks.append(time.perf_counter() - clock)
        threads.append(time.thread_time() - start)
    busy = device_busy(step) if device != "cpu" else float("nan")
    module.zero_grad(set_to_none=True)
    return {"clock": statistics.median(clocks), "thread": min(threads) if device == "cpu" else float("nan"),
            "busy": busy}


def device_busy(step) -> float:
    """The share of one step's wall time the device is busy: every device event's time (kernels,
    inductor's among them, and copies) over the step's wall time under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    device = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
    return sum(e.device_time_total for e in device) / 1e6 / wall


def measured(module, batch: dict, device: str, repeats: int) -> dict:
    """The step's seconds: ``clock`` (median wall), on CPU ``thread`` (the least thread CPU
    time) and ``ops`` (each ATen call at its least thread time, ``benchmarks/op_timer.py``),
    after a warm-up; on CUDA ``clock`` alone (the profiler gives the per-op times there)."""
    if device != "cpu":
        return {"clock": timed(module, batch, device, repeats), "thread": float("nan"), "ops": None}
    module_step(module, batch)()   # warm-up
    ops = op_times(module_step(module, batch), repeats)
    module.zero_grad(set_to_none=True)
    return {"clock": ops.clock_median, "thread": ops.step, "ops": ops}


def counted(module, batch: dict):
    """FLOPs of products and bytes every other op reads and writes, forward + backward; and the
    copies and casts, each with where it was made."""
    from autotp.testing.work import CopyCounter, WorkCounter

    with WorkCounter(sites=True) as work:
        module_step(module, batch)()
    with CopyCounter() as copies:
        module_step(module, batch)()
    module.zero_grad(set_to_none=True)
    return work, copies


def per_op(module, batch: dict, device: str) -> tuple[dict, float]:
    """Self device time per ATen op of one forward + backward (ms), and the device's busy share
    (CUDA; on CPU the op timer's least thread times serve, ``measured``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        module_step(module, batch)()
        _sync(device)
    wall = time.perf_counter() - start
    module.zero_grad(set_to_none=True)
    out: dict = {}
    busy = 0.0
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        t = (e.self_device_time_total if device != "cpu" else e.self_cpu_time_total) / 1e3
        out[e.key] = out.get(e.key, 0.0) + t
        busy += t if device != "cpu" else 0.0
    return out, (busy / 1e3 / wall if device != "cpu" else float("nan"))


def predicted(model, tp: int, batch: int, seq: int, profile: str, planning: dict,
              rank: int = 0) -> tuple[float, float, float]:
    """The cost model's forward + backward seconds: ``rank``'s (the rank the fake world runs),
    serial's / tp, and the part of the rank's on its experts' rows (``moe_load.experts_seconds``,
    priced at a balanced router's share). A plan made at a router's load (``expert_load`` in
    ``planning``) is priced here at a balanced share too, so that ``at_load`` scales it to the rows
    the rank ran as it does the others (the plan's own figure, at the busiest rank's share, is in
    its ``compute_s + comm_s``)."""
    from autotp.capture import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import step_breakdown
    from autotp.planner import build_plan

    prof = get_profile(profile)
    cap = capture(model)
    _, index, prop = build_plan(cap, tp, batch=batch, seq=seq, profile=prof, **planning)
    if index.expert_load is not None:
        from autotp.planner.expert_load import apply_load

        apply_load(index, None, {})   # the same placements, priced at a balanced router
    rank_b = step_breakdown(index, prop, prof, rank=rank)
    serial = step_breakdown(*build_plan(cap, 1, batch=batch, seq=seq, profile=prof, fuse_activations=False,
                                        fuse_norms=False, fuse_products=False)[1:],
                            prof)
    fwd_bwd = lambda b: b["products"] + b["attention"] + b["memory"]   # noqa: E731
    return fwd_bwd(rank_b), fwd_bwd(serial) / tp, experts_seconds(index, prop, prof, rank)


def model_for(name: str, layers: int, dtype: torch.dtype, device: str):
    from autotp import zoo

    family = zoo.family_of(name)
    config = zoo.published_config(name, layers=layers)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0 if key != "resid_pdrop" else getattr(config, key))
    if hasattr(config, "experts_implementation") and device == "cpu":
        config.experts_implementation = "batched_mm" if dtype == torch.float64 else config.experts_implementation
    return family, zoo.build(family.name, config, device=device, dtype=dtype)


def tiny_model_for(name: str, layers: int, dtype: torch.dtype, device: str, heads: int = 8, head_dim: int = 8):
    """``model_for`` at tiny widths (``--tiny``): the published model's family, ``heads`` of
    ``head_dim`` (``--tiny-width``; hidden 64 in 8 heads by default), 8 experts (top-2) where it has
    them."""
    from autotp import zoo

    family = zoo.family_of(name)
    extra = dict(experts=8, top_k=2) if family.name in zoo.EXPERT_FAMILIES else {}
    config = zoo.tiny_config(family.name, layers=layers, heads=heads, head_dim=head_dim, vocab=128,
                             positions=1024, **extra)
    return family, zoo.build(family.name, config, device=device, dtype=dtype)


def run_model(spec: str, args, figures: dict | None = None) -> list[str]:
    """The model's section of the result file; ``figures``, where given, gets its numbers (seconds) by
    version, for a driver that reads them (``benchmarks/gpu_round.py``)."""
    from autotp import zoo

    name, _, layers = spec.partition(":")
    family, model = model_for(name, int(layers or 2), getattr(torch, args.dtype), args.device)
    batch = {k: v.to(args.device) for k, v in zoo.example_batch(family.name, model.config, batch=args.batch,
                                                                 seq=args.seq, seed=0).items()}
    layouts = {"default": _sequence_parallel(args)}
    if family.name in zoo.EXPERT_FAMILIES:
        layouts.update({k: v for k, v in EXPERTS.items() if k in args.layouts})
    if getattr(args, "products_apart", False):   # the sibling products as written (the default joins them)
        layouts[APART] = {**layouts["default"], "fuse_products": False}
    cpu = args.device == "cpu"
    # experts' layouts run as the rank whose experts' load is nearest the mean (a balanced router's
    # step), and with --busiest-rank as the most loaded one too (benchmarks/moe_load.py)
    load = routing_load(model, batch, args.tp) if family.name in zoo.EXPERT_FAMILIES else None
    layouts = _with_measured_load(layouts, model, batch, getattr(args, "plan_load", "balanced"), load is not None)
    run_rank = load.balanced_rank if load is not None else 0
    busiest = load.busiest_rank if load is not None and getattr(args, "busiest_rank", "off") == "on" else None
    probe = load is not None and getattr(args, "rank_by", "count") == "probe"
    lines = [f"## {name}, {int(layers or 2)} layers, tp={args.tp} "
             + ("rank 0 of a fake world" if load is None else
                f"rank {run_rank} of a fake world (its experts' load nearest the mean)" if not probe else
                "a fake world's rank whose experts' rows are nearest the mean, per version") + f", {args.dtype}, "
             f"batch {args.batch} x seq {args.seq}, {args.device}", ""]
    if load is not None:
        lines += load_lines(load, {} if probe else {"every version": run_rank, **(
            {"the busiest rank's rows": busiest} if busiest is not None else {})}) + [""]
    serial = measured(model, batch, args.device, args.repeats)
    serial_counts, serial_copies = counted(model, batch)
    serial_ops, serial_busy = (serial["ops"].by_op, float("nan")) if cpu else per_op(model, batch, args.device)
    compiled_serial = None
    if args.compile:
        compiled_serial = compiled_time(torch.compile(model), batch, args.device, args.repeats)
    rows, probed = [], {}
    for label, planning in layouts.items():
        balanced, most = run_rank, busiest
        started = time.perf_counter()
        shares = _probe(model, batch, args, planning, serial_counts) if probe else None
        if shares is not None:   # the fake world's own loads: the rank nearest a balanced share, the most loaded
            probed[label] = shares, time.perf_counter() - started
            balanced = min(range(args.tp), key=lambda r: (abs(shares[r] - 1.0), r))
            most = max(range(args.tp), key=lambda r: (shares[r], -r)) if busiest is not None else None
        row = _run_rank(model, batch, args, planning, balanced, serial_counts)
        rows.append(dict(label=label, **row))
        if most is not None and most != balanced and "expert" in row["plan"].roles.values():
            # the same planning on the most loaded rank: what a real step under this router waits for
            rows.append(dict(label=f"{label}, busiest rank", **_run_rank(model, batch, args, planning, most,
                                                                         serial_counts, full=False)))
    if probed:
        lines += ["Experts' rows ÷ mean on each rank of the fake world (`--rank-by probe`: one step of each rank "
                  "counted; the rank nearest 1.00 ran the version, the largest its busiest row; the probe's wall "
                  "seconds, its programs written and two steps per rank):", "",
                  "| version | " + " | ".join(f"rank {r}" for r in range(args.tp)) + " | probe s |",
                  "|---|" + "---|" * (args.tp + 1)]
        lines += [f"| {label} | " + " | ".join(f"{x:.2f}" for x in shares) + f" | {seconds:.0f} |"
                  for label, (shares, seconds) in probed.items()]
        lines.append("")
    if figures is not None:
        figures.update(_figures(serial, serial_busy, compiled_serial, rows, load))
    tp = args.tp
    moe = load is not None
    lines += ["| version | " + ("rank | experts' work ÷ mean (grouped products' FLOPs) | " if moe else "")
              + "thread ms (least) | **serial/N ÷ rank, thread time** | ATen calls ms (each at its least) | "
              "serial/N ÷ rank, ATen calls | wall ms (median) | serial/N ÷ rank, "
              "wall | FLOPs rank ÷ serial/N | bytes rank ÷ serial/N | predicted ms (rank / serial÷N) | "
              + ("predicted ms at the rank's load | " if moe else "")
              + "predicted serial/N ÷ rank | device busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
              + ("---|---|---|" if moe else "")]
    pct = lambda x: "-" if x != x else f"{x:.0%}"   # noqa: E731
    ms = lambda x: "-" if x != x else f"{x * 1e3:.1f}"   # noqa: E731
    ratio = lambda share, x: "-" if x != x else f"{share / x:.2f}"   # noqa: E731
    calls = lambda t: t["ops"].total if t["ops"] is not None else float("nan")   # noqa: E731
    lines.append(f"| serial | {'- | - | ' if moe else ''}{ms(serial['thread'])} | - | {ms(calls(serial))} | - | "
                 f"{ms(serial['clock'])} | - | - | - | - | {'- | ' if moe else ''}- | {pct(serial_busy)} |")
    for r in rows:
        t, (pr, ps) = r["time"], r["predicted"]
        lines.append(f"| autotp {r['label']} | "
                     + (f"{r['rank']} | {'-' if r['load'] != r['load'] else format(r['load'], '.2f')} | "
                        if moe else "")
                     + f"{ms(t['thread'])} | **{ratio(serial['thread'] / tp, t['thread'])}** | "
                     f"{ms(calls(t))} | {ratio(calls(serial) / tp, calls(t))} | "
                     f"{ms(t['clock'])} | {ratio(serial['clock'] / tp, t['clock'])} | "
                     f"{r['counts'].flops / (serial_counts.flops / tp):.2f} | "
                     f"{r['counts'].moved / (serial_counts.moved / tp):.2f} | {pr * 1e3:.2f} / {ps * 1e3:.2f} | "
                     + (f"{r['at_load'] * 1e3:.2f} | " if moe else "")
                     + f"{ps / pr:.2f} | {pct(r['busy'])} |")
    if moe:
        lines += ["", "Experts' work ÷ mean: the rank's grouped expert products' FLOPs against serial's ÷ N. Under "
                  "expert parallelism that is the rows its experts ran over a balanced router's share (1.00); "
                  "expert-TP runs every row at its part of the width (1.00 where N divides the width, more on "
                  "a rank with a larger part); replicated experts run every row whole (N). The fake world's rows "
                  "are not the count above: its all-reduces return the rank's own part, so after the first g the "
                  "rank routes values of its own, and under the all-to-all dispatch its peers route as it does "
                  "(`benchmarks/fake_peers.py`). "
                  "'At the rank's load': the cost model prices the ops on a rank's experts' rows at a balanced "
                  "router's share; this column scales that part (`benchmarks/moe_load.experts_seconds`) by the "
                  "rows ÷ mean, the rest as predicted."]
    if args.compile:
        lines += ["", "Eager and compiled (`torch.compile`, inductor, dynamo's defaults; the warm-up call compiles), "
                  "the same steps:", "",
                  "| version | eager thread ms (least) | compiled thread ms (least) | **serial/N ÷ rank, eager** | "
                  "**serial/N ÷ rank, compiled** | eager wall ms (median) | compiled wall ms (median) | "
                  "serial/N ÷ rank, wall: eager / compiled |", "|---|---|---|---|---|---|---|---|",
                  f"| serial | {ms(serial['thread'])} | {ms(compiled_serial['thread'])} | - | - | "
                  f"{ms(serial['clock'])} | {ms(compiled_serial['clock'])} | - |"]
        for r in rows:
            t, c = r["time"], r["compiled"]
            if c is None:   # a busiest rank's run: eager alone
                continue
            lines.append(f"| autotp {r['label']} | {ms(t['thread'])} | {ms(c['thread'])} | "
                         f"**{ratio(serial['thread'] / tp, t['thread'])}** | "
                         f"**{ratio(compiled_serial['thread'] / tp, c['thread'])}** | {ms(t['clock'])} | "
                         f"{ms(c['clock'])} | {ratio(serial['clock'] / tp, t['clock'])} / "
                         f"{ratio(compiled_serial['clock'] / tp, c['clock'])} |")
    lines += _picks(rows)
    for r in rows:
        notes = [n for n in r["plan"].notes if n.startswith(("experts", "sequence", "expert load"))]
        if notes and not r["label"].endswith("busiest rank"):
            lines += ["", f"{r['label']} plan notes: " + " | ".join(n[:400] for n in notes)]
    first = rows[0]
    if cpu:
        lines += _by_kind(serial["ops"], first["time"]["ops"], first["label"], tp)
    lines += ["", f"Time per ATen op, rank ({first['label']}) beside serial/N, ms ("
              + ("each call at its least thread time over the repeats, summed per op" if cpu else
                 "the profiler's self device time") + ", forward + backward; the 20 largest of the rank's):", "",
              "| aten op | rank | serial/N | rank ÷ serial/N |", "|---|---|---|---|"]
    scale = 1e3 if cpu else 1.0   # the op timer's seconds, the profiler's ms
    for op, t in sorted(first["ops"].items(), key=lambda kv: -kv[1])[:20]:
        s_t = serial_ops.get(op, 0.0) / tp
        lines.append(f"| `{op}` | {t * scale:.2f} | {s_t * scale:.2f} | {t / s_t:.1f} |" if s_t else
                     f"| `{op}` | {t * scale:.2f} | 0 | - |")
    counts = first["counts"]
    lines += ["", f"Bytes per ATen op (not products), rank ({first['label']}) beside serial/N, MB (forward + backward, "
              "read and written; the 12 with the most bytes over the rank's share):", "",
              "| aten op | rank | serial/N | rank ÷ serial/N |", "|---|---|---|---|"]
    excess = {op: b - serial_counts.moved_by_op.get(op, 0) / tp for op, b in counts.moved_by_op.items()}
    for op in sorted(excess, key=lambda o: -excess[o])[:12]:
        s_b = serial_counts.moved_by_op.get(op, 0) / tp
        lines.append(f"| `{op}` | {counts.moved_by_op[op] / 1e6:.1f} | {s_b / 1e6:.1f} | "
                     + (f"{counts.moved_by_op[op] / s_b:.1f} |" if s_b else "- |"))
    lines += _sites_table(counts, serial_counts, [op for op in sorted(excess, key=lambda o: -excess[o])[:6]],
                          first["label"], tp)
    lines += _copies_table(serial_copies, first["copies"], first["label"], tp)
    lines.append("")
    del model
    return lines


#: the default plan with its sibling products as written (``--products-apart``: ``fuse_products=False``)
APART = "default, sibling products apart"
#: the default plan planned at the benchmark batch's measured routing load (``--plan-load``)
AT_LOAD = "default, measured load"


def _with_measured_load(layouts: dict, model, batch: dict, plan_load: str, moe: bool) -> dict:
    """``layouts`` with the default plan made at the routing load measured on ``batch``
    (``autotp.measure_expert_load``: the serial model's top-k, each MoE layer's experts priced at
    its busiest rank's rows): beside the balanced router's default (``both``) or instead of it
    (``measured``); as given for ``balanced`` or a model without experts."""
    import autotp

    if not moe or plan_load == "balanced":
        return layouts
    loaded = {**layouts["default"], "expert_load": autotp.measure_expert_load(model, batch)}
    rest = {k: v for k, v in layouts.items() if k != "default"}
    return {"default": loaded, **rest} if plan_load == "measured" else {"default": layouts["default"], AT_LOAD: loaded,
                                                                        **rest}


def _picks(rows: list[dict]) -> list[str]:
    """Which experts layout the default plan picked at a balanced router and at the measured load,
    each with its predicted step (the plan's: the busiest rank's share priced where a load is given)
    and the measured thread time of the rank run (none where ``--plan-load`` left one out)."""
    from autotp.planner.experts import WORDS, layer_layouts

    picked = [r for r in rows if r["label"] in ("default", AT_LOAD)]
    if not any(r["plan"].expert_load is not None for r in picked):
        return []
    out = ["", "The default plan's experts layout at a balanced router and at the batch's measured routing load "
           "(`--plan-load`; the plan's predicted step, on the profile at the planning workload; the rank's thread "
           "time as run above):", "", "| plan | experts layout | predicted step ms (plan) | rank thread ms |",
           "|---|---|---|---|"]
    for r in picked:
        plan = r["plan"]
        kinds = sorted({WORDS.get(k, k) for k in layer_layouts(plan.roles, plan.shapes).values()})
        out.append(f"| {r['label']} | {', '.join(kinds)} | {(plan.compute_s + plan.comm_s) * 1e3:.3f} | "
                   f"{r['time']['thread'] * 1e3:.1f} |")
    return out


def _probe(model, batch: dict, args, planning: dict, serial_counts) -> list[float] | None:
    """Each fake-world rank's experts' rows over a balanced share (``moe_load.expert_rows_share``),
    one step of each rank counted after the one that writes its program; None where the plan holds
    no expert-parallel stack (every rank computes alike). Rank 0 plans; the others' programs are
    written from its plan (``parallelize(plan=)``, with the planning's sequence-parallel and
    dispatch arguments, which the plan's placements do not hold: without them a dispatching plan's
    program gathers), planned afresh where that program's collectives are not the plan's."""
    from autotp.testing.work import WorkCounter

    shares, plan = [], None
    for rank in range(args.tp):
        with fake_rank(rank, args.tp), mirrored_peers():
            pm = _parallelize(model, args, planning, plan)
            if plan is not None and _collectives(pm.plan) != _collectives(plan):
                del pm
                pm = _parallelize(model, args, planning)
            module_step(pm, batch)()   # the program is written at the first call
            with WorkCounter() as work:
                module_step(pm, batch)()
            plan = plan or pm.plan
            del pm
        if "expert" not in plan.roles.values():
            return None
        shares.append(expert_rows_share(work, serial_counts, args.tp))
    model.zero_grad(set_to_none=True)
    return shares


def _collectives(plan) -> list[str]:
    return sorted(f"{c.kind} {c.tensor} {c.src} {c.dst}" for c in plan.comms)


def _parallelize(model, args, planning: dict, plan=None):
    """The rank program of ``planning`` on the current fake world's rank, or written from ``plan``
    (its placements, not solved again; the planning's other arguments kept)."""
    import autotp

    kwargs = planning if plan is None else dict(plan=plan, **{k: v for k, v in planning.items() if k != "layout"})
    return autotp.parallelize(model, args.tp, profile=args.profile, batch=args.plan_batch, seq=args.plan_seq,
                              device=args.device, **kwargs)


def _run_rank(model, batch: dict, args, planning: dict, rank: int, serial_counts, full: bool = True) -> dict:
    """One version of the rank program, as ``rank`` of a fake world: its step measured and counted,
    predicted (balanced and at the load its experts' rows had), and with ``full`` its ops timed and
    compiled where asked."""
    cpu = args.device == "cpu"
    # the program is written at the first call and run under the mirrored peers: an all-to-all
    # dispatch's rank sends and receives as if every peer routed as it does (benchmarks/fake_peers.py)
    with fake_rank(rank, args.tp), mirrored_peers():
        pm = _parallelize(model, args, planning)
        module_step(pm, batch)()
        pm.zero_grad(set_to_none=True)
        time_ = measured(pm, batch, args.device, args.repeats)
        counts, copies = counted(pm, batch)
        ops, busy = ((time_["ops"].by_op, float("nan")) if cpu else per_op(pm, batch, args.device)) if full \
            else ({}, float("nan"))
        pred_rank, pred_serial, experts = predicted(model, args.tp, args.batch, args.seq, args.profile, planning, rank)
        compiled = compiled_time(torch.compile(pm), batch, args.device, args.repeats) \
            if args.compile and full else None
        plan = pm.plan
        del pm   # its group ends with the fake world
    share = expert_rows_share(counts, serial_counts, args.tp)
    return dict(rank=rank, time=time_, counts=counts, copies=copies, ops=ops, busy=busy,
                predicted=(pred_rank, pred_serial), experts_s=experts, load=share,
                at_load=at_load(pred_rank, experts, share), compiled=compiled, plan=plan)


def _figures(serial: dict, serial_busy: float, compiled_serial: dict | None, rows: list[dict],
             load=None) -> dict:
    """The numbers of one model's run, by version (seconds; NaN where not measured): the step by
    each clock, compiled where run, the predicted rank and serial/N, the device's busy share, the
    experts' roles the plan gave, whether it dispatches by all-to-all, and its experts and
    sequence notes; for a mixture of experts, the rank run, its experts' rows over the mean
    (``load``) and the prediction at that load, the most loaded rank's run under ``busiest`` where
    made, and the routing load of the batch under the key ``"load"`` (rows per rank, max over mean,
    the ranks nearest the mean and most loaded)."""
    out = {"serial": {"clock": serial["clock"], "thread": serial["thread"], "busy": serial_busy,
                      "compiled": compiled_serial}}
    if load is not None:
        out["load"] = {"ranks": list(load.ranks), "max_over_mean": max(load.ranks) / load.mean,
                       "balanced_rank": load.balanced_rank, "busiest_rank": load.busiest_rank}
    for r in rows:
        roles = sorted({role for name, role in r["plan"].roles.items() if ".experts." in name})
        version = {"clock": r["time"]["clock"], "thread": r["time"]["thread"], "busy": r["busy"],
                   "compiled": r["compiled"], "predicted": r["predicted"][0],
                   "predicted_share": r["predicted"][1], "expert_roles": roles,
                   "rank": r["rank"], "load": r["load"], "predicted_at_load": r["at_load"],
                   # the dispatch's all-to-all of token rows (not a reshard S -> S), as moe_rank._kind
                   "dispatch": any(c.kind == "all_to_all" and str(c.src).startswith("P(tokens")
                                   for c in r["plan"].comms),
                   "notes": [n for n in r["plan"].notes if n.startswith(("experts", "sequence"))]}
        if r["label"].endswith(", busiest rank"):
            out[r["label"].removesuffix(", busiest rank")]["busiest"] = version
        else:
            out[r["label"]] = version
    return out


def _by_kind(serial_ops, rank_ops, label: str, tp: int) -> list[str]:
    """Where the rank's thread time goes beside serial/N, by kind of op (``benchmarks/op_timer.py``)."""
    s_cat, r_cat = by_category(serial_ops), by_category(rank_ops)
    lines = ["", f"Where the time goes, rank ({label}) beside serial/N, thread ms (each ATen call at its least "
             "over the repeats; 'outside' is the least whole step less its calls):", "",
             "| kind | rank | serial/N | rank - serial/N |", "|---|---|---|---|"]
    for c in CATEGORIES:
        if r_cat[c] or s_cat[c]:
            lines.append(f"| {c} | {r_cat[c] * 1e3:.1f} | {s_cat[c] / tp * 1e3:.1f} | "
                         f"{(r_cat[c] - s_cat[c] / tp) * 1e3:+.1f} |")
    lines.append(f"| the step (least thread time) | **{rank_ops.step * 1e3:.1f}** | **{serial_ops.step / tp * 1e3:.1f}** "
                 f"| {(rank_ops.step - serial_ops.step / tp) * 1e3:+.1f} |")
    return lines


def _sites_table(rank, serial, ops: list, label: str, tp: int) -> list[str]:
    """Where the ops with the most bytes over the rank's share were made, rank beside serial
    (``autotp.testing.work.op_site``: a node of the rank's program, a backward formula, autotp's
    own function; the model's own file and function in serial), the three largest sites each."""
    lines = ["", f"Where those bytes were made, the 6 ops with the most over the share, rank ({label}) beside serial/N, "
             "MB (the three largest sites of each; `program <node>`: the rank program's node, `backward <Node>`: "
             "the backward formula autograd ran):", "",
             "| aten op | rank: site, MB | serial/N: site, MB |", "|---|---|---|"]

    def largest(counter, op, scale):
        found = sorted(((b, site) for (o, site), b in counter.moved_by_site.items() if o == op), reverse=True)[:3]
        return "; ".join(f"`{site}` {b / scale / 1e6:.1f}" for b, site in found) or "-"

    for op in ops:
        lines.append(f"| `{op}` | {largest(rank, op, 1)} | {largest(serial, op, tp)} |")
    return lines


def _copies_table(serial, rank, label: str, tp: int) -> list[str]:
    """The copies and casts of a step by where they were made (MB written), rank beside serial/N."""
    lines = ["", f"Copies and casts (`copy_`, `_to_copy`, `clone`, `cat`, `stack`, `pad`) by where they were made, "
             f"rank ({label}) beside serial/N, MB written per step (forward + backward; a collective's own writes "
             "are not among them, but for the copy a functional all-reduce makes of its input, `all_reduce`):", "",
             "| made by | op | rank | serial/N |", "|---|---|---|---|"]
    r_sites, s_sites = rank.by_site(), serial.by_site()
    for key in sorted(set(r_sites) | set(s_sites), key=lambda k: -max(r_sites.get(k, 0), s_sites.get(k, 0) / tp)):
        lines.append(f"| {key[0]} | `{key[1]}` | {r_sites.get(key, 0) / 1e6:.2f} | {s_sites.get(key, 0) / tp / 1e6:.2f} |")
    ours = sum(c.bytes for c in rank.autotp_copies())
    lines.append(f"| **autotp's own, in all** | | **{ours / 1e6:.2f}** | |")
    return lines


def _sequence_parallel(args) -> dict:
    """The default plan's ``sequence_parallel`` argument (``--sequence-parallel``; none: by cost)."""
    return {} if args.sequence_parallel == "cost" else {"sequence_parallel": args.sequence_parallel == "on"}


def copies_only(spec: str, args) -> list[str]:
    """``--copies-only``: the copies table of one model's rank (its default plan) beside serial/N,
    from one counted step after a warm-up; no timing and no prediction."""
    import autotp
    from autotp import zoo

    name, _, layers = spec.partition(":")
    family, model = model_for(name, int(layers or 2), getattr(torch, args.dtype), args.device)
    batch = {k: v.to(args.device) for k, v in zoo.example_batch(family.name, model.config, batch=args.batch,
                                                                 seq=args.seq, seed=0).items()}
    _, serial_copies = counted(model, batch)
    with mirrored_peers():
        pm = autotp.parallelize(model, args.tp, profile=args.profile, batch=args.plan_batch, seq=args.plan_seq,
                                device=args.device, **_sequence_parallel(args))
        module_step(pm, batch)()
        pm.zero_grad(set_to_none=True)
    _, copies = counted(pm, batch)
    return ([f"## {name}, {int(layers or 2)} layers, tp={args.tp} rank 0 of a fake world, {args.dtype}, "
             f"batch {args.batch} x seq {args.seq}, {args.device}, sequence parallelism {args.sequence_parallel}: "
             "copies only"]
            + _copies_table(serial_copies, copies, "default", args.tp) + [""])


#: the GPU workloads of the H200 measurements (``../shared/measurements/h200-2026-11-28/``)
REAL = (("gpt2-xl", 12, 8, 1024), ("llama-3-8b", 4, 2, 4096), ("mixtral-8x7b", 2, 2, 4096),
        ("qwen3-30b-a3b", 2, 2, 4096))


def predicted_at_real_size(tp: int, profile: str) -> list[str]:
    """The cost model's serial/N ÷ rank at the H200 measurements' workloads (meta models, bf16),
    with sequence parallelism chosen by cost and forbidden, and where the rank's time goes."""
    from autotp import zoo
    from autotp.capture import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import busiest_rank, step_breakdown
    from autotp.planner import build_plan

    prof = get_profile(profile)
    fwd_bwd = lambda b: b["products"] + b["attention"] + b["memory"]   # noqa: E731
    lines = [f"## Predicted at the GPU workloads ({profile}, bf16, tp={tp}, meta models)", "",
             "The busiest rank's step (each op at that rank's part of it: uneven splits rotate their larger "
             "part from layer to layer), and in brackets the bound the solver weighs (every op on its largest rank).",
             "",
             "Serial is priced as the model runs (its activations and norms as written: HF's GPT-2 runs its "
             "tanh-GELU as eight pointwise ops, Llama its RMSNorm statistic as five), the rank as autotp runs it "
             "(each fused into one op); the column "
             "'serial fused' divides a serial step fused the same way instead, the gain that is not the rank "
             "running fewer kernels than serial.", "",
             "| model (layers, batch x seq) | serial/N ÷ rank, SP by cost | without SP | serial fused | "
             "rank ms: products / attention / memory-bound | serial/N ms: products / attention / memory-bound | rank's communication ms "
             "(not overlapped) |",
             "|---|---|---|---|---|---|---|"]
    for name, layers, b, s in REAL:
        model = zoo.build(zoo.family_of(name).name, zoo.published_config(name, layers=layers), device="meta",
                          dtype=torch.bfloat16)
        cap = capture(model)
        serial = step_breakdown(*build_plan(cap, 1, batch=b, seq=s, profile=prof, fuse_activations=False,
                                            fuse_norms=False, fuse_products=False)[1:], prof)
        fused = step_breakdown(*build_plan(cap, 1, batch=b, seq=s, profile=prof)[1:], prof)
        got = {}
        for sp in (None, False):
            _, index, prop = build_plan(cap, tp, batch=b, seq=s, profile=prof, sequence_parallel=sp,
                                        memory_limit=float("inf"))
            got[sp] = (busiest_rank(index, prop, prof)[1], prop.comm_s, step_breakdown(index, prop, prof))
        rank, comm, bound = got[None]
        share = fwd_bwd(serial) / tp
        lines.append(f"| {name} ({layers}, {b} x {s}) | **{share / fwd_bwd(rank):.2f}** ({share / fwd_bwd(bound):.2f}) | "
                     f"{share / fwd_bwd(got[False][0]):.2f} ({share / fwd_bwd(got[False][2]):.2f}) | "
                     f"{fwd_bwd(fused) / tp / fwd_bwd(rank):.2f} | "
                     f"{rank['products'] * 1e3:.2f} / {rank['attention'] * 1e3:.2f}"
                     f" / {rank['memory'] * 1e3:.2f} | {serial['products'] / tp * 1e3:.2f} / "
                     f"{serial['attention'] / tp * 1e3:.2f} / {serial['memory'] / tp * 1e3:.2f} | {comm * 1e3:.2f} |")
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2-xl:2", "llama-3-8b:1", "mixtral-8x7b:1",
                                                   "qwen3-30b-a3b:1"], help="name:layers")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--plan-batch", type=int, default=8, help="the planning workload (the GPU run's)")
    p.add_argument("--plan-seq", type=int, default=1024)
    p.add_argument("--profile", default="h200", help="the profile the plan is made for (and predicted with)")
    p.add_argument("--layouts", nargs="*", default=list(EXPERTS), help="experts layouts weighed beside the default")
    p.add_argument("--products-apart", action="store_true",
                   help="also the default plan with fuse_products=False (q, k, v and gate, up as written, not each "
                        "one product), side by side")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on CPU: on a shared machine two threads make every small op wait at the "
                        "thread pool's barrier for a descheduled thread (a 512 KB copy_: 24 ms, against 0.01 ms "
                        "on one), which a rank's many small ops pay and serial's few large ones do not")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--predicted-only", action="store_true",
                   help="only the table predicted at the GPU workloads (meta models planned; nothing run)")
    p.add_argument("--copies-only", action="store_true",
                   help="only each model's copies table (one counted step; no timing, no predictions)")
    p.add_argument("--sequence-parallel", choices=["cost", "on", "off"], default="cost",
                   help="the default plan's sequence parallelism: chosen by cost, forced, or forbidden")
    p.add_argument("--busiest-rank", choices=["on", "off"], default="on",
                   help="a mixture of experts' expert-parallel versions run as the rank whose experts' load is "
                        "nearest the mean, and (on) as the most loaded rank too (benchmarks/moe_load.py)")
    p.add_argument("--rank-by", choices=["count", "probe"], default="probe",
                   help="which rank runs a mixture of experts' versions: by the serial model's routing counted "
                        "(count), or by each fake-world rank's own experts' rows, one counted step per rank "
                        "(probe: its all-reduces leave a rank's own part, so it routes values of its own)")
    p.add_argument("--plan-load", choices=["balanced", "measured", "both"], default="both",
                   help="a mixture of experts' default plan priced at a balanced router, at the routing load "
                        "measured on the benchmark batch (autotp.measure_expert_load: each MoE layer's experts at "
                        "its busiest rank's rows), or both side by side")
    p.add_argument("--tiny", action="store_true",
                   help="each model's family at tiny widths (hidden 64 in 8 heads, 8 experts top-2): the rows "
                        "and their counts, not a timing of the published widths")
    p.add_argument("--tiny-width", default="8x8", help="--tiny's heads x head dim")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        global model_for
        heads, head_dim = (int(x) for x in args.tiny_width.split("x"))
        model_for = functools.partial(tiny_model_for, heads=heads, head_dim=head_dim)
    if args.predicted_only:
        started = time.time()
        lines = ["# One rank of tp=N against its share of the serial step: predicted", "",
                 "Command: `python benchmarks/rank_efficiency.py " + " ".join(sys.argv[1:]) + "`", "", machine()
                 + f" Load average at the start {os.getloadavg()[0]:.1f}.", ""]
        lines += predicted_at_real_size(args.tp, args.profile)
        publish(lines + [f"Planning wall time {time.time() - started:.0f} s (meta models: no step is run)."], args.out)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)   # the thread time counts the calling thread's work alone
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    started = time.time()
    lines = ["# One rank of tp=N against its share of the serial step", "",
             "Command: `python benchmarks/rank_efficiency.py " + " ".join(sys.argv[1:]) + "`", "", machine(),
             (f"Device: {torch.cuda.get_device_name()}" if args.device != "cpu" else "Device: the CPU") +
             f"; the plans are made for profile `{args.profile}` at batch {args.plan_batch} x seq {args.plan_seq}."
             + (f" {torch.get_num_threads()} torch thread(s); load average at the start "
                f"{os.getloadavg()[0]:.1f}." if args.device == "cpu" else ""),
             ""] + ([] if args.copies_only else [
             "serial/N ÷ rank: 1.00 is a rank doing exactly its N-th of the serial step's compute (communication "
             "is not run: the fake backend returns at once). "
             + ("On CPU it is read off the thread's CPU time (`time.thread_time`, the least of the repeats: the "
                "step's own compute, which another job on the cores does not lengthen; one torch thread, so the "
                "calling thread does all of it); off the sum of the step's ATen calls, each at its least over the "
                "repeats (`benchmarks/op_timer.py`: what the kernels cost, without Python and autograd's "
                "bookkeeping, and with the least of each call's contention for the core's caches); and, for "
                "comparison, off the wall clock (the median), which also holds the time the step waited for a core. " if args.device == "cpu" else "")
             + "FLOPs and bytes are counted off the ops the steps run "
             "(forward + backward); 'predicted' is the cost model's forward + backward on the profile, at the "
             "measured workload.", ""])
    if not args.copies_only and not args.tiny:   # the published widths' table: not of a tiny run
        lines += predicted_at_real_size(args.tp, args.profile)
    for spec in args.models:
        with contextlib.suppress(KeyboardInterrupt):
            lines += copies_only(spec, args) if args.copies_only else run_model(spec, args)
        print("\n".join(lines[-8:]), flush=True)
    lines.append(f"Whole run {time.time() - started:.0f} s" + (f"; load average at the end {os.getloadavg()[0]:.1f}."
                                                                if args.device == "cpu" else "."))
    publish(lines, args.out or Path(__file__).with_suffix(".md"))


if __name__ == "__main__":
    main()
