"""One repeated layer of a plan, drawn as data flows through it (SVG), in Megatron-LM's terms.

Input: a :class:`~autotp.plan.Plan` with recorded flows (:mod:`autotp.plan_flow`). Output: SVG
text. Steps are laid out top to bottom by depth (a step sits one row below the deepest step it
reads from, so q, k and v, or gate and up, sit side by side); each weight matrix is drawn with its
split dim cut into the ranks' shares, coloured by rank (column: cut across its outputs, row: across
its inputs, vocab: across its rows, experts: whole experts per rank; grey where every rank holds
it: replicated, or the whole k and v of a multi-query projection). f and g (and all-gathers,
scatters, reduce-scatters) are circles on the edge where the plan puts them; edges are labelled
with the placement of the activation that flows along them (R replicated, S(d) split on dim d,
P partial sums). Nothing is read of the family: the same code draws GPT-2 (Megatron-LM's Figure
3), Llama, Falcon's grouped layout or an MoE layer.

The SVG is written by a few lines of our own: the drawing needs rectangles, lines, circles and
text, which is less than a dependency would bring.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from ..errors import ConfigError
from ..placements import Shard, local_ranges
from .flow import Flow, FlowStep

#: one colour per rank (cycled past 10), chosen apart in hue and readable under black text
RANK_COLOURS = ("#8ecae6", "#ffb703", "#90be6d", "#f4978e", "#b8a1e3", "#f9c74f", "#4cc9f0", "#e5989b",
                "#a3c4bc", "#ffd6a5")
WHOLE = "#d0d0d0"
COMM_COLOURS = {"f": "#1d4ed8", "g": "#b91c1c"}
COMM_WORDS = {"f": "f: forward identity, backward all-reduce",
              "g": "g: forward all-reduce, backward identity",
              "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
              "all_gather_f": "all-gather forward, reduce-scatter backward (f̄)", "scatter": "scatter (keep own part)",
              "all_reduce": "all-reduce", "reshard": "reshard",
              "all_to_all": "all-to-all forward, the reverse backward (a reshard, an expert dispatch)"}
COMM_MARKS = {"all_gather_f": "AGf", "all_gather": "AG", "reduce_scatter": "RS", "scatter": "SC", "all_reduce": "AR", "reshard": "RE",
              "all_to_all": "A2A"}
CELL_W, FONT = 330, 11
MAX_SIDE, MIN_SIDE = 150, 14


class _Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "none", rx: float = 0,
             extra: str = "") -> None:
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{max(h, 0.5):.1f}" '
                          f'rx="{rx}" fill="{fill}" stroke="{stroke}"{extra}/>')

    def line(self, x1: float, y1: float, x2: float, y2: float, colour: str = "#444", dash: bool = False) -> None:
        d = ' stroke-dasharray="4 3"' if dash else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" '
                          f'stroke-width="1.2" marker-end="url(#arrow)"{d}/>')

    def path(self, d: str, colour: str = "#888") -> None:
        self.parts.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.2" stroke-dasharray="4 3" '
                          'marker-end="url(#arrow)"/>')

    def circle(self, x: float, y: float, r: float, fill: str) -> None:
        self.parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{fill}" stroke="#222"/>')

    def text(self, x: float, y: float, s: str, size: int = FONT, anchor: str = "start", weight: str = "normal",
             colour: str = "#111", cls: str = "") -> None:
        c = f' class="{cls}"' if cls else ""
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                          f'font-weight="{weight}" fill="{colour}"{c}>{escape(s)}</text>')

    def document(self, width: float, height: float) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
                f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#444"/></marker></defs>\n'
                f'<rect width="100%" height="100%" fill="white"/>\n')
        return head + "\n".join(self.parts) + "\n</svg>\n"


def pick_flow(plan: Any, layer: str | None = None) -> "Flow":
    """The flow of ``layer`` (a name such as ``transformer.h.5``), else the one most layers repeat."""
    flows = plan.flows or []
    if not flows:
        raise ConfigError("this plan records no layer flows to draw (a plan saved by an older autotp, a model "
                          "without numbered layers, or a graph whose flows were not recorded: the log says why); "
                          "re-create it with autotp.plan(...)")
    if layer is None:
        # most repeated; among equals the last (a first layer often differs: the embedding's g)
        return max(reversed(flows), key=lambda f: len(f.indices))
    for f in flows:
        for i in f.indices:
            if layer in (f"{f.stack}.{i}", f"{f.stack}.{{{i}}}"):
                return f
    known = ", ".join(f"{f.stack}.{i}" for f in flows for i in f.indices[:1])
    raise ConfigError(f"the plan has no layer {layer!r}; layers it can draw: {known} (or any index of their stacks)")


def figure(plan: Any, path: Any = None, layer: str | None = None) -> str:
    flow = pick_flow(plan, layer)
    svg = draw(plan, flow)
    if path is not None:
        Path(path).write_text(svg)
    return svg


def _depths(steps: tuple["FlowStep", ...]) -> list[int]:
    depth: list[int] = []
    for s in steps:
        depth.append(1 + max((depth[k] for k in s.sources), default=-1))
    return depth


def _title_of(plan: Any, flow: "Flow") -> str:
    from .view import indices_text

    n = len(flow.indices)
    where = f"{flow.stack}.{indices_text(flow.indices)}" if n > 1 else f"{flow.stack}.{flow.indices[0]}"
    return (f"{where}: one layer{' of ' + str(n) if n > 1 else ''} at tp={plan.tp} "
            f"(profile {plan.profile}, batch {plan.batch}, seq {plan.seq})")


def draw(plan: Any, flow: "Flow") -> str:
    """The SVG of one layer of ``flow`` (its first index's parameters and heads)."""
    steps = flow.steps
    first = flow.indices[0]
    fqn = (lambda rest: f"{flow.stack}.{first}.{rest}")
    depth = _depths(steps)
    rows: dict[int, list[int]] = {}
    for k, d in enumerate(depth):
        rows.setdefault(d, []).append(k)
    sizes = [max(plan.shapes[fqn(p)], default=1) for s in steps for p in s.params if fqn(p) in plan.shapes]
    biggest = max(sizes, default=1)
    heights = {k: _height(plan, s, fqn, biggest) for k, s in enumerate(steps)}
    widest = max(len(r) for r in rows.values())
    width = max(CELL_W * widest, 760) + 120
    svg = _Svg()
    svg.text(20, 26, _title_of(plan, flow), size=14, weight="bold")
    y = 56
    pos: dict[int, tuple[float, float, float, float]] = {}   # step -> (x centre, top, bottom, half width)
    for d in sorted(rows):
        ks = rows[d]
        row_h = max(heights[k] for k in ks)
        span = CELL_W * len(ks)
        x0 = 100 + (width - 120 - span) / 2
        for j, k in enumerate(ks):
            cx = x0 + CELL_W * j + CELL_W / 2
            top = y + (row_h - heights[k]) / 2
            pos[k] = (cx, top, top + heights[k], 0)
            _draw_step(svg, plan, steps[k], fqn, cx, top, biggest, first)
        y += row_h + 46
    for k, s in enumerate(steps):
        for src in s.sources:
            _edge(svg, steps[src], s, pos[src], pos[k], depth[k] - depth[src])
    y = _legend(svg, plan, steps, y)
    return svg.document(width, y + 10)


def _height(plan: Any, s: "FlowStep", fqn: Any, biggest: int) -> float:
    if s.kind == "matmul" or s.kind == "embedding":
        name = _matrix(plan, s, fqn)
        joined = sum(1 for p in s.params if fqn(p) != name and len(plan.shapes.get(fqn(p), ())) >= 2)
        return max(_matrix_box(plan, name, biggest)[1] + 2 * 16 + 4, 38 + 13 * (joined + 1))
    if s.kind == "comm":
        return 34
    return 40


def _matrix(plan: Any, s: "FlowStep", fqn: Any) -> str | None:
    """The step's weight: its first parameter of two or more dims."""
    return next((fqn(p) for p in s.params if fqn(p) in plan.shapes and len(plan.shapes[fqn(p)]) >= 2), None)


def _side(n: int, biggest: int) -> float:
    return max(MIN_SIDE, MAX_SIDE * (n / biggest) ** 0.5)


def _axes(plan: Any, name: str) -> tuple[int, int]:
    """(dim drawn across, dim drawn down): a column split cuts across, a row or vocab split down."""
    shape = plan.shapes[name]
    p = plan.params[name]
    a, b = len(shape) - 1, len(shape) - 2
    if isinstance(p, Shard) and p.dim >= len(shape) - 2:
        split, other = p.dim, (len(shape) - 2 if p.dim == len(shape) - 1 else len(shape) - 1)
        return (split, other) if plan.roles.get(name) == "column" else (other, split)
    return a, b


def _matrix_box(plan: Any, name: str | None, biggest: int) -> tuple[float, float]:
    if name is None:
        return 60.0, 24.0
    across, down = _axes(plan, name)
    shape = plan.shapes[name]
    w, h = _side(shape[across], biggest), _side(shape[down], biggest)
    if len(shape) == 3:   # experts side by side
        n = min(shape[0], 16)
        w, h = max(w, 8 * n) , h
    return w, h


def _draw_step(svg: _Svg, plan: Any, s: "FlowStep", fqn: Any, cx: float, top: float, biggest: int,
               first: int) -> None:
    if s.kind == "comm":
        colour = COMM_COLOURS.get(s.op, "#6b21a8")
        svg.circle(cx, top + 17, 15, colour)
        svg.text(cx, top + 22, s.op if s.op in ("f", "g") else COMM_MARKS.get(s.op, s.op[:2].upper()), size=13,
                 anchor="middle", weight="bold", colour="white", cls=f"comm comm-{s.op}")
        svg.text(cx + 22, top + 14, COMM_WORDS.get(s.op, s.op), size=10)
        svg.text(cx + 22, top + 27, f"{s.output}" + (f"  before {s.module}" if s.module else ""), size=10,
                 colour="#555")
        return
    if s.kind in ("input", "output"):
        svg.rect(cx - 70, top + 4, 140, 30, "#f1f5f9", "#64748b", rx=15)
        svg.text(cx, top + 24, f"layer {s.kind} ({s.output})", anchor="middle", cls=s.kind)
        return
    if s.kind == "attention":
        svg.rect(cx - 95, top + 2, 190, 36, "#fef3c7", "#b45309", rx=6)
        heads = _heads(plan, fqn(s.module) if s.module else None)
        svg.text(cx, top + 17, f"attention ({s.op})", anchor="middle", cls="attention")
        svg.text(cx, top + 31, heads, size=10, anchor="middle", colour="#555")
        return
    name = _matrix(plan, s, fqn)
    if s.kind == "weight" or name is None:
        label = ", ".join(s.params) or s.module or s.op
        half = max(90, 3.4 * len(label) + 10)
        svg.rect(cx - half, top + 4, 2 * half, 32, "#f8fafc", "#94a3b8", rx=4)
        svg.text(cx, top + 18, label, anchor="middle", cls="param")
        roles = sorted({plan.roles.get(fqn(p), "?") for p in s.params})
        svg.text(cx, top + 31, f"{s.op} ({', '.join(roles)}) -> {s.output}", size=10, anchor="middle",
                 colour="#555")
        return
    w, h = _matrix_box(plan, name, biggest)
    x, y = cx - w / 2 - 60, top + 16
    svg.text(cx - 60, top + 11, _short(name, flow_prefix=fqn("")), anchor="middle", weight="bold", cls="param")
    _draw_matrix(svg, plan, name, x, y, w, h)
    shape = "x".join(map(str, plan.shapes[name]))
    role = plan.roles.get(name, "?")
    if len(plan.shapes[name]) == 3 and isinstance(plan.params[name], Shard) and plan.params[name].dim == 0:
        role = "expert"
    tx = x + w + 10
    svg.text(tx, y + 11, f"{role} {_plain(plan.params[name])}", weight="bold", cls="role")
    svg.text(tx, y + 25, f"{shape}, {s.op}", size=10, colour="#555")
    # matrices joined with it into one product (sibling products fused: q | k | v), each named
    joined = [p for p in s.params if fqn(p) != name and len(plan.shapes.get(fqn(p), ())) >= 2]
    extra = [p for p in s.params if fqn(p) != name and p not in joined]
    if extra:
        svg.text(tx, y + 38, "+ " + ", ".join(p.rsplit(".", 1)[-1] + " " + plan.roles.get(fqn(p), "?")
                                             for p in extra), size=10, colour="#555")
    line = y + 38 + (13 if extra else 0)
    svg.text(tx, line, f"out: {s.output}", size=10, colour="#555")
    for p in joined:   # joined: its rows follow the first's in one product
        line += 13
        svg.text(tx, line, _short(fqn(p), flow_prefix=fqn("")), size=10, colour="#555", cls="param")


def _short(name: str, flow_prefix: str) -> str:
    return name[len(flow_prefix):] if name.startswith(flow_prefix) else name


def _plain(p: Any) -> str:
    import re

    return re.sub(r"@\d+", "", repr(p))


def _heads(plan: Any, module: str | None) -> str:
    att = plan.attention or {}
    if module is not None and module in att:
        return f"heads per rank: {att[module]}"
    return "runs whole on every rank" if att else ""


def _draw_matrix(svg: _Svg, plan: Any, name: str, x: float, y: float, w: float, h: float) -> None:
    """The weight with its split dim cut into the ranks' shares (grey: held by every rank)."""
    shape = plan.shapes[name]
    p = plan.params[name]
    if len(shape) == 3:
        n = min(shape[0], 16)
        gap = 2
        cw = (w - gap * (n - 1)) / n
        for e in range(n):
            ex = x + e * (cw + gap)
            if isinstance(p, Shard) and p.dim == 0:
                owner = next((r for r in range(plan.tp) if any(a <= e < b for a, b in
                                                                local_ranges(shape[0], p, plan.tp, r))), None)
                svg.rect(ex, y, cw, h, RANK_COLOURS[owner % len(RANK_COLOURS)] if owner is not None else WHOLE,
                         "#333")
            else:
                _cut(svg, plan, name, ex, y, cw, h)
        return
    _cut(svg, plan, name, x, y, w, h)


def _cut(svg: _Svg, plan: Any, name: str, x: float, y: float, w: float, h: float) -> None:
    shape = plan.shapes[name]
    p = plan.params[name]
    if not isinstance(p, Shard) or p.dim < len(shape) - 2:
        svg.rect(x, y, w, h, WHOLE, "#333")
        return
    across, down = _axes(plan, name)
    size = shape[p.dim]
    length = w if p.dim == across else h
    holders: dict[tuple[int, int], list[int]] = {}
    for r in range(plan.tp):
        for a, b in local_ranges(size, p, plan.tp, r):
            holders.setdefault((a, b), []).append(r)
    svg.rect(x, y, w, h, "white", "#333")
    for (a, b), ranks in sorted(holders.items()):
        colour = WHOLE if len(ranks) > 1 else RANK_COLOURS[ranks[0] % len(RANK_COLOURS)]
        o, L = length * a / size, length * (b - a) / size
        if p.dim == across:
            svg.rect(x + o, y, L, h, colour, "#333", extra=' stroke-width="0.4"')
        else:
            svg.rect(x, y + o, w, L, colour, "#333", extra=' stroke-width="0.4"')
    svg.rect(x, y, w, h, "none", "#111")


def _edge(svg: _Svg, src: "FlowStep", dst: "FlowStep", a: tuple, b: tuple, span: int) -> None:
    ax, _, abot, _ = a
    bx, btop, _, _ = b
    # what flows: the producer's output, or what a collective takes in (the tensor it converts
    # may be a slice of the producer's output: Falcon's whole k and v)
    label = dst.output.split("->")[0] if dst.kind == "comm" else src.output.split("->")[-1]
    if span == 1:
        svg.line(ax, abot + 2, bx, btop - 2)
        svg.text((ax + bx) / 2 + 5, (abot + btop) / 2 + 4, label, size=10, colour="#0f5132", cls="placement")
        return
    # a value that skips rows (the residual stream): around the left side
    left = 40
    svg.path(f"M {ax - 70:.1f} {abot - 10:.1f} C {left:.1f} {abot:.1f}, {left:.1f} {btop:.1f}, {bx - 70:.1f} "
             f"{btop + 10:.1f}")


def _legend(svg: _Svg, plan: Any, steps: tuple, y: float) -> float:
    y += 4
    svg.text(20, y, "ranks:", size=11, weight="bold")
    for r in range(plan.tp):
        svg.rect(70 + r * 58, y - 10, 14, 12, RANK_COLOURS[r % len(RANK_COLOURS)], "#333")
        svg.text(88 + r * 58, y, f"rank {r}", size=10)
    svg.rect(70 + plan.tp * 58, y - 10, 14, 12, WHOLE, "#333")
    svg.text(88 + plan.tp * 58, y, "every rank", size=10)
    y += 20
    svg.text(20, y, "placements on the edges: R replicated, S(d) split on dim d (xN/u: N interleaved blocks of "
             "u-wide atoms), P partial sums", size=10, colour="#333")
    kinds = sorted({s.op for s in steps if s.kind == "comm"})
    if kinds:
        y += 16
        svg.text(20, y, "; ".join(COMM_WORDS.get(k, k) for k in kinds), size=10, colour="#333")
    return y + 10
