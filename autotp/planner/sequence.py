"""Sequence parallelism in a plan, as the planner reads and explains it: how many regions a
propagation splits along the sequence (Megatron-SP's reduce-scatter in place of an all-reduce),
whether a program has a sequence to split at tp, the plan's note saying where it runs and why,
the note of a later program that ``sequence_parallel=True`` cannot apply to, and the clauses of
the PlanError where a forced program holds no region along the sequence (its cause and its fix).

Nothing here changes a plan: the strategies are the rules' (:mod:`autotp.passes.rules`), the choice
the solver's; these functions count and say."""
from __future__ import annotations

from typing import Any, Mapping

from ..capture import Capture
from ..passes.propagate import GraphIndex, Propagation
from ..placements import Routed, Shard


def sequence_regions(index: GraphIndex, prop: Propagation) -> int:
    """How many regions of a propagation run split along the sequence: reduce-scatters of a
    Partial along a dynamic dim or along the length a program holds as a number
    (``Capture.static_lengths``: Mamba's capture on CPU), or into the tokens' rows of a sequence
    split flattened with the batch (``[b*s, h]``: OPT's MLP); and a split of another dim moved into
    such a split, where no partial sum enters the region (embeddings split by columns, resharded
    into the sequence split at the first norm: ``rules/nn.py``; by an all-to-all, or cut from an
    all-gather another consumer shares)."""
    from ..passes.propagate import _meta
    from ..passes.rules.contract import along_sequence

    nodes = {n.name: n for n in index.capture.graph.nodes}
    count = 0
    for c in prop.comms:
        if c.kind == "reduce_scatter" and isinstance(c.dst, Routed) and c.dst.tokens:
            count += 1
        elif c.kind in ("reduce_scatter", "all_to_all", "scatter") and isinstance(c.dst, Shard) and c.tensor in nodes:
            if c.kind != "reduce_scatter" and not (isinstance(c.src, Shard) and c.src.dim != c.dst.dim):
                continue   # (a whole tensor sliced to the rank's tokens enters no region of its own)
            meta = _meta(nodes[c.tensor])
            if meta is not None and (meta.static(c.dst.dim) is None or along_sequence(meta, c.dst.dim, index.sequence)):
                count += 1
    return count


def sequence_to_split(cap: Capture, tp: int) -> bool:
    """Whether a program has a sequence sequence parallelism may split at ``tp``: a dynamic
    sequence dim, or a length it holds as a number of at least ``tp`` tokens."""
    return "seq" in cap.dim_symbols.values() or any(n >= tp for n in cap.static_lengths)


def sequence_note(index: GraphIndex, prop: Propagation) -> str | None:
    """Where a plan runs regions split along the sequence, and whether by cost or forced."""
    regions = sequence_regions(index, prop)
    if not regions:
        return None
    how = "forced (sequence_parallel=True)" if index.force_sequence else "chosen by cost (cheaper than all-reducing there)"
    return (f"sequence parallelism in {regions} region{'s' if regions > 1 else ''}, {how}: layer norms, dropouts and "
            "residual adds run on s/tp tokens between a reduce-scatter (or, from a split by columns, an all-to-all) "
            "and an all-gather along s (Megatron-SP's ḡ and f̄)")


def sequence_dropped(inputs: Mapping[str, Any], training: bool, step: str, cap: Capture, tp: int) -> str:
    """The note of a later program of ``parallelize`` planned by cost under
    ``sequence_parallel=True`` because it has no sequence to split (:func:`sequence_to_split`):
    a decode step's one token (``step="decode"``), lengths its capture holds static and not
    asked dynamic (a one-token prompt), or a length export fixed that is shorter than ``tp``."""
    if step:
        call = f"a generation {step} step"
    else:
        given = ", ".join(sorted(k for k, v in inputs.items() if v is not None))
        call = f"the call with {given} ({'training' if training else 'eval'} mode)"
    lengths = sorted(cap.static_lengths)
    if step == "decode":
        why = "it runs one token a row: there is no sequence to split (its cache stays split by head)"
    elif lengths:
        why = (f"its capture holds the sequence at {_tokens(lengths)} (torch.export fixed the length), fewer than "
               f"tp={tp}: no split of it gives every rank a token")
    else:
        why = "its capture holds every length static (a one-token prompt): there is no sequence dim to split"
    return (f"sequence_parallel=True does not apply to the program of {call}: {why}, so it is planned by cost "
            "(every program with a sequence to split is forced)")


def no_sequence_region(index: GraphIndex, replayed: bool) -> str:
    """Why a forced program holds no region along the sequence, as a clause: it has no sequence
    dim, its fixed length is shorter than tp, or no partial sum meets an op along it (in a plan
    solved here, or under a saved plan's placements: ``replayed``)."""
    cap, tp = index.capture, index.tp
    lengths = sorted(cap.static_lengths)
    if not index.sequence and not lengths:
        return (f"this program ({cap.model_name}, tp={tp}) has no sequence dim to split: no input's length is "
                "dynamic or fixed by export (the example inputs' sequence dims are held static, or the model takes "
                "none)")
    if not sequence_to_split(cap, tp):
        return (f"this program ({cap.model_name}) holds its sequence at {_tokens(lengths)} (torch.export fixed the "
                f"length: the forward reads it as a number), fewer than tp={tp}: no split of it gives every rank a "
                "token")
    along = "a dynamic sequence dim" if not lengths else f"the sequence (held static at {_tokens(lengths)})"
    if replayed:
        return ("under the plan's parameter placements no row-parallel product's partial sum meets an add, a dropout "
                f"or a cast along {along} in this program ({cap.model_name}, tp={tp}): nothing here can be "
                "reduce-scattered along the sequence")
    return (f"no row-parallel product's partial sum meets an add, a dropout or a cast along {along} in this plan at "
            f"tp={tp} (no layer is split so that a reduce-scatter along the sequence can replace its all-reduce)")


def sequence_fix(index: GraphIndex) -> str:
    """What a user can do where a forced program holds no region along the sequence."""
    if sequence_to_split(index.capture, index.tp):
        return ("Pin a row-parallel layout (layout={'<glob>': 'row'}), or leave sequence_parallel to the planner "
                "(None)")
    return (f"Capture with a sequence of at least tp={index.tp} tokens (example_kwargs= with longer inputs), or leave "
            "sequence_parallel to the planner (None)")


def _tokens(lengths: list[int]) -> str:
    return " or ".join(f"{n} token{'s' if n != 1 else ''}" for n in lengths)
