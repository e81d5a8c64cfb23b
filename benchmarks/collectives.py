"""autotp's collectives against a bare torch.distributed collective of the same bytes and
DTensor's redistribute of the same tensor, side by side on local gloo ranks.

    .venv/bin/python benchmarks/collectives.py --out benchmarks/collectives.md

Each rank times, in turn and repeated, on the same tensors: autotp's all-gather of a shard
(``gather_scatter._all_gather``: the logits' vocabulary dim, an even split and an uneven one),
the bare gather followed by the one copy any dim-2 gather needs (the backend's rank-major
buffer laid out along dim 2: the floor for a gather of that dim),
``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) of the same local bytes (bare: the floor), the list
``dist.all_gather`` + ``torch.cat`` that autotp used before, and ``DTensor.redistribute`` from
``Shard(dim)`` to ``Replicate()``; and autotp's all-reduce (g's forward) against a bare
``dist.all_reduce`` and DTensor's ``Partial() -> Replicate()``; autotp's reduce-scatter onto the sequence dim
(sequence parallelism) against a bare ``reduce_scatter_single`` of the same bytes and DTensor's
``Partial() -> Shard(1)``; and the vocab-parallel
cross-entropy (forward + backward, its three all-reduces included) on a rank's V/tp columns
against serial ``F.cross_entropy`` on all V (the "bare" row there). Times are medians over the
repeats; the slowest rank's median is shown.
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


def _medians_ms(fns: dict, repeats: int) -> dict:
    """Each version's median time in ms, the versions taken in turn within every repeat (so a
    change in the machine's load falls on all of them alike), behind a barrier each."""
    import torch.distributed as dist

    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def run_rank(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor import Shard as TorchShard

    from autotp.placements import Shard, local_size
    from autotp.distributed import comm, gather_scatter

    # all_gather_single from torch 2.13 (all_gather_into_tensor, its older name, warns there)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    torch.set_num_threads(1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (tp,))
    out = {}
    b, s = args.batch, args.seq
    for vocab in (args.vocab, args.vocab + 1):          # even, then uneven
        shard = Shard(2)
        x = torch.randn(b, s, local_size(vocab, shard, tp, rank))
        width = max(local_size(vocab, shard, tp, r) for r in range(tp))
        padded = torch.randn(b, s, width)

        def listed():
            send = padded.movedim(2, 0).contiguous()
            recv = [torch.empty_like(send) for _ in range(tp)]
            dist.all_gather(recv, send, group=group)
            return torch.cat([r.movedim(0, 2) for r in recv], dim=2)

        def bare():
            o = padded.new_empty((tp * b, s, width))
            all_gather_single(o, padded, group=group)
            return o

        dt = DTensor.from_local(x, mesh, [TorchShard(2)], run_check=False,
                                shape=torch.Size((b, s, vocab)), stride=torch.empty(b, s, vocab, device="meta").stride())
        kind = "even" if vocab % tp == 0 else "uneven"
        out[f"all-gather {kind} [{b}, {s}, {vocab}] dim 2"] = _medians_ms({
            "autotp": lambda: gather_scatter._all_gather(x, group, shard, vocab, "bench"),
            "bare all_gather_single": bare,
            "list all_gather + cat (before)": listed,
            "DTensor redistribute": lambda: dt.redistribute(mesh, [Replicate()]).to_local(),
            # what separates a dim-2 gather from the bare one: the rank-major buffer laid out
            # along dim 2, one copy of the whole tensor (no communication)
            "bare + the layout copy alone": lambda: bare().view(tp, b, s, width).movedim(0, 2)
                                                    .reshape(b, s, tp * width),
        }, args.repeats)
    h = torch.randn(b, s, args.hidden)
    hd = DTensor.from_local(h, mesh, [Partial()], run_check=False)

    def bare_reduce():
        y = h.clone()
        dist.all_reduce(y, group=group)
        return y

    out[f"all-reduce [{b}, {s}, {args.hidden}]"] = _medians_ms({
        "autotp": lambda: comm._all_reduce(h, group, "bench"),
        "bare all_reduce": bare_reduce,
        "DTensor redistribute": lambda: hd.redistribute(mesh, [Replicate()]).to_local(),
    }, args.repeats)
    # sequence parallelism's reduce-scatter: a partial sum onto this rank's sequence shard (dim 1)
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    partial = torch.randn(b, s, args.hidden)
    pd = DTensor.from_local(partial, mesh, [Partial()], run_check=False)

    def bare_reduce_scatter():
        o = partial.new_empty((b // tp, s, args.hidden))
        reduce_scatter_single(o, partial, group=group)
        return o

    out[f"reduce-scatter [{b}, {s}, {args.hidden}] onto dim 1"] = _medians_ms({
        "autotp": lambda: gather_scatter._reduce_scatter(partial, group, Shard(1), s, "bench"),
        "bare reduce_scatter_single (dim 0)": bare_reduce_scatter,
        "DTensor redistribute": lambda: pd.redistribute(mesh, [TorchShard(1)]).to_local(),
    }, args.repeats)
    # the vocab-parallel loss, forward + backward, on this rank's V/tp columns against serial
    # cross_entropy on all V in the same process
    import torch.nn.functional as F

    from autotp.distributed.functional import _VocabParallelCrossEntropy

    n, vocab = b * s, args.vocab
    ranges = ((rank * vocab // tp, (rank + 1) * vocab // tp),)
    local = torch.randn(n, vocab // tp, requires_grad=True)
    whole = torch.randn(n, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (n,))

    def parallel_loss():
        _VocabParallelCrossEntropy.apply(local, target, group, ranges, -100, 1).backward()

    def serial_loss():
        F.cross_entropy(whole, target).backward()

    out[f"cross-entropy forward + backward, {n} rows, vocab {vocab}"] = _medians_ms({
        "bare: serial cross_entropy on V": serial_loss,
        f"autotp vocab-parallel on V/{tp}": parallel_loss,
    }, args.repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from autotp.testing import launch

    results = launch(run_rank, args.tp, args, timeout=1800)
    load = os.getloadavg()
    lines = ["# Collectives: autotp vs bare torch.distributed vs DTensor", "",
             f"Command: `.venv/bin/python benchmarks/collectives.py{' --out ' + args.out if args.out else ''}`", "",
             machine() + f" Load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}. {args.tp} gloo "
             f"ranks, 1 thread each, float32; medians of {args.repeats} calls, the versions taken in turn "
             "within each repeat; the slowest rank's median.", ""]
    for case in results[0]:
        lines += [f"## {case}", "", "| version | ms | vs bare |", "|---|---|---|"]
        rows = {k: max(r[case][k] for r in results) for k in results[0][case]}
        floor = next(v for k, v in rows.items() if k.startswith("bare"))
        for k, v in rows.items():
            lines.append(f"| {k} | {v:.2f} | {v / floor:.2f}x |")
        lines.append("")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
