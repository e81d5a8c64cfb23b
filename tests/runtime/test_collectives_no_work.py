"""A blocking c10d collective may return no work: NCCL does so under torch 2.11 where the
options say ``asyncOp = False`` (found on an H200: ``'NoneType' object has no attribute 'wait'``
from every eager all-reduce). autotp's eager collectives wait only for work they are given.

The ranks run each eager collective through a group that runs the real gloo collective, waits
for it, and returns None, as NCCL in torch 2.11 does; the results must equal the same calls on
the plain group."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autotp.distributed import comm, exchange, gather_scatter
from autotp.distributed.mesh import get_mesh
from autotp.placements import Shard

#: the group methods autotp's eager collectives call with ``asyncOp = False``
BLOCKING = ("allreduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
            "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter_single_coalesced",
            "reduce_scatter_tensor_coalesced")


class NoWorkGroup:
    """``group`` whose blocking collectives return no work (each waited for here)."""

    def __init__(self, group) -> None:
        self._group = group

    def __getattr__(self, name):
        method = getattr(self._group, name)
        if name not in BLOCKING:
            return method

        def blocking(*args):
            method(*args).wait()

        return blocking


def _collectives(no_work: bool) -> list[torch.Tensor]:
    mesh = get_mesh(2)
    group = NoWorkGroup(mesh.tp_group) if no_work else mesh.tp_group
    coalesces = gather_scatter._backend_coalesces   # asks dist for the backend: of the group the proxy holds
    gather_scatter._backend_coalesces = lambda group, device: coalesces(getattr(group, "_group", group), device)
    try:
        return _run(group)
    finally:
        gather_scatter._backend_coalesces = coalesces


def _run(group) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    shard = Shard(1)
    reduced = x.clone()
    comm._c10d_all_reduce(reduced, group)
    out = [comm._all_reduce(x, group, "all_reduce"), reduced,
           gather_scatter._all_gather(x, group, Shard(0), 4, "gather along dim 0"),
           gather_scatter._all_gather(x, group, shard, 12, "gather along dim 1"),
           gather_scatter._reduce_scatter(x, group, shard, 6, "reduce_scatter"),
           exchange._c10d_all_to_all(x.reshape(12, 3), [6, 6], [6, 6], group, "all_to_all")]
    # rows of the gather and reduce-scatter along dim 1 (two leading rows) go as one coalesced
    # call where the backend has one, else one collective a row: both ways
    saved, gather_scatter._backend_coalesces = gather_scatter._backend_coalesces, lambda group, device: False
    try:
        out += [gather_scatter._all_gather(x, group, shard, 12, "gather along dim 1, a row at a time"),
                gather_scatter._reduce_scatter(x, group, shard, 6, "reduce_scatter, a row at a time")]
    finally:
        gather_scatter._backend_coalesces = saved
    return out


def test_eager_collectives_wait_only_for_work_they_are_given(cluster):
    for rank, (plain, none) in enumerate(zip(cluster.run(_collectives, False), cluster.run(_collectives, True))):
        assert len(plain) == len(none)
        for i, (a, b) in enumerate(zip(plain, none)):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"rank {rank}, collective {i}: {m}")
