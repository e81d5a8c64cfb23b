"""What an expert layer's ops read of their rows, and of the host.

A rank under expert parallelism runs its own experts' rows alone; how many those are is a value
on the device, read to the host once per layer where the rank's program needs it (a
device-to-host sync the cost model prices and ``host_reads=False`` forbids). This module says,
from the graph and a strategy, where that happens:

* :func:`grouped_reader`: the gather ``h[idx]`` that only a grouped product reads (through casts),
  so the rank's program may gather its own experts' rows right before the product;
* :func:`reads_rows` / :func:`permutes_rows`: which ops would read the count, and which reorders
  keep every row once (no read, a gather by the inverse backward: :func:`inverse_permutations`);
* :func:`host_reads` / :func:`reads_host`: how many reads a strategy makes on a rank (priced),
  and whether it may read at all (refused under ``host_reads=False``).

Nothing here offers a strategy; the rules (:mod:`.experts`, :mod:`.routed`) and the index
(:class:`autotp.passes.propagate.GraphIndex`) ask."""
from __future__ import annotations

from typing import Any

import sympy
import torch

from ...placements import Routed
from .routing import counted_by, index_length, inverses, is_permutation
from .contract import OpInfo, Strategy
from .registry import op_name

aten = torch.ops.aten


#: the grouped products by name: transformers registers its fallback op only once imported
GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
#: ops that carry a gathered row to a grouped product unchanged but for its dtype or memory
CARRY_ROWS = frozenset((aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                        aten.contiguous.default, aten.alias.default))


def grouped_reader(node: Any) -> tuple[list, Any] | None:
    """``(chain, product)`` where ``node`` is ``h[idx]`` (rows gathered by one 1-D index) read by
    one grouped product of experts alone, as its x, through ``chain`` (casts and copies, each
    read once); None otherwise. Such a gather's rows are the product's rows, sorted by expert
    (the product's ``offs`` say whose): a rank under expert parallelism needs its own experts'
    rows alone, ``h[idx[start:end]]``, not every row to slice them. Its bounds come from
    ``offs``, which the model computes after the gather; nothing between the gather and the
    product may write ``h`` or ``idx`` or change the grad or autocast mode, so that the rank's
    program can gather there, right before the product (see autotp/passes/rewrite.py)."""
    from torch import fx

    from .registry import REGION_BOUNDS, aliases_first, mutates_first

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args) == 2):
        return None
    h, indices = node.args
    if not (isinstance(h, fx.Node) and isinstance(indices, (list, tuple)) and len(indices) == 1
            and isinstance(indices[0], fx.Node)):
        return None
    hv, iv = h.meta.get("val"), indices[0].meta.get("val")
    if not (isinstance(hv, torch.Tensor) and hv.is_floating_point() and hv.ndim == 2
            and isinstance(iv, torch.Tensor) and not iv.is_floating_point() and iv.ndim == 1):
        return None
    chain, cur = [], node
    while True:
        users = list(cur.users)
        if len(users) != 1 or users[0].op != "call_function" or not users[0].args or users[0].args[0] is not cur:
            return None
        user = users[0]
        if op_name(user.target) in GROUPED_MM:
            break
        if user.target not in CARRY_ROWS:
            return None
        chain.append(user)
        cur = user
    read = {h, indices[0]}
    at = node.next
    while at is not user:
        if at.op == "call_function" and (at.target in REGION_BOUNDS or (
                (mutates_first(at.target) or aliases_first(at.target)) and at.args and at.args[0] in read)):
            return None
        at = at.next
    return chain, user


def reads_rows(node: Any) -> bool:
    """Whether ``node``, run on a rank's own experts' rows alone where its inputs hold every row,
    reads how many are the rank's on the host (the rewrite below): a grouped product or the
    gather in front of it (the layer's bounds, :func:`autotp.distributed.experts.expert_bounds`,
    read once: the first of them to take routed rows pays it), the first pick by a tensor of
    expert ids not sorted and counted by the layer's offsets (:func:`counted_by`; the picks by
    the same ids share the read), a reorder by an index not known a permutation."""
    from torch import fx

    from ...capture import shape_of

    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if op_name(node.target) in GROUPED_MM:
        return True
    if node.target is not aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
        return False
    index = node.args[1][0]
    stack = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if grouped_reader(node) is not None:
        return True
    if isinstance(stack, torch.Tensor) and stack.ndim >= 2 and isinstance(stack.shape[0], int):   # a pick
        earlier = [u for u in index.users if u.target is aten.index.Tensor and len(u.args) == 2
                   and list(u.args[1]) == [index] and _before(u, node)]
        return counted_by(index, stack.shape[0]) is None and not earlier
    # rows reordered: unread where the index keeps every row once (routed_permute)
    return not (isinstance(stack, torch.Tensor) and stack.ndim and is_permutation(index)
                and sympy.expand(index_length(index) - shape_of(node.args[0])[0]) == 0)


def permutes_rows(node: Any) -> bool:
    """Whether ``node`` is ``x[index]`` of float rows by one 1-D index the graph makes a
    permutation of x's rows (:func:`is_permutation`, as long as x's rows): every row kept once,
    so its backward is a gather by the inverse permutation (``distributed.functional.permute_rows``)."""
    from torch import fx

    from ...capture import shape_of

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args) == 2
            and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1):
        return False
    x, index = node.args[0], node.args[1][0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.ndim >= 1
            and isinstance(index, fx.Node) and is_permutation(index)):
        return False
    return sympy.expand(index_length(index) - shape_of(x)[0]) == 0


def inverse_permutations(index: Any) -> list:
    """The nodes the graph makes the inverse of the permutation ``index`` (:func:`.routing.inverses`):
    the ``p`` that ``index`` inverts, where ``index`` is made as ``inv[p] = arange(n)``
    (transformers' inverse of the sort by expert), ``inv.scatter_(0, p, arange(n))`` or
    ``argsort(p)``; and every node made so from ``index`` itself (transformers' ``inv_perm``,
    the inverse of the ``perm`` the routing weights are reordered by). A reorder by ``index``
    gathers its gradient back by one of them (``distributed.functional.permute_rows``) where the
    rank's program holds it by then: no scatter to make the inverse (the rank's program makes
    an inverse made after the reorder before it: ``passes/rewrite._inverses_first``)."""
    return inverses(index)


def _before(a: Any, b: Any) -> bool:
    """Whether node ``a`` comes before node ``b`` in their graph."""
    at = a.next
    while at.op != "root":
        if at is b:
            return True
        at = at.next
    return False


def host_reads(info: OpInfo, strategy: Strategy) -> int:
    """How many reads to the host ``strategy`` of the op ``info`` makes on a rank: one where it
    opens a run of routed rows (every input holds every row, its output only the rank's) and
    :attr:`~.contract.OpInfo.reads_rows`, or reorders routed rows by an index not known a
    permutation. A product that sends a rank's tokens' rows to their experts' ranks (the
    all-to-all dispatch) reads its bounds and split sizes at once, and with them how many rows
    the reorder of the rank's tokens in front of it (``h[perm // k]``) holds: that reorder's one
    read, priced at the reorder, where the product's x is rows gathered for it alone
    (:attr:`~.contract.OpInfo.x_gathered`: the rank's program runs the two together,
    passes/rewrite.py); one of its own otherwise."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    if any(isinstance(p, Routed) and p.tokens for p in strategy.inputs) and \
            any(isinstance(p, Routed) and not p.tokens for p in outs):
        return 0 if info.x_gathered else 1   # the all-to-all dispatch: the layer's one read
    if not info.reads_rows or not any(isinstance(p, Routed) for p in outs):
        return 0
    routed_in = [isinstance(p, Routed) for p in strategy.inputs]
    reorder = info.target is aten.index.Tensor and routed_in[:1] == [True]
    return int(reorder or not any(routed_in))


def reads_host(info: OpInfo, strategy: Strategy) -> bool:
    """Whether ``strategy`` of the op ``info`` may read a value on the host on a rank, which
    ``host_reads=False`` forbids: where it reads itself (:func:`host_reads`), and where it holds
    rows whose row map some op read (a rank's experts' rows, rows the dispatch sent: the layer's
    bounds read once and shared, so a later op of the run is priced no read of its own) or rows
    of their tokens reordered (meeting rows in the merge's order, they are matched by value).
    Rows of a merge of the batch with a split dim in its order (``Routed(tokens=True)``: the
    sequence-split tokens, Mamba2's heads merged with the batch) have a row map the shapes give:
    no read."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    if any(isinstance(p, Routed) and not (p.tokens and not p.reordered) for p in (*strategy.inputs, *outs)):
        return True
    return host_reads(info, strategy) > 0
