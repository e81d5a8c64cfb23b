"""A capture as bytes and back, so that one rank captures and the others load its program.

Capture is the costliest part of planning a small model (torch.export traces every op through
fake tensors: seconds a model), and every rank of a TP group captured the same model before
(``autotp.distributed.captures`` now has one rank capture and the others load). The bytes are
torch's graph pickle (``torch.fx._graph_pickler``, what inductor's out-of-process compile
ships graphs with): the graph with every node's metadata (each value's fake tensor, its module
stack, its source), the fake tensors remade in a fresh fake mode whose shape environment is
the capturing rank's (the same symbols, ranges and replacements), the lifted constants as
real tensors. A loaded capture gives the plan a fresh one gives (tests/test_capture_wire.py).

Either side may fail on a program torch's pickle does not know (an op outside aten, a
higher-order op's callable, another torch's private layout): :func:`dumps` and :func:`loads`
raise :class:`WireError` then, and the caller captures the model itself instead.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from .program import Capture

__all__ = ["WireError", "dumps", "loads"]


class WireError(Exception):
    """A capture torch's graph pickle could not write or read (the caller captures instead)."""


def _pickler() -> Any:
    """torch's graph pickler (a private module of torch.fx; torch 2.13 has it): a torch
    without it, or with another layout of it, is a WireError, and every rank captures itself."""
    try:
        from torch.fx import _graph_pickler
        return _graph_pickler.GraphPickler, _graph_pickler.Options
    except (ImportError, AttributeError) as exc:
        raise WireError(f"this torch has no graph pickler ({exc})") from exc


def _options(Options: Any) -> Any:
    """Every op and every node's metadata kept (the defaults drop module stacks, which the
    planner reads, and refuse ops outside aten)."""
    fields = {f.name for f in dataclasses.fields(Options)}
    keep = {"ops_filter": None}
    if "node_metadata_key_filter" in fields:
        keep["node_metadata_key_filter"] = None
    return Options(**keep)


def dumps(cap: Capture) -> bytes:
    """``cap`` as bytes :func:`loads` reads in another process with the same torch and autotp."""
    GraphPickler, Options = _pickler()
    try:
        return GraphPickler.dumps(cap, _options(Options))
    except Exception as exc:  # noqa: BLE001 - any failure of the pickle: the ranks capture themselves
        raise WireError(f"{type(exc).__name__}: {exc}") from exc


def loads(data: bytes) -> Capture:
    """The capture :func:`dumps` wrote, its fake tensors in a fresh fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    GraphPickler, _ = _pickler()
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        with warnings.catch_warnings():   # torch's own unpickling of a tree spec warns of its deprecated API
            warnings.simplefilter("ignore", FutureWarning)
            cap = GraphPickler.loads(data, mode)
    except Exception as exc:  # noqa: BLE001 - as in dumps
        raise WireError(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(cap, Capture):
        raise WireError(f"the bytes hold a {type(cap).__name__}, not a capture")
    return cap
