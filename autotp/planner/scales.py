"""Which per-row scales of products' outputs (a mixture of experts' routing weights) a plan
offers to move to the products' inputs, and the note of a plan that moved them
(:mod:`autotp.passes.row_scales`)."""
from __future__ import annotations

from typing import Any

from ..capture import module_path
from ..passes.row_scales import RowScale, row_scales
from ..placements import Shard


def local_width(placement: Any, width: int, tp: int) -> int:
    """A rank's columns of a ``[rows, width]`` tensor under ``placement`` (the largest share
    where it is split on its columns; every column otherwise: whole, partial or routed rows)."""
    if isinstance(placement, Shard) and placement.dim in (1, -1):
        return -(-width // tp)
    return width


def narrower_scales(index: Any, prop: Any) -> list[RowScale]:
    """The row scales of ``index``'s capture whose product's input a rank holds narrower than its
    output under ``prop``'s placements (the scale would run on fewer columns there, forward and
    backward, on the same rows)."""
    nodes = {n.name: n for n in index.capture.graph.nodes}
    out = []
    for scale in row_scales(index.capture):
        inner = local_width(prop.placements.get(nodes[scale.x]), scale.inner, index.tp)
        outer = local_width(prop.placements.get(nodes[scale.product]), scale.outer, index.tp)
        if inner < outer:
            out.append(scale)
    return out


def scales_note(index: Any, scales: list[RowScale], saved_s: float) -> str:
    """The plan's note where the per-row scales run on the products' inputs."""
    from .experts import _layers_text

    nodes = {n.name: n for n in index.capture.graph.nodes}
    modules = list(dict.fromkeys(module_path(nodes[s.product]) or s.product for s in scales))
    widths = sorted({(s.inner, s.outer) for s in scales})
    width_text = ", ".join(f"{i} against {o}" for i, o in widths)
    return (f"per-row scales (routing weights) of {len(scales)} product{'s' if len(scales) > 1 else ''} in "
            f"{_layers_text(modules)} applied to the product's input rows, not its output rows (columns "
            f"{width_text}, before the split): cheaper by {saved_s * 1e3:.3f} ms/step")
