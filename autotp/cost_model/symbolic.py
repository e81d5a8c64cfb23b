"""Per-op and per-collective costs.

Sizes are sympy expressions in the captured graph's dynamic dims (batch and sequence);
:func:`numel` evaluates them for a workload. Compute is priced as the larger of its FLOPs at
the profile's rate and its memory traffic at the profile's bandwidth (a roofline), for
forward plus backward (backward is twice the forward's FLOPs for products).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Mapping

import sympy
import torch

from ..passes.rules import OpInfo, Strategy, TensorMeta
from ..placements import Partial, Shard, max_local_size
from .devices import DeviceProfile

aten = torch.ops.aten

#: forward + backward relative to forward
TRAIN_FACTOR = 3.0


#: Ops that move no data (views, metadata, casts to the same dtype as traced).
FREE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.t.default, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.detach.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.to.dtype, aten.to.dtype_layout, aten.sym_size.int,
    aten.contiguous.default,
}


def numel(shape: tuple, env: Mapping[sympy.Symbol, int]) -> int:
    return _numel(shape, tuple(sorted(env.items(), key=lambda kv: str(kv[0]))))


@lru_cache(maxsize=65536)
def _numel(shape: tuple, env: tuple) -> int:
    value = sympy.Integer(1)
    for s in shape:
        value = value * s
    if value.free_symbols:
        value = value.subs(dict(env))
    return int(value)


def nbytes(meta: TensorMeta, env: Mapping) -> int:
    itemsize = meta.dtype.itemsize
    return numel(meta.shape, env) * itemsize


def _metas(out: Any) -> list[TensorMeta]:
    if isinstance(out, TensorMeta):
        return [out]
    if isinstance(out, tuple):
        return [o for o in out if isinstance(o, TensorMeta)]
    return []


def forward_flops(info: OpInfo, env: Mapping) -> float:
    t = info.target
    if t in (aten.mm.default, aten.linear.default, aten.bmm.default, aten.matmul.default):
        k = info.inputs[0].shape[-1]
        return 2.0 * numel(info.output.shape + (k,), env)
    if t is aten.scaled_dot_product_attention.default:
        q, k = info.inputs[0], info.inputs[1]
        return 4.0 * numel(q.shape, env) * numel(k.shape[-2:-1], env)
    return 0.0


def shard_fraction(info: OpInfo, strategy: Strategy, tp: int) -> float:
    """The largest rank's share of the op's work under ``strategy`` (1.0: replicated)."""
    frac = 1.0
    pairs = list(zip(info.inputs, strategy.inputs))
    out = strategy.output
    outs = out if isinstance(out, tuple) else (out,)
    pairs += [(m, p) for m, p in zip(_metas(info.output), outs)]
    for meta, p in pairs:
        if isinstance(p, Shard):
            size = meta.static(p.dim)
            if size:
                frac = min(frac, max_local_size(size, p, tp) / size)
    if frac == 1.0 and any(isinstance(p, Partial) for p in outs):
        frac = 1.0 / tp
    return frac


def compute_time(info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile, tp: int) -> float:
    """Forward + backward seconds of one op on the largest rank's share.

    Products are priced by FLOPs. Memory-bound ops are priced as a trained model runs them:
    fused into their neighbours (bias-dropout-add, fused norms), so each costs one write of
    its output forward and one backward, not a pass over every input.
    """
    if info.target in FREE_OPS:
        return 0.0
    frac = shard_fraction(info, strategy, tp)
    flops = forward_flops(info, env) * frac
    if flops:
        return TRAIN_FACTOR * profile.matmul_time(flops)
    traffic = sum(nbytes(m, env) for m in _metas(info.output)) * frac
    return 2.0 * profile.memory_time(traffic)


def collective_time(kind: str, full_bytes: float, profile: DeviceProfile, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of a redistribution of a tensor of ``full_bytes``."""
    ar = profile.all_reduce_time(full_bytes, tp)
    ag = profile.all_gather_time(full_bytes, tp)
    return {
        "f": (0.0, ar),
        "g": (ar, 0.0),
        "all_gather": (ag, 0.0),
        "scatter": (0.0, ag),
        "reduce_scatter": (ag, ag),
        "reshard": (ag, ag),
    }[kind]


def collective_bytes(kind: str, full_bytes: float, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes each rank sends."""
    if tp <= 1:
        return 0.0, 0.0
    ar, ag = 2 * (tp - 1) / tp * full_bytes, (tp - 1) / tp * full_bytes
    return {
        "f": (0.0, ar),
        "g": (ar, 0.0),
        "all_gather": (ag, 0.0),
        "scatter": (0.0, ag),
        "reduce_scatter": (ag, ag),
        "reshard": (ag, ag),
    }[kind]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
