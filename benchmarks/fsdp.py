"""Data parallelism two ways on a dp 2 x tp 2 world of local gloo ranks: autotp's per-parameter
gradient all-reduce hooks against FSDP2 (``autotp.runtime.fsdp.fully_shard``), side by side in
one run: training step time (forward, backward, AdamW) and bytes per rank of parameters,
gradients and optimizer state.

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
    from autotp.runtime import fsdp

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    out = {}
    for kind in ("hooks", "fsdp2"):
        torch.manual_seed(0)
        pm = autotp.parallelize(GPT2LMHeadModel(config), tp=2, layout=LAYOUT)
        if kind == "fsdp2":
            fsdp.fully_shard(pm)
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
                     "state_bytes": _bytes(state)}
    return out


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
        "# Data parallelism: per-parameter all-reduce hooks vs FSDP2",
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
        "gradient bytes/rank | AdamW state bytes/rank |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("hooks", "fsdp2"):
        rows = [r[kind] for r in results]
        lines.append(f"| {kind} | {max(r['median_ms'] for r in rows):.1f} | {max(r['best_ms'] for r in rows):.1f} | "
                     f"{max(r['param_bytes'] for r in rows):,} | {max(r['grad_bytes'] for r in rows):,} | "
                     f"{max(r['state_bytes'] for r in rows):,} |")
    h = max(r["hooks"]["median_ms"] for r in results)
    f = max(r["fsdp2"]["median_ms"] for r in results)
    hs = max(r["hooks"]["state_bytes"] for r in results)
    fs = max(r["fsdp2"]["state_bytes"] for r in results)
    lines += ["", f"FSDP2 / hooks: step time {f / h:.2f}x, optimizer state per rank {fs / hs:.2f}x.", "",
              "FSDP2 gathers every parameter over dp before each forward and reduce-scatters the gradients "
              "after backward, the whole module as one unit (autotp's programs are one graph each, so "
              "there is no per-layer prefetch to overlap with compute); the hooks all-reduce each gradient "
              "as backward produces it."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
