"""A module's structure as text: what the capture cache keys on and what cut-and-expand compares.

Every plain value a model's code may read (numbers, strings, dtypes, HuggingFace configs as
their full JSON, functions by qualified name, tensors that are not parameters by dtype, shape
and values) is described; anything else raises :class:`Uncacheable`.
"""
from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

import torch


#: nn.Module's own attributes; private attributes of the model's classes are keyed like any other
#: (transformers keeps a replaced ``loss_function`` in ``_loss_function``)
_TORCH_BOOKKEEPING = frozenset(torch.nn.Module().__dict__) - {"training"}

_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class Uncacheable(Exception):
    """The model has state the key cannot read; it is captured afresh."""


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _describe(value: Any, where: str) -> str:
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v, where) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_describe(v, where) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_describe(v, where)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, torch.Tensor):   # not a parameter or buffer: export lifts it as a constant
        if value.device.type == "meta":
            return f"tensor{tuple(value.shape)}{value.dtype}"
        data = hashlib.sha256(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        return f"tensor{tuple(value.shape)}{value.dtype}:{data}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _qualname(value)
    if isinstance(value, functools.partial):
        return (f"partial {_describe(value.func, where)} {_describe(value.args, where)} "
                f"{_describe(value.keywords, where)}")
    if isinstance(value, types.MethodType):
        return f"method {_qualname(value.__func__)} of {type(value.__self__).__name__}"
    if hasattr(value, "to_json_string") and hasattr(value, "to_dict"):   # a HuggingFace config
        return (value.to_json_string(use_diff=False) + f" attn={getattr(value, '_attn_implementation', None)}"
                f" experts={getattr(value, '_experts_implementation', None)}")
    raise Uncacheable(f"{where} is a {type(value).__name__}, which the structure key cannot read")
