"""What the ranks' agreement on a call's state costs: a training step with and without it.

    .venv/bin/python benchmarks/agreement_cost.py --out benchmarks/agreement_cost.md

On 2 local gloo ranks (one torch thread each), every rank builds the same random GPT-2 (float32)
and parallelizes it at tp 2 in Megatron's layout, once per version. A step is ``zero_grad``,
forward with labels, backward and an AdamW step. The versions take turns step by step after
``--warmup`` steps (a barrier starts each step); reported per version: the slowest rank's median
and best step over ``--steps`` timed ones, and the median's spread (quartiles).

- ``without``: the per-call state left out of the call's check (grad mode, autocast, the frozen
  parameters, the optimizer step count: ``pm._context`` returns nothing, the module is not
  counted by the optimizer hook): the check as it was before these fields;
- ``default``: as shipped (the fields above in every call's check, the step counted);
- ``replicas every step``: ``pm.check_replicas_every = 1`` (a SHA-256 of every replicated
  parameter and buffer at the first call after each optimizer step);
- ``values``: ``pm.check_inputs = "values"`` (a SHA-256 of each input too).

Also measured on rank 0, alone: one ``pm._context()`` (the state fields of a call), the optimizer
post-step hook's search for the modules an optimizer steps, one hash of the replicas, and the
weight digest's throughput (SHA-256 of the bytes, against the digest it replaced:
three integer sums of the bits, re-implemented here for the comparison).
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

VERSIONS = ("without", "default", "replicas every step", "values")
MEGATRON_GPT2 = {"*.attn.c_attn.weight": "column", "*.attn.c_attn.bias": "column", "*.attn.c_proj.weight": "row",
                 "*.mlp.c_fc.weight": "column", "*.mlp.c_fc.bias": "column", "*.mlp.c_proj.weight": "row",
                 "transformer.wte.weight": "vocab"}


def _old_digest(t: torch.Tensor) -> int:
    """The digest value_digest used before: sum, sum of squares and position-weighted sum of the bits."""
    bits = t.detach().contiguous().reshape(-1).view(torch.int32)
    total = squares = weighted = 0
    chunk = 1 << 20
    weights = torch.arange(1, chunk + 1, dtype=torch.int64)
    for start in range(0, bits.numel(), chunk):
        x = bits[start:start + chunk].to(torch.int64)
        total += int(x.sum())
        squares += int((x * x).sum())
        weighted += int((x * weights[: x.numel()]).sum())
    return hash((total, squares, weighted))


def _rank(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import autotp
    from autotp.runtime.module import module as module_mod
    from autotp.distributed.agreement import value_digest

    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    modules, optims = {}, {}
    for version in VERSIONS:
        torch.manual_seed(0)
        pm = autotp.parallelize(GPT2LMHeadModel(config), tp=2, layout=MEGATRON_GPT2)
        if version == "without":
            pm._context = lambda replicas=False: ()
            module_mod._LIVE.discard(pm)
        if version == "replicas every step":
            pm.check_replicas_every = 1
        if version == "values":
            pm.check_inputs = "values"
        modules[version], optims[version] = pm, torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {v: [] for v in VERSIONS}
    for step in range(args.warmup + args.steps):
        for version in VERSIONS:
            pm, opt = modules[version], optims[version]
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            pm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if step >= args.warmup:
                times[version].append(time.perf_counter() - start)
    out = {"median": {v: statistics.median(t) for v, t in times.items()},
           "best": {v: min(t) for v, t in times.items()},
           "quartiles": {v: statistics.quantiles(t, n=4)[::2] for v, t in times.items()}}
    if dist.get_rank() == 0:
        pm = modules["default"]
        start = time.perf_counter()
        for _ in range(1000):
            pm._context()
        out["context_us"] = (time.perf_counter() - start) / 1000 * 1e6
        opt = optims["default"]
        start = time.perf_counter()
        for _ in range(1000):
            for live in list(module_mod._LIVE):   # what the post-step hook does per step
                live._owns_any(opt)
        out["hook_us"] = (time.perf_counter() - start) / 1000 * 1e6
        start = time.perf_counter()
        entries = pm._replica_entries()
        out["replicas_ms"] = (time.perf_counter() - start) * 1e3
        out["replicas"] = (len(entries), sum(p.to_local().numel() for n, p in pm.named_parameters()
                                             if any(e.startswith(n + ":") for e in entries)))
        big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        value_digest(big)
        out["sha_s"] = time.perf_counter() - start
        start = time.perf_counter()
        _old_digest(big)
        out["old_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from autotp.testing import launch

    load_before = os.getloadavg()[0]
    results = launch(_rank, 2, args, timeout=3600.0)
    load_after = os.getloadavg()[0]
    first = results[0]
    slowest = {v: max(r["median"][v] for r in results) for v in VERSIONS}
    best = {v: max(r["best"][v] for r in results) for v in VERSIONS}
    spread = {v: max(results, key=lambda r: r["median"][v])["quartiles"][v] for v in VERSIONS}
    base, base_best = slowest["without"], best["without"]
    lines = [
        "# The cost of the ranks' agreement on a call's state",
        "",
        "Command: `.venv/bin/python benchmarks/agreement_cost.py " + " ".join(sys.argv[1:]) + "`",
        "",
        machine() + f" Load average (1 min) {load_before:.1f} before, {load_after:.1f} after: the machine is "
        "shared, so steps are noisy; the versions take turns step by step to share the noise.",
        "",
        f"GPT-2, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, batch "
        f"{args.batch} x {args.seq} tokens, float32, tp 2 on 2 gloo ranks (one thread each), Megatron's layout; "
        f"a step = zero_grad + forward + backward + AdamW; the slowest rank's median of {args.steps} steps after "
        f"{args.warmup} warm-up steps.",
        "",
        "| version | median step (ms) | quartiles (ms) | vs without | best step (ms) | vs without |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {v} | {slowest[v] * 1e3:.1f} | {spread[v][0] * 1e3:.0f}-{spread[v][1] * 1e3:.0f} | "
              f"{slowest[v] / base:.3f}x | {best[v] * 1e3:.1f} | {best[v] / base_best:.3f}x |" for v in VERSIONS]
    count, elements = first["replicas"]
    lines += [
        "",
        f"Alone, on rank 0: one call's state fields (`pm._context()`): {first['context_us']:.1f} us "
        f"({first['context_us'] * 1e-6 / base * 100:.4f}% of the median step without them); the post-step hook's "
        f"search of the {len(VERSIONS) - 1} modules it counts for one optimizer: {first['hook_us']:.1f} us; one hash of "
        f"the replicas ({count} replicated parameters and buffers, {elements / 1e6:.2f} M parameter elements): "
        f"{first['replicas_ms']:.1f} ms.",
        f"The weight digest of 16 M float32 (64 MB): SHA-256 of the bytes {first['sha_s'] * 1e3:.0f} ms, the three "
        f"integer sums it replaced {first['old_s'] * 1e3:.0f} ms.",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
