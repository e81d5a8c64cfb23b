"""One registry of per-op sharding rules, keyed by ATen op overload.

A rule answers, for one op and the placements its tensor inputs currently have, which
*strategies* are sound: each :class:`Strategy` names the placement every tensor input must
have and the placement the output then has. The planner picks the cheapest (inputs are
redistributed where they differ). A rule may also register a *localizer* that rewrites the
op's arguments for a rank's local shards (view sizes, split sizes, ...).

Adding an op is adding one decorated function to the family file it belongs to
(``matrix.py``, ``view.py``, ``pieces.py``, ``joins.py``, ``pointwise.py``, ``nn.py``,
``misc.py``). An op with no rule falls back to "replicate everything" with a warning naming it:
slower, never wrong.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import sympy
import torch

from ...cached_hash import cached_hash, state_without_hash
from ...capture.program import op_name
from ...placements import (REPLICATE, REPLICATE_PARTIAL_GRAD, Partial, Placement, Replicate, ReplicatePartialGrad,
                           Routed, Shard, block_sets)

aten = torch.ops.aten

log = logging.getLogger("autotp.rules")


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype

    __hash__ = cached_hash   # metas key the cost caches, one lookup per strategy
    __getstate__ = state_without_hash

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def static(self, dim: int) -> int | None:
        size = self.shape[dim]
        return int(size) if size.is_Integer else None

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


OutputPlacement = Any  # Placement, a tuple of them (multi-output ops), or None (non-tensor)


def along_sequence(meta: TensorMeta, dim: int, sequence: frozenset) -> bool:
    """Whether ``meta``'s ``dim`` is a sequence dim: its size is a sequence's symbol or, in a
    program that holds the length as a number (:attr:`autotp.capture.Capture.static_lengths`),
    that number. Where several dims have that number (a call whose length equals the hidden
    size), the first after the batch dim is taken for the sequence, as in ``(b, s, h)``: any
    shard the rules offer is exact, so a wrong guess costs only speed, never a result."""
    size = meta.shape[dim]
    if size not in sequence:
        return False
    if not size.is_Integer:
        return True
    same = [d for d, s in enumerate(meta.shape) if s == size]
    return dim == next((d for d in same if d >= 1), same[0])


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Placement, ...]
    output: OutputPlacement
    #: collectives the op runs inside itself (vocab-parallel loss): (kind, TensorMeta moved)
    internal: tuple = ()
    #: a column-parallel product into a tailed shard: input 0's f covers the dealt runs only
    #: (the tail's gradient is whole on every rank already), see :func:`tail_sound`
    f_runs_only: bool = False
    #: a bias add that takes its product as the product makes it: the rank adds the bias inside
    #: the product (``autotp/passes/fused_bias.py``), its own forward kernel gone
    fused: bool = False

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def __repr__(self) -> str:
        return f"{list(self.inputs)} -> {self.output}"


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass
class OpInfo:
    """What a rule sees of one op: its target, arguments (tensors replaced by
    :class:`TensorMeta`), its tensor inputs in argument order, and its output's meta."""

    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    output: Any  # TensorMeta, a tuple of them, or None
    tp: int
    #: dim -> (chunks, unit[, rotate[, tail[, grouped[, sizes[, whole]]]]])
    hints: dict[int, tuple] = field(default_factory=dict)
    uneven: bool = False   # may a fresh shard leave some ranks one atom more?
    #: symbols of sequence dims: the one dynamic size a fresh shard may split (sequence
    #: parallelism); never the batch, which may be smaller than tp. In a program that holds the
    #: length as a number (Capture.static_lengths), that number (:func:`along_sequence`)
    sequence: frozenset = frozenset()
    #: sequence parallelism forced (``sequence_parallel=True``): an add that can take a Partial
    #: operand reduce-scattered along the sequence offers nothing that all-reduces it whole
    force_sequence: bool = False
    #: an index by a constant list: (indexed dim, its non-negative positions); None otherwise
    picks: tuple | None = None
    #: an index gathering rows (``h[idx]``) read by one grouped product of experts alone (through
    #: casts): its rows are the product's, sorted by expert, so a rank can gather its own alone
    gathers_expert_rows: bool = False
    #: this op, placed to run a rank's own experts' rows alone where its inputs hold every row,
    #: reads their count on the host (:func:`autotp.passes.rules.row_reads.reads_rows`)
    reads_rows: bool = False
    #: an index of float rows by a permutation of them (``x[inv_perm]``: transformers' inverse of
    #: the sort by expert, :func:`autotp.passes.rules.routing.is_permutation`): its backward is a
    #: gather by the inverse permutation, not a scatter-add (the rank's program runs it so)
    permutes_rows: bool = False
    #: an index of a stack of experts by a router's ids sorted and counted into a grouped product's
    #: ``offs`` (gpt-oss's biases, :func:`.routing.counted_pick`): the rows it picks are the product's
    counted_pick: bool = False
    #: ``k`` where the op is an index of float rows by ``p // k`` of a permutation ``p`` of ``k``
    #: times the rows (every row taken exactly ``k`` times: :func:`.gathered_rows.row_copies`); else 0
    row_copies: int = 0
    #: the number of experts where the op sorts a router's top-k ids (a ``sort``), or counts the
    #: ids such a sort sorted (a ``histc``): what a rank routing its own rows exchanges
    #: (:mod:`.local_routing`); else 0
    routing_experts: int = 0
    #: a grouped product whose x is rows gathered for it alone (``gathers_expert_rows``), or a
    #: cast between them: routed, those are the product's own experts' rows, which only its
    #: expert-parallel strategies can take (routed through the casts)
    x_gathered: bool = False
    #: hints for a fresh shard of an input's dim, (input index, dim) -> as ``hints``: a product's
    #: contracted features read off how x was made (heads x head_dim: whole heads)
    input_hints: dict[tuple[int, int], tuple] = field(default_factory=dict)
    #: what the cost model needs beyond the shapes (set by the graph index): whether each tensor
    #: input carries a gradient back, the dtype the model trains in (its parameters'), and how many
    #: uses send a gradient back into the output (autograd sums them: one kernel each past the first)
    grad_inputs: tuple | None = None
    train_dtype: Any = None
    grad_uses: int = 1
    #: which tensor inputs are strided views (a transpose, an expand, a slice of an inner dim):
    #: an elementwise kernel on one takes PyTorch's slower non-vectorized path
    strided_inputs: tuple = ()
    #: an in-place op whose written input nothing else reads (not a view, not a program input,
    #: no other user: a ``zeros`` buffer filled by ``copy_``): it may be converted for the op, no
    #: update is lost, since the op's own output is what is read after
    writes_alone: bool = False

    @functools.cached_property
    def args_key(self) -> tuple:
        """The op's arguments (tensors as their metas) and keyword arguments, hashable."""
        return _frozen(self.args), _frozen(tuple(sorted(self.kwargs.items())))

    @property
    def cost_key(self) -> tuple:
        """Everything the cost of one strategy of this op depends on: equal across layers."""
        return (self.target, self.inputs, self.output, self.args_key, self.grad_inputs, self.train_dtype,
                self.grad_uses, self.strided_inputs, self.reads_rows, self.x_gathered, self.permutes_rows)

    def hint(self, dim: int) -> tuple[int, int, int, int, bool, tuple, tuple]:
        """(chunks, unit, rotate, tail, grouped, sizes, whole) a fresh shard of output ``dim`` should use
        (fused q/k/v: 3 blocks of heads; rotate: which rank takes the first run of atoms; tail: atoms at
        the end of each block kept whole, a fused multi-query k and v; grouped: the blocks are
        groups of heads sharing a k and v, which may be dealt to sets of ranks, as a tail's are;
        sizes: the relative sizes of blocks of unequal size, Phi-3's q|k|v of fewer kv heads, taken
        first where tp can deal their groups; ``chunks`` and ``tail`` then say the layout taken where
        it cannot: equal blocks of their common size (``chunks = sum(sizes)``), or one block whose
        k and v stay whole (a tail, a split's q | k | v: GPT-BigCode's multi-query layout)); whole:
        blocks of ``sizes`` every rank holds whole (Mamba2's one group of B and C))."""
        return self._full(self.hints.get(dim, (1, 1)))

    def input_hint(self, input_index: int, dim: int) -> tuple[int, int, int, int, bool, tuple, tuple]:
        """As :meth:`hint`, for a fresh shard of input ``input_index``'s ``dim``."""
        return self._full(self.input_hints.get((input_index, dim), (1, 1)))

    @staticmethod
    def _full(h: tuple) -> tuple[int, int, int, int, bool, tuple, tuple]:
        h = tuple(h)
        return h + (1, 1, 0, 0, False, (), ())[len(h):]

    def fresh_shard(self, dim: int) -> Shard | None:
        """A shard of output ``dim`` following the hint, or None if the dim cannot be split tp ways."""
        return self.fresh_shard_of(None, dim)

    def fresh_shard_of(self, input_index: int | None, dim: int) -> Shard | None:
        """Like :meth:`fresh_shard`, for input ``input_index``'s ``dim`` (None: the output)."""
        out = self.output if input_index is None else self.inputs[input_index]
        size = out.static(dim)
        if size is None:
            # A sequence dim's size is known only at run time: a plain shard in contiguous runs,
            # uneven whenever tp does not divide that call's length.
            return Shard(dim) if self.uneven and out.shape[dim] in self.sequence else None
        if along_sequence(out, dim, self.sequence):
            # a length the program holds as a number: a plain shard too, never a hint's blocks
            return Shard(dim) if size >= self.tp and (self.uneven or size % self.tp == 0) else None
        chunks, unit, rotate, tail, grouped, sizes, whole = (self.hint(dim) if input_index is None
                                                             else self.input_hint(input_index, dim))
        if sizes and size % (sum(sizes) * unit) == 0:
            # blocks of unequal size (q heads | fewer k | v heads) dealt in groups (a kv head with
            # its query heads): every rank holds its run of query heads with the key/value heads
            # they use, nothing replicated. Where tp does not divide the groups, the first ranks
            # take one more (uneven); where there are fewer groups than ranks, the hint's
            # fallback below: k and v whole on every rank (a tail) or equal blocks of the
            # common size (whose k and v attention gathers).
            per = size // (sum(sizes) * unit)
            if per % self.tp == 0 or (self.uneven and per > self.tp):
                return Shard(dim, len(sizes), unit, rotate % self.tp if per % self.tp else 0, sizes=sizes,
                             whole=whole)
        if size % (chunks * unit) or size // (chunks * unit) <= tail:
            chunks, unit, tail, grouped = 1, 1, 0, False
        dealt = size // (chunks * unit) - tail
        if dealt < self.tp:
            return self._per_block_shard(dim, chunks, unit, rotate, tail, dealt) if tail or grouped else None
        if dealt % self.tp == 0:
            rotate = 0                      # even: nothing to balance
        elif not self.uneven:
            return None
        return Shard(dim, chunks, unit, rotate % self.tp, tail)

    def _per_block_shard(self, dim: int, chunks: int, unit: int, rotate: int, tail: int,
                         dealt: int) -> Shard | None:
        """Fewer query heads in a group than ranks, and fewer groups than ranks (Falcon's new
        layout at 2 groups of 4 heads, tp=8): each group dealt to its own set of ranks, its
        query heads among them and its k and v whole on each (a tail); the output projection's
        rows, grouped the same way, follow. Every rank gets at least one atom; uneven sets or
        runs only if ``uneven``."""
        if not 1 < chunks < self.tp:
            return None
        sets = [count for _, count in block_sets(chunks, self.tp)]
        if max(sets) > dealt:
            return None                     # a rank of the largest set would hold no atom
        even = len(set(sets)) == 1 and dealt % sets[0] == 0
        if not even and not self.uneven:
            return None
        return Shard(dim, chunks, unit, 0 if even else rotate % self.tp, tail, per_block=True)


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


class LocalContext:
    """How a localizer turns a global size argument into this rank's local size.

    ``local(arg, size, shard)``: ``arg`` is the op's argument for a dimension of global
    ``size`` that is now sharded by ``shard``; returns the argument to pass locally (an int,
    -1 kept as is, or — in a graph — a node computing it)."""

    def __init__(self, tp: int, rank: int, group: Any = None):
        self.tp = tp
        self.rank = rank
        self.group = group   # the TP process group, for ops that communicate inside themselves

    def local(self, arg: Any, size: Any, shard: Shard) -> Any:
        from ...placements import local_size

        if isinstance(arg, int) and arg == -1:
            return -1
        if isinstance(arg, int):
            return local_size(arg, shard, self.tp, self.rank)
        if isinstance(size, sympy.Expr) and size.is_Integer:
            return local_size(int(size), shard, self.tp, self.rank)
        raise NotImplementedError(f"cannot localize symbolic size argument {arg!r} sharded by {shard}")

    def size(self, expr: Any) -> Any:
        """A global size as an argument: an int, or — in a graph — a node computing it."""
        if isinstance(expr, sympy.Expr) and expr.is_Integer:
            return int(expr)
        raise NotImplementedError(f"cannot compute the dynamic size {expr} outside a graph")


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

