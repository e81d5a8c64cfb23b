"""One capture for a TP group: its first rank captures the model, the others load the program.

Every rank of a TP group runs the same model's program, and captured it on its own before:
``tp`` times the seconds of torch.export, on the host cores the ranks share (8 ranks of a
node, each tracing the model through fake tensors at once). :func:`captured_once` has TP rank 0
capture and send the program (:mod:`autotp.capture.wire`: torch's graph pickle, a fraction of
the capture's time to write and to read) over the group's gloo control group; the others load
it. Planning stays on every rank (it is the rank's own program that is rewritten), and the
agreement check still compares every rank's captured graph before the first collective.

The exchange: one small all-reduce (does every rank hold this capture already, in its capture
cache?), then, unless all do, the size and the bytes broadcast from rank 0, the program after
its structure key. A rank that holds it keeps its own; a rank whose model's key is not rank 0's
(a constant of its own: the agreement check then names the difference) captures its own. Where rank 0 cannot write the program, or a rank cannot read it, that rank
captures the model itself (logged at debug level): the same program, by the same code. A
capture that fails on rank 0 sends nothing; every rank then captures on its own and fails with
its own error, which :func:`autotp.distributed.agreement._on_every_rank_or_none` agrees on.
The ranks trust each other's bytes, as torch's ``broadcast_object_list`` does: they are one job.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..capture import wire
from ..capture.program import Capture
from .comm import _comm, broadcast_bytes, sent_from_source

__all__ = ["captured_once", "stats"]

log = logging.getLogger(__name__)

#: this process's exchanges: captures it sent (as TP rank 0), loaded from rank 0, made itself
#: where it could not load one (or was not sent one), and held already by every rank
_counts = {"sent": 0, "loaded": 0, "made": 0, "held": 0}


_SEP = b"\n"   # between the structure key (hex) and the program's bytes

#: the ``key`` of a capture whose model the ranks agreed on already (see :func:`captured_once`)
AGREED = "agreed"


def placed(key: str | None, module: torch.nn.Module, inputs: dict | None = None) -> str | None:
    """``key`` with the devices ``module``'s tensors and ``inputs`` lie on, each with its index: a
    capture traced on ``cuda:0`` holds that device in its values and may hold it in its ops, so a
    rank whose model lies on ``cuda:1`` captures its own (a model on the CPU or the meta device,
    the usual start, is shared: the rewrite places the program on each rank's device)."""
    if key is None:
        return None
    tensors = itertools.chain(module.parameters(), module.buffers(),
                              (v for v in (inputs or {}).values() if isinstance(v, torch.Tensor)))
    return f"{key} on {','.join(sorted({str(t.device) for t in tensors}))}"


def stats() -> dict[str, int]:
    """This process's capture exchanges so far (tests and benchmarks read them)."""
    return dict(_counts)


def captured_once(mesh: Any, make: Callable[[], Capture], key: str | None,
                  held: Callable[[], Capture | None] = lambda: None,
                  keep: Callable[[Capture], Capture] = lambda cap: cap) -> Capture:
    """The capture ``make()`` makes, made on TP rank 0 only and sent to the group's other ranks.

    ``key``: the structure key of what is captured (:func:`autotp.capture.cache.key_of`: the
    module tree, every plain attribute, hook and tensor constant, the example inputs), sent with
    the program; a rank whose own key differs (its model holds another constant: a bug the
    agreement check names) or is None (a model the key cannot read) captures its own model
    instead, so that the program it runs, and the check compares, is its own. :data:`AGREED`:
    the ranks' models were found alike already (a later program of a module whose first one
    passed the agreement check); the program is sent whatever the keys (an export leaves state
    on the model it traced, transformers' output-capturing hooks: rank 0's would differ). ``held()``: this rank's
    capture where it holds one already (its cache's), without capturing; ``keep(cap)``: what a
    rank does with a capture it received (keeps it in its cache), returning the capture to use.
    Every rank of the TP group must call this together."""
    group = getattr(mesh, "control_group", None)
    if group is None or len(mesh.tp_ranks) < 2 or mesh.backend == "fake":   # fake: one rank, alone in its world
        return make()
    own = held()
    everyone = torch.tensor([0 if own is None else 1], dtype=torch.int64)
    with _comm("all_reduce(min) asking whether every rank holds the capture", group):
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if everyone.item() == 1:
        _counts["held"] += 1
        return own
    source = mesh.tp_ranks[0]
    if mesh.tp_rank == 0:
        def produce() -> tuple[Capture, bytes]:
            cap = own if own is not None else make()
            try:
                return cap, (key.encode() + _SEP + wire.dumps(cap) if key is not None else b"")
            except wire.WireError as exc:
                log.debug("autotp: the capture is not sent to the other ranks (%s); they capture the model "
                          "themselves", exc)
                return cap, b""

        cap, data = sent_from_source(produce, source, group, "captured program")
        _counts["sent"] += bool(data)
        return cap
    data = broadcast_bytes(b"", source, group, "captured program")
    if own is not None:
        return own
    theirs, _, data = data.partition(_SEP)
    if data and key is not None and theirs == key.encode():   # AGREED on rank 0 and here alike
        try:
            cap = keep(wire.loads(data))
            _counts["loaded"] += 1
            return cap
        except wire.WireError as exc:
            log.debug("autotp: rank %d could not load TP rank 0's capture (%s); capturing the model itself",
                      mesh.tp_rank, exc)
    if data and theirs != (key or "").encode():
        log.debug("autotp: rank %d's model is not TP rank 0's (another structure key); capturing its own",
                  mesh.tp_rank)
    _counts["made"] += 1
    return make()
