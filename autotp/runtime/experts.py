"""What a rank runs of an expert product under expert parallelism: its own experts' rows.

A rank holds a contiguous run of whole experts (``first``, ``count`` of them) and computes the
(token, expert) rows routed to them; every other row of its result is zero, so the sum over
ranks (a g) is the whole product (autotp.placements.Routed). Both functions are plain torch
ops, differentiable through autograd: the gradient of a rank's experts comes from its rows alone.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def routed_gather(weight: torch.Tensor, index: torch.Tensor, first: int, count: int, total: int) -> torch.Tensor:
    """``weight_full[index]`` (``total`` experts) for the experts this rank holds (``weight`` is
    its run of them), zero where ``index`` names an expert held elsewhere (transformers' batched
    experts pick each (token, expert) pair's weights so)."""
    local = torch.where(index < 0, index + total, index) - first
    mine = (local >= 0) & (local < count)
    if count == 0:   # a rank with no expert (fewer experts than ranks): all zero, still in the graph
        return weight.new_zeros(index.shape + weight.shape[1:]) + weight.sum() * 0
    picked = weight[local.clamp(0, count - 1)]
    return picked.masked_fill(~mine.view(mine.shape + (1,) * (picked.dim() - mine.dim())), 0)


def routed_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int, count: int,
                      op: str, **kwargs: Any) -> torch.Tensor:
    """A grouped product (``x``'s rows sorted by expert, ``offs`` the cumulative rows per expert,
    of every expert) over this rank's experts only: their rows run through the product the
    model's program uses (``op``, by name: ``"aten._grouped_mm.default"``) and the other rows are zero."""
    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    rows = x.shape[0]
    start = int(offs[first - 1]) if first > 0 else 0
    end = int(offs[first + count - 1]) if count else start
    width = weight.shape[-1]
    if end == start:   # no row routed to this rank's experts
        return x.new_zeros(rows, width) + (weight.sum() + x.sum()) * 0
    out = target(x[start:end], weight, offs=offs[first:first + count] - start, **kwargs)
    return F.pad(out, (0, 0, start, rows - end))


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc`` on any device: CPU counts only floats. transformers' grouped experts count
    tokens per expert as floats on CPU and as ints elsewhere, and a later program, captured from
    the weightless meta twin, holds the int form; the counts are the same either way."""
    if x.dtype.is_floating_point or x.device.type != "cpu":
        return torch.histc(x, bins, min, max)
    return torch.histc(x.double(), bins, min, max).to(x.dtype)
