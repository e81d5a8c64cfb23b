"""A program: one kind of call's capture, plan and rewritten graph, and which calls it serves.

A ParallelModule holds one program per kind of call it has seen (training or inference, the
inputs present, their dtypes, a generation step); :meth:`Program.serves` decides whether a
call's inputs are the ones a program was captured for, and :func:`unequal_symbol` /
:func:`within_ranges` read the captured dims' symbols and ranges against a call's sizes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from ...capture import Capture
from ...capture.program import guards_hold
from ...plan import Plan
from ...placements import Shard


@dataclass
class Program:
    """One call signature's program: its capture, its plan (the module's one parameter layout,
    this graph's collectives) and this rank's rewritten graph, with what feeds the graph."""

    capture: Capture
    plan: Plan
    graph_module: fx.GraphModule
    param_order: list[str]          # the parameter FQN fed to each parameter placeholder
    buffer_order: list[str]         # the buffer FQN fed to each buffer placeholder
    constants: list[torch.Tensor]
    bounds: dict = field(default_factory=dict)   # input key -> the table it indexes (runtime/module/inputs.py)
    step: str = ""   # "prefill"/"decode": a generation step's program (autotp.generation), not a call's
    arriving: dict = field(default_factory=dict)   # input key -> its placement when it comes in split
    #: (flat output index, the split dim, its whole size, the DTensor placement over tp) for each
    #: output a call returns split, as a DTensor (``gather_logits``); made once, outside any trace
    split: tuple = ()
    #: tensor input key -> (dtype, rank, the (dim, size) pairs the capture kept static), read off
    #: the graph once (not per call: torch.compile traces the calls, and the graph with them)
    inputs: dict = field(init=False, default_factory=dict)
    #: parameter FQNs the program's layer calls read themselves (per-layer FSDP: runtime.module.outline)
    outlined: frozenset = frozenset()
    #: the graph's forward as eager code (:func:`~autotp.runtime.module.eager_code.eager_forward`:
    #: its ops and collectives called without the Python between), made from the graph module's
    #: code ``eager_of`` (its ``_code``, made again when the graph is recompiled); None: the graph
    #: module runs itself
    eager: Callable[..., Any] | None = field(init=False, default=None, repr=False)
    eager_of: str | None = field(init=False, default=None, repr=False)

    def bind_eager(self) -> Callable[..., Any] | None:
        """The eager code of the graph module's current code, made now (see ``eager``)."""
        from .eager_code import eager_forward

        gm = self.graph_module
        self.eager, self.eager_of = eager_forward(gm), gm._code
        return self.eager

    def serves(self, kwargs: dict[str, Any], training: bool, tied: bool = True, guarded: bool = True) -> bool:
        """Does this program compute a call with these inputs, in this mode? Same tensor inputs
        (names, dtypes, ranks), same non-tensor flags (a flag left out takes the captured value),
        and equal sizes where the capture has one symbol (``tied=False``: all but that), within
        export's guards (``guarded=False``: all but those)."""
        cap = self.capture
        if cap.training != training:
            return False
        for key, value in kwargs.items():
            if key in cap.constant_inputs:
                if isinstance(value, torch.Tensor) or value != cap.constant_inputs[key]:
                    return False
            elif key not in cap.input_keys or not isinstance(value, torch.Tensor):
                return False
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        wanted = [k for k in cap.input_keys if k not in cap.constant_inputs]
        if sorted(tensors) != sorted(wanted):
            return False
        for key, (dtype, ndim, static) in self.inputs.items():
            if key in tensors:
                if dtype != tensors[key].dtype or ndim != tensors[key].dim():
                    return False
                # a dim the capture kept static (a float input's features) must have its size:
                # another size is another program, never a silently wrong answer
                split = self.arriving.get(key)
                skip = split.dim if isinstance(split, Shard) else -1   # a local size: the plan's split
                if any(tensors[key].shape[i] != n and i != skip for i, n in static):
                    return False
        # sizes that break a guard export traced under (a chunked scan's other residue class of
        # lengths, a single chunk) are another program's
        if guarded and not guards_hold(cap, tensors):
            return False
        # dims the capture made one symbol must be equal: a call whose lengths differ there (an
        # encoder-decoder's source and target) is another program
        return not tied or unequal_symbol(cap, tensors, self.arriving) is None

    def __post_init__(self) -> None:
        metas = {n.name: n.meta.get("val") for n in self.capture.graph.nodes if n.op == "placeholder"}
        for key, node_name in zip(self.capture.input_keys, self.capture.user_inputs):
            val = metas.get(node_name)
            if isinstance(val, torch.Tensor):
                static = tuple((i, int(d)) for i, d in enumerate(val.shape) if not isinstance(d, torch.SymInt))
                self.inputs[key] = (val.dtype, val.dim(), static)


#: builds a program for a call: (inputs, training[, generation step]) -> (capture, plan, rewritten graph)
ProgramBuilder = Callable[..., tuple]


def unequal_symbol(capture: Capture, kwargs: dict[str, Any], arriving: dict | None = None) -> str | None:
    """Where ``kwargs`` give two input dims of one symbol of ``capture`` different sizes, a
    sentence naming them (None where they agree). A dim ``arriving`` split holds a local size."""
    seen: dict[str, tuple[str, int]] = {}   # symbol -> (first input dim carrying it, its size)
    for key, sym in capture.input_dims.items():
        name, dim = key.rsplit(".", 1)
        value = kwargs.get(name)
        split = (arriving or {}).get(name)
        if not isinstance(value, torch.Tensor) or value.dim() <= int(dim) \
                or (isinstance(split, Shard) and split.dim == int(dim)):
            continue
        size = value.shape[int(dim)]
        first = seen.setdefault(sym, (key, size))
        if first[1] != size:
            return (f"{first[0].replace('.', ' dim ')} has size {first[1]} but {key.replace('.', ' dim ')} has {size}: "
                    f"the model was captured with these dims equal (one symbol, {sym})")
    return None


def fixed_length(captures: list[Capture], kwargs: dict[str, Any]) -> str | None:
    """Where a call's input has another size in a dim that capture found fixed (a forward that
    loops over the sequence: :attr:`Capture.fixed_dims`), a sentence saying that the call gets a
    program traced at its own size, what that costs and how to avoid it (said once per module)."""
    for cap in captures:
        for key, size in cap.fixed_dims.items():
            name, dim = key.rsplit(".", 1)
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > int(dim) and value.shape[int(dim)] != size:
                return (f"{name} has {value.shape[int(dim)]} elements in dim {dim}, but {cap.model_name}'s program was "
                        f"captured at {size} there and holds that size only: torch.export fixed the dim while tracing "
                        f"(the forward reads it as a number, e.g. loops over the sequence). Each other length gets a "
                        f"program of its own, captured on first use (seconds each); pad {name} to a few lengths "
                        "(labels -100 where padded) to keep their number small")
    return None


def broken_guards(programs: list[Program], kwargs: dict[str, Any], training: bool) -> str | None:
    """Where a call is a program's in all but the guards torch.export traced it under (a chunked
    scan's padding, Gated DeltaNet's 64-token chunks, lightning attention's blocks: another chunk
    count, or another residue class of the chunk, runs other code), a sentence saying that the
    call gets a program of its own, what that costs and how to avoid it. Said for each such new
    program: the next call of that chunk count is the new program's."""
    for program in programs:
        cap = program.capture
        if program.step or not cap.guards or guards_hold(cap, kwargs) \
                or not program.serves(kwargs, training, guarded=False):
            continue
        metas = {n.name: n.meta.get("val") for n in cap.graph.nodes if n.op == "placeholder"}
        traced = dict(zip(cap.input_keys, (metas.get(node) for node in cap.user_inputs)))
        read = sorted({(name, int(dim)) for guard in cap.guards
                       for name, dim in re.findall(r"L\['([^']+)'\]\.size\(\)\[(\d+)\]", guard)})
        sizes = []
        for name, dim in read:
            value, meta = kwargs.get(name), traced.get(name)
            if not isinstance(value, torch.Tensor) or not isinstance(meta, torch.Tensor) or value.dim() <= dim:
                continue
            hint = getattr(getattr(meta.shape[dim], "node", None), "hint", meta.shape[dim])
            if hint is not None and int(hint) != value.shape[dim]:
                sizes.append(f"{name} dim {dim} = {value.shape[dim]} (traced at {int(hint)})")
        said = ", ".join(sizes) or ", ".join(f"{n} dim {d}" for n, d in read)
        return (f"{said}: a size that breaks the guards torch.export traced {cap.model_name}'s program under (guards on "
                f"the length, as a forward that pads the sequence to a chunk and runs chunk by chunk makes: another "
                f"chunk count, or another residue class of the chunk, runs other code). This call gets a program of its own, captured, planned and "
                f"rewritten now (seconds, once per chunk count; later calls of that count reuse it); pad the inputs "
                f"to lengths of few chunk counts (labels -100 where padded) to keep the programs few")
    return None


def within_ranges(capture: Capture, kwargs: dict[str, Any]) -> bool:
    """Are the inputs' dynamic dims within what the capture was traced for?"""
    for key, (lo, hi) in capture.range_constraints.items():
        name, dim = key.rsplit(".", 1)
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > int(dim) and not lo <= value.shape[int(dim)] <= hi:
            return False
    return True
