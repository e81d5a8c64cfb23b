"""The cache a generation step hands its model: transformers' own ``DynamicCache`` for the
model's config, filled from plain named tensors, with windowed layers told their true length.

A transformers ``DynamicCache`` built from a config keeps a sliding-window layer (Mistral's,
gpt-oss's every other layer, Gemma's local layers) or a chunked-attention layer (Llama-4's) as a
``DynamicSlidingWindowLayer``: it holds only the last ``window - 1`` positions' keys and values
and counts the positions that passed through its ``update`` (``cumulative_length``). That count
is what the mask reads: the query's position (``get_seq_length``) and where the held keys start
among all positions seen (``get_mask_sizes``: the offset into the 2-D padding mask, and for
chunked attention the chunk a key falls in). A generation step is handed the cache whole, as
tensors: filled through ``update`` the layer counted the held keys (``window - 1``) as all it had
seen, so past the window a left-padded row's mask was read at the first positions instead of
the last (the padded prompt's pads where the real tokens are: wrong tokens from the second new
one, no error), and chunk boundaries fell elsewhere.

:class:`StepWindowLayer` is that layer handed its true count, ``past``: the attention mask's
width less the step's tokens (generate passes the mask to every decode step of a model with
windowed layers, all ones when nothing is padded). Its sizes are the ones transformers' layer
computes, written without a branch on the lengths (``min``, and a slice from there for what it keeps),
so one captured program serves a cache shorter than the window and one at the window alike:
transformers' ``if cumulative_length >= sliding_window`` under torch.export guards the program to
one side (the prefill's sequence range began at ``window - 1``; a decode program captured past
the window refused a cache below it).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def _window_layer_class() -> type | None:
    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer
    except ImportError:   # a transformers without per-layer cache types: nothing to replace
        return None
    return DynamicSlidingWindowLayer


def windowed_layers(config: Any) -> dict[int, int]:
    """Layer index -> window of the layers whose cache ``DynamicCache(config=config)`` holds as a
    sliding window (sliding-window and chunked attention: the last ``window - 1`` positions);
    empty where none, or where transformers has no such layer type."""
    window = _window_layer_class()
    if window is None or config is None:
        return {}
    try:
        from transformers.cache_utils import DynamicCache
        layers = DynamicCache(config=config).layers
    except Exception:   # a config transformers cannot read as a cache
        return {}
    return {i: int(layer.sliding_window) for i, layer in enumerate(layers) if type(layer) is window}


@functools.cache
def _step_window_layer() -> type | None:
    base = _window_layer_class()
    if base is None:
        return None

    class StepWindowLayer(base):
        """``DynamicSlidingWindowLayer`` holding ``keys``/``values`` (the last ``window - 1``
        positions at most) after ``past`` positions were seen; see the module docstring."""

        def __init__(self, sliding_window: int, keys: torch.Tensor | None, values: torch.Tensor | None,
                     past: Any):
            super().__init__(sliding_window=sliding_window)
            if keys is not None:
                self.lazy_initialization(keys, values)
                self.keys, self.values = keys, values
            self.cumulative_length = past

        def _holds(self) -> bool:
            return self.keys is not None and self.keys.dim() == 4

        def _held(self) -> Any:
            return self.keys.shape[-2] if self._holds() else 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self._holds():   # the prefill: nothing seen before this step
                self.lazy_initialization(key_states, value_states)
                full_keys, full_values = key_states, value_states
            else:
                full_keys = torch.cat([self.keys, key_states], dim=-2)
                full_values = torch.cat([self.values, value_states], dim=-2)
            self.cumulative_length = self.cumulative_length + key_states.shape[-2]
            length = full_keys.shape[-2]
            start = length - torch.sym_min(length, self.sliding_window - 1)   # the last window - 1 positions
            self.keys, self.values = full_keys[:, :, start:], full_values[:, :, start:]
            return full_keys, full_values   # this step attends to the held keys and its own

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            held = self._held()
            return held + query_length, self.cumulative_length - held

        def get_seq_length(self) -> int:
            return self.cumulative_length

    return StepWindowLayer


def own_cache_class(model: Any) -> type | None:
    """The cache class a model makes and requires of its own, where it has one: a subclass of
    ``DynamicCache`` that a module's forward names as the type of its cache argument (MiniMax's
    ``MiniMaxCache``, which keeps its lightning attention's states in a list beside the layers
    and refuses any other cache); None for a model that takes any ``DynamicCache``."""
    import typing

    from transformers.cache_utils import DynamicCache

    seen = set()
    for module in model.modules():
        forward = type(module).forward
        if forward in seen:
            continue
        seen.add(forward)
        names = [n for n in inspect.signature(forward).parameters if n in ("cache", "past_key_values")]
        if not names:
            continue
        try:
            hint = typing.get_type_hints(forward).get(names[0])
        except Exception:   # an annotation that does not resolve: no class named there
            continue
        for cls in typing.get_args(hint) or (hint,):
            if isinstance(cls, type) and issubclass(cls, DynamicCache) and cls is not DynamicCache:
                return cls
    return None


def own_states(cache: Any) -> list[tuple[str, list]]:
    """The per-layer lists a cache class of the model's own keeps beside its layers (MiniMax's
    ``linear_cache``: a lightning attention layer's state at its layer's index, ``[]`` for the
    others), by attribute name: what a step hands out and takes back as ``{name}_{layer}``."""
    from transformers.cache_utils import DynamicCache

    if type(cache) is DynamicCache:
        return []
    plain = set(vars(DynamicCache()))
    return [(name, value) for name, value in vars(cache).items() if name not in plain and isinstance(value, list)]


def step_cache(config: Any, tensors: dict[int, tuple[torch.Tensor, torch.Tensor]], past: Any,
               cache_class: type | None = None) -> Any:
    """A ``DynamicCache`` (or ``cache_class``, the model's own: :func:`own_cache_class`) for
    ``config`` holding ``tensors`` (attention layer -> its keys and values; {} for the prefill)
    after ``past`` positions; ``past`` None: what the tensors hold (the windowed layers then
    count their held keys, as transformers' update would)."""
    from transformers.cache_utils import DynamicCache

    cls = cache_class or DynamicCache
    try:
        cache = cls(config=config)
    except TypeError:   # a transformers without per-layer cache types, or a class of the model's own
        cache = cls()
    window, layer_class = _window_layer_class(), _step_window_layer()
    for i in range(len(cache.layers) if window is not None else 0):
        layer = cache.layers[i]
        if type(layer) is window:
            keys, values = tensors.get(i, (None, None))
            seen = 0 if keys is None else past if past is not None else keys.shape[-2]
            cache.layers[i] = layer_class(layer.sliding_window, keys, values, seen)
    for i, (keys, values) in sorted(tensors.items()):
        if layer_class is None or i >= len(cache.layers) or not isinstance(cache.layers[i], layer_class):
            cache.update(keys, values, i)
    return cache
