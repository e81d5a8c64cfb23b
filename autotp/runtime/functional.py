"""Plain functions the rewritten graph calls where a sharded op needs more than its ATen op."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor,
                             ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Look up the rows this rank holds (``ranges`` of the full vocabulary, in local order);
    rows held elsewhere give 0, so the sum over ranks (a g all-reduce) is the full lookup."""
    local = torch.zeros_like(indices)
    mask = torch.zeros_like(indices, dtype=torch.bool)
    offset = 0
    for start, stop in ranges:
        hit = (indices >= start) & (indices < stop)
        local = torch.where(hit, indices - start + offset, local)
        mask = mask | hit
        offset += stop - start
    out = F.embedding(local, weight)
    return out * mask.unsqueeze(-1).to(out.dtype)
