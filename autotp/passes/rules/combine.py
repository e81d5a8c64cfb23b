"""An expert layer's combine reduce-scattered straight into the rank's tokens.

Under expert-TP the combine (the routing weights' product, the reorder back to token order, the
top-k sum) is linear in the down product's partial rows, so its result ``[b*s, h]`` is a Partial.
Where the model casts it to another dtype before the view back to ``[b, s, h]`` (Mixtral: float32
routing weights make the combine float32, ``.to(hidden.dtype)`` after it), the cast takes no
Partial (each rank's summand would be rounded apart), so the sum was made whole by a g of ``[b*s,
h]`` and, under sequence parallelism, sliced to the rank's run of the sequence at the residual add.

A cast to a narrower dtype of a Partial whose rows are flattened tokens (dim 0 ``outer * s``, ``s`` a
sequence symbol) is offered on the rank's own tokens instead: the Partial reduce-scattered along
the sequence into ``Routed(0, tokens=True)`` rows (``P(tokens 0)``, the rank's ``b`` runs of
``s/tp``, the row map :func:`~autotp.distributed.experts.token_rows` makes), the cast on them, and
the view back to ``[b, s/tp, h]`` a local view (:func:`.experts.token_sequence`). Half a g's bytes
forward; backward the reduce-scatter's all-gather, as the scatter's was. Chosen by cost.
"""
from __future__ import annotations

from typing import Any

import torch

from ...placements import PARTIAL, Routed
from .pointwise import CASTS, sequence_factors
from .registry import OpInfo, Strategy, TensorMeta, _RULES, register

aten = torch.ops.aten

#: the rank's tokens, in sequence order: its ``b`` runs of ``s/tp`` rows
TOKENS = Routed(0, tokens=True)

_CAST_RULES = {t: _RULES[t] for t in CASTS}


def _partial_tokens(info: OpInfo, placements: tuple) -> bool:
    """A cast to a narrower dtype of a plain Partial ``[outer*s, ...]`` (flattened tokens) where
    the sequence may be split afresh. Narrower alone (the combine's float32 to the hidden dtype):
    offered on a widening cast too (a router's logits to float32, a Partial where the router is
    row-parallel), it took no plan, and its placements pushed Mixtral-8x7B's search at 2 layers
    past :data:`~autotp.passes.solve.MAX_STATES` (890 states before, over 1024 then)."""
    if info.tp <= 1 or len(info.inputs) != 1 or not placements or placements[0] != PARTIAL or not info.uneven:
        return False
    meta, out = info.inputs[0], info.output
    if not isinstance(out, TensorMeta) or meta.ndim < 1 or not _narrows(meta.dtype, out.dtype):
        return False
    return sequence_factors(meta.shape[0], info.sequence) is not None


def _narrows(have: Any, want: Any) -> bool:
    """Whether a cast from dtype ``have`` to ``want`` narrows a floating-point value."""
    return (isinstance(have, torch.dtype) and isinstance(want, torch.dtype) and have.is_floating_point
            and want.is_floating_point and torch.finfo(want).bits < torch.finfo(have).bits)


def tokens_cast_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """The cast's own strategies and, for a Partial of flattened tokens, the cast on the rank's
    own tokens, the Partial reduce-scattered into them (the conversion; rewrite.scatter_tokens)."""
    found = _CAST_RULES[info.target](info, placements)
    if _partial_tokens(info, placements):
        found.append(Strategy((TOKENS,), TOKENS))
    return found


register(*CASTS)(tokens_cast_rule)
