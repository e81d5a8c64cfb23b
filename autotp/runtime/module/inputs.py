"""Call-time checks of inputs: never a silently wrong answer.

Empty inputs (a dim of size 0) are refused (:func:`check_not_empty`).


Serially, a token id outside the vocabulary raises (``embedding``: index out of range) and so
does a label outside it (``cross_entropy``: target out of bounds). On the vocab-parallel path
each rank looks up only its own rows and masks the rest, so an id outside every rank's range
would give a zero vector and a finite, wrong loss. So a program reads off its graph which user
inputs index a table of which size (:func:`index_bounds`), and every call checks them before
running (:func:`check_index_bounds`). The ranks of a TP group got the same inputs (checked
first), so they all raise the same :class:`~autotp.errors.InputError` or none does.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

#: ops through which an index tensor keeps its values (only moved, cut or padded)
_CARRY = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.contiguous.default,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device, aten.alias.default,
    aten.pad.default, aten.constant_pad_nd.default,
}


def _source(node: Any, inputs: dict[str, str]) -> str | None:
    """The user input ``node`` carries the values of, if any."""
    for _ in range(32):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            return inputs.get(node.name)
        if node.op != "call_function" or node.target not in _CARRY:
            return None
        node = node.args[0]
    return None


def index_bounds(capture: Any) -> dict[str, tuple[int, int | None, str]]:
    """Input key -> (size of the table it indexes, an ignored value or None, what it indexes)."""
    inputs = dict(zip(capture.user_inputs, capture.input_keys))
    found: dict[str, tuple[int, int | None, str]] = {}
    for node in capture.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default:
            weight, index = node.args[0], node.args[1]
            key, ignore, what = _source(index, inputs), None, "an embedding table"
        elif node.target is aten.cross_entropy_loss.default:
            weight, index = node.args[0], node.args[1]
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
            key, what = _source(index, inputs), "the classes of a cross-entropy loss"
        else:
            continue
        val = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        size = val.shape[0] if node.target is aten.embedding.default else val.shape[-1]
        if key is not None and isinstance(size, int):
            previous = found.get(key)
            if previous is None or size < previous[0]:
                found[key] = (size, ignore, what)
    return found


def check_index_bounds(bounds: dict[str, tuple[int, int | None, str]], kwargs: dict[str, Any]) -> None:
    """Refuse an index input holding a value outside the table it indexes. The smallest and
    largest kept value of every checked input are read back from the device in one transfer
    (on a GPU each read waits for the queued work: one wait per call, not three per input)."""
    staged = stage_index_bounds(bounds, kwargs, defer=False)
    if staged is not None:
        staged.check()


class StagedBounds:
    """The ends of a call's index inputs, computed where the inputs are and copied to the host
    without waiting (:func:`stage_index_bounds`); :meth:`check` reads them and raises the
    InputError :func:`check_index_bounds` raises. On a GPU the copy is queued behind the call's
    own work, and reading it waits for the device to reach that point, which a call later it has."""

    def __init__(self, found: torch.Tensor, checked: list, event: Any = None, call: str = ""):
        self.found, self.checked, self.event, self.call = found, checked, event, call

    def check(self) -> None:
        from ...errors import InputError

        if self.event is not None:
            self.event.synchronize()
        found = self.found.tolist()   # a host tensor: on the device the values were copied from
        for i, (key, size, ignore, what) in enumerate(self.checked):
            lo, hi = found[2 * i], found[2 * i + 1]
            if lo > hi:
                continue
            if lo < 0 or hi >= size:
                bad = lo if lo < 0 else hi
                raise InputError(
                    f"{key} {'of ' + self.call + ' ' if self.call else ''}holds {bad}, outside [0, {size}) "
                    f"({key} indexes {what} of {size} rows"
                    + ("" if ignore is None else f"; {ignore} marks an ignored position") + "): "
                    "the serial model raises an IndexError here; fix the data or the tokenizer's vocabulary"
                )


def stage_index_bounds(bounds: dict[str, tuple[int, int | None, str]], kwargs: dict[str, Any],
                       defer: bool = True, call: str = "") -> StagedBounds | None:
    """The ends of every index input of ``bounds`` in ``kwargs``, staged for :meth:`StagedBounds.check`
    (None where nothing is checked). ``defer``: copied to the host without waiting for the device
    (``call`` names the call in the error, which comes a call later); else read at once."""
    checked, ends = [], []
    for key, (size, ignore, what) in bounds.items():
        value = kwargs.get(key)
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_floating_point():
            continue
        value = value.to(torch.int64)
        if ignore is None:
            ends += [value.min(), value.max()]
        else:   # ignored positions count as neither end (all ignored: the ends cross, nothing to check)
            kept = value != ignore
            ends += [torch.where(kept, value, _INT64_MAX).min(), torch.where(kept, value, _INT64_MIN).max()]
        checked.append((key, size, ignore, what))
    if not checked:
        return None
    found = torch.stack(ends)
    if not defer:
        return StagedBounds(found, checked)
    # a copy the device queues behind the call's work; on the host it is the values themselves
    host = found.to("cpu", non_blocking=True, copy=True)
    event = None
    if found.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return StagedBounds(host, checked, event, call)


_INT64_MAX, _INT64_MIN = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min


def check_not_empty(kwargs: dict[str, Any]) -> None:
    """A tensor input with a dim of size 0 (an empty batch, an empty sequence) is refused on every
    rank: export specializes size 0, and a collective over nothing would still be a collective."""
    from ...errors import InputError

    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and 0 in value.shape:
            raise InputError(
                f"{key} has shape {tuple(value.shape)}: an empty batch or sequence; autotp runs no empty "
                "call (skip it in the data loader, or call the serial model for it)"
            )
