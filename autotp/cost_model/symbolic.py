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
* **memory** an op keeps for backward: what ATen's autograd formula keeps (:mod:`.saved`: inputs,
  outputs, statistics, masks), at the largest rank's share (:func:`kept_bytes`); counted once
  per storage by :meth:`~autotp.passes.propagate.GraphIndex.activation_bytes`.

Bytes: floating-point tensors are priced at the profile's training datatype
(``DeviceProfile.dtype_bytes``: 2 on the GPU profiles, whose FLOP rates are bf16/fp16 rates;
4 on CPU), whatever dtype the model was traced in, so that a float32 meta model is planned as
it would train on that device. Integer tensors keep their own size.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from functools import lru_cache
from typing import Any, Mapping

import sympy
import torch

from ..capture.program import op_name
from ..passes.rules import OpInfo, Strategy, TensorMeta
from ..passes.rules.row_reads import host_reads
from . import kernels
from .work import OpWork, Product, local_numel, metas
from .work import element_bytes as _element_bytes
from ..placements import Routed, Shard, max_local_size
from .devices import DeviceProfile
from .saved import Kept

log = logging.getLogger("autotp")

aten = torch.ops.aten

PRODUCTS = kernels.PRODUCTS
GROUPED_PRODUCTS = kernels.GROUPED_PRODUCTS


# ---- symbolic sizes -------------------------------------------------------------------------
def numel_expr(shape: tuple) -> sympy.Expr:
    value = sympy.Integer(1)
    for s in shape:
        value = value * s
    return value


def element_bytes(meta: TensorMeta, dtype_bytes: int | None, train_dtype: torch.dtype | None = None) -> int:
    """Bytes per element as priced: floats at the profile's training dtype, integers as traced.
    With ``train_dtype`` (the model's, :func:`~autotp.passes.propagate.training_dtype`), a float
    of another dtype keeps its own size (:func:`.work.element_bytes`): what a collective of
    it moves (the vocabulary-parallel loss's float32 sums in a bf16 model)."""
    return _element_bytes(meta.dtype, dtype_bytes, train_dtype)


def bytes_expr(meta: TensorMeta, dtype_bytes: int | None = None, train_dtype: torch.dtype | None = None) -> sympy.Expr:
    return numel_expr(meta.shape) * element_bytes(meta, dtype_bytes, train_dtype)


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


# ---- evaluation -------------------------------------------------------------------------------
def evaluate(expr: sympy.Expr, env: Mapping[sympy.Symbol, int]) -> float:
    # the workload in one order, by the symbols' names (str() of a symbol runs sympy's printer:
    # a tenth of the solver's seconds went to it)
    return _evaluate(expr, tuple(sorted(env.items(), key=_symbol_name)))


def _symbol_name(item: tuple) -> str:
    sym = item[0]
    return sym.name if isinstance(sym, sympy.Symbol) else str(sym)


@lru_cache(maxsize=65536)
def _evaluate(expr: sympy.Expr, env: tuple) -> float:
    if expr.free_symbols:
        expr = sympy.sympify(expr.xreplace(dict(env)))   # subs' generality costs five times more
        if expr.free_symbols:   # a size neither the workload nor the example fixes: priced at 1
            log.info("autotp: the cost model prices %s at 1 (no workload value for %s)", expr,
                     sorted(map(str, expr.free_symbols)))
            expr = expr.xreplace({sym: 1 for sym in expr.free_symbols})
    return float(expr)


def numel(shape: tuple, env: Mapping[sympy.Symbol, int]) -> int:
    return int(evaluate(numel_expr(tuple(shape)), env))


def nbytes(meta: TensorMeta, env: Mapping, dtype_bytes: int | None = None,
           train_dtype: torch.dtype | None = None) -> int:
    """Bytes of a whole tensor at the workload ``env`` (floats at ``dtype_bytes`` if given; with
    ``train_dtype``, those of another dtype at their own size: :func:`element_bytes`)."""
    return int(evaluate(bytes_expr(meta, dtype_bytes, train_dtype), env))


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


def op_work(info: OpInfo, strategy: Strategy, profile: DeviceProfile, tp: int, rank: int | None = None) -> OpWork:
    """:func:`.kernels.op_work` for ``info`` (its inputs' gradients and the training dtype as
    the index recorded them), plus the sums autograd makes where a tensor's gradient comes
    from several uses (the residual stream's ``add_``); on the largest rank, or on ``rank``."""
    return _op_work(info.target, info.inputs, info.output, info.args_key, strategy, tp, profile.dtype_bytes,
                    info.train_dtype, info.grad_inputs, info.grad_uses, info.strided_inputs, rank, info.permutes_rows,
                    info.row_copies, info.routing_experts, info.offs_bytes, info.expert_share)


@lru_cache(maxsize=65536)
def _op_work(target, inputs, output, args_key, strategy, tp, dtype_bytes, train_dtype, grad_inputs, grad_uses,
             strided_inputs, rank, permutes_rows=False, row_copies=0, routing_experts=0, offs_bytes=0,
             expert_share=None):
    info = OpInfo(target, args_key[0], dict(args_key[1]), inputs, output, tp)
    info.expert_share = expert_share   # a router's load (autotp/planner/expert_load.py)
    info.grad_inputs = grad_inputs
    info.strided_inputs = strided_inputs
    info.permutes_rows = permutes_rows   # its backward a gather (kernels.op_work)
    # the routing's kernels (cost_model/routing): a rank's own sort's, and the dispatch's from a whole sort
    info.row_copies, info.routing_experts, info.offs_bytes = row_copies, routing_experts, offs_bytes
    work = kernels.op_work(info, strategy, tp, dtype_bytes, train_dtype, rank)
    outs = metas(output)
    if grad_uses > 1 and outs and outs[0].is_float:
        place = strategy.output[0] if isinstance(strategy.output, tuple) else strategy.output
        share = None if expert_share is None else max(expert_share) if rank is None else expert_share[rank]
        out_bytes = (local_numel(outs[0], place, tp, rank, share)
                     * _element_bytes(outs[0].dtype, dtype_bytes, train_dtype))
        work = replace(work, moved=work.moved + (("elementwise", 3 * (grad_uses - 1) * out_bytes),),
                       launches=work.launches + grad_uses - 1)
    return work


def product_seconds(p: Product, env: Mapping, profile: DeviceProfile, elem_bytes: int,
                    align: Any = None) -> tuple[float, float]:
    """(seconds, seconds per FLOP) of one product at the workload ``env``: the slower of its
    FLOPs at the rate its shape reaches and its operands' traffic (a skinny product, a decode
    step's, is memory-bound). ``align``: the rewrite's padding of unaligned products."""
    if p.padded is not None and align is not None and evaluate(p.rows, env) >= align.min_rows:
        # the rewrite runs it padded to an aligned width (autotp/cost_model/alignment.py): the
        # aligned product's time, plus the pad's copies, per the product's own FLOPs
        seconds = product_seconds(p.padded, env, profile, elem_bytes)[0] + evaluate(p.pad_bytes, env) / profile.mem_bw
        work = evaluate(p.batch * p.m * p.n * p.k, env)
        return seconds, seconds / (2 * work) if work > 0 else 0.0
    work = evaluate(p.batch * p.m * p.n * p.k, env)
    if work <= 0:
        return 0.0, 0.0
    k = evaluate(p.k, env)
    flop_s = 2 * work / profile.product_rate(work, k, p.aligned)
    moved = evaluate(p.batch * (p.m * p.k + p.k * p.n + p.m * p.n), env) * elem_bytes
    seconds = max(flop_s, moved / profile.mem_bw)
    if p.streamed and profile.grouped_bw:   # each expert's weights streamed for its few rows (DeviceProfile)
        seconds += grouped_stream_bytes(p, env, elem_bytes) / profile.grouped_bw
    return seconds, seconds / (2 * work)


def grouped_stream_bytes(p: Product, env: Mapping, elem_bytes: int) -> float:
    """The bytes of a grouped product's experts' weights one pass streams (its weights forward
    and for the input's gradient, the weights' gradient written), every expert's."""
    return evaluate(p.batch * p.streamed, env) * elem_bytes


def split_seconds(info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile,
                  tp: int, align: Any = None, rank: int | None = None) -> dict[str, float]:
    """Forward + backward seconds of one op on the largest rank (or on ``rank``), by kind:
    ``products``, ``attention`` and ``memory`` (memory-bound kernels and every kernel's launch)."""
    work = op_work(info, strategy, profile, tp, rank)
    eb = profile.dtype_bytes
    products = sum(product_seconds(p, env, profile, eb, align)[0] for p in work.products)
    attention = sum(max(evaluate(a.flops, env) / profile.attention_rate(a.head_dim, a.dropout),
                        evaluate(a.moved, env) / profile.mem_bw) for a in work.attention)
    memory = sum(evaluate(b, env) / profile.bandwidth(cls) for cls, b in work.moved)
    memory += work.launches * profile.launch_s + work.passes * profile.sort_pass_s
    return {"products": products, "attention": attention, "memory": memory,
            "host_reads": host_reads(info, strategy) * profile.host_read_time()}


def compute_time_expr(info: OpInfo, strategy: Strategy, profile: DeviceProfile, tp: int,
                      env: Mapping | None = None, align: Any = None) -> sympy.Expr:
    """Forward + backward seconds of one op on the largest rank, symbolic in b and s: each
    product's FLOPs at the rate its shape reaches at the workload ``env`` (so the expression is
    a polynomial, exact there and near it; without ``env``, at the profile's peak), every
    memory-bound kernel's bytes at its class's bandwidth, and the launches."""
    work = op_work(info, strategy, profile, tp)
    total = sympy.Integer(0)
    for p in work.products:
        per_flop = product_seconds(p, env, profile, profile.dtype_bytes, align)[1] if env is not None else 1 / profile.flops
        total += p.flops * sympy.Float(per_flop, 6)
    for a in work.attention:
        total += a.flops / profile.attention_rate(a.head_dim, a.dropout)
    for cls, b in work.moved:
        total += b / profile.bandwidth(cls)
    return total + work.launches * profile.launch_s + work.passes * profile.sort_pass_s \
        + host_reads(info, strategy) * profile.host_read_time()


def compute_time(info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile, tp: int,
                 align: Any = None) -> float:
    """:func:`compute_time_expr` at the workload ``env``."""
    return sum(split_seconds(info, strategy, env, profile, tp, align).values())


def _fraction(meta: TensorMeta, p: Any, tp: int, share: tuple | None = None) -> float:
    if isinstance(p, Routed):   # a rank's rows of experts: at uniform routing, or the busiest rank's share
        return 1.0 / tp if share is None or p.tokens else max(share)
    if isinstance(p, Shard) and meta.static(p.dim) is None:
        return 1.0 / tp   # a sequence shard: about 1/tp of the tokens
    size = meta.static(p.dim) if isinstance(p, Shard) else None
    return max_local_size(size, p, tp) / size if size else 1.0


def kept_bytes(item: Kept, info: OpInfo, strategy: Strategy, env: Mapping, profile: DeviceProfile, tp: int,
               root: TensorMeta | None = None) -> float:
    """Bytes on the largest rank of one tensor ``info``'s backward keeps (:func:`.saved.kept`).
    An input is priced at its storage ``root``'s size (a view keeps the whole storage it views)
    split as the input is; an output at its own placement; a tensor made for backward split as
    the op's first input is."""
    if item.source == "new":
        nbytes = item.nbytes or element_bytes(info.inputs[0], profile.dtype_bytes)
        return evaluate(item.numel * nbytes, env) * _fraction(info.inputs[0], strategy.inputs[0], tp,
                                                               info.expert_share)
    if item.source == "output":
        outs = info.output if isinstance(info.output, tuple) else (info.output,)
        # one placement for every output where the strategy gives one (the solver's whole strategy)
        places = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,) * len(outs)
        meta, p = outs[item.index], places[item.index]
        return evaluate(bytes_expr(meta, profile.dtype_bytes), env) * _fraction(meta, p, tp, info.expert_share)
    meta, want = info.inputs[item.index], strategy.inputs[item.index]
    return evaluate(bytes_expr(root or meta, profile.dtype_bytes), env) * _fraction(meta, want, tp,
                                                                                     info.expert_share)


# ---- collectives ---------------------------------------------------------------------------------
#: (forward, backward) collective of each redistribution kind
COLLECTIVES = {
    "f": (None, "all_reduce"),
    "all_gather_f": ("all_gather", "reduce_scatter"),   # an all-gather into sharded compute (f fused in)
    "g": ("all_reduce", None),
    "all_gather": ("all_gather", None),
    "scatter": (None, "all_gather"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "reshard": ("all_gather", "all_gather"),
    "all_reduce": ("all_reduce", None),     # inside an op (vocab-parallel cross-entropy)
    "all_to_all": ("all_to_all", "all_to_all"),   # inside an op (an expert dispatch), reversed backward
    # inside an op: a row-split table read by columns (rules/nn.py's BY_COLUMNS), reversed backward
    "all_to_all_columns": ("all_to_all", "all_to_all"),
    "all_gather_rows": ("all_gather", "reduce_scatter"),   # inside an op: rows of a rank's tokens (f fused in)
    "grad_if": (None, None),      # a read of an all_gather_f made for another consumer (its copies:
    "rank_slice": (None, None),   # propagate.read_seconds)
}


def ring_volume(collective: str | None, full_bytes: Any, n: int) -> Any:
    """Bytes each rank sends in a ring collective over a tensor of ``full_bytes``."""
    if collective is None or n <= 1:
        return 0
    if collective == "all_to_all":   # each rank's 1/n share, all but 1/n of it sent
        return sympy.Rational(n - 1, n * n) * full_bytes
    return (2 if collective == "all_reduce" else 1) * sympy.Rational(n - 1, n) * full_bytes


def conversion_kinds(kind: str | None, f: bool) -> list[str]:
    """The collectives a conversion of ``kind`` (None: none) followed by an f runs: an all-gather
    into sharded compute takes the f into its backward (a reduce-scatter, not an all-reduce)."""
    if kind == "all_gather" and f is True:   # f == "apart": kept apart (see propagate.wants_f)
        return ["all_gather_f"]
    return ([kind] if kind else []) + (["f"] if f else [])


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
        elif coll == "all_to_all":
            out.append(profile.all_to_all_time(full_bytes, tp))
        else:
            out.append(profile.all_gather_time(full_bytes, tp))
    return out[0], out[1]


def collective_bytes(kind: str, full_bytes: float, tp: int, grad: bool = True) -> tuple[float, float]:
    """(forward, backward) bytes each rank sends (``grad=False``: no backward)."""
    if tp <= 1:
        return 0.0, 0.0
    share = {None: 0.0, "all_reduce": 2 * (tp - 1) / tp, "all_to_all": (tp - 1) / tp ** 2}
    fw, bw = COLLECTIVES[kind]
    return share.get(fw, (tp - 1) / tp) * full_bytes, share.get(bw if grad else None, (tp - 1) / tp) * full_bytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf


def step_breakdown(index: Any, prop: Any, profile: DeviceProfile, rank: int | None = None) -> dict[str, Any]:
    """A propagation's predicted compute at its workload, split as a profiler splits a step:
    ``products``, ``attention``, ``memory`` (memory-bound kernels and launches), ``host_reads``
    (what reads to the host cost, :meth:`DeviceProfile.host_read_time`) and ``optimizer`` seconds,
    and ``by_op``: ATen op name -> seconds (forward + backward).

    Each op on its largest rank by default (what the solver weighs: a bound on every rank's step);
    with ``rank``, each op on that rank, whose step is what a profiler of that rank sees — lower
    where uneven splits rotate their larger part from layer to layer (:func:`busiest_rank`)."""
    out = {"products": 0.0, "attention": 0.0, "memory": 0.0, "host_reads": 0.0, "optimizer": prop.update_s}
    by_op: dict[str, float] = {}
    cache: dict = {}
    for node, strat in prop.chosen.items():
        info = index.infos[node]
        key = (info.cost_key, strat)
        parts = cache.get(key)
        if parts is None:
            parts = cache[key] = split_seconds(info, strat, index.env, profile, index.tp, index.align, rank)
        for kind, seconds in parts.items():
            out[kind] += seconds
        name = op_name(info.target)
        by_op[name] = by_op.get(name, 0.0) + sum(parts.values())
    out["by_op"] = dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
    return out


def busiest_rank(index: Any, prop: Any, profile: DeviceProfile) -> tuple[int, dict[str, Any]]:
    """(rank, :func:`step_breakdown` of that rank) for the rank whose predicted forward + backward
    is the longest: the step the others wait for, at most the per-op bound of ``step_breakdown``."""
    steps = [step_breakdown(index, prop, profile, rank) for rank in range(index.tp)]
    busy = max(range(index.tp), key=lambda r: steps[r]["products"] + steps[r]["attention"] + steps[r]["memory"])
    return busy, steps[busy]
