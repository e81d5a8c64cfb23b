"""``host_reads=False``: plans with no device-to-host read in a step. The planner refuses, with a
PlanError naming the op or the pin and the fix, a model whose own program reads device values on
the host whatever the layout (a value read, an output sized by values, transformers' grouped experts
fallback), and a layout pinning whole experts per rank (expert parallelism, whose rows a rank counts
on the host every step) where no plan is left without it."""
from __future__ import annotations

from typing import Mapping

from ..capture import Capture, module_path
from ..errors import PlanError
from ..placements import Placement, Shard
from .experts import expert_stacks


#: ops of a model's program that read device values on the host whatever the layout: a value read
#: (``.item()``, ``bool(t)``, ``torch.equal``), an output sized by the values, transformers' grouped
#: experts fallback (its offsets, ``.tolist()``)
_READS_VALUES = ("aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default",
                 "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                 "aten.unique_dim.default", "aten.unique_consecutive.default",
                 "transformers.grouped_mm_fallback.default")


def refuse_pinned_reads(cap: Capture, pinned: Mapping[str, Placement], tp: int, exc: PlanError) -> None:
    """``host_reads=False`` and no plan: where whole experts are pinned per rank (expert
    parallelism, whose rows a rank counts on the host), a PlanError that says so (Llama-4's
    experts, every token through every expert, hold such a pin without a read)."""
    stacks = expert_stacks(cap)
    whole = [stacks[p] for p, placement in pinned.items()
             if p in stacks and isinstance(placement, Shard) and placement.dim == 0]
    if whole and tp > 1:
        raise PlanError(f"host_reads=False, but the layout pins {whole[0]} to whole experts per rank (expert "
                        "parallelism), where a rank reads how many rows its experts got on the host every step: pin "
                        "'expert_column'/'expert_row' (expert-TP), or allow host_reads") from exc


def refuse_model_reads(cap: Capture) -> None:
    """``host_reads=False``: a PlanError where the model's own program reads values on the host."""
    from ..passes.rules.registry import op_name

    reading: dict[str, None] = {}   # each op in each module once, in graph order
    for node in cap.graph.nodes:
        name = op_name(node.target) if node.op == "call_function" else ""
        is_sized = name == "aten.repeat_interleave.Tensor" and node.kwargs.get("output_size") is None
        if name in _READS_VALUES or is_sized:
            reading[f"{name} in {module_path(node) or 'the model'}"] = None
    if reading:
        fallback = any("grouped_mm_fallback" in r for r in reading)
        raise PlanError(
            f"host_reads=False, but the model's own program reads device values on the host, whatever the layout: "
            f"{'; '.join(list(reading)[:3])}{f' and {len(reading) - 3} more' if len(reading) > 3 else ''}. "
            + ("transformers runs its experts through grouped_mm_fallback where torch's grouped kernel does not take "
               "the dtype under capture (anything but bfloat16): run the model in bfloat16, or set "
               "config._experts_implementation = 'batched_mm'; " if fallback else "")
            + "or allow host_reads (the reads then stop the host each step)")
