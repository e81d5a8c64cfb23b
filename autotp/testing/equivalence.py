"""Equivalence with the serial model: run the serial model and its parallel counterpart on the
same inputs, forward and backward, and compare loss, logits and every parameter's gradient (this
rank's shard against the same slice of the serial gradient), each relative to its scale.

:func:`keep_loss_precision`: HuggingFace's causal-LM loss casts logits to float32 even in a
float64 model; this gives the model a loss in the logits' own dtype, so that a float64 check
measures the rewrite and not float32 rounding of the loss.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from ..placements import Shard

#: Relative error bounds the property tests hold the parallel model to.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def computed_precision(model: nn.Module, inputs: Mapping[str, Any]) -> torch.dtype:
    """The least precise floating dtype ``model``'s forward computes in on ``inputs``, whatever
    its parameters' dtype: a float64 Llama's RMSNorm takes its variance in float32, GPT-J's
    attention upcasts q and k to float32 and back. A parallel plan that sums in another order
    moves such a model's values by float32's rounding, not float64's, past that op."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    found = {next(model.parameters()).dtype}

    def floats(tree) -> list[torch.dtype]:
        return [t.dtype for t in tree_flatten(tree)[0]
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel() > 1]

    class _Dtypes(TorchDispatchMode):
        """Notes every op that casts floating values down (a float64 input, a float32 output):
        float32 made from integers (OPT's positions from the mask's cumsum) rounds nothing."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            into = floats((args, kwargs))
            if into:
                finest = min(torch.finfo(d).eps for d in into)
                found.update(d for d in floats(out) if torch.finfo(d).eps > finest)
            return out

    with torch.no_grad(), _Dtypes():
        model(**inputs)
    return max(found, key=lambda d: torch.finfo(d).eps)


def tolerance(model: nn.Module, inputs: Mapping[str, Any]) -> float:
    """The relative error bound (:data:`TOLERANCE`) of the least precise dtype ``model``
    computes in on ``inputs`` (:func:`computed_precision`)."""
    return TOLERANCE.get(computed_precision(model, inputs), 1e-2)


def _causal_lm_loss_in_logits_dtype(logits, labels, vocab_size: int, num_items_in_batch=None,
                                    ignore_index: int = -100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss without its ``logits.float()``: float64 stays float64."""
    import torch.nn.functional as F

    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()     # what the HF loss does it for: half precision
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if reduction == "sum" else loss


def keep_loss_precision(model: nn.Module) -> nn.Module:
    """Make a HuggingFace causal LM compute its loss in the logits' dtype (see module docs).

    The serial model and every capture of it then agree on the loss's precision; without it a
    float64 model's loss (and every gradient, which flows from it) carries float32 rounding
    (relative ~1e-8 over a 50257-word vocabulary), whatever the parallel plan."""
    if not hasattr(type(model), "loss_function"):
        raise TypeError(f"{type(model).__name__} has no HuggingFace loss_function to replace")
    model.loss_function = _causal_lm_loss_in_logits_dtype
    return model


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, scale) (absolute when both are zero); inf where
    one side has a nan or inf the other has not.

    ``scale`` is the size of the group the tensor belongs to: a gradient that is zero in exact
    arithmetic (a key projection's bias: softmax ignores a constant added to every score) is
    rounding noise on both sides, so it is measured against its module's gradients, not itself
    (:func:`gradient_scales`: or its block's, where the whole module's gradient is such noise)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    # a nan or inf is equal only to the same value in the same place (a nan where the other side
    # has a number is an infinite error, never a nan that max() and <= would pass over)
    odd = ~(actual.isfinite() & expected.isfinite())
    if bool(odd.any()):
        alike = (actual == expected) | (actual.isnan() & expected.isnan())
        if not bool(alike[odd].all()):
            return math.inf
        actual, expected = actual.masked_fill(odd, 0.0), expected.masked_fill(odd, 0.0)
    denom = max(expected.norm().item(), scale)
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


def _module_grad_norms(model: nn.Module) -> dict[str, float]:
    """Module FQN -> the norm of the gradients of the parameters it holds directly."""
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            owner = name.rpartition(".")[0]
            squares[owner] = squares.get(owner, 0.0) + param.grad.detach().double().pow(2).sum().item()
    return {owner: total ** 0.5 for owner, total in squares.items()}


def _subtree_grad_norms(model: nn.Module) -> dict[str, float]:
    """Module FQN -> the norm of the gradients of every parameter under it ("" for the model)."""
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        square = param.grad.detach().double().pow(2).sum().item()
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            squares[prefix] = squares.get(prefix, 0.0) + square
    return {prefix: total ** 0.5 for prefix, total in squares.items()}


def gradient_scales(model: nn.Module) -> dict[str, float]:
    """Parameter name -> the scale its gradient's error is measured against (see
    :func:`relative_error`): the norm of its module's gradients, or, where those are rounding
    noise, of the smallest enclosing module's whose are not.

    A whole module's gradient can be zero in exact arithmetic: OLMo2's separate ``q_proj`` and
    ``k_proj`` at two tokens, where the one position with a label attends to itself alone, so q
    and k never change the loss. Serial and parallel then give noise of the attention block's
    backward (1e-16 of its ``v_proj`` gradient) and differ by 100% against the module itself.
    A module whose gradient norm is below ``sqrt(eps)`` of its parent's is taken as such noise:
    measured against itself it could not be held to a tolerance anyway (the parent's rounding,
    ``eps`` of the parent, is more than ``sqrt(eps)`` of it), so the parent's scale is used, and
    so on up; every other gradient is measured against its own module's, as before."""
    norms = _subtree_grad_norms(model)
    direct = _module_grad_norms(model)
    scales: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        floor = torch.finfo(param.grad.dtype).eps ** 0.5 if param.grad.is_floating_point() else 0.0
        owner = name.rpartition(".")[0]
        scale = direct.get(owner, 0.0)
        while owner and scale < floor * norms.get(owner.rpartition(".")[0], 0.0):
            owner = owner.rpartition(".")[0]
            scale = norms.get(owner, 0.0)
        scales[name] = scale
    return scales


def _split_placement(t: Any) -> Shard:
    """The autotp placement of a split output (a DTensor on the tp mesh)."""
    from ..runtime.module.dtensor import RunShard

    (over_tp,) = t.placements
    return over_tp.shard if isinstance(over_tp, RunShard) else Shard(over_tp.dim)


def _output_error(got: Any, expected: torch.Tensor, tp: int, rank: int) -> float:
    """The relative error of an output; one kept split (a DTensor: logits with
    ``gather_logits`` off) must be the whole tensor's shape and this rank's part of it."""
    from ..distributed.shards import local_shard

    if not hasattr(got, "to_local"):
        return relative_error(got, expected)
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"split output has shape {tuple(got.shape)}, the serial one {tuple(expected.shape)}")
    return relative_error(got.to_local(), local_shard(expected, _split_placement(got), tp, rank))


def equivalence_errors(model: nn.Module, pm: nn.Module, inputs: Mapping[str, Any]) -> dict[str, float]:
    """Relative errors of ``pm`` (a ParallelModule of ``model``) against ``model``, forward and
    backward, on this rank. ``model``'s gradients are overwritten."""
    from ..distributed.shards import local_shard

    model.zero_grad(set_to_none=True)
    pm.zero_grad(set_to_none=True)
    ref = model(**inputs)
    out = pm(**inputs)
    errors: dict[str, float] = {}
    plan = pm.plan
    rank = pm.mesh.tp_rank if pm.mesh is not None else 0
    ref_loss = getattr(ref, "loss", None)
    if ref_loss is not None:
        errors["loss"] = relative_error(out.loss, ref_loss)
        errors["logits"] = _output_error(out.logits, ref.logits, plan.tp, rank)
        ref_loss.backward()
        out.loss.backward()
    else:   # no loss (an inference call): the first output, squared and summed, drives backward
        first = ref[0] if isinstance(ref, (tuple, list)) or hasattr(ref, "to_tuple") else ref
        got = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
        errors["output"] = _output_error(got, first, plan.tp, rank)
        if hasattr(got, "to_local"):   # kept split: each rank's part drives its own backward
            got, first = got.to_local(), local_shard(first, _split_placement(got), plan.tp, rank)
        first.float().pow(2).sum().backward()
        got.float().pow(2).sum().backward()
    scales = gradient_scales(model)
    for name, param in model.named_parameters():   # a tied pair once, under the name listed first
        if param.grad is None:
            continue
        held = plan.aliases.get(name, name)            # the name the plan and the shards use
        placement = plan.params[held]
        expected = local_shard(param.grad, placement, plan.tp, rank) if isinstance(placement, Shard) else param.grad
        grad = pm.local_grad(held)
        if grad is None:
            errors[f"grad:{held}"] = float("inf")
        else:
            errors[f"grad:{held}"] = relative_error(grad, expected, scales[name])
    return errors


def assert_equivalent(model: nn.Module, tp: int, inputs: Mapping[str, Any], *, rtol: float | None = None,
                      **parallelize_kwargs: Any) -> dict[str, float]:
    """Parallelize ``model`` at ``tp`` (inside an initialized world) and check that it computes
    what ``model`` computes, within ``rtol`` or else :func:`tolerance` (the bound of the least
    precise dtype the model computes in). Returns the errors; raises AssertionError naming the
    worst."""
    from ..api import parallelize

    pm = parallelize(model, tp, **parallelize_kwargs)
    errors = equivalence_errors(model, pm, inputs)
    bound = rtol if rtol is not None else tolerance(model, inputs)
    worst = max(errors, key=errors.get)
    if errors[worst] > bound:
        raise AssertionError(f"parallel model differs from serial at {worst}: relative error "
                             f"{errors[worst]:.3e} > {bound:.1e} (tp={tp})")
    return errors
