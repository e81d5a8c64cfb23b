"""Greedy generation tokens/s: autotp's pm.generate (KV cache split by head) against the serial
model's own generate(do_sample=False), side by side in one run on local gloo ranks.

    .venv/bin/python benchmarks/generation.py --out benchmarks/generation.md

Every rank builds the same random GPT-2 (no hub), times the serial ``model.generate`` and then
``pm.generate`` on the same prompts (tokens checked equal), at each tp. Each rank process runs
torch on ``--threads`` threads, and so does its serial run: the ratio compares one rank's
program with the same model on the same share of the machine. Timings are the best of
``--repeats`` calls after one warm-up call (the warm-up captures the prefill and decode
programs; its time is reported separately as first-call seconds).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, publish  # noqa: E402


def run_rank(args: argparse.Namespace, tp: int) -> dict:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.prompt), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :args.prompt // 4] = 0      # one left-padded row
    call = dict(attention_mask=mask, max_new_tokens=args.new, pad_token_id=args.vocab - 1, eos_token_id=None)

    def best(fn) -> tuple[float, torch.Tensor]:
        times, out = [], None
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        return min(times), out

    with torch.no_grad():
        model.generate(ids, do_sample=False, **call)                   # warm-up
        serial_s, want = best(lambda: model.generate(ids, do_sample=False, **call))
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp, layout={"*.c_attn.weight": "column", "*.attn.c_proj.weight": "row",
                                               "*.mlp.c_fc.weight": "column", "*.mlp.c_proj.weight": "row"})
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    pm.generate(ids, **call)                                          # captures prefill and decode
    first_s = time.perf_counter() - start
    parallel_s, got = best(lambda: pm.generate(ids, **call))
    tokens = args.batch * args.new
    return {"rank": dist.get_rank(), "equal": bool(torch.equal(got, want)), "serial_tps": tokens / serial_s,
            "parallel_tps": tokens / parallel_s, "setup_s": setup_s, "first_s": first_s,
            "cache_heads": int(pm.kv_cache["key_0"].shape[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from autotp.testing import launch

    rows = []
    for tp in args.tp:
        results = launch(run_rank, tp, args, tp, timeout=1800)
        r0 = results[0]
        rows.append(f"| {tp} | {all(r['equal'] for r in results)} | {r0['cache_heads']} of {args.heads} | "
                    f"{min(r['serial_tps'] for r in results):.1f} | {min(r['parallel_tps'] for r in results):.1f} | "
                    f"{min(r['parallel_tps'] for r in results) / min(r['serial_tps'] for r in results):.2f}x | "
                    f"{max(r['setup_s'] for r in results):.1f} | {max(r['first_s'] for r in results):.1f} |")
    load = os.getloadavg()[0]
    lines = [
        "# Greedy generation: pm.generate vs serial generate",
        "",
        f"Command: `.venv/bin/python benchmarks/generation.py {' '.join(sys.argv[1:])}`",
        "",
        machine() + f" Load average at the end: {load:.1f}.",
        "",
        f"Model: GPT-2, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
        f"float32, random weights. Batch {args.batch} (one row left-padded by {args.prompt // 4}), prompt "
        f"{args.prompt} tokens, {args.new} new tokens, greedy. Each rank and its serial run use "
        f"{args.threads} torch thread(s); tokens/s = batch x new tokens / best of {args.repeats} calls.",
        "",
        "| tp | tokens equal on every rank | cache heads per rank | serial tokens/s | autotp tokens/s | autotp / serial "
        "| parallelize s | first generate s (captures) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The serial figure is measured in each rank process just before the parallel one (the slowest rank's "
        "figure is shown for both). With more ranks than cores the ranks share cores and the per-rank "
        "figures fall for both columns alike; the ratio is what the table is for. A decode step is small "
        "(one token per row): its time is mostly per-op overhead and the two all-reduces per layer, so "
        "tensor parallelism pays off in generation when the weights are large, as on GPUs, not on a "
        "tiny model on CPU cores.",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
