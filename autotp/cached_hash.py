"""A frozen dataclass's hash, computed once per object.

Placements, tensor metas, strategies and device profiles key the planner's caches and the
solver's states, and are hashed many times each; dataclass's own ``__hash__`` hashes every field
on every call. A class takes these two as ``__hash__ = cached_hash`` and
``__getstate__ = state_without_hash`` (assigned in the class body: a frozen dataclass would
otherwise write its own ``__hash__`` over an inherited one).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any


def cached_hash(self: Any) -> int:
    """The hash of the fields dataclass would hash, computed on first use and kept on the object."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in fields(self) if (f.compare if f.hash is None else f.hash)))
        object.__setattr__(self, "_hash", h)
    return h


def state_without_hash(self: Any) -> dict:
    """The object's state for pickling, without the kept hash (a symbol's or a string's hash
    differs between processes)."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}
