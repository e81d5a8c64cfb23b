"""What capture traces with: example inputs, dynamic dims and sequence bounds.

A HuggingFace model's example inputs are synthesized from its config (ids and labels); a call's
own inputs are bound to the forward's argument names and resized to example lengths, since
export specializes a dim of size 0 or 1 or one equal to a static size of the model. Batch (dim 0)
and sequence (dim 1 of integer inputs) are dynamic, one sequence symbol per distinct length.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import CaptureError, ConfigError


#: Example sizes used for tracing: 0 and 1 are avoided since export specializes them, and the
#: length is chosen (`_example_seq`) so it does not equal a static size of the model.
EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 11


def hf_example_kwargs(model: torch.nn.Module, batch: int = EXAMPLE_BATCH, seq: int = EXAMPLE_SEQ,
                      device: torch.device | str | None = None, target_seq: int | None = None) -> dict[str, Any]:
    """Example inputs for a HuggingFace model, synthesized from its config: ids and labels. An
    encoder-decoder model's labels (the decoder's side) are ``target_seq`` long, so that the
    captured program takes source and target of different lengths (one symbol each)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise CaptureError(
            f"cannot synthesize example inputs for {type(model).__name__}: it has no HuggingFace "
            "config with vocab_size; pass example_kwargs={...} (or example_inputs=(...)) to autotp"
        )
    n_pos = _max_positions(model)
    if n_pos is not None:
        seq = min(seq, n_pos)
    if seq < 2:
        raise CaptureError(f"{type(model).__name__} accepts at most {n_pos} positions; cannot trace")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    target = target_seq if target_seq is not None and getattr(config, "is_encoder_decoder", False) else seq
    labels = torch.randint(0, config.vocab_size, (batch, target), generator=gen)
    if device is not None:
        # A meta model gets meta inputs: buffers it indexes with them (BERT's token types)
        # live on the meta device too, and export only needs shapes.
        ids, labels = ids.to(device), labels.to(device)
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def bind_inputs(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any],
                owner: str = "the model") -> dict[str, Any]:
    """Positional inputs named by the model's forward signature: everything downstream of
    capture is keyed by argument name, so ``pm(x)`` and ``pm(input_ids=x)`` are one call."""
    if not args:
        return dict(kwargs)
    if signature is None:
        raise ConfigError(f"{owner}.forward has no readable signature: pass the inputs as keyword arguments")
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        raise ConfigError(f"{owner}.forward takes *args, so positional inputs have no names: "
                          "pass them as keyword arguments")
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"inputs do not fit {owner}.forward{signature}: {exc}") from None
    return dict(bound.arguments)


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def config_int(model: torch.nn.Module, *names: str) -> int | None:
    """The first of ``names`` that the model's config holds as an int, or None."""
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _max_positions(model: torch.nn.Module) -> int | None:
    return config_int(model, "n_positions", "max_position_embeddings", "n_ctx")


#: the widest sequence range tried when neither the model's config nor the caller bounds it
DEFAULT_SEQ_RANGE = (2, 1 << 20)


def _token_inputs(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inputs whose dim 1 is a sequence: every integer tensor of 2 dims or more."""
    return {k: v for k, v in kwargs.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point()}


def lengths_of(kwargs: dict[str, Any]) -> set[str]:
    """Every token input's length dim ("input_ids.1"): what :func:`example_like` keeps to trace
    a call at its own lengths."""
    return {f"{key}.1" for key in _token_inputs(kwargs)}


def _length_groups(kwargs: dict[str, Any]) -> dict[str, int]:
    """Each token input -> the index of its length among the distinct lengths, in order of
    first appearance: inputs of one length share a symbol, an encoder-decoder's source and
    target lengths get one each."""
    lengths: dict[int, int] = {}
    return {k: lengths.setdefault(int(v.shape[1]), len(lengths)) for k, v in _token_inputs(kwargs).items()}


def _dynamic_shapes(kwargs: dict[str, Any], seq_range: tuple[int, int]) -> dict[str, Any]:
    """Batch (dim 0) and sequence (dim 1) of every 2-D integer input are dynamic; inputs of one
    length in the example share one sequence dim, each other length has its own."""
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    groups = _length_groups(kwargs)
    seqs = [torch.export.Dim("seq" if i == 0 else f"seq{i}", min=seq_range[0], max=seq_range[1])
            for i in range(max(groups.values(), default=-1) + 1)]
    shapes: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in groups:
            shapes[key] = {0: batch, 1: seqs[groups[key]]}
        elif isinstance(value, torch.Tensor) and value.dim() >= 1:
            shapes[key] = {0: batch}
        else:
            shapes[key] = None
    return shapes


def seq_bounds(model: torch.nn.Module, seq_range: tuple[int, int] | None = None) -> tuple[int, int]:
    """The sequence lengths a capture should accept: ``seq_range`` if given, else 2 up to the
    config's maximum positions, else :data:`DEFAULT_SEQ_RANGE` (export then narrows it to what
    the model allows, e.g. a position table's length, or a minimum length the model needs)."""
    if seq_range is not None:
        lo, hi = seq_range
        if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi):
            raise ConfigError(f"seq_range={seq_range!r}: give (min, max) lengths with 2 <= min <= max "
                              "(lengths 0 and 1 are specialized by torch.export)")
        return lo, hi
    n_pos = _max_positions(model)
    return (2, n_pos) if n_pos else DEFAULT_SEQ_RANGE


def _example_seq(seq_range: tuple[int, int]) -> int:
    """An example length inside the range that is unlikely to equal a static size of the model
    (a head dim, a rotary dim: export would then tie the sequence to it)."""
    return _example_seqs(seq_range, 1)[0]


def _example_seqs(seq_range: tuple[int, int], n: int) -> list[int]:
    """``n`` distinct example lengths inside the range, the likeliest to be no static size of
    the model first (fewer where the range is narrower)."""
    lo, hi = seq_range
    picks = [length for length in (11, 13, 7, 5, 3, 2) if lo <= length <= hi]
    picks += [length for length in range(lo, min(hi, lo + n + 6) + 1) if length not in picks]
    return picks[:n] or [lo]


def example_like(inputs: dict[str, Any], seq_range: tuple[int, int], keep: Any = ()) -> dict[str, Any]:
    """Example inputs for capturing a call like ``inputs``: the same names, dtypes and values,
    resized (tiled, then cut) to a batch of 2 and, for 2-D integer inputs, to example lengths,
    since export specializes a dim of size 0 or 1 (a one-token call) or one equal to a static
    size of the model: inputs of one length in the call get one example length, inputs of
    another length another (an encoder-decoder's source and target), so the program's symbols
    equate what the call does and no more. Non-tensor inputs are kept as they are. ``keep``:
    input dims ("input_ids.1") kept at the call's size (dims an earlier capture found fixed, or
    lengths an earlier capture's guards do not hold for), each with every input of its length."""
    groups = _length_groups(inputs)
    lengths = _example_seqs(seq_range, max(groups.values(), default=0) + 1)
    # a kept dim keeps every input of its length: a padded call's mask has the ids' length
    kept = {group for key, group in groups.items() if f"{key}.1" in keep}
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() == 0:
            out[key] = value
            continue
        shape = list(value.shape)
        shape[0] = EXAMPLE_BATCH
        if key in groups and groups[key] not in kept:
            shape[1] = lengths[min(groups[key], len(lengths) - 1)]
        reps = [-(-want // have) for want, have in zip(shape, value.shape)]
        out[key] = value.repeat(*reps)[tuple(slice(0, n) for n in shape)].clone()
    return out
