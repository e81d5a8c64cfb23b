"""A call's inputs of the wrong kind, refused by name before a program is captured for them.

A call whose inputs no program serves gets a new capture (another signature); inputs that could
never be captured (a float ``attention_mask``, ``input_ids`` without a batch dim) would then fail
inside torch.export with a CaptureError about making the forward traceable, which blames the
model. Instead, before any capture:

- an input a program was captured with must come with as many dims, and as floating point or
  not, as it was captured with (read off the capture's placeholders, whatever the model);
- HuggingFace's conventions for its token inputs hold: ``input_ids`` is an integer
  ``[batch, length]`` tensor and a 2-D ``attention_mask`` holds integers or bools of the same
  shape. (The serial model turns a float mask into a boolean one, so 0.5 would count as kept:
  autotp asks for the integer mask rather than guess.)

The ranks' inputs were compared first (same names, shapes and dtypes), so every rank raises
the same :class:`~autotp.errors.InputError`, or none does.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ...errors import InputError


def check_input_kinds(captures: Iterable[Any], kwargs: dict[str, Any]) -> None:
    seen: dict[str, Any] = {}
    for capture in captures:
        nodes = {n.name: n for n in capture.graph.nodes if n.op == "placeholder"}
        for name, key in zip(capture.user_inputs, capture.input_keys):
            val = nodes[name].meta.get("val") if name in nodes else None
            if isinstance(val, torch.Tensor):
                seen.setdefault(key, val)
    for key, value in kwargs.items():
        if not isinstance(value, torch.Tensor) or key not in seen:
            continue
        val = seen[key]
        if value.dim() != val.dim():
            raise InputError(f"{key} has {value.dim()} dim{'s' if value.dim() != 1 else ''} {tuple(value.shape)}, but "
                             f"the module runs {key} with {val.dim()}: pass it with {val.dim()} dims"
                             + (f" ({key}[None] for one sequence)" if value.dim() + 1 == val.dim() else ""))
        if value.is_floating_point() != val.is_floating_point():
            kind = "floating-point" if val.is_floating_point() else "integer"
            raise InputError(f"{key} is a {str(value.dtype).removeprefix('torch.')} tensor, but the module runs {key} "
                             f"as {kind} ({str(val.dtype).removeprefix('torch.')}): pass {key}.to({val.dtype})")
    _check_token_inputs(kwargs)


def _check_token_inputs(kwargs: dict[str, Any]) -> None:
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point():
            raise InputError(f"input_ids is a {str(ids.dtype).removeprefix('torch.')} tensor: token ids are integers")
        if ids.dim() == 1:
            raise InputError(f"input_ids has 1 dim {tuple(ids.shape)}: autotp takes a [batch, length] tensor of "
                             "2 dims (input_ids[None] for one sequence)")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if mask.is_floating_point():
            raise InputError(f"attention_mask is a {str(mask.dtype).removeprefix('torch.')} tensor: pass the 0/1 mask "
                             "as integer or bool (attention_mask.long()); the serial model would read any nonzero "
                             "float as 1")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and tuple(mask.shape) != tuple(ids.shape):
            raise InputError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(ids.shape)}: give "
                             "one mask entry per token")
