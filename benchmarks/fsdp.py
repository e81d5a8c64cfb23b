"""Data parallelism three ways on a dp 2 x tp 2 world of local gloo ranks: autotp's per-parameter
gradient all-reduce hooks against FSDP2 (``autotp.runtime.fsdp.fully_shard``) with one unit per
repeated layer (the default) and with the whole module as one unit, side by side in one run:
training step time (forward, backward, AdamW) and bytes per rank of parameters, gradients and
optimizer state, and the most parameter bytes FSDP2 holds gathered at once in a forward.

    .venv/bin/python benchmarks/fsdp.py --out benchmarks/fsdp.md

Each rank builds the same random GPT-2 (no hub), planned with the Megatron layout, and runs
``--steps`` timed steps after ``--warmup`` steps, each on its own half of the batch; the two
versions run one after the other in the same rank processes. Times are per rank, the median
and the best over the timed steps, the slowest rank reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, publish  # noqa: E402

LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}


def _bytes(tensors) -> int:
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in tensors if t is not None)


def run_rank(args: argparse.Namespace) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import autotp
    from autotp.runtime.module import fsdp

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        pm = autotp.parallelize(GPT2LMHeadModel(config), tp=2, layout=LAYOUT)
        if kind != "hooks":
            fsdp.fully_shard(pm, per_layer=kind == "fsdp2 per layer")
        peak = _gathered_peak(pm) if kind != "hooks" else None
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1 + pm.mesh.dp_rank)
        times = []
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            start = time.perf_counter()
            opt.zero_grad()
            pm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        state = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
        out[kind] = {"median_ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times),
                     "param_bytes": _bytes(list(pm.parameters())),
                     "grad_bytes": _bytes([p.grad for p in pm.parameters()]),
                     "state_bytes": _bytes(state), "gathered_bytes": peak() if peak else None}
    return out


KINDS = ("hooks", "fsdp2 whole module", "fsdp2 per layer")


def _gathered_peak(pm) -> "callable":
    """Track, through FSDP2's units' forward hooks, the most parameter bytes gathered at once
    (a unit's whole parameters from its pre-forward until its forward ends and it reshards;
    the root unit's stay gathered for the whole forward). Returns a function reading it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in pm.modules() if isinstance(m, FSDPModule)]

    def gathered(p) -> int:   # this rank's tp part of the parameter, whole over dp
        return p.numel() * p.element_size() // (pm.mesh.tp if p.placements[-1].is_shard() else 1)

    sizes = {}
    for m in units:
        nested = {id(q) for u in units if u is not m and u in set(m.modules()) for q in u.parameters()}
        sizes[id(m)] = sum(gathered(p) for p in m.parameters() if id(p) not in nested)
    state = {"now": 0, "peak": 0}

    def enter(module, args):
        state["now"] += sizes[id(module)]
        state["peak"] = max(state["peak"], state["now"])

    def leave(module, args, output):
        if module is not pm:
            state["now"] -= sizes[id(module)]

    for m in units:
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)
    pm.register_forward_pre_hook(lambda module, args: state.update(now=0), prepend=True)
    return lambda: state["peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from autotp.testing import launch

    results = launch(run_rank, 4, args, timeout=1800)
    load = os.getloadavg()
    lines = [
        "# Data parallelism: per-parameter all-reduce hooks vs FSDP2 (per layer and whole module)",
        "",
        f"Command: `.venv/bin/python benchmarks/fsdp.py{' --out ' + args.out if args.out else ''}`",
        "",
        machine() + f" Load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; the 4 rank "
        f"processes run {args.threads} thread each on the machine's {os.cpu_count()} cores (oversubscribed: "
        "times include waiting for a core, both versions alike).",
        "",
        f"Model: GPT-2, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
        f"float32, Megatron layout at tp 2; dp 2 (4 ranks); per DP rank batch {args.batch} x seq {args.seq}; "
        f"a step is forward, backward and AdamW; {args.warmup} warm-up steps, {args.steps} timed.",
        "",
        "| DP through | step ms (median, slowest rank) | step ms (best) | parameter bytes/rank | "
        "gradient bytes/rank | AdamW state bytes/rank | parameter bytes gathered at once (forward) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        rows = [r[kind] for r in results]
        gathered = rows[0]["gathered_bytes"]
        lines.append(f"| {kind} | {max(r['median_ms'] for r in rows):.1f} | {max(r['best_ms'] for r in rows):.1f} | "
                     f"{max(r['param_bytes'] for r in rows):,} | {max(r['grad_bytes'] for r in rows):,} | "
                     f"{max(r['state_bytes'] for r in rows):,} | "
                     f"{'-' if gathered is None else f'{gathered:,}'} |")

    def worst(kind: str, key: str) -> float:
        return max(r[kind][key] for r in results)

    h, hs = worst("hooks", "median_ms"), worst("hooks", "state_bytes")
    lines.append("")
    for kind in KINDS[1:]:
        lines.append(f"{kind} / hooks: step time {worst(kind, 'median_ms') / h:.2f}x, optimizer state per rank "
                     f"{worst(kind, 'state_bytes') / hs:.2f}x.")
    lines += ["",
              "FSDP2 reduce-scatters the gradients over dp and shards the optimizer state; per layer, each "
              "repeated layer is a unit whose forward runs that layer's ops (autotp.runtime.module.outline), so its "
              "parameters are gathered just before them and freed after (the root unit, embeddings and head, "
              "stays gathered through the forward); as one unit, every parameter is gathered before the "
              "forward. The hooks all-reduce each gradient as backward produces it. The gathered-at-once "
              "column counts each unit's parameters from its pre-forward hook to the end of its forward, "
              "per rank (its tp part of each tp-split tensor)."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
