"""How long capture, planning and rewriting take, and how that grows with depth.

Capture (first table): torch.export of the whole model alone; autotp's capture exporting it
whole; autotp's default capture, which exports the stack of blocks cut to three and expands the
graph (autotp.capture.expand); ``autotp.plan(model, tp)`` timed inside a fresh process (and the
process's whole wall time, imports included), with the default capture and with whole export;
and, in that process after the plan, a new call signature's program (eval mode, no labels:
capture, replay of the plan, one rank's rewrite).

Planning (second table) = ``build_plan`` (graph index, exact solve, plan with costs and b,s
expressions); rewriting = one rank's ``rewrite``; capture excluded, done once per model.
Models are GPT-2 configurations on the meta device, planned at batch 8, seq 1024, tp 8 on the
h100-dgx profile. Each figure is the best of ``--repeats`` runs (the median and the CPU time
are also shown): other processes share this machine's cores.

    .venv/bin/python benchmarks/planner_speed.py --out benchmarks/planner_speed.md
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()   # before torch's import: a fresh process's setup includes it

import torch  # noqa: E402
from common import cpu_model, publish  # noqa: E402


def gpt2_model(hidden: int, heads: int, layers: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab))


def gpt2_capture(hidden: int, heads: int, layers: int, vocab: int):
    from autotp.capture import capture

    return capture(gpt2_model(hidden, heads, layers, vocab))


def _capture_modules():
    """(the module holding capture's ``EXPAND`` switch, the one holding its example-input helpers):
    ``autotp.capture.export`` and ``autotp.capture.inputs``; both ``autotp.capture`` itself in a tree
    from before capture became a package (a side-by-side baseline)."""
    try:
        import autotp.capture.export as E
        import autotp.capture.inputs as I
    except ImportError:
        import autotp.capture as E
        I = E
    return E, I


def capture_times(dims: tuple, repeats: int) -> dict:
    """Export alone, capture whole, capture cut and expanded: best of ``repeats`` each, one model."""
    C, I = _capture_modules()

    model = gpt2_model(*dims)
    kwargs = I.hf_example_kwargs(model, seq=I._example_seq(I.seq_bounds(model)), device="meta")
    shapes = I._dynamic_shapes(kwargs, I.seq_bounds(model))
    out = {"export": [], "whole": [], "expand": []}
    for _ in range(repeats):
        t = time.perf_counter()
        torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=shapes)
        out["export"].append(time.perf_counter() - t)
        for key, flag in (("whole", False), ("expand", True)):
            C.EXPAND = flag
            t = time.perf_counter()
            cap = C.capture(model)
            out[key].append(time.perf_counter() - t)
            assert bool(cap.expanded) == flag
        C.EXPAND = True
    return {k: min(v) for k, v in out.items()}


def child(dims: tuple, tp: int, whole: bool, t0: float) -> None:
    """In a fresh process: the model, autotp.plan, then a new signature's program; JSON on stdout."""
    import json

    import autotp
    from autotp.api import build_plan, capture_model
    from autotp.passes.rewrite import rewrite

    C, I = _capture_modules()
    C.EXPAND = not whole
    model = gpt2_model(*dims)
    t1 = time.perf_counter()
    plan = autotp.plan(model, tp, batch=8, seq=1024, profile="h100-dgx")
    t2 = time.perf_counter()
    model.eval()   # another call: inference, ids alone
    inputs = I.example_like({"input_ids": torch.zeros((1, 5), dtype=torch.long, device="meta")}, I.seq_bounds(model))
    cap = capture_model(model, example_kwargs=inputs)
    t2a = time.perf_counter()
    _, index, prop = build_plan(cap, tp, batch=8, seq=1024, profile="h100-dgx", plan=plan)
    t2b = time.perf_counter()
    rewrite(index, prop, 0, None, torch.device("cpu"))
    t3 = time.perf_counter()
    print(json.dumps({"setup": t1 - t0, "plan": t2 - t1, "new_signature": t3 - t2, "expanded": bool(cap.expanded),
                      "parts": [t2a - t2, t2b - t2a, t3 - t2b]}))


def fresh_process(name: str, tp: int, whole: bool, tree: str | None = None, mode: str = "--child",
                  repeats: int = 5) -> dict:
    """``child`` (or, with ``mode="--plan-child"``, :func:`plan_child`) in a new process, importing
    the autotp of ``tree`` (a checkout's root; default: this script's)."""
    import json

    cmd = [sys.executable, __file__, mode, name, "--tp", str(tp), "--repeats", str(repeats)] + \
        (["--whole"] if whole else [])
    # an autotp already on PYTHONPATH (another tree, for a side-by-side run) comes before this one's
    paths = [tree or "", os.environ.get("PYTHONPATH", ""), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall"] = wall
    return result


def measure(cap, tp: int, repeats: int) -> dict:
    from autotp.api import build_plan
    from autotp.passes.rewrite import rewrite

    plans, rewrites, cpu = [], [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        plan, index, prop = build_plan(cap, tp, batch=8, seq=1024, profile="h100-dgx")
        t1 = time.perf_counter()
        rewrite(index, prop, 0, None, torch.device("cpu"))
        t2, c2 = time.perf_counter(), time.process_time()
        plans.append(t1 - t0)
        rewrites.append(t2 - t1)
        cpu.append(c2 - c0)
    totals = [p + r for p, r in zip(plans, rewrites)]
    return {"plan": min(plans), "rewrite": min(rewrites), "total": min(totals),
            "median": statistics.median(totals), "cpu": min(cpu), "nodes": len(cap.graph.nodes),
            "megatron": plan.comm_counts()}


def plan_child(dims: tuple, tp: int, repeats: int) -> None:
    """In a fresh process: capture, then :func:`measure`; JSON on stdout."""
    import json

    print(json.dumps(measure(gpt2_capture(*dims), tp, repeats)))


def side_by_side(other: str, names: list[str], tp: int, pairs: int, repeats: int, out: str | None) -> None:
    """This tree against ``other`` (another checkout's root), process by process in alternating
    order, so that both meet the same load: ``autotp.plan`` in a fresh process, and planning +
    rewriting after capture (best of ``repeats`` in each process). Medians over ``pairs``."""
    this = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": other, "after": this}
    rows = []
    for name in names:
        got: dict = {k: {"plan": [], "wall": [], "new": [], "total": [], "cpu": []} for k in trees}
        for i in range(pairs):
            for key in (("before", "after") if i % 2 == 0 else ("after", "before")):
                fresh = fresh_process(name, tp, False, trees[key])
                planned = fresh_process(name, tp, False, trees[key], mode="--plan-child", repeats=repeats)
                got[key]["plan"].append(fresh["plan"])
                got[key]["wall"].append(fresh["wall"])
                got[key]["new"].append(fresh["new_signature"])
                got[key]["total"].append(planned["total"])
                got[key]["cpu"].append(planned["cpu"])
        med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()}
        rows.append((name, med))
        print(f"{name}: {got}", file=sys.stderr)
    lines = [
        "| model | " + " | ".join(f"{m} s: before / after (ratio)" for m in
                                  ("plan, fresh process", "process wall", "new signature",
                                   "plan + rewrite after capture", "CPU of plan + rewrite")) + " |",
        "|---|---|---|---|---|---|",
    ]
    for name, med in rows:
        b, a = med["before"], med["after"]
        lines.append(f"| {name} | " + " | ".join(f"{b[m]:.3f} / {a[m]:.3f} ({a[m] / b[m]:.2f}x)"
                                                for m in ("plan", "wall", "new", "total", "cpu")) + " |")
    publish(lines, out)


CONFIGS = [
    # name, hidden, heads, layers, vocab
    ("gpt2-xl", 1600, 25, 48, 50257),
    ("8.3B x12", 3072, 32, 12, 51200),
    ("8.3B x24", 3072, 32, 24, 51200),
    ("8.3B x48", 3072, 32, 48, 51200),
    ("8.3B", 3072, 32, 72, 51200),
]


#: the models of the capture table
CAPTURE_CONFIGS = ["gpt2-xl", "8.3B x24", "8.3B x48"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--capture-repeats", type=int, default=2)
    ap.add_argument("--fresh-repeats", type=int, default=5, help="fresh processes per model (plan, new signature)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--out", help="write the markdown result here too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan-child", help=argparse.SUPPRESS)
    ap.add_argument("--side-by-side", metavar="TREE",
                    help="time this tree against another checkout's root (alternating fresh processes) instead")
    ap.add_argument("--pairs", type=int, default=4, help="processes per tree and model for --side-by-side")
    ap.add_argument("--models", default="gpt2-xl,8.3B x24", help="comma-separated, for --side-by-side")
    args = ap.parse_args()
    dims = {name: (hidden, heads, layers, vocab) for name, hidden, heads, layers, vocab in CONFIGS}
    if args.child:
        child(dims[args.child], args.tp, args.whole, T0)
        return
    if args.plan_child:
        plan_child(dims[args.plan_child], args.tp, args.repeats)
        return
    if args.side_by_side:
        side_by_side(args.side_by_side, args.models.split(","), args.tp, args.pairs, args.repeats, args.out)
        return
    capture_rows = []
    for name in CAPTURE_CONFIGS:
        c = capture_times(dims[name], args.capture_repeats)
        runs = [fresh_process(name, args.tp, False) for _ in range(args.fresh_repeats)]
        fast = dict(min(runs, key=lambda r: r["plan"]))
        best = min(runs, key=lambda r: r["new_signature"])
        fast.update(new_signature=best["new_signature"], parts=best["parts"],
                    new_median=statistics.median(r["new_signature"] for r in runs),
                    new_max=max(r["new_signature"] for r in runs), plan_median=statistics.median(r["plan"] for r in runs))
        slow = fresh_process(name, args.tp, True)
        capture_rows.append((name, c, fast, slow))
        print(f"{name}: {c} {fast} {slow}", file=sys.stderr)
    rows = []
    for name, hidden, heads, layers, vocab in CONFIGS:
        t = time.perf_counter()
        cap = gpt2_capture(hidden, heads, layers, vocab)
        capture_s = time.perf_counter() - t
        r = measure(cap, args.tp, args.repeats)
        rows.append((name, hidden, heads, layers, r, capture_s))
        print(f"{name}: {r}", file=sys.stderr)
    base = next(row[4] for row in rows if row[0] == "8.3B x12")
    lines = [
        "# Planner speed",
        "",
        f"Command: `{' '.join(['.venv/bin/python'] + sys.argv)}`",
        "",
        f"Machine: {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores (`nproc`), "
        f"{cpu_model()}; torch {torch.__version__}; Python {platform.python_version()}. "
        f"Other jobs shared the cores (load average {os.getloadavg()[0]:.1f} at the end): wall-clock figures are "
        "the best of the repeats, with the median beside it; CPU seconds (this process) are less disturbed "
        "by the sharing, and the growth with depth is given in them.",
        "",
        f"Workload: batch 8, seq 1024, tp {args.tp}, profile h100-dgx, meta-device GPT-2 models.",
        "",
        "## Capture, and a plan from a fresh process",
        "",
        f"In-process capture figures are the best of {args.capture_repeats} (the process already warm). "
        "*export alone*: `torch.export.export` of the whole model; *capture whole*: autotp's capture with "
        "`autotp.capture.export.EXPAND = False`; *cut + expand*: autotp's default capture (three blocks exported, "
        "the graph grown to the model's depth; the graph is node for node the whole capture's). "
        f"*plan, fresh process*: `autotp.plan(model, {args.tp})` timed inside a new Python process (best of "
        f"{args.fresh_repeats}, median beside it; *process wall*: the subprocess's whole wall time, interpreter start and "
        "imports of torch, transformers and autotp included; *imports + model*: the part of it before "
        "`autotp.plan` inside the script, torch's import included); *whole* beside it: the same with whole export "
        "(one run). *new signature*: in that process after the plan, the program of another call "
        "(eval mode, `input_ids` alone; the plan's call was in train mode, with labels): capture (the "
        "model's second: its stack cut to one block, the block calls read against the template the first "
        f"capture learned), the plan replayed, one rank's rewrite; best of the {args.fresh_repeats} processes "
        "with its parts, then the median and the slowest.",
        "",
        "| model | layers | export alone s | capture whole s | cut + expand s | speed-up | plan, fresh process s "
        "(median) | imports + model s | process wall s | plan, fresh process, whole s | process wall, whole s "
        "| new signature s (capture + replay + rewrite) | new signature median s | slowest s | new signature, whole s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c, fast, slow in capture_rows:
        lines.append(f"| {name} | {dims[name][2]} | {c['export']:.2f} | {c['whole']:.2f} | {c['expand']:.2f} | "
                     f"{c['whole'] / c['expand']:.1f}x | {fast['plan']:.2f} ({fast['plan_median']:.2f}) | {fast['setup']:.2f} | "
                     f"{fast['wall']:.2f} | {slow['plan']:.2f} | {slow['wall']:.2f} | "
                     f"{fast['new_signature']:.2f} ({' + '.join(f'{x:.2f}' for x in fast['parts'])}) | "
                     f"{fast['new_median']:.2f} | {fast['new_max']:.2f} | {slow['new_signature']:.2f} |")
    lines += [
        "",
        "## Planning and rewriting after capture",
        "",
        "| model | hidden | heads | layers | graph nodes | plan s | rewrite s | plan + rewrite s (best) | median "
        "| CPU s (best) | CPU vs 12 layers | capture s (excluded, default) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, hidden, heads, layers, r, capture_s in rows:
        growth = f"{r['cpu'] / base['cpu']:.2f}x" if name.startswith("8.3B") else ""
        lines.append(f"| {name} | {hidden} | {heads} | {layers} | {r['nodes']} | {r['plan']:.3f} | {r['rewrite']:.3f} | "
                     f"{r['total']:.3f} | {r['median']:.3f} | {r['cpu']:.3f} | {growth} | {capture_s:.1f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
