"""In-place f and g: which all-reduces of a rank's program may write the sum over their tensor.

Input: a rank's rewritten ``GraphModule`` (:mod:`autotp.passes.rewrite`). Output: the same module,
its f and g modules (:class:`~autotp.distributed.comm_modules.CopyToTP`, ``ReduceFromTP``) marked
``in_place`` where reducing in the tensor's own storage changes nothing any other op reads. The
serial model makes no copy there; a functional all-reduce copies its input before reducing it
(Megatron's ``_reduce`` all-reduces in place and returns the tensor).

**g** (forward) reduces the partial product. In place when, walking up from the g's input through
view ops (``view``, ``reshape``, ...) and casts (:data:`CASTS`), every node on the way has the next
as its only reader, and the first is a :data:`FRESH` op: its result is a new tensor that no backward
formula keeps (a product saves its operands, never its result; ``relu``, ``exp``, ``softmax`` save
their result, which is why they are not listed). A cast is its input itself (``to`` a dtype it has:
the only cast a Partial passes, :mod:`autotp.passes.rules.pointwise`) or a new tensor that its
backward does not save (``_to_copy``'s casts the gradient back): either way the walk goes on through
it as through a view, which asks no less of what is above it (GPT-2's logits' ``.float()`` between a
row-parallel head and its g, with sequence parallelism). Another reader of the partial (a residual
that adds it, a graph output) or an input or parameter keeps the copy.

**f** (backward) reduces the gradient of its output. In place when every reader of the f's
output, through view ops, is an operand of a :data:`GRAD_FRESH` op: one whose backward makes a
new tensor for that operand (``grad @ W.T`` for a product's activation, ``grad * other`` for
``mul``). The gradient the f receives is then that new tensor, or the sum of several (autograd
adds them into a buffer of its own), or a view of one: a tensor no other formula holds. Where a
reader's backward passes the gradient on as it is (``add`` to both its operands, ``clone``,
``addmm``'s bias of the output's own dims), or the output leaves the graph (a hook, the user's
``backward(gradient)``), the gradient may be shared and the f copies. A bias of fewer dims than
its output (added by ``add``, or inside its product: :data:`BIASED`) gets a new tensor, the sum.

**Under activation checkpointing** (:mod:`autotp.passes.checkpoint`) each recomputed layer is a
program of its own to the g rule: a g keeps its mark only where the tensor it writes is made
inside its layer (:func:`recomputed_layer_in_place`). ``torch.utils.checkpoint`` keeps a layer's
inputs and re-runs the layer from them in backward; a g that summed one of them in place (the
vocabulary-parallel embedding's partial, whose g joins the first layer that reads it) makes the
recompute start from the sum and add it up again: every activation recomputed from it tp times
too large. Autograd's check on the kept inputs raises "modified by an inplace operation" for
that, unless a ``saved_tensors_hooks`` is active, which bypasses the check: then the gradients
are silently wrong. A g whose partial the layer makes is exact under recomputation: the
recompute makes that partial anew and sums it again, as the first run did. An f is untouched:
its in-place write is to a gradient in backward, which recomputation neither reads nor keeps
(the non-reentrant checkpoint's backward runs the first forward's autograd graph; only the
saved tensors come from the recompute).

At run time an in-place reduce is eager code only (a compiled program reduces through the
functional collective, which inductor puts in place itself) and needs a contiguous tensor (else
it copies); it bumps the tensor's autograd version, so a formula that did save it raises
autograd's "modified by an inplace operation" rather than reading the sum: a safety net, which
saved-tensor hooks take away (checkpoint's own, inside a recomputed layer); the rule above is what
holds there.
"""
from __future__ import annotations

from torch import fx

import torch

from ..distributed.comm_modules import CopyToTP, ReduceFromTP
from ..distributed.experts import gather_rows, routed_combine, routed_scatter
from ..distributed.functional import vocab_parallel_embedding
from .rules.pointwise import CASTS

aten = torch.ops.aten

#: ops whose result aliases their first argument and whose backward saves nothing of theirs
VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints, aten.transpose.int, aten.t.default,
    aten.permute.default,
})

#: ops whose result is a new tensor that no backward formula saves (an experts layer's combine
#: and scatter: an ``index_add`` and a ``scatter`` into zeros, whose backwards read the index; the
#: vocabulary-parallel embedding: a lookup, its foreign rows zeroed in place by a mask)
FRESH = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
    aten.linear.default, aten._grouped_mm.default, aten.embedding.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
    routed_combine, routed_scatter, vocab_parallel_embedding,
})

#: op -> the argument positions whose gradient its backward makes as a new tensor
GRAD_FRESH = {
    aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.matmul.default: (0, 1),
    aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2),   # not the added term: its gradient is grad
    aten.linear.default: (0, 1), aten._grouped_mm.default: (0, 1),
    aten.mul.Tensor: (0, 1), aten.div.Tensor: (0, 1), aten.embedding.default: (0,),
    aten.layer_norm.default: (0, 2, 3), aten.native_layer_norm.default: (0, 2, 3), aten.rms_norm.default: (0, 2),
    gather_rows: (0,),   # an experts layer's rows picked by index: the gradient scattered into zeros
}

#: ops whose backward passes the gradient on as it is, summed down to an operand of fewer dims
#: (``sum_to``: a new tensor) where the operand is broadcast: the gradient of a bias of ``[h]``
#: added to ``[b, s, h]`` is new, that of an operand of the result's own dims may be ``grad``
#: itself, shared with the other operand
BROADCAST = frozenset({aten.add.Tensor, aten.sub.Tensor})

#: products with their bias inside (:mod:`autotp.passes.fused_bias`) -> the bias's position: its
#: gradient, like a broadcast add's, is the output's summed over the tokens, a new tensor, where
#: the bias has fewer dims than the output
BIASED = {aten.linear.default: 2, aten.addmm.default: 0}


def reduce_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Marks the f and g modules of ``gm`` whose all-reduce may run in place (module docs)."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if type(module) is ReduceFromTP:
            module.in_place = g_may_reduce_in_place(node)
        elif type(module) is CopyToTP:
            module.in_place = f_may_reduce_in_place(node)
    return gm


def recomputed_layer_in_place(layer: fx.GraphModule) -> None:
    """Under activation checkpointing: clears the ``in_place`` mark of each g of ``layer`` (one
    recomputed layer's partition) that would write a tensor the layer does not make itself, one of
    the inputs checkpoint keeps to recompute from (module docs). Every f keeps its mark."""
    for node in layer.graph.nodes:
        if node.op == "call_module":
            module = layer.get_submodule(node.target)
            if type(module) is ReduceFromTP and module.in_place:
                module.in_place = g_may_reduce_in_place(node)


def g_may_reduce_in_place(g: fx.Node) -> bool:
    """Whether the g node's input is a fresh, unsaved tensor that the g alone reads (through
    views and casts, each read by the next alone)."""
    node, reader = g.args[0], g
    while isinstance(node, fx.Node):
        if list(node.users) != [reader]:
            return False
        if node.op != "call_function":
            return False
        if node.target in FRESH:
            return True
        if node.target not in VIEWS and node.target not in CASTS:
            return False
        node, reader = node.args[0], node
    return False


def f_may_reduce_in_place(f: fx.Node) -> bool:
    """Whether every reader of the f node's output, through views, makes a new gradient for it."""
    return _grad_is_fresh(f)


def _grad_is_fresh(node: fx.Node) -> bool:
    if not node.users:
        return False   # no gradient reaches it: nothing to gain
    for user in node.users:
        reads = _reads(user, node)
        if user.op != "call_function":
            return False
        if user.target is aten.sym_size.int:
            continue   # reads a size, no value: no gradient (a fused product's view back, fused_bias.py)
        if user.target in VIEWS:
            if reads != [0] or not _grad_is_fresh(user):
                return False
        elif user.target in BROADCAST:
            if None in reads or not _ndim(node) < _ndim(user):
                return False
        elif user.target in BIASED and BIASED[user.target] in reads:
            if not _ndim(node) < _ndim(user) or not set(reads) - {BIASED[user.target]} <= set(GRAD_FRESH[user.target]):
                return False
        elif user.target not in GRAD_FRESH or not set(reads) <= set(GRAD_FRESH[user.target]):
            return False
    return True


def _ndim(node: fx.Node) -> float:
    """The node's number of dims, as the rewrite recorded it (``autotp_ndim``; an f's: its
    input's); infinity where unknown, which no broadcast rule accepts."""
    if node.op == "call_module" and node.target.startswith("f_"):
        node = node.args[0]
    return node.meta.get("autotp_ndim", float("inf"))


def _reads(user: fx.Node, node: fx.Node) -> list:
    """Where ``user`` reads ``node``: the position of each top-level argument that is it, and None
    for each read nested in a list or passed by keyword."""
    where: list = [i for i, a in enumerate(user.args) if a is node]
    nested = [a for a in user.args if not isinstance(a, fx.Node)] + [user.kwargs]
    fx.node.map_arg(nested, lambda n: where.append(None) if n is node else None)
    return where
