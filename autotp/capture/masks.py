"""Capture a call without an attention mask the way transformers runs it eagerly.

Called without ``attention_mask`` (and without a cache), a transformers model's SDPA attention
runs with no mask at all: causal attention as ``is_causal=True``, bidirectional attention
unmasked, and grouped-query attention with k and v left at their own heads
(``enable_gqa=True``), which lets torch pick its flash kernels. Under ``torch.export``
transformers decides otherwise, on purpose: an exported program is meant to serve any later
call, so it never skips the mask (``masking_utils._ignore_causal_mask_sdpa`` answers False
while exporting), cannot tell from traced position ids that no sequences are packed, and,
with a mask, repeats k and v to every query head. Captured that way every decoder attended
with a materialized ``[b, 1, s, s]`` mask and repeated k/v (an H200, Llama with 16 query and 4
key/value heads: attention's backward 1.34 ms a step against HF's own 0.70).

autotp's programs do not serve any later call: each serves the calls of the signature it was
captured for (the same inputs present, a generation step's cache or none), and a call with an
``attention_mask`` or ``position_ids`` is captured on its own. So, while autotp exports a call,
:func:`eager_masks` answers transformers' two questions as its eager run would for every call
of that signature, and only where the answer does not depend on the values of a tensor:

* no sequences are packed, when the call passes no ``position_ids`` (the model then makes its
  own, consecutive from 0: transformers' packing test finds nothing in them, every time);
* the causal mask can be skipped when there is no padding mask, no sliding window or chunk,
  the queries start at position 0 and the query and key lengths are the same symbol, so
  equal for every call (transformers' own conditions, without its export refusal); the
  bidirectional mask likewise when there is no padding mask and no local window.

Everything else is asked of transformers itself. Where its ``masking_utils`` lacks these
functions (another version), nothing is changed and the mask is captured as before.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)

#: words in the names of the inputs that carry padding, positions or a cache (``attention_mask``,
#: ``decoder_attention_mask``, ``position_ids``, ``cache_position``, ``past_key_values``):
#: a call that passes one of them is captured with transformers' own (exporting) decisions
_VALUE_WORDS = ("mask", "position", "cache", "past")


def _masking_utils() -> Any:
    try:
        from transformers import masking_utils
    except Exception:   # transformers absent or too old to have it: nothing to answer
        return None
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "find_packed_sequence_indices")
    return masking_utils if all(callable(getattr(masking_utils, n, None)) for n in names) else None


def _statically_equal(a: Any, b: Any) -> bool:
    """``a == b`` for every call: equal ints, or sizes the shape environment knows equal
    (the same symbol), decided without adding a guard to the capture."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _exporting() -> bool:
    import torch

    return torch.compiler.is_exporting()


def _is_zero(offset: Any) -> bool:
    return type(offset) is int and offset == 0


def wants_eager_masks(kwargs: dict[str, Any]) -> bool:
    """Whether a call with these inputs runs its attention without a mask in eager transformers
    for every value of them: no input that carries padding, positions or a cache."""
    return not any(value is not None and not isinstance(value, bool) and any(word in name for word in _VALUE_WORDS)
                   for name, value in kwargs.items())   # (use_cache=False is a switch, not a cache)


@contextlib.contextmanager
def eager_masks(kwargs: dict[str, Any]) -> Iterator[None]:
    """While exporting a call with ``kwargs``: transformers' mask decisions as in its eager run
    (see the module docstring); a no-op for a call that passes a mask, positions or a cache,
    and for a transformers without these functions."""
    mu = _masking_utils()
    if mu is None or not wants_eager_masks(kwargs):
        yield
        return
    causal, bidirectional, packed = (mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa,
                                     mu.find_packed_sequence_indices)

    # each answers only inside the export (another thread's eager run asks transformers)
    def ignore_causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None,
                      *args, **kwargs):
        if _exporting() and padding_mask is None and local_attention_size is None and not args \
                and not kwargs and _is_zero(q_offset) and _statically_equal(q_length, kv_length):
            return True
        return causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size, *args, **kwargs)

    def ignore_bidirectional(padding_mask, kv_length, local_attention_size=None, *args, **kwargs):
        if _exporting() and padding_mask is None and local_attention_size is None and not args and not kwargs:
            return True
        return bidirectional(padding_mask, kv_length, local_attention_size, *args, **kwargs)

    def no_packing(position_ids, *args, **kwargs):
        if _exporting():
            return None   # the model's own positions: consecutive from 0, one sequence per row
        return packed(position_ids, *args, **kwargs)

    mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa = ignore_causal, ignore_bidirectional
    mu.find_packed_sequence_indices = no_packing
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa = causal, bidirectional
        mu.find_packed_sequence_indices = packed
