"""Column and row hints: how a fresh shard of a tensor's dim learns its blocks, atom and tail from
how the graph uses it next (a later equal ``split``: fused q, k, v; a view that factors the dim:
a head of ``head_dim`` elements; an unequal split: a multi-query layout's whole tail), read by
:class:`~autotp.passes.propagate.GraphIndex` when it indexes a product.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import sympy
import torch
from torch import fx

from ..capture import shape_of
from ..placements import Shard
from .rules.pieces import slice_range
from .rules.view_map import map_view_shard, view_groups

aten = torch.ops.aten


_FOLLOW_SAME = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.to.dtype,
    aten.to.dtype_layout, aten._to_copy.default, aten.dropout.default, aten.contiguous.default,
    aten.alias.default, aten.clone.default,
    # an RMSNorm's statistic fused (autotp/passes/norms.py): its normalized values laid out as
    # x, as the written statistic's are (_statistic)
    aten.rms_norm.default,
}


def column_hint(node: fx.Node, dim: int, tp: int = 1, uneven: bool = False,
                constant: Any = None) -> tuple[int, int, int, tuple, tuple]:
    """(chunks, unit, tail, sizes, whole) for a fresh shard of ``node``'s ``dim``, read off how it is used next:
    a later equal ``split`` of that dim gives the blocks (fused q, k, v), a later view that
    factors it gives the atom (a head of ``head_dim`` elements), and a fused multi-query or
    grouped layout gives the tail, the atoms every rank keeps whole: an unequal split whose
    first piece is the query heads (GPT-BigCode's ``[q | k | v]``), or a view into heads whose
    readers slice the query heads off the front of each group and pick k and v from its end
    (Falcon: ``[..., :-2, :]``, ``[..., [-2], :]``). Where a group of heads is itself a whole
    atom (Falcon's new layout, k and v inside each group) and there are at least ``tp`` groups
    (an even count, or ``uneven``), the groups are dealt whole instead: nothing is replicated.
    A fused projection read back with slices of unequal width (Phi-3's q | k | v with fewer
    key/value heads) gives ``sizes``, the pieces' relative widths: blocks of unequal size, each
    dealt in groups (``()``: the blocks are equal); an unequal split gives both its pieces'
    ``sizes`` and the tail, for where tp cannot deal the groups; ``whole``: blocks of ``sizes``
    every rank holds whole (Mamba2's one group of B and C, see :func:`_grouped_pieces`).
    ``constant(node)``: a lifted constant's value (the index lists), or None."""
    chunks, unit, tail_elems = 1, 1, 0
    blocks: tuple = ()   # unequal blocks' relative sizes
    blocks_at = 0        # ``chunks`` when they were read: they hold while no later split multiplies it
    cur, d = node, dim
    size = shape_of(node)[dim] if shape_of(node) is not None else None

    def done(c: int, u: int, t_elems: int, t_atoms: int = 0) -> tuple[int, int, int, tuple, tuple]:
        if t_elems:
            if t_elems % (c * u):
                return 1, 1, 0, (), ()
            t_atoms += t_elems // u
        return c, u, t_atoms, blocks if c == blocks_at else (), ()

    for _ in range(32):
        users = [u for u in cur.users if u.op == "call_function"]
        if not users:
            break
        u = users[0]
        if u.target is operator.getitem:
            cur = u
            continue
        pieces = _slices_tiling(cur, users, d)
        if pieces is not None and blocks:
            break   # the first piece read back with slices again: its blocks are not followed
        if pieces is not None:
            # a fused projection read back with slices (Phi-3's q | k | v): blocks of the pieces'
            # greatest common size, followed into the first piece (the query heads); pieces of
            # unequal size (fewer key/value heads) are also blocks of their own (``sizes``), which
            # contract.OpInfo.fresh_shard_of deals where tp divides every block's atoms
            widths = [b - a for a, b, _ in pieces]
            block = math.gcd(*widths)
            if len(set(widths)) > 1 and chunks == 1 and not tail_elems:
                # unequal: where tp cannot deal the groups (fewer kv heads than ranks), the query
                # heads dealt and k and v whole on every rank (a tail), as for a split below
                blocks, blocks_at, tail_elems = tuple(w // block for w in widths), chunks, sum(widths[1:])
            else:
                chunks *= pieces[-1][1] // block
            cur = pieces[0][2]
            continue
        if len(users) > 1 and cur.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            # a norm over the dim (OLMo2's q_norm over all heads' width): its statistic (the mean
            # of squares) reduces the dim away; the hint follows the normalized values
            rest = [v for v in users if not _statistic(v, d)]
            if len(rest) != 1 or len(rest) == len(users):
                break
            u = rest[0]
        t = u.target
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            src, dst = shape_of(cur), shape_of(u)
            mapped = map_view_shard(src, dst, Shard(d))
            if mapped is not None:
                d, cur = mapped.dim, u
                continue
            for gi, go in view_groups(src, dst) or []:
                if gi == [d] and len(go) > 1:
                    sizes = [dst[j] for j in go]
                    if not all(x.is_Integer for x in sizes[1:]):
                        break
                    sizes = [int(x) if x.is_Integer else None for x in sizes]
                    grouped = unit * math.prod(sizes[1:])
                    if len(go) >= 3 and None not in sizes and _unbound(u, go[0]):
                        # ModernBERT's [b, s, 3, heads, d] unbound into q, k, v: 3 blocks of heads
                        return done(chunks * sizes[0], unit * math.prod(sizes[2:]), tail_elems)
                    for k, j in enumerate(go):
                        tail = _tail_of_readers(u, j, sizes[k], constant)
                        if not tail or sizes[k] is None or any(x is None for x in sizes[:k]):
                            continue
                        groups = None if size is None or not size.is_Integer else int(size) // (chunks * grouped)
                        if k and groups is not None and groups >= tp and (groups % tp == 0 or uneven):
                            break   # whole groups: each rank's k and v come with its query heads
                        return done(chunks * math.prod(sizes[:k]), unit * math.prod(sizes[k + 1:]), tail_elems,
                                    tail)
                    return done(chunks, grouped, tail_elems)
            break
        if t is aten.chunk.default and (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) % len(
                shape_of(cur)) != d:
            break   # as before chunk was followed: only a chunk of the split dim (a fused gate|up) gives blocks
        if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            sdim = (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) % len(shape_of(cur))
            pieces = [v.shape[sdim] for v in u.meta["val"]]
            if t is aten.chunk.default and len(set(pieces)) != 1:
                break
            if sdim == d:
                if len(set(pieces)) != 1 and chunks == 1 and not tail_elems and not blocks:
                    grouped = _grouped_pieces(u, d, tp, uneven, constant)
                    if grouped is not None:
                        return grouped
                if len(set(pieces)) != 1:
                    # q heads first, then k and v of fewer kv heads: blocks of unequal size, dealt
                    # in groups (a kv head with its query heads) where tp can deal them, else
                    # k and v kept whole (a tail: GPT-BigCode's one kv head); follow q
                    first = [g for g in u.users if g.target is operator.getitem and g.args[1] == 0]
                    if chunks != 1 or tail_elems or blocks or not first or \
                            not all(isinstance(x, int) for x in pieces):
                        break
                    block = math.gcd(*pieces)
                    blocks, blocks_at = tuple(x // block for x in pieces), chunks
                    tail_elems, cur = sum(pieces[1:]), first[0]
                    continue
                chunks *= len(pieces)
            cur = u
            continue
        if t in _FOLLOW_SAME and shape_of(u) == shape_of(cur):
            cur = u
            continue
        if t is aten.transpose.int:
            d, cur = _through_transpose(u, d), u
            continue
        if t is aten.unsqueeze.default:
            at = u.args[1] % (len(shape_of(cur)) + 1)
            d = d + 1 if d >= at else d
            cur = u
            continue
        if t in (aten.squeeze.dim, aten.squeeze.dims) and shape_of(u) is not None:
            mapped = map_view_shard(shape_of(cur), shape_of(u), Shard(d))
            if mapped is not None:
                d, cur = mapped.dim, u
                continue
        # the products of a mixture's experts carry a weight's output features into theirs: a
        # picked stack's rows through ``bmm(w[ids], x)``, a stack's last dim through the grouped one
        ndim = len(shape_of(cur) or ())
        if t is aten.bmm.default and u.args[0] is cur and d == ndim - 2:
            cur = u
            continue
        if _is_grouped(t) and len(u.args) > 1 and u.args[1] is cur and ndim == 3 and d == 2:
            d, cur = 1, u
            continue
        break
    return done(chunks, unit, tail_elems)


#: ops a piece of a fused projection passes through on its way to being split again, its dim
#: kept: casts, unary elementwise functions, a depthwise convolution along the sequence
_UNARY = {aten.silu.default, aten.sigmoid.default, aten.relu.default, aten.gelu.default, aten.tanh.default,
          aten.softplus.default}


def _grouped_pieces(split: fx.Node, d: int, tp: int, uneven: bool, constant: Any) -> tuple | None:
    """Mamba2's fused in-projection ``[z | x | B | C | dt]``, split into ``z | xBC | dt`` with
    ``xBC`` split again into ``x | B | C`` after its convolution: blocks of unequal size, one per
    innermost piece, dealt in ``ngroups`` groups (a group: its heads' z, x and dt, its own B and C).
    Each piece's atom is read off its own use (x viewed into heads, B and C into groups of
    ``d_state``; a piece read no further counts single elements), the groups are the greatest
    common count of atoms over the pieces, and the blocks' sizes are each piece's width per group.
    Where tp cannot deal the groups (one group of B and C, as every published Bamba, Falcon-H1
    and Granite-4.0-H has), the inner pieces of fewer atoms than ranks (B and C) are held whole
    on every rank (``whole``) and the others dealt in groups of heads: as many as divide every
    piece's width (bamba-9b: 128 heads, B of 128; granite-4.0-h-tiny: 48 heads and B of 128 make
    16 groups of 3 heads). Only where a piece is split again (so a plain q | k | v keeps its
    reading) and tp can deal the groups (as :meth:`OpInfo.fresh_shard_of` deals blocks of
    unequal size); else None."""
    blocks = _piece_atoms(split, d, tp, uneven, constant, nested_ok=True)
    if blocks is None or not any(inner for _, _, inner in blocks):
        return None
    whole = ()
    groups = math.gcd(*(atoms for _, atoms, _ in blocks))
    if groups < tp:
        whole = tuple(i for i, (_, atoms, inner) in enumerate(blocks) if inner and atoms < tp)
        dealt = [atoms for i, (_, atoms, _) in enumerate(blocks) if i not in whole]
        if not whole or not dealt:
            return None
        # the whole blocks' widths in the dealt groups' parts: a group count dividing them too
        groups = math.gcd(*dealt, *(blocks[i][0] for i in whole))
    if groups < tp or (groups % tp and not uneven):
        return None
    per_group = [width // groups for width, _, _ in blocks]
    unit = math.gcd(*per_group)
    sizes = tuple(w // unit for w in per_group)
    return sum(sizes), unit, 0, sizes, whole


def _piece_atoms(split: fx.Node, d: int, tp: int, uneven: bool, constant: Any,
                 nested_ok: bool) -> list[tuple[int, int, bool]] | None:
    """(width, atoms, split again) of each innermost piece of an unequal ``split`` of dim ``d``."""
    widths = [v.shape[d] for v in split.meta["val"]]
    if not all(isinstance(w, int) for w in widths):
        return None
    items = {g.args[1]: g for g in split.users if g.target is operator.getitem}
    out = []
    for i, width in enumerate(widths):
        piece = items.get(i)
        if piece is None:
            out.append((width, width, False))
            continue
        again = _split_again(piece, d) if nested_ok else None
        if again is not None:
            inner = _piece_atoms(*again, tp, uneven, constant, nested_ok=False)
            if inner is None or sum(w for w, _, _ in inner) != width:
                return None
            out += [(w, a, True) for w, a, _ in inner]
            continue
        unit = _factored_atom(piece, d) or column_hint(piece, d, tp, uneven, constant)[1]
        out.append((width, width // unit if width % unit == 0 else width, False))
    return out


def _factored_atom(node: fx.Node, d: int) -> int | None:
    """``k`` where ``node``'s dim ``d`` is next viewed as ``[..., g, k, ...]`` (through casts): B and C
    of Mamba2 viewed into ``[b, s, ngroups, d_state]``, whose atom is a group even where there is one
    (a view to ``[.., 1, d_state]``, which a shard of the dim passes through unchanged)."""
    cur = node
    for _ in range(8):
        users = [u for u in cur.users if u.op == "call_function"]
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            src, dst = shape_of(cur), shape_of(u)
            if src is None or dst is None or len(dst) != len(src) + 1 or tuple(dst[:d]) != tuple(src[:d]) \
                    or tuple(dst[d + 2:]) != tuple(src[d + 1:]) or not (dst[d].is_Integer and dst[d + 1].is_Integer):
                return None
            return int(dst[d + 1]) if dst[d] * dst[d + 1] == src[d] else None
        if not ((u.target in _FOLLOW_SAME or u.target is operator.getitem) and shape_of(u) == shape_of(cur)):
            return None
        cur = u
    return None


def _split_again(node: fx.Node, d: int) -> tuple[fx.Node, int] | None:
    """(the split, its dim) where ``node``'s dim ``d`` is split unequally again further on, through
    casts, transposes, unary functions, a depthwise convolution (channels on dim 1) and slices of
    other dims (the convolution's padding cut off), each the only reader; None otherwise."""
    cur = node
    for _ in range(16):
        users = [u for u in cur.users if u.op == "call_function"]
        if len(users) != 1:
            return None
        u, shape = users[0], shape_of(cur)
        t = u.target
        if t in (aten.split.Tensor, aten.split_with_sizes.default):
            sdim = (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) % len(shape)
            pieces = [v.shape[sdim] for v in u.meta["val"]]
            return (u, d) if sdim == d and len(set(pieces)) > 1 else None
        if t is aten.transpose.int:
            d = _through_transpose(u, d)
        elif t is aten.conv1d.default:
            groups = u.args[6] if len(u.args) > 6 else u.kwargs.get("groups", 1)
            if u.args[0] is not cur or d != 1 or groups != shape[1]:
                return None
        elif t is aten.slice.Tensor:
            if (u.args[1] if len(u.args) > 1 else 0) % len(shape) == d:
                return None
        elif not ((t in _FOLLOW_SAME or t in _UNARY) and shape_of(u) == shape):
            return None
        cur = u
    return None


def _is_grouped(target: Any) -> bool:
    from .rules.row_reads import GROUPED_MM
    from .rules.registry import op_name

    return op_name(target) in GROUPED_MM


def _slices_tiling(node: fx.Node, users: list, d: int) -> list[tuple[int, int, fx.Node]] | None:
    """(start, stop, slice) of ``node``'s readers where all are step-1 slices of dim ``d`` that
    tile it without overlap, in order; None otherwise."""
    shape = shape_of(node)
    if len(users) < 2 or shape is None or not shape[d].is_Integer:
        return None
    pieces = []
    for u in users:
        bounds = slice_bounds(u) if u.target is aten.slice.Tensor else None
        if bounds is None or bounds[0] != d:
            return None
        pieces.append((bounds[1], bounds[2], u))
    pieces.sort(key=lambda p: p[:2])
    ends = [0] + [b for _, b, _ in pieces]
    if any(a != ends[i] for i, (a, _, _) in enumerate(pieces)) or ends[-1] != int(shape[d]):
        return None
    return pieces


_SQUARES = {aten.pow.Tensor_Scalar, aten.square.default, aten.mul.Tensor, aten._to_copy.default, aten.to.dtype,
            aten.to.dtype_layout}


def _statistic(node: fx.Node, dim: int) -> bool:
    """Whether ``node`` only feeds a reduction of ``dim`` (kept as a size-1 dim) through
    elementwise squares and casts: the mean of squares of an RMSNorm over that dim."""
    for _ in range(4):
        shape = shape_of(node)
        if shape is None:
            return False
        if node.target in (aten.mean.dim, aten.sum.dim_IntList):
            dims = node.args[1] if len(node.args) > 1 else None
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            return bool(keep) and isinstance(dims, (list, tuple)) and [x % len(shape) for x in dims] == [dim]
        users = list(node.users)
        if node.target not in _SQUARES or len(users) != 1:
            return False
        node = users[0]
    return False


def _unbound(view: fx.Node, dim: int) -> bool:
    """Whether every reader of ``view`` unbinds its ``dim``."""
    nd = len(shape_of(view))
    return bool(view.users) and all(
        u.target is aten.unbind.int and (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)) % nd == dim
        for u in view.users)


def _through_transpose(node: fx.Node, d: int) -> int:
    """Where dim ``d`` goes through the ``transpose`` ``node`` (either way: it swaps two dims)."""
    nd = len(shape_of(node))
    a, b = node.args[1] % nd, node.args[2] % nd
    return b if d == a else a if d == b else d


def row_hint(node: fx.Node, dim: int, tp: int = 1, uneven: bool = False) -> tuple[int, int]:
    """(chunks, unit) of ``node``'s ``dim`` read off how it was made: a reshape that merged
    heads into it (``[b, s, heads, d] -> [b, s, heads * d]``) gives atoms of ``d``, and an
    earlier merge of groups into the heads (Falcon's ``[kv, n_rep] -> heads``, past attention
    and rotary) gives the blocks, or, where :func:`column_hint` deals whole groups (at least
    ``tp`` of them), atoms of a group's heads. The contracted dim of a row-parallel product whose weight is
    transposed first (Falcon's ``x @ dense.weight.T``) is cut this way, so the weight's rows
    match x's heads."""
    cur, d = node, dim
    chunks, unit = 1, None
    for _ in range(64):
        if cur.op != "call_function" or not cur.args or not isinstance(cur.args[0], fx.Node):
            break
        src = cur.args[0]
        t = cur.target
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
            before, after = shape_of(src), shape_of(cur)
            if before is None or after is None:
                break
            merged = next((gi for gi, go in view_groups(before, after) or [] if go == [d] and len(gi) > 1), None)
            if merged is not None:
                lead, rest = sympy.Integer(1), sympy.Integer(1)
                for j in merged[:-1]:
                    lead = lead * before[j]
                for j in merged[1:]:
                    rest = rest * before[j]
                if unit is None:          # heads * d: atoms of d; go on with the heads dim
                    if not rest.is_Integer:
                        break
                    unit, cur, d = int(rest), src, merged[0]
                    continue
                per = before[merged[-1]]
                if lead.is_Integer and per.is_Integer:   # groups * query heads per group
                    groups = int(lead)
                    if groups >= tp and (groups % tp == 0 or uneven):
                        unit *= int(per)  # whole groups dealt (as column_hint chooses): runs of groups
                    else:
                        chunks = groups   # each group's heads dealt (a tail): blocks of groups
                break
            mapped = map_view_shard(after, before, Shard(d))
            if mapped is None:
                break
            cur, d = src, mapped.dim
            continue
        if t in _FOLLOW_SAME and shape_of(src) == shape_of(cur):
            cur = src
            continue
        if t is aten.scaled_dot_product_attention.default:
            cur = src   # the output's heads are q's
            continue
        if t is aten.transpose.int:
            d, cur = _through_transpose(cur, d), src
            continue
        if t is aten.permute.default:
            d = cur.args[1][d] % len(shape_of(cur))
            cur = src
            continue
        break
    return (chunks, unit) if unit is not None else (1, 1)


def index_picks(node: fx.Node, constant: Any) -> tuple[int, tuple[int, ...]] | None:
    """(dim, positions) of ``x[..., [p0, p1], ...]`` indexing one dim by a constant list
    (non-negative positions), or None."""
    if node.target is not aten.index.Tensor or constant is None:
        return None
    indices = node.args[1]
    picked = [(i, t) for i, t in enumerate(indices) if t is not None]
    shape = shape_of(node.args[0])
    if len(picked) != 1 or shape is None:
        return None
    dim, idx = picked[0]
    value = constant(idx)
    size = shape[dim]
    if value is None or value.dim() != 1 or value.dtype not in (torch.int64, torch.int32) or not size.is_Integer:
        return None
    n = int(size)
    return dim, tuple(int(v) + n if int(v) < 0 else int(v) for v in value.tolist())


def slice_bounds(node: fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, stop) of a step-1 ``slice`` of a static dim, normalized, or None."""
    shape = shape_of(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else 0
    if shape is None or not isinstance(dim, int):
        return None
    dim %= len(shape)
    found = slice_range(shape[dim], node.args[1:])
    return None if found is None else (dim,) + found


def _tail_of_readers(view: fx.Node, dim: int, n: int | None, constant: Any) -> int:
    """How many atoms at the end of ``view``'s ``dim`` its readers take apart from the rest: one
    reader slices ``[0, n - t)``, the others slice or index inside ``[n - t, n)``; 0 if not so."""
    if n is None:
        return 0
    head, rest = None, []
    for user in view.users:
        if user.target is aten.slice.Tensor:
            bounds = slice_bounds(user)
            if bounds is None or bounds[0] != dim:
                return 0
            _, a, b = bounds
            if a == 0 and b < n and head is None:
                head = b
            else:
                rest.extend(range(a, b))
        elif user.target is aten.index.Tensor:
            picks = index_picks(user, constant)
            if picks is None or picks[0] != dim:
                return 0
            rest.extend(picks[1])
        else:
            return 0
    if head is None or head == 0 or not rest or min(rest) < head:
        return 0
    return n - head
