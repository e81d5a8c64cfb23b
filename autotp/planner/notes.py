"""What a plan says about its memory and about what it leaves whole: the MemoryLimitError where no
plan fits (the bytes per rank the fastest plan needs, training state against activations, the
remedies of the larger part first), the note of a plan that keeps most of the model replicated
(and how to split more), and the note of a Mamba2 in-projection left unsplit by head (its head
groups too few for tp). Each reads a solved plan; none changes it."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import MemoryLimitError
from ..passes.propagate import GraphIndex
from ..placements import Placement, Shard
from ..plan.plan import Plan


def what_memory_takes(exc: MemoryLimitError, index: GraphIndex, batch: int, seq: int) -> MemoryLimitError:
    """``exc`` (no plan fits the memory limit; the solver found what the fastest plan needs) with
    a message that says it: the bytes per rank, training state against activations, and what
    would bring them under the limit, the larger part's remedies first."""
    gib, limit, tp = 2 ** 30, exc.limit_bytes, index.tp
    state, acts = exc.state_bytes, exc.activation_bytes
    for_state = ("a larger tp, pipeline stages (autotp.plan(..., world=N) chooses tp x pp x dp) or data-parallel "
                 "sharding (autotp.runtime.fsdp.fully_shard) for the training state")
    for_acts = ("a smaller batch or seq for the activations (each layer's recomputed already: "
                "activation_checkpointing=True)" if index.recomputed
                else "a smaller batch or seq, or activation_checkpointing=True, for the activations")
    fixes = f"{for_state}; {for_acts}" if state >= acts else f"{for_acts}; {for_state}"
    message = (f"no plan fits the memory limit of {limit / gib:.2f} GiB per rank at tp={tp} (the slower plans that "
               f"shard more were searched too): the fastest plan needs {exc.needed_bytes / gib:.2f} GiB per rank, "
               f"training state {state / gib:.2f} GiB (weights, gradients, Adam's moments) and activations "
               f"{acts / gib:.2f} GiB at batch {batch}, seq {seq}. Use {fixes}; or raise memory_limit")
    return MemoryLimitError(message, exc.needed_bytes, state, acts, limit)


#: below this share of parameter bytes split across ranks, a plan says why and how to split more
SPLIT_SHARE_NOTED = 0.5


def replicated_note(result: Plan, layout: Mapping[str, Any] | None) -> str | None:
    """Why most of the model stays whole, and how to force splits, when the solver left it so."""
    serial = result.serial_param_bytes()
    saved = serial - max(result.param_bytes_per_rank())
    share = saved / (serial * (1 - 1 / result.tp)) if serial else 1.0   # 1.0: every byte split tp ways
    if share >= SPLIT_SHARE_NOTED:
        return None
    return (f"most of the model runs replicated (the split saves {share:.0%} of what splitting everything "
            f"{result.tp} ways would): at this workload (batch={result.batch}, seq={result.seq}, profile "
            f"{result.profile}) the collectives a split needs cost more than the compute it saves. To split "
            "more: pin roles with layout={'<glob>': 'column'|'row'|'vocab'}, plan for the workload you will "
            "run (batch=, seq=), or pass the profile of the hardware (profile=)"
            + ("" if not layout else "; the given layout's pins are applied"))


def unsplit_mixer_note(index: GraphIndex, result: Plan) -> str | None:
    """Why a Mamba2 in-projection (``[z | x | B | C | dt]``, its ``x | B | C`` split again after
    the convolution: :func:`~autotp.passes.hints._grouped_pieces`) is not split by head where tp
    cannot deal its head groups: it is whole, or its z dealt and the rest whole (a tail). B's and
    C's rows, whole on every rank where there are fewer groups than ranks, must divide into as
    many parts as the heads: 6 heads beside a state of 4 make 2 groups, too few for tp 3."""
    import math

    import torch

    from ..passes.hints import _grouped_pieces, _piece_atoms
    from ..plan.plan import _projection

    cap, tp, uneven = index.capture, index.tp, index.uneven
    unsplit: list[tuple[str, Placement, int, int]] = []
    for node in cap.graph.nodes:
        if node.target is not torch.ops.aten.split_with_sizes.default or "val" not in node.args[0].meta:
            continue
        d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % node.args[0].meta["val"].dim()
        blocks = _piece_atoms(node, d, tp, uneven, None, nested_ok=True)
        if blocks is None or not any(inner for _, _, inner in blocks) or _grouped_pieces(node, d, tp, uneven, None):
            continue
        _, param = _projection(node.args[0], cap.param_names)
        placement = result.params.get(param)
        if param is not None and not (isinstance(placement, Shard) and placement.sizes):
            # as _grouped_pieces reads it: B and C (inner pieces of fewer atoms than ranks) whole,
            # the others dealt in as many head groups as divide every piece
            held = [inner and atoms < tp for _, atoms, inner in blocks]
            dealt = math.gcd(*(atoms for (_, atoms, _), h in zip(blocks, held) if not h))
            groups = math.gcd(dealt, *(width for (width, _, _), h in zip(blocks, held) if h))
            unsplit.append((param, placement, dealt, groups))   # dealt: x's and dt's heads (z counts elements)
    if not unsplit:
        return None
    param, placement, heads, groups = unsplit[0]
    fits = [t for t in range(2, groups + 1) if groups % t == 0 or uneven]
    why = f"fewer than tp={tp}" if groups < tp else f"not a multiple of tp={tp} (uneven=False)"
    n = len(unsplit)
    return (f"{n} Mamba2 in-projection{'s' if n > 1 else ''} ({param}: {placement}{', ...' if n > 1 else ''}) "
            f"not split by head, the mixer's scan unsplit: its {heads} heads and the rows of B and C divide "
            f"into {groups} head group{'s' if groups > 1 else ''} at most, {why}"
            + (f"; tp in {fits} splits it by head" if fits else "")
            + ". The model computes what the serial one does")
