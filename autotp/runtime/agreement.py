"""Ranks agree before they talk.

Tensor parallelism is SPMD: every rank of a TP group must run the same program, calling the
same collectives in the same order on tensors of the same shapes. When they do not (another
layout on one rank, another autotp or torch version, a batch of another length), the first
collective hangs until the timeout or, worse, sums unrelated tensors. So, before its first real
collective, each rank:

* fingerprints what it is about to run (:func:`fingerprint`): the software versions, the plan's
  parameter placements, the plan's collectives, and the rewritten graph (nodes, their targets,
  the comm modules with their global shard layouts; local sizes, which legitimately differ
  between ranks of an uneven split, are left out);
* compares the fingerprints with one small all-reduce on the group (:func:`check_agreement`).

Each call's inputs are checked the same way (:func:`check_same_inputs`: names, shapes,
dtypes). When the digests differ, every rank sees it from the same all-reduce, so every rank
then exchanges the differing sections' entries (two more small collectives) and raises the same
:class:`~autotp.errors.DisagreementError`, saying what differs on which rank. The exchange is
JSON bytes in tensors: nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx

from ..errors import DisagreementError
from .collectives import _comm, group_ranks, group_size

__all__ = ["Fingerprint", "fingerprint", "check_agreement", "check_same_inputs", "input_signature"]

# Digests are cut to 62 bits so that both h and -h fit an int64 (one MAX all-reduce finds min and max).
_BITS = 62


@dataclass(frozen=True)
class Fingerprint:
    """What one rank will run, as named sections of short text entries (compared by digest)."""

    sections: tuple[tuple[str, tuple[str, ...]], ...]

    def digests(self) -> list[int]:
        return [_digest(entries) for _, entries in self.sections]


def _digest(entries: Sequence[str]) -> int:
    h = hashlib.sha256("\n".join(entries).encode()).digest()
    return int.from_bytes(h[:8], "little") >> (64 - _BITS)


# ---------------------------------------------------------------- what a rank will run

def fingerprint(plan: Any, graph_module: fx.GraphModule) -> Fingerprint:
    from ..version import __version__

    software = (f"autotp {__version__}", f"torch {torch.__version__}")
    params = tuple(f"{fqn}: {p!r} {list(plan.shapes.get(fqn, ()))}" for fqn, p in sorted(plan.params.items()))
    params += (f"tp={plan.tp}",)
    params += tuple(f"alias {a} -> {b}" for a, b in sorted(plan.aliases.items()))
    params += tuple(f"output {k} kept split {v!r}" for k, v in sorted(plan.sharded_outputs.items()))
    comms = tuple(f"{c.kind} of {c.tensor} for {c.consumer} ({c.src} -> {c.dst})" for c in plan.comms)
    return Fingerprint((
        ("the software versions differ", software),
        ("the plan's parameter placements differ", params),
        ("the plan's collectives differ", comms),
        ("the rewritten graphs differ", tuple(_graph_entries(graph_module))),
    ))


def _graph_entries(gm: fx.GraphModule) -> list[str]:
    from ..passes.rules import op_name

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, bool) or not isinstance(a, int):
            return repr(a)
        return "int"  # a size: local sizes differ between the ranks of an uneven split

    out = []
    for node in gm.graph.nodes:
        args = pytree.tree_map(arg, (node.args, dict(node.kwargs)))
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            layout = f"{mod.shard!r} of {mod.full_size}" if hasattr(mod, "shard") else ""
            target = f"{type(mod).__name__}({layout})"
        elif node.op == "call_function":
            target = op_name(node.target)
        else:
            target = str(node.target)
        out.append(f"{node.op} {node.name} = {target}{args}")
    return out


def input_signature(names: Sequence[str], values: Sequence[Any]) -> tuple[str, ...]:
    """The part of a call's inputs every rank of a TP group must share: names, shapes, dtypes."""
    return tuple(f"{n}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor)
                 else f"{n}: {v!r}" for n, v in zip(names, values))


# ---------------------------------------------------------------- comparing

def check_agreement(fp: Fingerprint, group, what: str = "before their first collective") -> None:
    """Raise DisagreementError on every rank of ``group`` unless all fingerprints are equal."""
    if group is None or group_size(group) == 1:
        return
    differing = _differing(fp.digests(), group)
    if not differing:
        return
    ranks = list(group_ranks(group) or range(group_size(group)))
    lines = []
    for i in differing:
        title, entries = fp.sections[i]
        per_rank = _all_gather_json(list(entries), group)
        lines.append(f"- {title}: {_first_difference(per_rank, ranks)}")
    raise DisagreementError(
        f"ranks {ranks} of the TP group disagree {what}, so their collectives would hang or mix "
        "unrelated tensors:\n" + "\n".join(lines) + "\n"
        "Every rank must call autotp.parallelize with the same model, tp, layout or plan, profile and "
        "planning sizes, under the same autotp and torch versions."
    )


def check_same_inputs(signature: tuple[str, ...], group, what: str = "TP group") -> None:
    """Raise DisagreementError on every rank of ``group`` unless all got inputs of one signature.
    ``what`` names the group in the error (a TP group, or a pipeline's stages and their TP ranks)."""
    if group is None or group_size(group) == 1:
        return
    if not _differing([_digest(signature)], group):
        return
    ranks = list(group_ranks(group) or range(group_size(group)))
    per_rank = _all_gather_json(list(signature), group)
    raise DisagreementError(
        f"the inputs of this call differ across the {what} of ranks {ranks}: "
        f"{_first_difference(per_rank, ranks)}. Every rank of a {what} must get the same batch "
        f"(split data across data-parallel groups, not across the ranks of one {what})."
    )


def _differing(digests: list[int], group) -> list[int]:
    """Indices whose digest is not the same on every rank: one all-reduce(MAX) of [h, -h]."""
    both = torch.tensor(digests + [-d for d in digests], dtype=torch.int64)
    with _comm("all_reduce(max) in autotp's agreement check", group):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(digests)
    return [i for i in range(n) if int(both[i]) != -int(both[n + i])]


def _all_gather_json(value: Any, group) -> list[Any]:
    """Every rank's ``value`` (JSON-able), as a list in group-rank order."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(group_size(group))]
    with _comm("all_gather of sizes in autotp's agreement check", group):
        dist.all_gather(sizes, size, group=group)
    width = max(int(s) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    received = [torch.empty_like(padded) for _ in sizes]
    with _comm("all_gather of fingerprints in autotp's agreement check", group):
        dist.all_gather(received, padded, group=group)
    return [json.loads(bytes(r[: int(s)].tolist()).decode()) for r, s in zip(received, sizes)]


def _first_difference(per_rank: list[list[str]], ranks: list[int]) -> str:
    """Where the ranks' entry lists first part ways, with each distinct entry and its ranks."""
    length = max(len(e) for e in per_rank)
    for i in range(length):
        seen: dict[str, list[int]] = {}
        for rank, entries in zip(ranks, per_rank):
            seen.setdefault(entries[i] if i < len(entries) else "(nothing: fewer entries)", []).append(rank)
        if len(seen) > 1:
            shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v!r}"
                              for v, r in seen.items())
            return f"entry {i}: {shown}"
    return "the same entries in another order"


# ---------------------------------------------------------------- capture and planning, on every rank or none

def _on_every_rank_or_none(mesh: Any, step: Any) -> Any:
    """Run ``step`` (capture and planning: no collectives) and tell the TP group whether it
    worked, with one small all-reduce, before anyone waits in a collective of the model. A
    rank that failed raises its own error; the others raise at once instead of waiting for it
    until the collective timeout."""
    try:
        value, failure = step(), None
    except Exception as exc:   # re-raised below, after the group has been told
        value, failure = None, exc
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is not None:
        import torch.distributed as dist

        ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if failure is None and ok.item() == 0:
            raise DisagreementError(
                f"another rank of TP group {list(mesh.tp_ranks)} failed to capture or plan the model (its own "
                "error says why); this rank stops too instead of waiting for it in a collective"
            )
    if failure is not None:
        raise failure
    return value


def _agreed_seed(mesh: Any, seed: int | None) -> int:
    """One dropout seed for the whole TP group: ``seed``, or TP rank 0's initial seed."""
    seed = torch.initial_seed() % (1 << 62) if seed is None else int(seed)
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is None:
        return seed
    import torch.distributed as dist

    value = torch.tensor([seed], dtype=torch.int64)
    dist.broadcast(value, src=mesh.tp_ranks[0], group=group)
    return int(value.item())
