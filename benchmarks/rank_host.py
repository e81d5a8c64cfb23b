"""The host's work per step of one rank of tp=N, against the serial model's, at widths where kernels cost nothing.

A GPU rank whose kernels are short waits on its host (a gpt2-xl rank of tp 8 on an H200: about
20 ms of kernels in a 54 ms step). What the host does per step does not depend on the widths, so
it is measured here on tiny models (hidden 64, 8 heads, batch 1 x seq 16), where the kernels
themselves cost next to nothing: one process joins torch's ``fake`` process-group backend as rank
0 of N (collectives return at once), and runs

* a **training step**: gradients dropped, a forward with labels, ``loss.backward()``;
* an **inference call**: ``eval()``, ``torch.no_grad()``, a forward of the ids alone;

of the serial model and of the rank, after a warm-up (the rank's programs built), and reports
for each: the host time (``time.thread_time`` of the calling thread, the least of ``--repeats``
rounds in which the programs take turns, one torch thread, the backward run on that thread too:
on a GPU the autograd engine would run it on a thread of its own, which a calling thread's clock
does not see), and counts
that do not depend on the machine: ATen calls (a dispatch mode), Python function calls
(``sys.setprofile``; :mod:`autotp.testing.host`) and the nodes of the backward graph. The rank's
plan is Megatron's layout pinned (column/row products, vocabulary-split embeddings and head),
with and without sequence parallelism, planned for profile ``h200`` at batch 8 x seq 1024 (the
tiny widths would otherwise be planned replicated). A mixture of experts (``mixtral:2:16x2``: 16
experts, top-2, of width 64, bfloat16, so that its experts run the grouped products a GPU runs)
has its attention and vocabulary pinned so and its experts by each plan that matters: by cost,
expert-parallel, expert-parallel with the all-to-all dispatch under sequence parallelism,
expert-TP; its rank's peers route as it does (``benchmarks/fake_peers.py``). Each step's reads
of device values on the host are counted too (``autotp.testing.host.HostReads``: on a GPU each
drains the stream), by the function that made them.

    python benchmarks/rank_host.py                       # writes benchmarks/rank_host.md
    python benchmarks/rank_host.py --models gpt2:2 --repeats 5 --out -
    python benchmarks/rank_host.py --json before.json   # on the code before a change, then after it:
    python benchmarks/rank_host.py --before before.json --before-label <commit>
    python benchmarks/rank_host.py --note "A shared 2-core CPU, loaded by other jobs."
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, publish  # noqa: E402
from benchmarks.fake_peers import mirrored_peers  # noqa: E402

PLANS = {"Megatron": dict(sequence_parallel=False), "Megatron + SP": dict(sequence_parallel=True)}

#: a mixture of experts' attention and vocabulary pinned to Megatron's layout (Llama's names), its
#: experts by each plan below (the layouts ``benchmarks/rank_efficiency.py`` and
#: ``tests/e2e/test_experts.py`` force)
MOE_ATTENTION = {"*q_proj.weight": "column", "*k_proj.weight": "column", "*v_proj.weight": "column",
                 "*o_proj.weight": "row", "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab"}
MOE_PLANS = {
    "experts by cost": dict(layout=MOE_ATTENTION),
    "expert-parallel": dict(layout={**MOE_ATTENTION, "*.experts.*": "expert"}),
    "expert-parallel, all-to-all + SP": dict(layout={**MOE_ATTENTION, "*.experts.*": "expert"},
                                             sequence_parallel=True, expert_dispatch=True),
    "expert-TP": dict(layout={**MOE_ATTENTION, "*.experts.gate_up_proj": "expert_column",
                              "*.experts.down_proj": "expert_row"}),
}
#: the model's own op that reads device values on the host (transformers' grouped experts where
#: ``_grouped_mm`` does not take the dtype: float32 on CPU), not the rank's to remove
MODEL_READS = "_grouped_mm_fallback"


def parse(spec: str) -> tuple[str, int, int | None, int | None]:
    """``family:layers`` or, for a mixture of experts, ``family:layers:EXPERTSxTOPK``."""
    family, layers, *moe = spec.split(":")
    experts, top_k = (int(n) for n in moe[0].split("x")) if moe else (None, None)
    return family, int(layers), experts, top_k


def tiny(family: str, layers: int, seq: int, experts: int | None = None, top_k: int | None = None,
         dtype: torch.dtype = torch.float32):
    from autotp import zoo

    # an expert's width of 64 (8 per rank of tp 8 under expert-TP): bfloat16's grouped product takes
    # strides of 16 bytes' multiples only
    width = {"qwen3-moe": "moe_intermediate_size"}.get(family, "intermediate_size")
    extra = dict(experts=experts, top_k=top_k, **{width: 64}) if experts else {}
    config = zoo.tiny_config(family, layers=layers, heads=8, head_dim=8, vocab=128, positions=1024, **extra)
    model = zoo.build(family, config, dtype=dtype)
    batch = zoo.example_batch(family, config, batch=1, seq=seq, seed=0)
    return model, batch


def training_step(module, batch: dict):
    def step():
        module.zero_grad(set_to_none=True)
        loss = module(**batch).loss
        loss.backward()
        return loss
    return step


def inference_call(module, batch: dict):
    ids = {"input_ids": batch["input_ids"]}

    def step():
        with torch.no_grad():
            return module(**ids).logits
    return step


def least_times(steps: dict, repeats: int) -> dict:
    """Each step's least thread seconds over ``repeats`` rounds, the steps taken in turn within a
    round (so that a load that comes and goes on a shared machine falls on all of them alike),
    after two warm-up steps each. The backward runs on the calling thread: on a GPU the autograd
    engine would run it on a thread of its own per device, whose time the calling thread's clock
    does not hold (the forward's alone, where on CPU it is the whole step's)."""
    for step in steps.values():
        for _ in range(2):
            step()
    best = {label: float("inf") for label in steps}
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(repeats):
            for label, step in steps.items():
                start = time.thread_time()
                step()
                best[label] = min(best[label], time.thread_time() - start)
    return best


def counted(step, held: list) -> dict:
    """The step's ATen calls, Python calls (by file and by function), backward graph's nodes and
    reads of device values on the host (``held``: what a GPU would hold, :class:`HostReads`'
    roots): all of them, and those of the model's own ops (:data:`MODEL_READS`)."""
    from autotp.testing.host import AtenCalls, HostReads, PythonCalls, autograd_nodes

    with AtenCalls() as aten:
        step()
    with PythonCalls() as python:
        step()
    with HostReads(held) as reads:
        step()
    out = step()
    nodes = autograd_nodes(out) if out.requires_grad else 0
    own = [what for what, stack in reads.reads if any(f.startswith(MODEL_READS) for f in stack)]
    where = Counter(f"{_reader(stack)}: {what}" for what, stack in reads.reads)
    return {"aten": aten.total, "python": python.total, "nodes": nodes, "reads": len(reads.reads),
            "model_reads": len(own), "by_file": python.by_file(), "by_function": python.by_function,
            "where_read": where}


def _reader(stack: tuple) -> str:
    """The innermost function of autotp's (or the model's grouped fallback) a read was made in."""
    for name in reversed(stack):
        if name.startswith(MODEL_READS) or name in ("expert_bounds", "picked_rows", "routed_reorder",
                                                    "dispatch_sizes", "local_dispatch_sizes"):
            return name
    return stack[-3] if len(stack) >= 3 else "?"


def measure(model, batch: dict, plans: dict, args) -> tuple[dict, dict]:
    """Serial and each plan's rank, timed and counted, a training step and an inference call."""
    import autotp
    from autotp.testing.host import device_tensors

    modules = {"serial": model}
    for label, planning in plans.items():
        model.train()   # captured for training: the inference call's program is built on first use
        modules[label] = autotp.parallelize(model, args.tp, profile="h200", batch=8, seq=1024, **planning)
        # the index bounds staged, read after the step, as under NCCL (where it is the default): on
        # the fake backend a check would read them in the step, a read no GPU rank makes
        modules[label].deferred_checks = True
    rows = {}
    for kind, make in (("training step", training_step), ("inference call", inference_call)):
        for module in modules.values():
            module.train(kind == "training step")
        steps = {label: make(module, batch) for label, module in modules.items()}
        times = least_times(steps, args.repeats)
        for label, step in steps.items():
            rows[(kind, label)] = {"thread": times[label], **counted(step, device_tensors(modules[label], batch))}
    return rows, modules


def run_model(spec: str, args) -> tuple[list[str], dict]:
    from autotp.testing.host import MEGATRON

    family, layers, experts, top_k = parse(spec)
    dtype = getattr(torch, args.moe_dtype) if experts else torch.float32
    seq = args.moe_seq if experts else args.seq
    model, batch = tiny(family, layers, seq, experts, top_k, dtype)
    plans = MOE_PLANS if experts else {label: dict(layout=MEGATRON[family], **planning)
                                       for label, planning in PLANS.items()}
    # alone on the fake backend, a rank's peers route their tokens as it does (benchmarks/fake_peers.py):
    # its experts get rows from every peer, and the all-to-all's blocks have their sizes
    with mirrored_peers() if experts else contextlib.nullcontext():
        rows, modules = measure(model, batch, plans, args)
    moe = f", {experts} experts top-{top_k}, {args.moe_dtype}" if experts else ""
    lines = [f"## {family}, {layers} layers (hidden 64, 8 heads, vocabulary 128{moe}), batch 1 x seq {seq}, "
             f"tp={args.tp} rank 0", "",
             "| call | program | host ms (least) | rank ÷ serial | ATen calls | Python calls | autograd nodes | "
             "host reads (the model's own) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in ("training step", "inference call"):
        serial = rows[(kind, "serial")]
        for label in modules:
            r = rows[(kind, label)]
            ratio = "-" if label == "serial" else f"**{r['thread'] / serial['thread']:.2f}**"
            lines.append(f"| {kind} | {label} | {r['thread'] * 1e3:.2f} | {ratio} | {r['aten']} | {r['python']} | "
                         f"{r['nodes'] if kind == 'training step' else '-'} | {r['reads']} ({r['model_reads']}) |")
    read = sorted({(label, kind) for (kind, label), r in rows.items() if r["where_read"]})
    if read:
        lines += ["", "Where the host reads are made (the function, what it reads), per call:", ""]
        for label, kind in read:
            where = "; ".join(f"{n} x `{w}`" for w, n in sorted(rows[(kind, label)]["where_read"].items()))
            lines.append(f"- {label}, {kind}: {where}")
    for label, module in modules.items():
        if label == "serial" or not plans[label].get("sequence_parallel"):
            continue
        for program in module.programs:
            kinds = {type(m).__name__ for m in program.graph_module.modules()}
            if not kinds & {"ReduceScatterToTP", "GatherIntoTP"}:
                mode = "training" if program.capture.training else "inference"
                lines += ["", f"Note: {label}'s {mode} program holds no sequence-parallel collective: "
                          "`sequence_parallel=True` forces the program `parallelize` captures, and one built later "
                          "for another kind of call chooses by cost (docs/architecture.md, section 5), which at "
                          "these widths is the layout without it."]
    return lines + [""], {spec: rows}


def where_python_goes(rows: dict, label: str, top: int) -> list[str]:
    """The files the rank's Python calls of a training step are made in, beside serial's."""
    serial, rank = rows[("training step", "serial")], rows[("training step", label)]
    extra = Counter({f: n - serial["by_file"].get(f, 0) for f, n in rank["by_file"].items()})
    lines = ["| file | rank | serial | rank - serial |", "|---|---|---|---|"]
    for f, n in extra.most_common(top):
        lines.append(f"| `{f}` | {rank['by_file'][f]} | {serial['by_file'].get(f, 0)} | {n:+d} |")
    return lines


def before_and_after(before: dict, after: dict, label: str) -> list[str]:
    """The rank's figures of an earlier run (``--before``) beside this run's, with serial's host
    time of each run (the ratio rank ÷ serial is read within a run: the runs' loads differ)."""
    lines = [f"## Before ({label}) and after", "",
             "Host ms: the least of the repeats in each run; rank ÷ serial: within each run. On a shared "
             "machine the host ms of two runs move with the load each ran under (this run's is in its header "
             "and its last line), and a ratio within a run less; the counts do not move: they are the "
             "figures a change is held to.", "",
             "| model | call | program | host ms before → after | rank ÷ serial before → after | "
             "ATen calls before → after | Python calls before → after | autograd nodes before → after | "
             "host reads before → after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, now in after.items():
        spec, kind, program = key.split(" | ")
        was = before.get(key)
        if was is None or program == "serial" or f"{spec} | {kind} | serial" not in before:
            continue
        serial_now, serial_was = after[f"{spec} | {kind} | serial"], before[f"{spec} | {kind} | serial"]
        nodes = f"{was['nodes']} → {now['nodes']}" if kind == "training step" else "-"
        lines.append(f"| {spec} | {kind} | {program} | {was['thread'] * 1e3:.2f} → {now['thread'] * 1e3:.2f} | "
                     f"{was['thread'] / serial_was['thread']:.2f} → **{now['thread'] / serial_now['thread']:.2f}** | "
                     f"{was['aten']} → {now['aten']} | {was['python']} → **{now['python']}** | {nodes} | "
                     f"{was.get('reads', '?')} → {now['reads']} |")
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2:2", "gpt2:12", "llama:2", "llama:12", "mixtral:2:16x2",
                                                   "qwen3-moe:2:16x8"],
                   help="family:layers, or family:layers:EXPERTSxTOPK for a mixture of experts")
    p.add_argument("--moe-dtype", default="bfloat16", help="the mixtures of experts' dtype (bfloat16: the grouped "
                                                           "products a GPU runs, not float32's fallback that reads)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--moe-seq", type=int, default=64,
                   help="a mixture of experts' sequence: enough (token, expert) rows that rank 0's experts get some "
                        "(a rank alone on the fake backend cannot take rows back from experts that got none)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--top", type=int, default=15, help="files shown in the table of where the Python calls go")
    p.add_argument("--out", default=None, help="the result file ('-': print only)")
    p.add_argument("--json", default=None, help="also write the figures here, for a later run's --before")
    p.add_argument("--before", nargs="+", default=[], help="--json files of earlier runs (the code before a "
                                                           "change): their figures set beside this run's, a table each")
    p.add_argument("--before-label", nargs="+", default=[], help="what each --before run was (a commit)")
    p.add_argument("--note", default=None, help="a line on the machine's state, put under its description "
                                                "(a shared, loaded machine)")
    args = p.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotp import __version__  # noqa: F401  (imported before the clock starts)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    started = time.time()
    lines = ["# The host's work per step: one rank of tp=N against the serial model", "",
             "Command: `python benchmarks/rank_host.py " + shlex.join(sys.argv[1:]) + "`", "", machine(),
             f"1 torch thread; load average at the start {os.getloadavg()[0]:.1f}." +
             (f" {args.note}" if args.note else ""), "",
             "Tiny widths, so that the kernels cost next to nothing and the step is the host's work: the "
             "Python, the autograd engine and the dispatcher around the ATen ops. Host ms: the calling thread's "
             "CPU time (`time.thread_time`), the least of the repeats; ATen calls (a dispatch mode), Python "
             "function calls (`sys.setprofile`) and the backward graph's nodes are counts, the same on any "
             "machine (`autotp/testing/host.py`). The rank runs alone on torch's `fake` backend (its "
             "collectives return at once), Megatron's layout pinned (a mixture of experts': its attention and "
             "vocabulary, its experts by each plan; its peers' routing mirrored, `benchmarks/fake_peers.py`). Host "
             "reads: reads of device values on the host a GPU would stop for (`HostReads`), the index checks "
             "deferred as under NCCL.", ""]
    kept = {}
    for spec in args.models:
        more, rows = run_model(spec, args)
        lines += more
        kept.update(rows)
        print("\n".join(more), flush=True)
    figures = {f"{spec} | {kind} | {label}": {k: v for k, v in row.items()
                                              if k not in ("by_file", "by_function", "where_read")}
               for spec, rows in kept.items() for (kind, label), row in rows.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    for i, before in enumerate(args.before):
        label = args.before_label[i] if i < len(args.before_label) else "before"
        lines += before_and_after(json.loads(Path(before).read_text()), figures, label)
    dense = [spec for spec in kept if parse(spec)[2] is None]
    shown = ([("gpt2:12" if "gpt2:12" in dense else dense[0], label) for label in PLANS] if dense else []) + \
        [(spec, label) for spec in kept if parse(spec)[2] for label in MOE_PLANS if label != "experts by cost"]
    for spec, label in shown:
        lines += [f"Where the Python calls of a training step go, {spec}, {label}: the {args.top} files with the most "
                  "calls over serial's:", ""] + where_python_goes(kept[spec], label, args.top) + [""]
    lines.append(f"Whole run {time.time() - started:.0f} s; load average at the end {os.getloadavg()[0]:.1f}.")
    publish(lines, None if args.out == "-" else (args.out or Path(__file__).with_suffix(".md")))


if __name__ == "__main__":
    main()
