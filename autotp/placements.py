"""Placements of a tensor on the tensor-parallel group.

A tensor is ``Replicate()`` (every rank holds all of it), ``Partial()`` (every rank holds a
summand; the value is the sum over ranks) or ``Shard(dim, chunks, unit)``.

``Shard`` covers GPT-2's traps in one description. The sharded dimension is viewed as ``chunks``
equal blocks laid side by side (q, k and v in a fused ``c_attn``: chunks=3); each block is cut
into atoms of ``unit`` elements (one attention head: unit=head_dim) and the atoms are dealt to
the ranks in contiguous runs, the first ``n_atoms % tp`` ranks taking one atom more. With
chunks=1 and unit=1 this is the plain contiguous shard; when tp divides the atoms every rank
holds the same amount (an even shard). ``rotate`` shifts which rank takes which run (rank r
takes run ``(r + rotate) % tp``): layers of an uneven model rotate their extra head around the
ranks so that every rank ends up holding the same number of parameters.

``tail`` keeps the last ``tail`` atoms of every block whole on every rank: multi-query and
grouped-query attention with fewer key/value heads than ranks, fused into one projection
(GPT-BigCode's ``c_attn`` = q heads | k | v, Falcon's groups of query heads | k | v). The query
heads are dealt as above and each rank holds its run followed by the block's k and v. Every
element a rank holds is still the same element of the whole tensor, so slicing, gathering and
checkpoints work from :func:`local_ranges` alone; only sums over ranks must take the tail once.

``per_block`` deals the blocks, not their atoms, to the ranks first: with fewer blocks than ranks
(Falcon's new layout, 2 groups of 4 query heads with their k and v at tp=8) the ranks are cut
into one consecutive set per block (sets as even as atoms are dealt: 3, 3, 2 ranks for 3 blocks
at tp=8), and each block's atoms are dealt among its own set's ranks, its tail whole on each of
them. A rank then holds one block's run and tail: ranks 0-3 group 0's query heads one each with
group 0's k and v, ranks 4-7 group 1's. Where a view splits the blocks onto a dim of their own
(``[..., groups, heads + 2, head_dim]``), ``outer`` names that dim: the shard's own dim then
holds one block, and every rank holds one entry of dim ``outer``, its set's block.

``sizes`` gives blocks of unequal size: the blocks' relative sizes, in order (a fused q|k|v of
grouped-query attention, 40 query heads beside 10 key and 10 value heads: ``sizes=(4, 1, 1)``,
``chunks=3``, shown ``S(0x4:1:1/128)``). The dim is ``sum(sizes)`` equal parts, block ``i``
taking ``sizes[i]`` of them. Reduced by their gcd, the sizes are one group: ``sizes[i]`` atoms
of block ``i`` (4 query heads and the key and value head they share), and each block holds
``per`` groups, one per part. The groups are dealt to the ranks as atoms are, the same run of
every block, so a rank holds a run of the query heads and the key/value heads they use
(Megatron's layout of a fused grouped projection); where tp does not divide the groups (10 kv
heads at tp=8) the first ranks take one group more: rank 0 holds query heads 0-7 with kv heads
0-1, rank 7 query heads 36-39 with kv head 9. Equal blocks are the case ``sizes = (1, ..., 1)``
(a group is one atom of each block), which is why equal sizes are written as plain ``chunks``.
No tail, and no per-block dealing, with it.

``whole`` names blocks of unequal size that every rank holds whole, among dealt ones: Mamba2's
in-projection ``[z | x | B | C | dt]`` of one group of B and C (every published Bamba, Falcon-H1,
Granite-4.0-H), whose heads' z, x and dt are dealt while every head reads the one B and C. A whole
block is ``sizes[i] * per * unit`` elements as any block (``per`` the groups dealt), shown in
brackets: ``S(0x64:64:[1]:[1]:1)`` is 128 heads of 64 with a state of 128. Like a tail it is
replicated data inside a shard: every rank holds the same elements, its gradient whole on each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Union

from .cached_hash import cached_hash, state_without_hash


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand; the value is the sum over the TP group."""

    def __repr__(self) -> str:
        return "P"


@dataclass(frozen=True)
class ReplicatePartialGrad:
    """Replicate forward, its gradient a summand: every rank holds the whole tensor, computed by
    ops linear in a tensor that passed an f (Megatron's copy into the tensor-parallel region),
    so the gradient a rank sends back through it is its own summand, which that f sums. The rows
    of the tokens gathered for an expert product (``h[perm // k]``, ``[T*k, h]``): the f sits on
    the tokens ``[T, h]`` before the gather, k times fewer bytes summed than an f on the rows;
    the gather's backward (a scatter-add, linear) carries each rank's summand to it.

    Only sharded compute (whose f it stands for) and ops that keep the value as it is (a cast to
    its own dtype, a copy) read it; replicated compute would send back a whole gradient from
    every rank, which the f would count once per rank: no conversion to ``Replicate`` without
    an f where a gradient flows (autotp/passes/propagate.py)."""

    def __repr__(self) -> str:
        return "R(grad P)"


@dataclass(frozen=True)
class Routed(Partial):
    """The rows along ``dim`` of (token, expert) pairs under expert parallelism, each held by the
    one rank that holds its expert, *compactly*: a rank's local tensor has its own rows alone
    (their global ids in a row map the rewrite carries, autotp/distributed/experts.py). Scattered
    into zeros, the ranks' rows sum to the whole tensor, as any Partial's pieces do (a g makes
    it Replicate); unlike one, a row's holder has its exact value, so any op on rows alone (an
    activation, a product with a replicated factor, the next expert product) runs on a rank's
    rows with no collective (see autotp/passes/rules/routed.py).

    ``span`` > 1: the row ids count over ``span`` dims from ``dim`` on (``[tokens, top_k, ...]``,
    a view of the rows), which a sum over the inner ones combines into a Partial.

    ``tokens``: the rows are held by the rank that holds their *token* (a sequence split,
    ``[b, s/tp, h]`` flattened to the rank's ``b`` runs of ``s/tp`` rows), not by their expert's
    rank: an expert product reading them first sends each row to its expert's rank (an
    all-to-all dispatch, autotp/distributed/experts.py). The same rows where a view merges the
    batch with a dim split by head (Mamba2's ``[b, h, d, n] -> [b*h, d, n]``): each held by the
    rank of its head; ``unit``: the atoms of the shard merged (``Shard(1, unit=u)``, laid out as
    a plain one), which a view splitting the rows back returns.

    ``sent``: rows held by their experts' ranks that the dispatch sent there from their tokens'
    ranks; the reverse all-to-all, which needs the dispatch's plan, may send them back (the
    combine on the tokens' ranks).

    ``reordered`` (with ``tokens``): rows held by their tokens' ranks that are not the rank's
    tokens in sequence order (a reorder's, the combine's): made whole, they are scattered into
    zeros and summed, where the rank's tokens in sequence order are all-gathered along it.

    ``own`` (with ``tokens``): the (token, expert) rows of the rank's own tokens routed by the rank
    alone (autotp/distributed/expert_routing.py): its flat top-k ids and weights, their sort by
    expert and what is computed from it, in an order of the rank's own making, and index values
    that are *local* positions among them. No collective makes them whole: only the ops of the
    local routing read them (autotp/passes/rules/local_routing.py).

    ``ascending`` (with ``reordered``): the rows lie in ascending order of their global ids, each
    token's rows together in top-k order (a rank's rows put back in its tokens' order by the
    inverse of its own sort, ``out[inv]``): a token's rows are summed as they lie
    (``token_sums_in_order``), where rows in another order are sorted by id and gathered first
    (``token_sums``).

    ``alone`` (with ``reordered``): the rank's tokens' rows put in the order of its own routing
    (``h[perm // k]`` by its own sort's positions, for a grouped product): where that product
    sends them to their experts' ranks, the dispatch's split sizes and plan come from the counts
    the rank's sort exchanged (``local_dispatch_sizes``, ``local_dispatch_plan``), not from every
    row sorted whole (``dispatch_sizes``, ``dispatch_plan``). The same rows, held and converted
    alike: the mark says which of the two the dispatching product is priced with
    (``cost_model/routing.dispatch_work``), and is not printed. With ``sent``: rows such a
    dispatch sent, whose plan sends them back into the order they left in with no gather of the
    rank's own rows (``DispatchPlan.order`` None): the combine back is priced so
    (``propagate.sends_own_order``).

    ``heads`` (with ``tokens``; 0: none): rows a merge made of dims ending in a static dim of
    that many entries split by head (Gated DeltaNet's ``[b, s, heads, d] -> [b*s*heads, d]``),
    each held by the rank of its head whatever the dims merged before it hold, the sequence
    included: a view may split them back along those dims (``token_split``), where rows of a
    sequence split (``[b, s/tp, h] -> [b*s, h]``) are held by their position along it. Printed
    as ``by 4 heads``."""

    dim: int = 0
    span: int = 1
    tokens: bool = False
    sent: bool = False
    reordered: bool = False
    unit: int = 1
    own: bool = False
    ascending: bool = False
    alone: bool = False
    heads: int = 0

    def __post_init__(self) -> None:
        if self.heads and not self.tokens:
            raise ValueError("Routed.heads says rows a merge made of a dim split by head: tokens=True")
        if self.heads < 0:
            raise ValueError(f"Routed.heads counts the heads merged (0: none), got {self.heads}")
        if self.own and not self.tokens:
            raise ValueError("Routed.own says rows a rank routed from its own tokens: tokens=True")
        if self.tokens and self.sent:
            raise ValueError("Routed rows are held by their tokens' ranks or were sent to their experts', not both")
        if self.reordered and not self.tokens:
            raise ValueError("Routed.reordered says how rows held by their tokens' ranks are ordered: tokens=True")
        if self.ascending and not self.reordered:
            raise ValueError("Routed.ascending says rows reordered lie in their ids' order: reordered=True")
        if self.alone and not (self.reordered or self.sent):
            raise ValueError("Routed.alone says rows reordered by a rank's own routing, or sent by its dispatch: "
                             "reordered=True or sent=True")

    def __repr__(self) -> str:
        kind = "tokens" if self.tokens else "sent" if self.sent else "routed"
        rows = f"{self.dim}" if self.span == 1 else f"{self.dim}:{self.dim + self.span}"
        unit = f"/{self.unit}" if self.unit != 1 else ""
        flags = "".join(f", {name}" for name in ("reordered", "ascending", "own") if getattr(self, name))
        flags += f", by {self.heads} heads" if self.heads else ""
        return f"P({kind} {rows}{unit}{flags})"


@dataclass(frozen=True)
class Shard:
    dim: int
    chunks: int = 1
    unit: int = 1
    rotate: int = 0
    tail: int = 0    # atoms at the end of every block that every rank holds whole
    per_block: bool = False   # each block dealt to its own set of ranks (fewer blocks than ranks)
    outer: int = -1  # per_block only: the dim whose entries are the blocks (-1: blocks on ``dim``)
    sizes: tuple = ()   # the blocks' relative sizes where they differ (q|k|v of 40|10|10 heads: (4, 1, 1))
    whole: tuple = ()   # indices of blocks of ``sizes`` every rank holds whole (Mamba2's one B and C)

    def __post_init__(self) -> None:
        if self.whole:
            whole = tuple(sorted({int(i) for i in self.whole}))
            sizes = tuple(self.sizes) or (1,) * self.chunks
            if len(sizes) != self.chunks or whole[0] < 0 or whole[-1] >= self.chunks or len(whole) == self.chunks \
                    or min(sizes) < 1 or self.tail or self.per_block:
                raise ValueError(f"Shard.whole {whole} needs indices of blocks ({self.chunks}, one dealt), "
                                 f"positive sizes, no tail and no per-block dealing")
            g = math.gcd(*sizes)
            # kept even where the sizes are equal: which blocks are whole needs them spelled out
            object.__setattr__(self, "whole", whole)
            object.__setattr__(self, "sizes", tuple(x // g for x in sizes))
        elif self.sizes:
            sizes = tuple(int(x) for x in self.sizes)
            if len(sizes) != self.chunks or min(sizes) < 1 or self.tail or self.per_block:
                raise ValueError(f"Shard.sizes {sizes} needs one positive size per block ({self.chunks}), "
                                 f"no tail and no per-block dealing")
            g = math.gcd(*sizes)
            # the same blocks compare equal however they are spelled; equal blocks are plain chunks
            object.__setattr__(self, "sizes", () if len(set(sizes)) == 1 else tuple(x // g for x in sizes))
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be normalized to >= 0, got {self.dim}")
        if self.chunks < 1 or self.unit < 1 or self.tail < 0:
            raise ValueError(f"Shard chunks and unit must be >= 1 and tail >= 0, got "
                             f"{self.chunks}, {self.unit}, {self.tail}")
        if self.outer >= 0 and (not self.per_block or self.outer == self.dim):
            raise ValueError(f"Shard.outer={self.outer} needs per_block and a dim other than {self.dim}")

    __hash__ = cached_hash   # placements key the solver's states, hashed per transition
    __getstate__ = state_without_hash

    def __repr__(self) -> str:
        extra = ""
        if self.sizes:
            extra += "x" + ":".join(f"[{x}]" if i in self.whole else str(x) for i, x in enumerate(self.sizes))
        elif self.chunks != 1:
            extra += f"x{self.chunks}"
        if self.unit != 1:
            extra += f"/{self.unit}"
        if self.rotate:
            extra += f"@{self.rotate}"
        if self.tail:
            extra += f"+{self.tail}"
        if self.per_block:
            extra += " per block" if self.outer < 0 else f" per block of dim {self.outer}"
        return f"S({self.dim}{extra})"

    def with_dim(self, dim: int) -> "Shard":
        return replace(self, dim=dim)

    def with_blocks(self, dim: int, chunks: int, unit: int) -> "Shard":
        """The same dealing of atoms to ranks, described on another dim or block structure
        (blocks of unequal size keep their sizes: only their dim and atom may change)."""
        if self.sizes and chunks != self.chunks:
            raise ValueError(f"{self!r}: blocks of unequal size cannot be regrouped into {chunks}")
        return replace(self, dim=dim, chunks=chunks, unit=unit)

    @property
    def holds_whole(self) -> bool:
        """Whether every rank holds some of the dim whole (a tail, or whole blocks): replicated
        data inside a shard, which a sum over ranks would count once per rank."""
        return bool(self.tail or self.whole)

    def without_tail(self) -> "Shard":
        """The dealt part alone: what a rank holds of each block's leading atoms."""
        return replace(self, tail=0)

    @property
    def blocks_in_dim(self) -> int:
        """Blocks laid side by side along ``dim`` itself (one where ``outer`` holds them)."""
        return 1 if self.outer >= 0 else self.chunks

    @property
    def parts(self) -> int:
        """Equal parts the dim is cut into before atoms: the blocks, or where their sizes differ
        the sum of their relative sizes (a dim splits this way when ``parts * unit`` divides it)."""
        return sum(self.sizes) if self.sizes else self.blocks_in_dim


Placement = Union[Replicate, Shard, Partial, ReplicatePartialGrad]   # Routed is a Partial
REPLICATE = Replicate()
PARTIAL = Partial()
REPLICATE_PARTIAL_GRAD = ReplicatePartialGrad()


def atoms_per_chunk(size: int, shard: Shard) -> int:
    """How many atoms one block deals out to the ranks (its tail, held whole, not counted);
    raises if the dimension does not factor, or its blocks differ in size (:func:`block_atoms`)."""
    if shard.sizes:
        raise ValueError(f"{shard!r} has blocks of unequal size: see block_atoms")
    if not divides(size, shard):
        raise ValueError(
            f"dimension of size {size} does not split into {shard.blocks_in_dim} blocks of "
            f"{shard.unit}-element atoms" + (f" ending in {shard.tail} whole ones" if shard.tail else "")
        )
    return size // (shard.blocks_in_dim * shard.unit) - shard.tail


def divides(size: int, shard: Shard) -> bool:
    """Whether ``size`` factors as the shard says. A block of a per-block shard may be all tail
    (k picked out of each group: every rank of a set holds its block's whole)."""
    n = shard.parts * shard.unit
    if size % n:
        return False
    return not shard.tail or size // n > shard.tail or (shard.per_block and size // n == shard.tail)


def block_atoms(size: int, shard: Shard) -> tuple[int, ...]:
    """The atoms each block of the dim deals out to the ranks (tails not counted), in order."""
    if not shard.sizes:
        return (atoms_per_chunk(size, shard),) * shard.blocks_in_dim
    if not divides(size, shard):
        raise ValueError(f"dimension of size {size} does not split into blocks of {shard.sizes} parts of "
                         f"{shard.unit}-element atoms")
    per = size // (shard.parts * shard.unit)
    return tuple(x * per for x in shard.sizes)


def block_bounds(size: int, shard: Shard) -> tuple[tuple[int, int], ...]:
    """The [start, stop) of each block of the dim (blocks side by side on it)."""
    out, at = [], 0
    for n in block_atoms(size, shard):
        stop = at + (n + shard.tail) * shard.unit
        out.append((at, stop))
        at = stop
    return tuple(out)


def block_sets(chunks: int, tp: int) -> tuple[tuple[int, int], ...]:
    """A per-block shard's (first rank, ranks) for each block: consecutive sets, dealt like atoms."""
    return _runs(tp, chunks)


def _position(shard: Shard, tp: int, rank: int) -> tuple[int, int, int]:
    """(block, position in its set, set size) of ``rank`` under a per-block shard."""
    effective = (rank + shard.rotate) % tp
    for block, (first, count) in enumerate(block_sets(shard.chunks, tp)):
        if first <= effective < first + count:
            return block, effective - first, count
    raise AssertionError("unreachable: the sets cover every rank")


def _run(size: int, shard: Shard, tp: int, rank: int) -> tuple[int, int, int]:
    """(block, first atom, atoms) of ``rank``'s run; block -1: every block (an ordinary shard)."""
    n_atoms = atoms_per_chunk(size, shard)
    if shard.per_block:
        block, position, ranks = _position(shard, tp, rank)
        start, count = _runs(n_atoms, ranks)[position]
        return block, start, count
    start, count = _runs(n_atoms, tp)[(rank + shard.rotate) % tp]
    return -1, start, count


def outer_block(shard: Shard, tp: int, rank: int) -> int:
    """The entry of dim ``outer`` (the block) that ``rank`` holds under a per-block shard."""
    return _position(shard, tp, rank)[0]


def _runs(n_atoms: int, tp: int) -> tuple[tuple[int, int], ...]:
    """:func:`_atom_runs`, cached (the planner asks tens of thousands of times), but computed
    afresh inside a torch.compile trace of a rank program, where dynamo warns on every call of
    an ``lru_cache`` function."""
    import torch

    if torch.compiler.is_compiling():
        return _atom_runs.__wrapped__(n_atoms, tp)
    return _atom_runs(n_atoms, tp)


@lru_cache(maxsize=None)
def _atom_runs(n_atoms: int, tp: int) -> tuple[tuple[int, int], ...]:
    # not divmod: dynamo refuses it on a symbolic length (a sequence split under torch.compile)
    base, extra = n_atoms // tp, n_atoms % tp
    runs, start = [], 0
    for rank in range(tp):
        count = base + (1 if rank < extra else 0)
        runs.append((start, count))
        start += count
    return tuple(runs)


def resharded_by_all_to_all(have: "Placement", want: "Placement") -> bool:
    """Whether a tensor split as ``have`` becomes split as ``want`` by one all-to-all
    (:func:`autotp.distributed.collectives.reshard_tp`): two splits, of different dims or of one
    dealt two ways (heads one by one, then in pairs), each rank's part a set of runs that one rank
    alone holds (chunks, unit, rotate and unequal blocks dealt as they are; no tail or block held
    whole by every rank, no per-block dealing). Each rank then sends every other rank the runs of
    its part that rank wants (1/tp of its part, between dims), where a gather would make the
    whole tensor on every rank and cut it. Others are gathered and cut."""
    return (isinstance(have, Shard) and isinstance(want, Shard)
            and not any(p.holds_whole or p.per_block or p.outer >= 0 for p in (have, want)))


def is_even(size: int, shard: Shard, tp: int) -> bool:
    return all(n % tp == 0 for i, n in enumerate(block_atoms(size, shard)) if i not in shard.whole)


def groups_per_block(size: int, shard: Shard) -> int:
    """The groups each block of unequal size holds (``per``: block ``i`` is ``sizes[i] * per``
    atoms); of equal blocks, their atoms."""
    if not shard.sizes:
        return atoms_per_chunk(size, shard)
    if not divides(size, shard):
        raise ValueError(f"dimension of size {size} does not split into blocks of {shard.sizes} parts of "
                         f"{shard.unit}-element atoms")
    return size // (shard.parts * shard.unit)


def _sized_ranges(size: int, shard: Shard, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """:func:`local_ranges` of blocks of unequal size: the groups dealt in runs, the same run
    of every block (``sizes[i]`` atoms of block ``i`` per group)."""
    start, count = _runs(groups_per_block(size, shard), tp)[(rank + shard.rotate) % tp]
    out = []
    for i, ((a, b), n) in enumerate(zip(block_bounds(size, shard), shard.sizes)):
        width = n * shard.unit   # one group's elements in this block
        if i in shard.whole:
            out.append((a, b))
        elif count:
            out.append((a + start * width, a + (start + count) * width))
    return tuple(out)


def block_local_sizes(size: int, shard: Shard, tp: int, rank: int) -> tuple[int, ...]:
    """The elements ``rank`` holds of each block of a shard whose blocks lie side by side on
    its dim (no tail, no per-block dealing), in order: its local tensor is these one after another."""
    if shard.tail or shard.per_block:
        raise ValueError(f"{shard!r}: a tail or per-block dealing holds more than runs of its blocks")
    per = groups_per_block(size, shard)
    _, count = _runs(per, tp)[(rank + shard.rotate) % tp]
    return tuple((per if i in shard.whole else count) * n * shard.unit
                 for i, n in enumerate(shard.sizes or (1,) * shard.chunks))


def local_size(size: int, shard: Shard, tp: int, rank: int) -> int:
    """Elements of the sharded dimension held by ``rank``."""
    if shard.sizes:
        return sum(b - a for a, b in _sized_ranges(size, shard, tp, rank))
    block, _, count = _run(size, shard, tp, rank)
    blocks = 1 if block >= 0 else shard.chunks
    return blocks * (count + shard.tail) * shard.unit


def max_local_size(size: int, shard: Shard, tp: int) -> int:
    return max(local_size(size, shard, tp, r) for r in range(tp))


def local_ranges(size: int, shard: Shard, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) index ranges of the full dimension that ``rank`` holds, in local order."""
    if shard.sizes:
        return _sized_ranges(size, shard, tp, rank)
    n_atoms = atoms_per_chunk(size, shard)
    held, start, count = _run(size, shard, tp, rank)
    block = size // shard.blocks_in_dim
    out = []
    for c in range(shard.blocks_in_dim):
        if held >= 0 and shard.outer < 0 and c != held:
            continue   # a per-block shard: this rank's set holds one block
        if count:
            out.append((c * block + start * shard.unit, c * block + (start + count) * shard.unit))
        if shard.tail:
            out.append((c * block + n_atoms * shard.unit, (c + 1) * block))
    return tuple(out)


def owned_ranges(size: int, shard: Shard, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The ranges of :func:`local_ranges` that ``rank`` owns: its runs, and the blocks' tails on
    rank 0 alone. Every element of the dim is owned by exactly one rank (a norm or a checksum
    over ranks sums these)."""
    ranges = local_ranges(size, shard, tp, rank)
    if shard.whole:   # whole blocks: rank 0's
        whole = {block_bounds(size, shard)[i] for i in shard.whole}
        return ranges if rank == 0 else tuple(r for r in ranges if r not in whole)
    if shard.tail and shard.per_block:
        owner = _position(shard, tp, rank)[1] == 0   # a block's tail: the first rank of its set
    else:
        owner = rank == 0
    if not shard.tail or owner:
        return ranges
    n_atoms = atoms_per_chunk(size, shard)
    return tuple((a, b) for a, b in ranges if (a % (size // shard.blocks_in_dim)) < n_atoms * shard.unit)


@lru_cache(maxsize=4096)
def layout(size: int, shard: Shard, tp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Canonical per-rank ranges (adjacent ranges merged): two shards with equal layouts
    hold the same elements on every rank, whatever their chunks and unit say."""
    out = []
    for rank in range(tp):
        merged: list[list[int]] = []
        for a, b in local_ranges(size, shard, tp, rank):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        out.append(tuple((a, b) for a, b in merged))
    return tuple(out)


def same_placement(a: Placement | None, b: Placement | None, size: int | None, tp: int) -> bool:
    """Whether two placements hold the same data on every rank (sizes compared by layout)."""
    if a == b:
        return True
    if isinstance(a, Shard) and isinstance(b, Shard) and (a.outer >= 0 or b.outer >= 0):
        return False   # the dim's layout alone does not say which block (entry of outer) a rank holds
    if isinstance(a, Shard) and isinstance(b, Shard) and a.dim == b.dim and isinstance(size, int):
        if not (divides(size, a) and divides(size, b)):
            return False
        return layout(size, a, tp) == layout(size, b, tp)
    return False


#: ``Routed``'s flags, as a plan file names them (absent: False)
ROUTED_FLAGS = ("tokens", "sent", "reordered", "own", "ascending", "alone")


def to_json(p: Placement) -> dict:
    """A placement as a plan file holds it: every field that differs from its default (so
    ``from_json(to_json(p)) == p`` for every placement, and a file written before a field
    existed reads as that field's default)."""
    if isinstance(p, Shard):
        out = {"kind": "shard", "dim": p.dim, "chunks": p.chunks, "unit": p.unit, "rotate": p.rotate}
        if p.tail:
            out["tail"] = p.tail
        if p.per_block:
            out["per_block"] = True
        if p.outer >= 0:
            out["outer"] = p.outer
        if p.sizes:
            out["sizes"] = list(p.sizes)
        if p.whole:
            out["whole"] = list(p.whole)
        return out
    if isinstance(p, Routed):
        # every field, a default left out (a file written before a field existed reads as its default)
        out = {"kind": "partial", "routed": p.dim}
        if p.span != 1:
            out["span"] = p.span
        if p.unit != 1:
            out["unit"] = p.unit
        if p.heads:
            out["heads"] = p.heads
        out.update({flag: True for flag in ROUTED_FLAGS if getattr(p, flag)})
        return out
    if isinstance(p, Partial):
        return {"kind": "partial"}
    if isinstance(p, ReplicatePartialGrad):
        return {"kind": "replicate", "grad": "partial"}
    return {"kind": "replicate"}


def from_json(d: dict) -> Placement:
    kind = d.get("kind")
    if kind == "shard":
        return Shard(int(d["dim"]), int(d.get("chunks", 1)), int(d.get("unit", 1)), int(d.get("rotate", 0)),
                     int(d.get("tail", 0)), bool(d.get("per_block", False)), int(d.get("outer", -1)),
                     tuple(int(x) for x in d.get("sizes", ())), tuple(int(x) for x in d.get("whole", ())))
    if kind == "partial":
        if "routed" not in d:
            return PARTIAL
        return Routed(int(d["routed"]), span=int(d.get("span", 1)), unit=int(d.get("unit", 1)),
                      heads=int(d.get("heads", 0)), **{flag: bool(d.get(flag, False)) for flag in ROUTED_FLAGS})
    if kind == "replicate":
        return REPLICATE_PARTIAL_GRAD if d.get("grad") == "partial" else REPLICATE
    raise ValueError(f"unknown placement kind {kind!r}")
