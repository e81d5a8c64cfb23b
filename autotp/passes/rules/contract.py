"""What a rule sees of an op, what it answers, and what a localizer is handed.

:class:`OpInfo` is one op as the rules see it: its target, its arguments with tensors as
:class:`TensorMeta` (a sympy shape and a dtype), its inputs' and output's metas, tp, and the hints
a fresh shard follows (:meth:`OpInfo.fresh_shard`: fused q|k|v blocks, whole heads, tails, groups
dealt to sets of ranks, a sequence dim, :func:`along_sequence`). A rule answers with
:class:`Strategy` values: the placement each tensor input must have and the output's. A localizer
turns a global size argument into this rank's through a :class:`LocalContext`.

Values only: the registry (:mod:`.registry`) keys rules by op; the index
(:mod:`autotp.passes.propagate`) and the cost model read these values too.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ...cached_hash import cached_hash, state_without_hash
from ...placements import Placement, Shard, block_sets


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
    #: the op makes the inverse of a permutation (:func:`autotp.passes.rules.routing.makes_inverse`:
    #: ``inv[p] = arange(n)``, ``inv.scatter_(0, p, arange(n))``, ``argsort(p)``, ``sort(p)[1]``)
    inverts: bool = False
    #: an index of a stack of experts by a router's ids sorted and counted into a grouped product's
    #: ``offs`` (gpt-oss's biases, :func:`.routing.counted_pick`): the rows it picks are the product's
    counted_pick: bool = False
    #: ``k`` where the op is an index of float rows by ``p // k`` of a permutation ``p`` of ``k``
    #: times the rows (every row taken exactly ``k`` times: :func:`.gathered_rows.row_copies`); else 0
    row_copies: int = 0
    #: the number of experts where the op sorts a router's top-k ids (a ``sort``), or counts the
    #: ids such a sort sorted (a ``histc``): what a rank routing its own rows exchanges
    #: (:mod:`.local_routing`); on an index of float rows gathered for a grouped product
    #: (``gathers_expert_rows``), that product's experts (what its dispatch plans for); else 0
    routing_experts: int = 0
    #: with ``routing_experts`` on an index of float rows gathered for a grouped product
    #: (``gathers_expert_rows``): the element size of the product's ``offs`` (the cumulative rows
    #: per expert the all-to-all dispatch's split sizes are counted from, cost_model/routing)
    offs_bytes: int = 0
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
    #: the share of its MoE block's (token, expert) rows each rank's experts get under expert
    #: parallelism, per rank (``autotp.planner.expert_load``: a measured or given router load);
    #: None: a balanced router's ``1/tp``. Ops on a rank's experts' rows are priced at it
    expert_share: tuple | None = None

    @functools.cached_property
    def args_key(self) -> tuple:
        """The op's arguments (tensors as their metas) and keyword arguments, hashable."""
        return _frozen(self.args), _frozen(tuple(sorted(self.kwargs.items())))

    def forward_only(self) -> "OpInfo":
        """This op with no input carrying a gradient: what its forward alone costs (priced twice
        where activation checkpointing recomputes it, ``autotp.passes.checkpoint``)."""
        return dataclasses.replace(self, grad_inputs=tuple(False for _ in self.grad_inputs or ()))

    @property
    def cost_key(self) -> tuple:
        """Everything the cost of one strategy of this op depends on: equal across layers."""
        return (self.target, self.inputs, self.output, self.args_key, self.grad_inputs, self.train_dtype,
                self.grad_uses, self.strided_inputs, self.reads_rows, self.x_gathered, self.permutes_rows,
                self.row_copies, self.routing_experts, self.offs_bytes, self.expert_share)

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
