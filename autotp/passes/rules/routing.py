"""What the graph proves about an expert layer's routing, so that a rank running its own experts'
rows reads no more than it must (autotp/passes/rules/experts.py, autotp/distributed/experts.py).

* :func:`is_permutation`: an index that reorders rows without a row lost or repeated (the
  inverse of the sort by expert, transformers' way back to token order): a rank's rows keep their
  count through it, renumbered, unread; :func:`inverted` / :func:`inverses`: which node holds its
  inverse (``inv[p] = arange``, a scatter of an arange by ``p``, ``argsort(p)``).
* :func:`counted_by`: a router's ids sorted and counted per expert into a grouped product's
  ``offs``: a pick by those ids takes the rows the product takes, from the bounds read once.

Each proof reads how a node is made (the ops and arguments in front of it), never a model's
name; anything it cannot prove is answered False / None, and the rank then reads.
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch

from .registry import aliases_first, mutates_first

aten = torch.ops.aten

#: ops whose second output is the permutation that sorts a tensor
SORTS = frozenset((aten.sort.default, aten.sort.stable))
#: ops whose output is a permutation of ``0 .. n-1`` (n: its length) whatever their input
PERMUTATIONS = frozenset((aten.argsort.default, aten.argsort.stable, aten.randperm.default))
#: scatters of a tensor of values that replace what they write (no reduce)
SCATTERS = frozenset((aten.scatter.src, aten.scatter_.src))
#: ops that may make the inverse of a permutation (:func:`inverted`), beside a sort's indices
INVERTERS = frozenset((aten.index_put_.default, aten.index_put.default, aten.argsort.default,
                       aten.argsort.stable)) | SCATTERS


def index_length(node: Any) -> Any:
    """The length of a 1-D integer tensor ``node`` (a sympy size), or None for anything else."""
    from torch import fx

    from ...capture import shape_of

    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex()
            and val.dtype is not torch.bool and val.ndim == 1):
        return None
    return shape_of(node)[0]


def written(node: Any) -> bool:
    """Whether an op writes ``node`` in place, or a view of it, after it is made."""
    return any(u.op == "call_function" and u.args and u.args[0] is node and (
        mutates_first(u.target) or (aliases_first(u.target) and written(u))) for u in node.users)


def is_permutation(node: Any) -> bool:
    """Whether the graph makes the 1-D integer tensor ``node`` a permutation of ``0 .. n-1`` (n:
    its length), by how it is made: the indices a sort of a 1-D tensor returns, an argsort, a
    randperm, or ``inv[p] = arange(n)`` (or ``inv.scatter_(0, p, arange(n))``) into n entries for
    a permutation ``p`` (transformers' inverse of the sort by expert: every entry of ``inv``
    written once), each not written after. Such an index reorders
    rows without a row lost or repeated: the rows a rank holds keep their count."""
    n = index_length(node)
    if n is None or node.op != "call_function" or written(node):
        return False
    if node.target is operator.getitem:
        source, which = node.args
        return (which == 1 and getattr(source, "target", None) in SORTS
                and index_length(source.args[0]) is not None)
    if node.target in PERMUTATIONS:
        return True
    if node.target in (aten.clone.default, aten.alias.default):
        return is_permutation(node.args[0])
    written_by = _arange_written_by(node)
    if written_by is None or not is_permutation(written_by):
        return False
    base, values = node.args[0], node.args[3 if node.target in SCATTERS else 2]
    lengths = (index_length(base), index_length(written_by), _arange_length(values))
    return None not in lengths and all(sympy.expand(m - n) == 0 for m in lengths)


def _arange_written_by(node: Any) -> Any:
    """``p`` where ``node`` writes values at the positions ``p`` of its first argument, each once
    replacing what was there: ``index_put`` by one index without accumulating (``inv[p] = v``) or
    ``scatter`` of a tensor of values along dim 0 (``inv.scatter_(0, p, v)``, no reduce: the
    ``reduce`` overloads and ``scatter_add`` sum into the entries instead); else None. Whether ``p``
    is a permutation and ``v`` an arange as long as ``inv`` is the caller's to check."""
    if node.target in (aten.index_put_.default, aten.index_put.default):
        indices = node.args[1]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return indices[0] if not accumulate and len(indices) == 1 else None
    if node.target in SCATTERS and node.args[1] in (0, -1):
        return node.args[2]
    return None


def _unwrapped(node: Any) -> Any:
    """``node`` read through clones and aliases (the same values)."""
    while getattr(node, "target", None) in (aten.clone.default, aten.alias.default):
        node = node.args[0]
    return node


def _ascending(sort: Any) -> bool:
    """Whether the sort or argsort ``sort`` orders its input ascending (``descending`` False)."""
    positional = sort.target in (aten.sort.default, aten.argsort.default) and len(sort.args) > 2
    return not (sort.args[2] if positional else sort.kwargs.get("descending", False))


def inverted(node: Any) -> Any:
    """``p`` where the graph makes ``node`` the inverse of the permutation ``p`` (read through
    clones): ``inv[p] = arange(n)`` (``index_put``) or ``inv.scatter_(0, p, arange(n))`` into n
    entries (each written once, whatever the entries held: :func:`is_permutation`), or the
    ascending ``argsort(p)`` / ``sort(p)[1]`` of a permutation (the position of each value
    ``0 .. n-1`` in ``p``); else None. A sort of anything not a permutation, descending, an arange
    of another length, a scatter that sums or leaves entries unwritten are not inverses."""
    node = _unwrapped(node)
    if not is_permutation(node):
        return None
    written_by = _arange_written_by(node)
    if written_by is not None:
        return written_by
    sort = node.args[0] if node.target is operator.getitem else node
    if sort.target in SORTS or sort.target in PERMUTATIONS - {aten.randperm.default}:
        p = sort.args[0]
        if _ascending(sort) and is_permutation(p):
            return p
    return None


def makes_inverse(node: Any) -> bool:
    """Whether the op ``node`` makes the inverse of a permutation (:func:`inverted`): an
    ``index_put``, a scatter or an argsort that is one, or a sort whose indices are one (an
    ascending sort of a permutation). The rank routing its own rows builds its inverse by any
    of them (:mod:`.local_routing`)."""
    if getattr(node, "target", None) in SORTS:
        return any(u.target is operator.getitem and u.args[1] == 1 and inverted(u) is not None for u in node.users)
    return getattr(node, "target", None) in INVERTERS and inverted(node) is not None


def inverses(index: Any) -> list:
    """The nodes whose values the graph makes the inverse of the permutation ``index``: the ``p``
    that ``index`` inverts (:func:`inverted`), made before it, then every node made as the inverse
    of ``index`` (or of a clone of it) in graph order. A reorder ``x[index]`` gathers its gradient
    back by any of them (``distributed.functional.permute_rows``)."""
    if not is_permutation(index):
        return []
    found = [p] if (p := inverted(index)) is not None else []
    source = _unwrapped(index)
    for node in index.graph.nodes:
        if node.op == "call_function" and (node.target in INVERTERS or (
                node.target is operator.getitem and getattr(node.args[0], "target", None) in SORTS)):
            if node not in found and _unwrapped(inverted(node)) is source:
                found.append(node)
    return found


def _arange_length(node: Any) -> Any:
    """n where ``node`` is ``arange(n)`` (``0, 1, .., n-1``), else None."""
    if getattr(node, "target", None) is aten.arange.default:
        return index_length(node)
    if getattr(node, "target", None) in (aten.arange.start, aten.arange.start_step):
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        return index_length(node) if node.args[0] == 0 and step == 1 else None
    return None


#: ops that pass a tensor's values on unchanged (an int cast of ints included)
_SAME_VALUES = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                          aten.alias.default, aten.contiguous.default, aten.flatten.using_ints))
_TO = frozenset((aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout))


def _values_of(node: Any) -> Any:
    """The node whose values ``node`` holds unchanged, through reshapes and casts of integers."""
    def integral(n: Any) -> bool:
        val = getattr(n, "meta", {}).get("val")
        return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex()

    while getattr(node, "op", None) == "call_function" and (
            node.target in _SAME_VALUES or (node.target in _TO and integral(node) and integral(node.args[0]))):
        node = node.args[0]
    return node


def router_experts(ids: Any) -> int | None:
    """The number of experts where ``ids`` (a captured node) holds a router's top-k choices
    (the indices of a ``topk`` over a static dim of scores, reshaped or cast), else None."""
    node = _values_of(ids)
    if getattr(node, "target", None) is not operator.getitem or node.args[1] != 1:
        return None
    topk = node.args[0]
    if getattr(topk, "target", None) is not aten.topk.default:
        return None
    scores = topk.args[0].meta["val"]
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    size = scores.shape[dim]
    return size if isinstance(size, int) else None


def _expert_ids(node: Any, total: int) -> bool:
    """Whether ``node`` holds ids in ``0 .. total - 1`` by how it is made: the indices of a top-k
    over a dim of ``total`` scores (a router's choice), reshaped or cast."""
    return router_experts(node) == total


def counted_by(index: Any, total: int) -> Any:
    """The captured ``offs`` of a grouped product that counts ``index``'s ids, where ``index``
    is a router's ids (:func:`_expert_ids`, so each is in ``0 .. total - 1``) sorted ascending and
    ``offs`` is ``cumsum(histc(index, bins=total, min=0, max=total - 1))``, transformers' count of
    rows per expert; else None. Then the positions of one run of experts' ids in ``index`` are
    the rows ``offs`` gives those experts: a pick by ``index`` takes the rows the product takes."""
    if getattr(index, "target", None) is not operator.getitem or index.args[1] != 0:
        return None
    sort = index.args[0]
    if getattr(sort, "target", None) not in SORTS or sort.args[0].meta["val"].ndim != 1:
        return None
    descending = sort.args[2] if len(sort.args) > 2 else sort.kwargs.get("descending", False)
    if descending or not _expert_ids(sort.args[0], total):
        return None
    for user in index.users:
        chain = user
        while chain.target in _TO and len(chain.users) == 1:   # transformers counts float ids on CPU
            chain = next(iter(chain.users))
        if chain.target is not aten.histc.default:
            continue
        given = dict(zip(("bins", "min", "max"), chain.args[1:]), **chain.kwargs)
        if (given.get("bins", 100), given.get("min", 0), given.get("max", 0)) != (total, 0, total - 1):
            continue
        for cumsum in chain.users:
            if cumsum.target is aten.cumsum.default and cumsum.args[1] in (0, -1):
                return cumsum
    return None


def counted_pick(node: Any) -> bool:
    """Whether ``node`` is ``stack[ids]``: a stack of experts (a static number of them, dim 0)
    picked by a router's ids sorted and counted into a grouped product's ``offs``
    (:func:`counted_by`; gpt-oss's biases, ``gate_up_proj_bias[expert_ids_g]``). The rows it
    picks are the product's rows, in the same order: a rank picks its own experts' rows by
    their bounds among the rows sorted by expert."""
    from torch import fx

    from ...capture import shape_of

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args[1]) == 1):
        return False
    shape = shape_of(node.args[0])
    total = shape[0] if shape else None
    return isinstance(total, (int, sympy.Integer)) and counted_by(node.args[1][0], int(total)) is not None
