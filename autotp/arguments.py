"""Arguments checked at the door: the planning workload, the layout and the memory limit that
``plan``, ``parallelize`` and ``from_pretrained`` take are refused with a
:class:`~autotp.errors.ConfigError` naming the argument and what it takes, before any capture or
collective (a batch of 0 would otherwise price a plan at negative costs, a list given as layout
fail deep inside with a ValueError of Python's own)."""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Mapping

from .errors import ConfigError


def positive_int(name: str, value: Any, what: str) -> int:
    """``value`` as an int >= 1 (numpy integers too), or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ConfigError(f"{name}={value!r}: {name} must be a positive integer ({what})")
    return int(value)


def check_layout(layout: Any) -> Mapping[str, Any] | None:
    if layout is None:
        return None
    if not isinstance(layout, Mapping):
        raise ConfigError(f"layout={layout!r}: layout must be a mapping from parameter-name globs to roles, e.g. "
                          "{'*.c_attn.weight': 'column', '*.c_proj.weight': 'row'}, not a "
                          f"{type(layout).__name__}")
    keys = [k for k in layout if not isinstance(k, str)]
    if keys:
        raise ConfigError(f"layout keys must be parameter-name globs (strings); got {keys[:3]!r}")
    return layout


def check_memory_limit(limit: Any) -> float | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, Real) or math.isnan(limit) or limit <= 0:
        raise ConfigError(f"memory_limit={limit!r}: memory_limit is a positive number of bytes per rank "
                          "(e.g. 40 * 2**30 for 40 GiB), or None for the profile's device memory")
    return limit


def check_planning(batch: Any, seq: Any, layout: Any = None, memory_limit: Any = None) -> tuple:
    """``(batch, seq, layout, memory_limit)`` checked (seq and the others may be None)."""
    batch = positive_int("batch", batch, "the planning workload's batch size")
    if seq is not None:
        seq = positive_int("seq", seq, "the planning workload's sequence length")
    return batch, seq, check_layout(layout), check_memory_limit(memory_limit)


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool, or a ConfigError naming ``name`` (a string "False" is truthy)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: {name} is True or False")
    return value
