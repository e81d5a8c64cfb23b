"""One registry of per-op sharding rules, keyed by ATen op overload.

A rule answers, for one op and the placements its tensor inputs currently have, which
*strategies* are sound: each :class:`~.contract.Strategy` names the placement every tensor
input must have and the placement the output then has (what a rule sees and answers is
:mod:`.contract`). The planner picks the cheapest (inputs are redistributed where they differ).
A rule may also register a *localizer* that rewrites the op's arguments for a rank's local
shards (view sizes, split sizes, ...).

Adding an op is adding one decorated function to the family file it belongs to
(``matrix.py``, ``view.py``, ``pieces.py``, ``joins.py``, ``pointwise.py``, ``nn.py``,
``misc.py``). An op with no rule falls back to "replicate everything" with a warning naming it:
slower, never wrong. :func:`strategies` is the one lookup: it also answers for in-place ops by
their out-of-place twins and drops what a tail or an ``outer`` dim makes unsound.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Callable

import torch

from ...capture.program import op_name
from ...placements import REPLICATE, REPLICATE_PARTIAL_GRAD, Partial, Replicate, ReplicatePartialGrad, Routed, Shard
from .contract import LocalContext, OpInfo, Strategy

aten = torch.ops.aten

log = logging.getLogger("autotp.rules")


Rule = Callable[[OpInfo, tuple], list[Strategy]]
Localizer = Callable[[OpInfo, Strategy, tuple, dict, "LocalContext"], tuple[Any, tuple, dict]]

_RULES: dict[Any, Rule] = {}
_LOCALIZERS: dict[Any, Localizer] = {}
_warned: set[str] = set()


def register(*targets: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in targets:
            _RULES[t] = fn
        return fn

    return deco


def register_localizer(*targets: Any) -> Callable[[Localizer], Localizer]:
    def deco(fn: Localizer) -> Localizer:
        for t in targets:
            _LOCALIZERS[t] = fn
        return fn

    return deco


def replicate_all(info: OpInfo, placements: tuple) -> list[Strategy]:
    return [Strategy(tuple(REPLICATE for _ in info.inputs), replicated_output(info.output))]


def replicated_output(out: Any) -> Any:
    if out is None:
        return None
    if isinstance(out, tuple):
        return tuple(REPLICATE if o is not None else None for o in out)
    return REPLICATE


def has_rule(target: Any) -> bool:
    return target in _RULES or op_name(target) in _RULES


def mutates_first(target: Any) -> bool:
    """Whether an ATen op writes its first argument in place (``relu_``, ``masked_fill_``)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return bool(alias is not None and alias.is_write)


def aliases_first(target: Any) -> bool:
    """Whether an ATen op returns a view of its first argument (``squeeze``, ``view``,
    ``transpose``): its output shares the argument's storage, so a write to it writes both."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    arg, out = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return arg is not None and out is not None and not arg.is_write


def functional_of(target: Any) -> Any:
    """The out-of-place overload of an in-place ATen op that has a rule (``aten.relu_.default``
    -> ``aten.relu.default``), or None."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not mutates_first(target) or not name.endswith("_") or name.startswith("_"):
        return None
    base = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(base, getattr(target, "_overloadname", ""), None) if base is not None else None
    return overload if overload in _RULES else None


def _in_place(info: OpInfo, placements: tuple, functional: Any) -> list[Strategy]:
    """An in-place op without a rule of its own, by its out-of-place twin's rule: only the
    strategies that leave the tensor it writes as it is (a conversion would hand the op a copy,
    and views of the tensor would miss the update); where none does, every input replicated, the
    rewrite then writing a clone of the converted tensor."""
    found = _RULES[functional](replace(info, target=functional), placements)
    have = placements[0] if placements else None
    # nothing becomes a Partial by conversion: a strategy asking it of another input (a Partial
    # written with a replicated tensor added: Llama-4's shared expert's output, its routed sum
    # gathered) cannot run, and the fallback below can
    kept = [s for s in found if (have is None or s.inputs[0] == have)
            and all(p is None or not is_partial(w) or is_partial(p) for w, p in zip(s.inputs[1:], placements[1:]))]
    return kept or replicate_all(info, placements)


def strategies(info: OpInfo, placements: tuple) -> list[Strategy]:
    """The sound strategies for ``info`` given its inputs' current placements (None: a free
    parameter, which takes whatever placement the chosen strategy asks for)."""
    rule = _RULES.get(info.target) or _RULES.get(op_name(info.target))   # by name: a library's own op
    if rule is None and not info.inputs and info.output is None:
        return replicate_all(info, placements)   # size arithmetic (SymInt + 1): nothing to shard
    functional = functional_of(info.target) if rule is None else None
    if functional is not None:
        rule = functools.partial(_in_place, functional=functional)
    if rule is None:
        name = op_name(info.target)
        if name not in _warned:
            _warned.add(name)
            log.warning(
                "autotp: no sharding rule for %s; it runs replicated (correct, maybe slower). "
                "Register one in autotp/passes/rules/ to shard it.", name,
            )
        return replicate_all(info, placements)
    if any(isinstance(p, ReplicatePartialGrad) for p in placements):
        # whole forward: the rule's strategies for a replicated input (each then pays its
        # conversion, which only an f, already made, serves: propagate._conversion), and an op
        # that keeps the value as it is keeps its gradient a summand
        found = rule(info, tuple(REPLICATE if isinstance(p, ReplicatePartialGrad) else p for p in placements))
        if keeps_value(info) and len(placements) == 1:
            found.append(Strategy((REPLICATE_PARTIAL_GRAD,), REPLICATE_PARTIAL_GRAD))
    elif any(isinstance(p, Routed) for p in placements) and _ROUTED:
        found = _ROUTED[0](info, placements, rule)   # rows of experts: the ops that keep them routed
    else:
        found = rule(info, placements)
    if any(has_tail(p) for p in placements) or any(has_tail(p) for s in found for p in _outputs(s)):
        found = [s for s in found if tail_sound(info, s)]
    if any(has_outer(p) for p in placements) or any(has_outer(p) for s in found for p in _outputs(s)):
        found = [s for s in found if info.target in _OUTER_OPS
                 or not any(has_outer(p) for p in (*s.inputs, *_outputs(s)))]
    return found


#: ops that return their input's value as it is where the dtype asked is the input's own (a
#: copy, a cast to its own dtype): their gradient is the incoming one as it is
_VALUE_KEEPING = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                  aten.contiguous.default, aten.alias.default)


def keeps_value(info: OpInfo) -> bool:
    """Whether ``info`` is a copy or a cast to its input's own dtype: identity on each rank's
    value and on each rank's gradient summand (a cast that changes the dtype would round the
    summands apart)."""
    out = info.output
    return (info.target in _VALUE_KEEPING and len(info.inputs) == 1 and out is not None
            and not isinstance(out, tuple) and out.dtype == info.inputs[0].dtype)


#: the strategies of an op meeting a Routed (expert rows) input; rules/routed.py registers them,
#: so the registry does not import the family files above it
_ROUTED: list = []


def register_routed(strategies) -> Any:
    """Decorator: ``strategies(info, placements, rule)`` answers for ops with a Routed input."""
    _ROUTED[:] = [strategies]
    return strategies


#: the localizer of any strategy holding a Routed placement (a rank's rows of experts: they need
#: the row maps the rewrite carries); rules/routed_localizer.py registers it
_ROUTED_LOCALIZER: list = []


def register_routed_localizer(fn: Localizer) -> Localizer:
    """Decorator: the localizer for strategies with a Routed input or output."""
    _ROUTED_LOCALIZER[:] = [fn]
    return fn


def is_routed(strategy: Strategy) -> bool:
    """Whether a strategy holds a Routed placement among its inputs or outputs."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    return any(isinstance(p, Routed) for p in (*strategy.inputs, *outs))


def localizer_for(target: Any, strategy: Strategy) -> Localizer | None:
    """The localizer of ``target`` under ``strategy``: the routed one where it holds rows of experts."""
    if _ROUTED_LOCALIZER and is_routed(strategy):
        return _ROUTED_LOCALIZER[0]
    return localizer(target)


def has_outer(p: Any) -> bool:
    """A per-block shard whose blocks sit on a dim of their own: two dims differ per rank."""
    return isinstance(p, Shard) and p.outer >= 0


#: the ops whose rules place a per-block shard's ``outer`` dim (views, slices and picks of
#: Falcon's grouped heads); any other strategy that would carry one is dropped
_OUTER_OPS = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                        aten.slice.Tensor, aten.index.Tensor, aten.alias.default, aten.clone.default,
                        aten.contiguous.default, aten.detach.default))


def has_tail(p: Any) -> bool:
    """A shard holding replicated data: a tail, or blocks every rank holds whole."""
    return isinstance(p, Shard) and p.holds_whole


def _outputs(strategy: Strategy) -> tuple:
    return strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)


def tail_sound(info: OpInfo, strategy: Strategy) -> bool:
    """Whether a strategy stays exact where a placement keeps a whole tail on every rank. A
    tail is replicated data inside a shard: a sum over ranks (a Partial output, an op's own
    collectives) would count it once per rank, and so would the backward all-reduce (f) of a
    replicated float input feeding a tailed output. The column-parallel product is the one
    exception: it marks itself ``f_runs_only`` and the rewrite gives the f to the dealt runs alone."""
    if any(has_tail(p) for p in strategy.inputs) and (
            strategy.internal or any(isinstance(p, Partial) for p in _outputs(strategy))):
        return False
    if any(has_tail(p) for p in _outputs(strategy)) and not strategy.f_runs_only:
        return not any(isinstance(p, Replicate) and m.is_float for p, m in zip(strategy.inputs, info.inputs))
    return True


def localizer(target: Any) -> Localizer | None:
    return _LOCALIZERS.get(target) or _LOCALIZERS.get(op_name(target))


def registered_ops() -> list[Any]:
    return list(_RULES)


#: the ops that open or close a region of the program run under another grad or autocast mode
REGION_BOUNDS = (torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def is_shard(p: Any) -> bool:
    return isinstance(p, Shard)


def is_partial(p: Any) -> bool:
    return isinstance(p, Partial)


def is_replicate(p: Any) -> bool:
    return isinstance(p, Replicate)
