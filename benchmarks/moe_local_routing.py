"""What a rank runs to route a dispatching expert layer: every token's rows, or its own.

    python benchmarks/moe_local_routing.py --out benchmarks/moe_local_routing.md

One layer's routing at the MoE workloads of ``benchmarks/moe_rank.py`` (batch 2 x 4096 tokens;
Mixtral-8x7B: 8 experts, top 2; Qwen3-30B-A3B: 128 experts, top 8), the tokens split along the
sequence over gloo ranks (CPU, 1 thread each), from the rank's own tokens' top-k ids to the
dispatch plan, both ways:

* **whole** (what a dispatching layer's program runs today, autotp/distributed/experts.py): the
  ids all-gathered along the sequence, transformers' ``sort`` and ``histc`` and ``cumsum`` of
  every (token, expert) row, ``perm // k`` and every sorted row's holder, the reorder's positions
  of the rank's rows (``routed_reorder``), ``dispatch_sizes`` and ``dispatch_plan``;
* **local** (autotp/distributed/expert_routing.py): the rank's own rows sorted and counted, the
  counts all-gathered, ``local_dispatch_sizes`` and ``local_dispatch_plan``.

Counted exactly on each rank (a dispatch mode over the ATen calls): calls, the rows of the
largest tensor any call touches, the bytes the calls write, the bytes the collectives move;
and the CPU time of the rank's thread (weak: a loaded 2-core machine, median of a few repeats).
Both ways give the same plan (checked here on every run).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import publish

SHAPES = {"Mixtral-8x7B": dict(experts=8, k=2), "Qwen3-30B-A3B": dict(experts=128, k=8)}
BATCH, SEQ, REPEATS = 2, 4096, 5


class _Counter:
    """ATen calls, bytes written (outputs), the largest first dim touched; collectives apart."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = dict(calls=0, written=0, rows=0, comm=0, sorted_rows=0)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                counts["calls"] += 1
                counts["rows"] = max([counts["rows"]] + [a.shape[0] for a in tensors if a.ndim])
                if name == "sort":
                    counts["sorted_rows"] += tensors[0].numel()
                if "c10d" in str(func):   # a collective: the largest tensor it touches (a gather's output)
                    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
                            if isinstance(t, torch.Tensor)]
                    counts["comm"] += max((t.numel() * t.element_size() for t in flat), default=0)
                else:
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    counts["written"] += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _runs(experts: int, tp: int) -> tuple:
    from autotp.placements import Shard, local_ranges

    out = []
    for r in range(tp):
        ((a, b),) = local_ranges(experts, Shard(0), tp, r) or ((0, 0),)
        out.append((a, b - a))
    return tuple(out)


def measure(experts: int, k: int) -> dict:
    """On each rank: both ways, counted once and timed ``REPEATS`` times; the plans compared."""
    import torch.distributed as dist

    from autotp.distributed import expert_routing as R
    from autotp.distributed import experts as E
    from autotp.distributed.gather_scatter import _all_gather
    from autotp.placements import Shard

    torch.set_num_threads(1)
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    b, s = BATCH, SEQ
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(b * s, experts, generator=gen)
    all_ids = scores.topk(k, dim=-1).indices                         # [T, k]: every token's experts
    mine = E.token_rows(torch.empty(b, (s + tp - 1 - rank) // tp), 1, [b], s, tp, rank)
    ids = all_ids.index_select(0, mine)                              # [T_r, k]: the rank's tokens'
    runs = _runs(experts, tp)

    def whole():
        gathered = _all_gather(ids.view(b, -1, k), group, Shard(1), s, "all_gather of ids").reshape(-1)
        ids_g, perm = torch.sort(gathered)
        offs = torch.cumsum(E.histc(ids_g.to(torch.int32), experts, 0, experts - 1), 0, dtype=torch.int32)
        tokens = perm // k
        held = E.token_owners(ids, [b], s, tp).index_select(0, tokens)
        sizes = E.dispatch_sizes(held, offs, runs, rank)
        rows = E.routed_reorder(torch.empty(mine.numel(), 1), tokens, mine, b * s, sizes.sent)[1]
        return sizes, E.dispatch_plan(rows, held, offs, runs, sizes)

    def local():
        routing = R.route_locally(ids.reshape(-1), b, experts, group, tp, rank)
        sizes = R.local_dispatch_sizes(routing, runs, rank)
        return sizes, R.local_dispatch_plan(routing, runs, rank, sizes)

    out = {}
    for name, fn in (("whole", whole), ("local", local)):
        fn()   # warm (the token maps' cache, the allocator)
        with _Counter() as c:
            sizes, plan = fn()
        times = []
        for _ in range(REPEATS):
            dist.barrier(group)
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        out[name] = dict(c.counts, ms=1e3 * statistics.median(times), sizes=sizes[:3], plan=plan)
    # the same read (bounds, split sizes); the plans order an expert's rows alike only where the
    # whole sort (transformers': not stable) happens to be stable, so they are compared as sizes
    same = out["whole"]["sizes"] == out["local"]["sizes"] and all(
        getattr(out["whole"]["plan"], f).shape == getattr(out["local"]["plan"], f).shape
        for f in ("order", "unorder", "place", "arrival"))
    for v in out.values():
        del v["plan"], v["sizes"]
    return dict(out, same=same, rows=ids.numel())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp", type=int, default=4)
    args = parser.parse_args()
    from autotp.distributed.launch import LocalCluster

    lines = [
        "# A dispatching layer's routing on a rank: every token's rows, or its own",
        "",
        f"Command: `.venv/bin/python benchmarks/moe_local_routing.py --tp {args.tp} --out "
        "benchmarks/moe_local_routing.md`",
        "",
        f"{args.tp} gloo ranks on CPU, 1 thread each, on a shared 2-core machine under load (other jobs "
        "running): the times are weak, the counts exact. One layer's routing, batch "
        f"{BATCH} x {SEQ} tokens split along the sequence, from the rank's tokens' top-k ids to the "
        "dispatch plan (see the script's docstring for what each way runs). Rank 0's counts (every rank's "
        "alike but for its experts' received rows); CPU time: the slowest rank's median of "
        f"{REPEATS}. Both ways give the same read (bounds, split sizes) on every rank, checked each run; an "
        "expert's rows are in a stable order locally, in `torch.sort`'s (not stable at these sizes) whole.",
        "",
        "| layer | way | ATen calls | rows sorted | largest tensor (rows) | bytes written | collectives' bytes "
        "(the largest tensor of each) | CPU ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with LocalCluster(args.tp, timeout=600) as cluster:
        for label, shape in SHAPES.items():
            results = cluster.run(measure, shape["experts"], shape["k"])
            assert all(r["same"] for r in results), "the local routing's plan differs from the whole routing's"
            for way in ("whole", "local"):
                r = results[0][way]
                ms = max(x[way]["ms"] for x in results)
                lines.append(f"| {label} ({shape['experts']} experts, top {shape['k']}; the rank's rows "
                             f"{results[0]['rows']}) | {way} | {r['calls']} | {r['sorted_rows']} | {r['rows']} | "
                             f"{r['written']:,} | {r['comm']:,} | {ms:.2f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
