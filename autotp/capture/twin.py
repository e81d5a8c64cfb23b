"""The weightless shape twin: a copy of a model for its later captures, every tensor on the meta
device, so that a rank program does not keep the serial model's weights alive; and the memo of
the model's stacks that passed the three-block check, which the twin inherits.
"""
from __future__ import annotations

import copy
import itertools
import logging
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)


#: models whose stacks passed the three-block check: model -> {stack path: its
#: expand.Template or None}. Their later captures (other call signatures) cut them to
#: one block where a template describes how the blocks are called, else to two, where block 0
#: is alike the rest (stacks of period 1; a periodic stack keeps its first cut)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shape_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` for later captures, holding no weights: every parameter and buffer
    on the meta device (export reads only their shapes and dtypes; a tied pair stays one
    tensor), the module tree, configs and other attributes copied. A rank program keeps this
    for the call signatures it has not met yet, so that the model's own weights (the whole
    serial model, on every rank) are not kept alive by autotp once its shards are held: a user
    who drops the model gets its memory back. What the model's first capture learned about its
    stacks carries over. A model already all on the meta device is its own twin, and so is one
    ``copy.deepcopy`` refuses (logged)."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as exc:   # an attribute deepcopy refuses (a lock, a process group, a file)
        log.warning("autotp: %s cannot be copied without its weights (%s: %s); later captures read the model "
                    "itself, which stays referenced", type(model).__name__, type(exc).__name__, exc)
        return model
    if model in _CHECKED:
        _CHECKED[twin] = dict(_CHECKED[model])
    return twin


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds any tensor on the meta device (then export gets meta inputs)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
