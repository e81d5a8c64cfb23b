"""An RMSNorm written out as its statistic, run as the one ATen op that computes it.

HF's Llama-style RMSNorm (``LlamaRMSNorm`` and the many copies of it) is captured as ``to(float32)``,
``pow(x, 2)``, ``mean(-1, keepdim=True)``, ``add(eps)``, ``rsqrt``, ``mul(x, .)``, then
``to(input dtype)`` and the weight's ``mul``. The five statistic nodes run as five kernels forward
and about as many backward, each a pass over the ``[tokens, h]`` activation (in float32 for a bf16
model); ``aten.rms_norm(x, normalized_shape, None, eps)`` is the same function, one ATen op.

Input: a :class:`~autotp.capture.Capture`. Output (:func:`fuse_norms`): a copy whose graph has each
recognized statistic region replaced by ``aten.rms_norm``, and what was fused; the capture itself is
unchanged. The casts and the weight's multiply stay outside as the model writes them, so a bf16
model's norm is computed from the same float32 values and rounded to bf16 at the same place.

A region (:func:`find_norms`), read from the graph alone (no module or model name):

- ``x`` a floating tensor; its square ``pow(x, 2)``, ``square(x)`` or ``x * x``;
- the square's ``mean`` over the last ``k`` dims of ``x`` (any order), size-1 dims kept, no dtype;
- ``add`` of a number ``eps >= 0`` to the mean (either side);
- ``rsqrt`` of that, multiplied by ``x`` (either side); or its ``sqrt`` dividing ``x``;

every intermediate (square, mean, sum, root) read by the next alone and of ``x``'s dtype, the
result of ``x``'s shape and dtype, the normalized sizes numbers. Anything else (eps added to the
root or inside the mean, a mean over another dim or without ``keepdim``, no root, a statistic read
elsewhere) stays as written. ``aten.rms_norm`` reduces over the last ``k`` dims, adds ``eps`` in the
accumulation type and multiplies ``x`` by the reciprocal root: the written function exactly.

A norm of the token embedding's output (through casts, a scale, dropout) stays as written: a plan
may split that tensor by hidden columns, which the written statistic keeps (only x squared
gathered, each rank normalizing its columns) and ``aten.rms_norm`` would gather
(:func:`_reads_an_embedding`). With ``sequence_parallel=False`` :func:`~autotp.planner.build_plan`
does not fuse: there a plan
splits a norm's rows along the hidden dim through the written statistic (x squared gathered),
which ``aten.rms_norm``, keeping normalized dims whole, cannot.

A norm over a dim the plan splits into whole heads (OLMo2's q/k norms over all heads' width) runs
split, as its written statistic would: each rank's sum of squares all-reduced, one number a row
(``rms_norm_rule``, ``distributed.functional.SplitRmsNorm``).

What ``aten.rms_norm`` runs (the installed torch 2.13's dispatcher and PyTorch's
``aten/src/ATen/native/layer_norm.cpp``; 2.11 and 2.14 not checked one by one): it is
CompositeImplicitAutograd and calls ``_fused_rms_norm`` (but for channels-last or complex inputs
and a weight of another dtype, which run the composite), which on CUDA is one kernel forward
(``layer_norm_kernel.cu``: float32 accumulation, returns the output and ``rstd``) and
``_fused_rms_norm_backward`` one kernel backward (``dx`` from ``dy``, ``x`` and ``rstd``). On CPU
``_fused_rms_norm`` has no kernel and runs its composite (``rms_norm_composite``: ``pow``, ``mean``,
``add_``, ``rsqrt``, ``mul``), the ops the model writes in the same order, so a CPU rank computes
bit for bit what the written region does, in as many kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..capture.program import module_path
from .activations import Fused, fused_capture

aten = torch.ops.aten

_SQUARE = (aten.pow.Tensor_Scalar, aten.square.default, aten.mul.Tensor)
_ADD = (aten.add.Tensor, aten.add.Scalar)


@dataclass(frozen=True)
class Norm:
    """One recognized statistic region: its input, its nodes in graph order (the last computes
    the normalized ``x``), the sizes of the dims it normalizes and its epsilon."""

    x: fx.Node
    nodes: tuple[fx.Node, ...]
    normalized_shape: tuple[int, ...]
    eps: float


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sizes(val: torch.Tensor) -> tuple:
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in val.shape)


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _squared(sq: fx.Node) -> fx.Node | None:
    """The tensor ``sq`` squares (``pow(x, 2)``, ``square(x)``, ``x * x``), or None."""
    if sq.op != "call_function" or sq.target not in _SQUARE or sq.kwargs:
        return None
    if sq.target is aten.pow.Tensor_Scalar:
        return sq.args[0] if len(sq.args) == 2 and _number(sq.args[1]) and sq.args[1] == 2 else None
    if sq.target is aten.square.default:
        return sq.args[0]
    a, b = sq.args[:2]
    return a if a is b and isinstance(a, fx.Node) else None


def _mean_dims(mean: fx.Node, ndim: int) -> int | None:
    """How many trailing dims ``mean`` reduces (all of the last k, kept as size 1), or None."""
    if mean.target is not aten.mean.dim or mean.kwargs.get("dtype") is not None:
        return None
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not keep or not isinstance(dims, (list, tuple)) or not dims or len(mean.args) > 3:
        return None
    reduced = {d % ndim for d in dims}
    k = len(reduced)
    return k if len(dims) == k and reduced == set(range(ndim - k, ndim)) else None


def _eps(add: fx.Node, mean: fx.Node) -> float | None:
    """The number ``add`` adds to ``mean`` (``mean + eps`` or ``eps + mean``), or None."""
    if add.target not in _ADD or len(add.args) != 2:
        return None
    alpha = add.kwargs.get("alpha", 1)
    if set(add.kwargs) - {"alpha"} or not _number(alpha):
        return None
    a, b = add.args
    if a is mean and _number(b):
        eps = b * alpha
    elif b is mean and _number(a) and alpha == 1:
        eps = a
    else:
        return None
    return float(eps) if eps >= 0 else None


def _normalizes(root: fx.Node, x: fx.Node, scale: fx.Node) -> bool:
    """Whether ``root`` is ``x * rsqrt(.)`` (``scale`` the rsqrt) or ``x / sqrt(.)`` (the sqrt)."""
    if root.kwargs or len(root.args) != 2:
        return False
    if scale.target is aten.rsqrt.default:
        return root.target is aten.mul.Tensor and set(root.args) == {x, scale} and root.args[0] is not root.args[1]
    return root.target is aten.div.Tensor and root.args[0] is x and root.args[1] is scale


def _norm_at(mean: fx.Node) -> Norm | None:
    """The statistic region whose ``mean`` this is, or None."""
    sq = mean.args[0] if mean.args else None
    if not isinstance(sq, fx.Node) or _only_user(sq) is not mean:
        return None
    x = _squared(sq)
    x_val = _val(x)
    if x_val is None or not x_val.is_floating_point() or x_val.ndim == 0:
        return None
    k = _mean_dims(mean, x_val.ndim)
    add = _only_user(mean)
    eps = _eps(add, mean) if k is not None and add is not None else None
    root = _only_user(add) if eps is not None else None
    if root is None or root.op != "call_function" or root.target not in (aten.rsqrt.default, aten.sqrt.default):
        return None
    if root.args != (add,) or root.kwargs:
        return None
    out = _only_user(root)
    if out is None or not _normalizes(out, x, root):
        return None
    vals = [_val(n) for n in (sq, mean, add, root, out)]
    if any(v is None or v.dtype != x_val.dtype for v in vals) or _sizes(vals[-1]) != _sizes(x_val):
        return None
    shape = tuple(x_val.shape[x_val.ndim - k:])
    if not all(isinstance(s, int) for s in shape):
        return None
    return Norm(x, (sq, mean, add, root, out), shape, eps)


#: ops a norm's input may come through from the op that made it, its values laid out unchanged
_THROUGH = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                      aten.contiguous.default, aten.alias.default, aten.mul.Tensor, aten.dropout.default})


def _reads_an_embedding(norm: Norm) -> bool:
    """Whether ``norm``'s input is a token embedding's output (through casts, a scale, dropout):
    the one tensor a plan splits along the hidden dim (an untied embedding split by hidden
    columns, its all-gather half an all-reduce's bytes). The written statistic keeps that split
    (x squared gathered, x normalized split, the weight's multiply and casts split after it);
    ``aten.rms_norm`` keeps the normalized dims whole, so there it would gather x and normalize
    the whole of it on every rank."""
    node, seen = norm.x, 0
    while node.op == "call_function" and node.target in _THROUGH and seen < 8:
        tensors = [a for a in node.args if isinstance(a, fx.Node) and _val(a) is not None and a.op != "get_attr"]
        big = [a for a in tensors if _sizes(_val(a)) == _sizes(_val(node))]
        if len(big) != 1:
            return False
        node, seen = big[0], seen + 1
    return node.op == "call_function" and node.target is aten.embedding.default


def find_norms(graph: fx.Graph) -> list[Norm]:
    """Every statistic region of ``graph`` that ``aten.rms_norm`` computes (module docstring)."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.mean.dim:
            norm = _norm_at(node)
            if norm is not None and not _reads_an_embedding(norm):
                found.append(norm)
    return found


def fuse_norm_graph(graph: fx.Graph) -> list[Fused]:
    """Replace every recognized statistic region of ``graph`` (in place) by one ``aten.rms_norm``."""
    fused = []
    for norm in find_norms(graph):
        out = norm.nodes[-1]
        with graph.inserting_before(out):
            op = graph.call_function(aten.rms_norm.default, (norm.x, list(norm.normalized_shape), None, norm.eps))
        op.meta = dict(out.meta)   # same value, shape and dtype; the module (its layer) of the norm
        out.replace_all_uses_with(op)
        fused.append(Fused("RMSNorm", module_path(out) or out.name, len(norm.nodes)))
        for node in reversed(norm.nodes):
            graph.erase_node(node)
    if fused:
        graph.lint()
    return fused


def fuse_norms(cap: Any) -> tuple[Any, list[Fused]]:
    """A copy of capture ``cap`` with its RMSNorm statistics fused, and what was fused; ``cap``
    itself where there is none. Memoized on ``cap``, as :func:`~autotp.passes.activations.fuse_activations`."""
    return fused_capture(cap, "_fused_norms", lambda graph: bool(find_norms(graph)), fuse_norm_graph)


def norms_note(fused: list[Fused]) -> str | None:
    """The plan's note of the norms fused (None where none was)."""
    if not fused:
        return None
    many = len(fused) > 1
    return (f"norms fused: {len(fused)} RMSNorm statistic{'s' if many else ''} of {fused[0].nodes} ops "
            f"({fused[0].module}{', ...' if many else ''}) each run as one aten.rms_norm (on CUDA one kernel "
            "forward, one backward); fuse_norms=False keeps them as written")
