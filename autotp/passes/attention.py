"""Attention heads read from the graph: how many query heads each attention op has (off its
operands, not a config's attribute names), and the check that tp can split them."""
from __future__ import annotations

import torch

from ..capture import Capture, module_path
from ..errors import PlanError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_head_counts(cap: Capture) -> dict[str, int]:
    """Module -> number of query heads of each attention op in the graph, read off the op's
    operands (not a config's attribute names): ``scaled_dot_product_attention``'s q is
    ``[..., heads, s, d]``; eager attention's softmax of scores is ``[..., heads, s, s]``."""
    aten = torch.ops.aten
    found: dict[str, int] = {}
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            val = node.args[0].meta.get("val")
        elif node.target in (aten._softmax.default, aten.softmax.int):
            val = node.args[0].meta.get("val")
            if not (isinstance(val, torch.Tensor) and val.dim() >= 3
                    and all(isinstance(d, torch.SymInt) for d in val.shape[-2:])):
                continue
        else:
            continue
        if isinstance(val, torch.Tensor) and val.dim() >= 3 and not isinstance(val.shape[-3], torch.SymInt):
            found.setdefault(module_path(node), int(val.shape[-3]))
    return found


def check_heads(cap: Capture, tp: int, uneven: bool) -> None:
    """Heads are the dimension Megatron splits attention by: name it when it does not divide."""
    counts = attention_head_counts(cap)
    if not counts:
        return
    where, heads = min(counts.items(), key=lambda kv: kv[1])
    where = where or "the model"
    if tp > heads:
        raise PlanError(
            f"tp={tp} exceeds the {heads} attention heads of {where} (read off its attention op): a rank "
            f"would hold no head; choose tp <= {heads}"
        )
    if heads % tp and not uneven:
        raise PlanError(
            f"{heads} attention heads ({where}) cannot be split {tp} ways evenly with uneven=False; "
            f"choose tp in {_divisors(heads)} or pass uneven=True"
        )
