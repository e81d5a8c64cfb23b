"""Per-op and per-collective costs, as sympy expressions in the graph's dynamic dims.

Sizes are sympy expressions in the captured graph's symbols for batch and sequence. Every
cost term is built symbolically first and evaluated for a workload (``env``) second:

* **compute** of an op under a strategy, forward + backward, on the *largest* rank's share
  (uneven shards are priced by the rank that waits longest): products by their FLOPs, every
  other op by its memory traffic. A product is priced as a roofline, the larger of FLOP time
  and traffic time; other ops are assumed fused into their neighbours (bias-dropout-add,
  fused norms), so each streams its largest operand once forward and once backward;
* **collectives** by the alpha-beta ring formulas of :class:`~.devices.DeviceProfile`
  (all-reduce moves 2(n-1)/n of the bytes, all-gather and reduce-scatter (n-1)/n);
* **memory** an op keeps for backward: the activation inputs its backward needs (products,
  norms, attention, the loss, nonlinearities), at the largest rank's share.

Bytes: floating-point tensors are priced at the profile's training datatype
(``DeviceProfile.dtype_bytes``: 2 on the GPU profiles, whose FLOP rates are bf16/fp16 rates;
4 on CPU), whatever dtype the model was traced in, so that a float32 meta model is planned as
it would train on that device. Integer tensors keep their own size.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import Any, Mapping

import sympy
import torch

from ..passes.rules import OpInfo, Strategy, TensorMeta
from ..placements import Routed, Shard, max_local_size
from .devices import DeviceProfile

log = logging.getLogger("autotp")

aten = torch.ops.aten

#: forward + backward relative to forward, for products (backward computes two products)
TRAIN_FACTOR = 3.0
#: forward + backward relative to forward, for memory-bound ops (one write each way)
MEMORY_FACTOR = 2.0

#: Ops that move no data (views, metadata, casts to the same dtype as traced).
FREE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.t.default, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.detach.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.to.dtype, aten.to.dtype_layout, aten.sym_size.int,
    aten.contiguous.default,
}
PRODUCTS = {aten.mm.default, aten.linear.default, aten.bmm.default, aten.matmul.default}
#: grouped products (mixtures of experts), by name: transformers registers its fallback only once imported
GROUPED_PRODUCTS = frozenset(("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"))


# ---- symbolic sizes -------------------------------------------------------------------------
def numel_expr(shape: tuple) -> sympy.Expr:
    value = sympy.Integer(1)
    for s in shape:
        value = value * s
    return value


def element_bytes(meta: TensorMeta, dtype_bytes: int | None) -> int:
    """Bytes per element as priced: floats at the profile's training dtype, integers as traced."""
    if dtype_bytes is not None and meta.dtype.is_floating_point:
        return dtype_bytes
    return meta.dtype.itemsize


def bytes_expr(meta: TensorMeta, dtype_bytes: int | None = None) -> sympy.Expr:
    return numel_expr(meta.shape) * element_bytes(meta, dtype_bytes)


def forward_flops_expr(info: OpInfo) -> sympy.Expr:
    return _forward_flops_expr(info.target, info.inputs, info.output)


@lru_cache(maxsize=4096)
def _forward_flops_expr(t: Any, inputs: tuple, output: Any) -> sympy.Expr:
    if t in PRODUCTS or str(t) in GROUPED_PRODUCTS:   # a grouped product: each row by its expert's matrix
        return 2 * numel_expr(output.shape + (inputs[0].shape[-1],))
    if t is aten.scaled_dot_product_attention.default:
        q, k = inputs[0], inputs[1]
        return 4 * numel_expr(q.shape) * k.shape[-2]
    return sympy.Integer(0)


def _metas(out: Any) -> list[TensorMeta]:
    if isinstance(out, TensorMeta):
        return [out]
    if isinstance(out, tuple):
        return [o for o in out if isinstance(o, TensorMeta)]
    return []


def traffic_terms(info: OpInfo, dtype_bytes: int | None) -> tuple[str, tuple[sympy.Expr, ...]]:
    """Forward memory traffic as ("sum" | "max", terms): a product reads its operands and
    writes its result (the sum); any other op is assumed fused with its neighbours and streams
    its largest operand once (its output for elementwise ops, its input for a reduction such
    as the loss over the logits: the max)."""
    return _traffic_terms(info.target, info.inputs, info.output, dtype_bytes)


@lru_cache(maxsize=4096)
def _traffic_terms(target: Any, inputs: tuple, output: Any, dtype_bytes: int | None) -> tuple:
    written = sum((bytes_expr(m, dtype_bytes) for m in _metas(output)), sympy.Integer(0))
    read = tuple(bytes_expr(m, dtype_bytes) for m in inputs)
    if target in PRODUCTS or target is aten.scaled_dot_product_attention.default:
        return "sum", (written + sum(read, sympy.Integer(0)),)
    return "max", (written,) + read


def traffic_expr(info: OpInfo, dtype_bytes: int | None) -> sympy.Expr:
    how, terms = traffic_terms(info, dtype_bytes)
    return terms[0] if how == "sum" else sympy.Max(*terms)


def traffic(info: OpInfo, dtype_bytes: int | None, env: Mapping) -> float:
    """:func:`traffic_expr` at the workload ``env``."""
    return max(evaluate(t, env) for t in traffic_terms(info, dtype_bytes)[1])


# ---- evaluation -------------------------------------------------------------------------------
def evaluate(expr: sympy.Expr, env: Mapping[sympy.Symbol, int]) -> float:
    return _evaluate(expr, tuple(sorted(env.items(), key=lambda kv: str(kv[0]))))


@lru_cache(maxsize=65536)
def _evaluate(expr: sympy.Expr, env: tuple) -> float:
    if expr.free_symbols:
        expr = expr.subs(dict(env))
        if expr.free_symbols:   # a size neither the workload nor the example fixes: priced at 1
            log.info("autotp: the cost model prices %s at 1 (no workload value for %s)", expr,
                     sorted(map(str, expr.free_symbols)))
            expr = expr.subs({sym: 1 for sym in expr.free_symbols})
    return float(expr)


def numel(shape: tuple, env: Mapping[sympy.Symbol, int]) -> int:
    return int(evaluate(numel_expr(tuple(shape)), env))


def nbytes(meta: TensorMeta, env: Mapping, dtype_bytes: int | None = None) -> int:
    """Bytes of a whole tensor at the workload ``env`` (floats at ``dtype_bytes`` if given)."""
    return int(evaluate(bytes_expr(meta, dtype_bytes), env))


def forward_flops(info: OpInfo, env: Mapping) -> float:
    return evaluate(forward_flops_expr(info), env)


def shard_fraction(info: OpInfo, strategy: Strategy, tp: int) -> float:
    """The largest rank's share of the op's work under ``strategy`` (1.0: replicated).

    Only a split operand shares the work: an op on a Partial input (the sum of ranks' pieces,
    each the whole shape) or making a Partial output from whole inputs runs on every element on
    every rank, so it costs what it costs replicated. Routed rows (a rank's experts' rows, held
    compactly) are ``1/tp`` of the rows at uniform routing; a grouped product's own price is the
    busiest rank's share of the experts (its stack's Shard(0)), which is larger where tp does not
    divide them."""
    frac = 1.0
    pairs = list(zip(info.inputs, strategy.inputs))
    out = strategy.output
    outs = out if isinstance(out, tuple) else (out,)
    pairs += [(m, p) for m, p in zip(_metas(info.output), outs)]
    if any(isinstance(p, Routed) for _, p in pairs) and not any(isinstance(p, Shard) for _, p in pairs):
        return 1.0 / tp
    for meta, p in pairs:
        if isinstance(p, Shard):
            size = meta.static(p.dim)
            if size:
                frac = min(frac, max_local_size(size, p, tp) / size)
            elif size is None:   # a sequence shard: about 1/tp of the tokens (at most one more)
                frac = min(frac, 1.0 / tp)
    return frac


def compute_time_expr(info: OpInfo, strategy: Strategy, profile: DeviceProfile, tp: int,
                      env: Mapping | None = None) -> sympy.Expr:
    """Forward + backward seconds of one op on the largest rank's share, symbolic in b and s.

    With ``env`` the roofline's branch (FLOP- or memory-bound, largest operand) is the one
    taken at that workload, which keeps the expression a polynomial valid around it;
    without, it is a ``Max``."""
    if info.target in FREE_OPS:
        return sympy.Integer(0)
    frac = sympy.Rational(shard_fraction(info, strategy, tp)).limit_denominator(10 ** 6)
    flops = forward_flops_expr(info)
    how, terms = traffic_terms(info, profile.dtype_bytes)
    if env is not None:
        moved = terms[0] if how == "sum" else max(terms, key=lambda t: evaluate(t, env))
    else:
        moved = terms[0] if how == "sum" else sympy.Max(*terms)
    if flops != 0:
        if env is not None:
            flop_bound = evaluate(flops, env) / profile.flops >= evaluate(moved, env) / profile.mem_bw
            bound = flops / profile.flops if flop_bound else moved / profile.mem_bw
            return TRAIN_FACTOR * frac * bound
        return TRAIN_FACTOR * frac * sympy.Max(flops / profile.flops, moved / profile.mem_bw)
    return MEMORY_FACTOR * frac * moved / profile.mem_bw


def compute_time(info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile, tp: int) -> float:
    """:func:`compute_time_expr` at the workload ``env`` (a roofline per product)."""
    if info.target in FREE_OPS:
        return 0.0
    frac = shard_fraction(info, strategy, tp)
    flops = evaluate(forward_flops_expr(info), env)
    moved = traffic(info, profile.dtype_bytes, env)
    if flops:
        return TRAIN_FACTOR * frac * max(profile.matmul_time(flops), profile.memory_time(moved))
    return MEMORY_FACTOR * frac * profile.memory_time(moved)


#: Ops whose backward needs their (activation) inputs, which autograd keeps until then. Chains
#: of pointwise ops are assumed fused and keep nothing beyond what these already keep.
SAVES_INPUTS = PRODUCTS | {
    aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
    aten.scaled_dot_product_attention.default, aten._softmax.default, aten._log_softmax.default,
    aten.softmax.int, aten.log_softmax.int, aten.cross_entropy_loss.default,
    aten.tanh.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default,
}


def _fraction(meta: TensorMeta, p: Any, tp: int) -> float:
    if isinstance(p, Routed):
        return 1.0 / tp   # a rank's rows of experts, at uniform routing
    if isinstance(p, Shard) and meta.static(p.dim) is None:
        return 1.0 / tp   # a sequence shard: about 1/tp of the tokens
    size = meta.static(p.dim) if isinstance(p, Shard) else None
    return max_local_size(size, p, tp) / size if size else 1.0


def activation_bytes(info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile, tp: int,
                     is_param: tuple = ()) -> float:
    """Bytes of the op's float activation inputs kept for backward, on the largest rank
    (parameters are counted with the training state, not here)."""
    if info.target not in SAVES_INPUTS:
        return 0.0
    total = 0.0
    for i, (meta, want) in enumerate(zip(info.inputs, strategy.inputs)):
        if meta.is_float and not (i < len(is_param) and is_param[i]):
            total += evaluate(bytes_expr(meta, profile.dtype_bytes), env) * _fraction(meta, want, tp)
    return total


# ---- collectives ---------------------------------------------------------------------------------
#: (forward, backward) collective of each redistribution kind
COLLECTIVES = {
    "f": (None, "all_reduce"),
    "g": ("all_reduce", None),
    "all_gather": ("all_gather", None),
    "scatter": (None, "all_gather"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "reshard": ("all_gather", "all_gather"),
    "all_reduce": ("all_reduce", None),     # inside an op (vocab-parallel cross-entropy)
}


def ring_volume(collective: str | None, full_bytes: Any, n: int) -> Any:
    """Bytes each rank sends in a ring collective over a tensor of ``full_bytes``."""
    if collective is None or n <= 1:
        return 0
    return (2 if collective == "all_reduce" else 1) * sympy.Rational(n - 1, n) * full_bytes


def collective_time_expr(kind: str, full_bytes: sympy.Expr, profile: DeviceProfile, tp: int,
                         grad: bool = True) -> sympy.Expr:
    """Forward + backward seconds of redistribution ``kind``, symbolic in the tensor's bytes
    (``grad=False``: no gradient flows back through it, so its backward moves nothing)."""
    total = sympy.Integer(0)
    for coll in COLLECTIVES[kind][:2 if grad else 1]:
        if coll is None or tp <= 1:
            continue
        steps = 2 * (tp - 1) if coll == "all_reduce" else tp - 1
        total += steps * profile.link_latency + ring_volume(coll, full_bytes, tp) / profile.link_bw
    return total


def collective_time(kind: str, full_bytes: float, profile: DeviceProfile, tp: int,
                    grad: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of a redistribution of a tensor of ``full_bytes`` (``grad=False``:
    the tensor gets no gradient, a mask say, and the backward collective never runs)."""
    out = []
    for i, coll in enumerate(COLLECTIVES[kind]):
        if coll is None or (i == 1 and not grad):
            out.append(0.0)
        elif coll == "all_reduce":
            out.append(profile.all_reduce_time(full_bytes, tp))
        else:
            out.append(profile.all_gather_time(full_bytes, tp))
    return out[0], out[1]


def collective_bytes(kind: str, full_bytes: float, tp: int, grad: bool = True) -> tuple[float, float]:
    """(forward, backward) bytes each rank sends (``grad=False``: no backward)."""
    if tp <= 1:
        return 0.0, 0.0
    share = {None: 0.0, "all_reduce": 2 * (tp - 1) / tp}
    fw, bw = COLLECTIVES[kind]
    return share.get(fw, (tp - 1) / tp) * full_bytes, share.get(bw if grad else None, (tp - 1) / tp) * full_bytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
