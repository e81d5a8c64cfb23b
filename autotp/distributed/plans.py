"""One plan search for a TP group: its first rank searches, the others rebuild what it chose.

Every rank of a TP group plans the same capture with the same arguments, and searched on its
own before: ``tp`` times the solver's seconds (and the sibling products', the moved scales' and
the notes' extra solves), on the host cores the ranks share. :func:`planned_once` has TP rank 0
search and send what it chose (:class:`autotp.planner.planner.Decided`: the plan, which
capture it planned, each op's strategy and a digest of the result) over the group's gloo
control group; the others rebuild the plan from it in one walk of the graph, checked against
the digest. A rank's program is still rewritten from its own capture and propagation, and the
agreement check still compares the ranks' programs.

A rank where the plan does not rebuild (another capture: a model of its own, whose key was not
rank 0's; the digest not matched), or cannot be read, plans by itself (logged at debug level):
the same search by the same code. A search that fails on rank 0 sends nothing; every rank then
plans by itself and fails with its own error, which
:func:`autotp.distributed.agreement._on_every_rank_or_none` agrees on. So every rank passes
through the exchange exactly once per call, whatever happens: the caller runs it in a step of
its own, after the capture's (a rank whose capture failed never reaches it, nor does any other).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from .comm import broadcast_bytes, sent_from_source

__all__ = ["planned_once", "stats"]

log = logging.getLogger(__name__)

#: this process's exchanges: plans it sent (as TP rank 0), rebuilt from rank 0's, and searched
#: itself (none sent, or not rebuilt)
_counts = {"sent": 0, "rebuilt": 0, "made": 0}


def stats() -> dict[str, int]:
    """This process's plan exchanges so far (tests and benchmarks read them)."""
    return dict(_counts)


def planned_once(mesh: Any, make: Callable[[Any], Any], share: Callable[[Any], Any]) -> Any:
    """``make(None)`` (the search) on TP rank 0; ``make(given)`` on the others, where ``given`` is
    ``share(result)`` of rank 0's result (what it chose, as JSON's values: autotp loads no
    pickle), or ``make(None)`` where that fails.
    Every rank of the TP group must call this together, once, with nothing before it that may
    fail on one rank alone (module docstring)."""
    group = getattr(mesh, "control_group", None)
    if group is None or len(mesh.tp_ranks) < 2 or mesh.backend == "fake":   # fake: one rank, alone in its world
        return make(None)
    source = mesh.tp_ranks[0]
    if mesh.tp_rank == 0:
        def produce() -> tuple[Any, bytes]:
            result = make(None)
            try:
                return result, json.dumps(share(result)).encode()
            except Exception as exc:  # noqa: BLE001 - the others plan themselves: the same plan
                log.debug("autotp: the plan is not sent to the other ranks (%s); they plan themselves", exc)
                return result, b""

        result, data = sent_from_source(produce, source, group, "plan decided")
        _counts["sent"] += bool(data)
        return result
    data = broadcast_bytes(b"", source, group, "plan decided")
    if data:
        try:
            result = make(json.loads(data))
            _counts["rebuilt"] += 1
            return result
        except Exception as exc:  # noqa: BLE001 - a plan this rank cannot rebuild: it searches itself
            log.debug("autotp: rank %d did not rebuild TP rank 0's plan (%s); planning itself", mesh.tp_rank, exc)
    _counts["made"] += 1
    return make(None)
