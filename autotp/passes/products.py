"""Sibling products (several ``linear``s reading one tensor) run as one product of their weights
joined, its output split back in order.

HF's Llama-family attention writes ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and its MLP
``gate_proj(x)``, ``up_proj(x)``: separate ``linear``s reading the same tensor. Each is a kernel
forward and two backward, and the backward sums their input gradients with full-size ``add``s (two
for q, k, v; one for gate, up). Megatron fuses each set into one projection: one product forward,
and backward one input-gradient product whose sum over the siblings is accumulated inside the GEMM
(no adds), on a wider matrix (at tp=8 a Llama-3-8B rank's k and v are 128 columns each: skinny
products run well below peak).

Input: a :class:`~autotp.capture.Capture`. Output (:func:`fuse_products`): a copy whose graph has
each sibling set ``linear(x, W1) ... linear(x, Wn)`` replaced by
``split_with_sizes(linear(x, cat([W1, ..., Wn])), [o1, ..., on], -1)`` and its pieces; with biases
(each product read only by an ``add`` of its parameter bias, :func:`~.fused_bias.bias_add`), the
biases are joined too and added once to the joined product (added inside it on a rank, as serial's
own ``linear`` with a bias). The capture itself is unchanged.

Exact: every output column is the same dot product of ``x``'s row with the same weight row, and
``cat``'s backward hands each parameter its own rows of the joined weight's gradient, so every
gradient is the written one's (the input's summed inside one product instead of by ``add``s: the
same sum, rounded in another order). The parameters stay the model's own: the join is a node of
the program, computed from them at every step (a copy of the rank's weight shards forward, and
saved for the product's backward: the rank's shard of the siblings' weights per set, held until
the backward as the written products' ``x`` is), so state dicts, optimizers, checkpoints, FSDP2
and DTensor parameters see nothing new.

A set (:func:`find_siblings`), read from the graph alone (no module or model name): two or more
``aten.linear`` nodes reading the same node as their input in one repeated layer (the numbered
module on their module stack, or none: T5's decoder layers each read the encoder's output by their
own k and v, a set per layer), each weight a parameter's placeholder
(2-D, of the input's dtype), all of the same in-features and dtype, all with a bias (each product
read by its bias's ``add`` alone) or none. Products of other inputs, grouped products of experts
(``_grouped_mm``, ``bmm`` over experts: not ``linear``), a weight read twice in one set and a
product with a bias inside its call are left as written, and so is a set where an op writes a
product's output (or a view of it) in place (an in-place activation: a piece of the joined output
is a view of ``split_with_sizes``, which autograd lets no op write).

How a plan splits them: ``cat``'s rule (:mod:`.rules.joins`) joins weights each split by head into
one shard in blocks of unequal size (``Shard(0, 3, unit, sizes=(q, k, v))``: each rank's run of q,
of k and of v side by side, Megatron's layout of a fused grouped projection), and ``split``'s rule
cuts the product's output back into each rank's q, k and v. Where the siblings cannot split alike
(fewer kv heads than ranks: q split, k and v whole), the joined product has no split layout:
:func:`~autotp.planner.build_plan` plans the capture with those sets written apart too and keeps
the cheaper.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..capture.program import module_path, numbered_layer
from .activations import Fused, fused_capture
from .fused_bias import bias_add
from .rules.registry import aliases_first, mutates_first

aten = torch.ops.aten


@dataclass(frozen=True)
class Siblings:
    """One set of products of the same input: the input, the products in graph order, and each
    product's bias ``add`` (empty where they have none)."""

    x: fx.Node
    products: tuple[fx.Node, ...]
    bias_adds: tuple[fx.Node, ...] = ()

    @property
    def key(self) -> tuple[str, ...]:
        """The set by its products' names (stable across copies of a graph)."""
        return tuple(p.name for p in self.products)


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _product(node: fx.Node, x: fx.Node, param_names: Any) -> bool:
    """``linear(x, W)`` of a parameter's 2-D weight of ``x``'s dtype, no bias in the call."""
    if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
        return False
    if len(node.args) not in (2, 3) or node.args[0] is not x or (len(node.args) == 3 and node.args[2] is not None):
        return False
    w = node.args[1]
    if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in param_names):
        return False
    wv, xv, out = _val(w), _val(x), _val(node)
    return (wv is not None and xv is not None and out is not None and wv.dim() == 2 and xv.dim() >= 2
            and wv.dtype == xv.dtype and isinstance(wv.shape[0], int) and isinstance(wv.shape[1], int))


def find_siblings(graph: fx.Graph, param_names: Any, skip: frozenset = frozenset()) -> list[Siblings]:
    """Every set of sibling products of ``graph`` (module docstring), but those whose
    :attr:`Siblings.key` is in ``skip``."""
    found = []
    for x in graph.nodes:
        products = [u for u in x.users if _product(u, x, param_names)]
        # alike in in-features (they read one x, so they are) and weight dtype, and of one repeated
        # layer: T5's encoder output is read by every decoder layer's cross-attention k and v, and
        # one product across layers would tie the layers' ops together (per-layer FSDP could not
        # outline them, a pipeline stage could not hold a layer alone)
        by_kind: dict[tuple, list[fx.Node]] = {}
        for p in products:
            by_kind.setdefault((_val(p.args[1]).dtype, _val(p.args[1]).shape[1], numbered_layer(p)), []).append(p)
        for group in by_kind.values():
            weights = [p.args[1] for p in group]
            if len(group) < 2 or len(set(weights)) != len(weights):
                continue
            adds = [next(iter(p.users)) if len(p.users) == 1 else None for p in group]
            biased = [a is not None and bias_add(a, param_names) and a.args[0] is p for a, p in zip(adds, group)]
            if any(biased) and not all(biased):
                continue   # some with a bias, some without: left as written
            if any(_written_in_place(e) for e in (adds if all(biased) else group)):
                continue   # a piece of one output split in several is a view autograd lets no op write
            sibs = Siblings(x, tuple(group), tuple(adds) if all(biased) else ())
            if sibs.key not in skip:
                found.append(sibs)
    return found


def _written_in_place(node: fx.Node) -> bool:
    """Whether an op writes ``node``'s tensor, or a view of it, in place (an in-place activation on
    a product's output, ``relu_``). Joined, that output would be a piece of a ``split_with_sizes``,
    a view of an op that returns several, which autograd forbids writing in place."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op != "call_function" or not u.args or u.args[0] is not n:
                continue
            if mutates_first(u.target):
                return True
            if aliases_first(u.target):
                todo.append(u)
    return False


def _meta_from(node: fx.Node, like: fx.Node, val: Any) -> fx.Node:
    """``node`` placed in ``like``'s module (its layer: repeats, checkpointing) with value ``val``."""
    node.meta.update({k: like.meta[k] for k in ("stack_trace", "nn_module_stack") if k in like.meta})
    node.meta["val"] = val
    return node


def _fake_mode(val: torch.Tensor) -> Any:
    return getattr(val, "fake_mode", None)


def fuse_sibling_graph(graph: fx.Graph, param_names: Any, skip: frozenset = frozenset()) -> list[Fused]:
    """Replace every set of sibling products of ``graph`` (in place) by one product of their
    weights joined, split back in order; what was fused."""
    fused = []
    for sibs in find_siblings(graph, param_names, skip):
        first, last = sibs.products[0], sibs.products[-1]
        weights = [p.args[1] for p in sibs.products]
        outs = [int(_val(w).shape[0]) for w in weights]
        ends = list(sibs.bias_adds) or list(sibs.products)   # what the model's later ops read
        mode = _fake_mode(_val(sibs.x))
        ctx = mode if mode is not None else torch.no_grad()
        with ctx:
            w_val = torch.cat([_val(w) for w in weights])
            y_val = torch.nn.functional.linear(_val(sibs.x), w_val)
            b_val = torch.cat([_val(a.args[1]) for a in sibs.bias_adds]) if sibs.bias_adds else None
            z_val = y_val + b_val if b_val is not None else y_val
            piece_vals = torch.split(z_val, outs, -1)
        # before the first reader of any product (x and the weights come before every product);
        # where nothing reads them, after the last
        order = _order(graph)
        readers = [u for e in ends for u in e.users]
        place = (graph.inserting_before(min(readers, key=order.__getitem__)) if readers
                 else graph.inserting_after(max(ends, key=order.__getitem__)))
        with place:
            w_cat = _meta_from(graph.call_function(aten.cat.default, (weights,)), first, w_val)
            y = _meta_from(graph.call_function(aten.linear.default, (sibs.x, w_cat)), first, y_val)
            if sibs.bias_adds:
                b_cat = _meta_from(graph.call_function(aten.cat.default, ([a.args[1] for a in sibs.bias_adds],)),
                                   first, b_val)
                y = _meta_from(graph.call_function(aten.add.Tensor, (y, b_cat)), sibs.bias_adds[0], z_val)
            split = _meta_from(graph.call_function(aten.split_with_sizes.default, (y, outs, -1)), first,
                               list(piece_vals))
            pieces = [_meta_from(graph.call_function(operator.getitem, (split, i)), e, v)
                      for i, (e, v) in enumerate(zip(ends, piece_vals))]
        for end, piece in zip(ends, pieces):
            end.replace_all_uses_with(piece)
        for node in list(sibs.bias_adds) + list(sibs.products):   # readers first
            graph.erase_node(node)
        fused.append(Fused("+".join(str(o) for o in outs), _common_module(sibs.products) or last.name, len(outs)))
    if fused:
        graph.lint()
    return fused


def _common_module(products: tuple) -> str:
    """The module holding every product of a set (``model.layers.0.self_attn``)."""
    paths = [module_path(p).split(".") for p in products]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def fuse_products(cap: Any, skip: frozenset = frozenset()) -> tuple[Any, list[Fused]]:
    """A copy of capture ``cap`` with its sibling products fused (but the sets named in ``skip``,
    by :attr:`Siblings.key`), and what was fused; ``cap`` itself where there is none. Memoized on
    ``cap`` per ``skip``, as :func:`~autotp.passes.activations.fuse_activations`."""
    names = cap.param_names
    return fused_capture(cap, f"_fused_products_{sorted(skip)!r}" if skip else "_fused_products",
                         lambda graph: bool(find_siblings(graph, names, skip)),
                         lambda graph: fuse_sibling_graph(graph, names, skip))


def products_note(fused: list[Fused]) -> str | None:
    """The plan's note of the sibling products fused (None where none was)."""
    if not fused:
        return None
    kinds: dict[str, list[Fused]] = {}
    for f in fused:
        kinds.setdefault(f.op, []).append(f)
    parts = [f"{len(fs)} x {fs[0].nodes} products of one input ({k} rows: {fs[0].module}{', ...' if len(fs) > 1 else ''})"
             for k, fs in kinds.items()]
    return (f"sibling products fused: {'; '.join(parts)}, each run as one product of the weights joined "
            "(aten.cat each step), its output split back; fuse_products=False keeps them apart")
