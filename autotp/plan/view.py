"""The plan as a person reads it: repeated layers folded, and two plans compared.

Input: a :class:`~autotp.plan.Plan`, solved now or read back from JSON; nothing here needs the
graph. A *layer* is the first numbered module of a parameter's name (``transformer.h.7``,
``encoder.block.3``, ``model.layers.0``). Layers of one stack fold into a group when they hold the
same parameters under the layer (names, shapes, layouts and placements) up to the rotation of
uneven shards, which the solver moves one rank per layer so that every rank ends up holding as
much; a layer that holds anything else (T5's first block with its position bias, a dense layer
before MoE layers) is a group of its own. Collectives fold the same way: those every layer of a
group runs are shown once per layer, any other (the embedding's g that Falcon's first layer norm
asks for) is listed with its full name. Totals are always over the whole plan.
"""
from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from ..placements import Placement, Shard


#: stack, index, rest of a name under the first numbered module (rest may be empty)
_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.(.*))?$")
_ROTATION = re.compile(r"@\d+")
_NUMBERED = re.compile(r"_\d+$")


def split_layer(name: str) -> tuple[str, int, str] | None:
    """``transformer.h.7.attn.c_attn.weight`` -> ("transformer.h", 7, "attn.c_attn.weight")."""
    m = _LAYER.match(name)
    return (m.group(1), int(m.group(2)), m.group(3) or "") if m else None


def unrotated(p: Placement) -> Placement:
    return replace(p, rotate=0) if isinstance(p, Shard) else p


def indices_text(indices: tuple[int, ...] | list[int]) -> str:
    """{0..47}, {3}, {0, 2..5, 9}, or {1, 3, ..., 47} for a stride."""
    xs = sorted(indices)
    if len(xs) == 1:
        return f"{{{xs[0]}}}"
    step = xs[1] - xs[0]
    if len(xs) >= 3 and step > 1 and all(b - a == step for a, b in zip(xs, xs[1:])):
        return f"{{{xs[0]}, {xs[1]}, ..., {xs[-1]}}}"
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return "{" + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs) + "}"


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one stack that hold the same parameters alike (up to uneven rotation)."""

    stack: str                  # transformer.h
    indices: tuple[int, ...]    # the layers, ascending
    params: tuple[str, ...]     # names under a layer, in the model's order (attn.c_attn.weight)

    @property
    def name(self) -> str:
        return f"{self.stack}.{self.indices[0]}" if len(self.indices) == 1 else f"{self.stack}.{indices_text(self.indices)}"

    @property
    def first(self) -> str:
        return f"{self.stack}.{self.indices[0]}"

    def fqn(self, index: int, rest: str) -> str:
        return f"{self.stack}.{index}.{rest}" if rest else f"{self.stack}.{index}"


def layer_groups(plan: Any) -> list[LayerGroup]:
    """The plan's layers folded into groups, in the order their parameters appear."""
    layers: dict[tuple[str, int], list[str]] = {}
    for name in plan.params:
        parts = split_layer(name)
        if parts is not None and parts[2]:
            layers.setdefault(parts[:2], []).append(parts[2])
    by_sig: dict[tuple, list[int]] = {}
    for (stack, i), rests in layers.items():
        sig = tuple((r, plan.shapes[f"{stack}.{i}.{r}"], plan.roles[f"{stack}.{i}.{r}"],
                     unrotated(plan.params[f"{stack}.{i}.{r}"])) for r in rests)
        by_sig.setdefault((stack, sig), []).append(i)
    return [LayerGroup(stack, tuple(sorted(ix)), tuple(r for r, *_ in sig)) for (stack, sig), ix in by_sig.items()]


def comm_key(c: Any, rest: str) -> tuple:
    """What makes two layers' collectives the same: kind, where (under the layer), the op that
    needed it (node numbering dropped), the placements (rotation dropped), the bytes."""
    return (c.kind, rest, _NUMBERED.sub("", c.consumer), _ROTATION.sub("", c.src), _ROTATION.sub("", c.dst),
            round(c.fwd_bytes), round(c.bwd_bytes))


def comms_by_layer(plan: Any) -> tuple[dict[tuple[str, int], list], list]:
    """(stack, index) -> that layer's collectives as (key, CommOp); and those outside any layer."""
    layers: dict[tuple[str, int], list] = {}
    outside = []
    for c in plan.comms:
        parts = split_layer(c.module) if c.module else None
        if parts is None:
            outside.append(c)
        else:
            layers.setdefault(parts[:2], []).append((comm_key(c, parts[2]), c))
    return layers, outside


def _shape_text(shapes: list[tuple[int, ...]]) -> str:
    """One local shape, or per dim the smallest..largest over ranks."""
    dims = zip(*shapes)
    return "x".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in ((min(d), max(d)) for d in dims))


def _local_text(plan: Any, name: str) -> str:
    return _shape_text([plan.local_shape(name, r) for r in range(plan.tp)])


def _rotation_note(plan: Any, group: LayerGroup) -> str | None:
    """How the group's uneven shards rotate from layer to layer, in a line (None: they do not)."""
    rotating = [r for r in group.params
                if len({getattr(plan.params[group.fqn(i, r)], "rotate", 0) for i in group.indices}) > 1]
    if not rotating:
        return None
    first = group.indices[0]
    rot = [plan.params[group.fqn(i, rotating[0])].rotate for i in group.indices]
    step = (rot[1] - rot[0]) % plan.tp if len(rot) > 1 else 0
    regular = all((rot[0] + step * (i - first)) % plan.tp == r for i, r in zip(group.indices, rot))
    how = (f"by {step} rank{'s' if step > 1 else ''} per layer" if regular
           else "per layer (" + ", ".join(map(str, rot)) + ")")
    shown = ", ".join(rotating[:4]) + (f" and {len(rotating) - 4} more" if len(rotating) > 4 else "")
    return f"uneven splits rotate {how}, so every rank holds as much over the layers: {shown}"


def _heads_note(plan: Any, group: LayerGroup, heads: dict[str, list[int]]) -> list[str]:
    """Per attention module under the layer: heads per rank, how that varies over the layers."""
    out = []
    rests: dict[str, dict[int, list[int]]] = {}
    for module, per_rank in heads.items():
        parts = split_layer(module)
        if parts is not None and parts[0] == group.stack and parts[1] in group.indices:
            rests.setdefault(parts[2], {})[parts[1]] = per_rank
    for rest, by_layer in rests.items():
        first = by_layer[min(by_layer)]
        line = f"attention heads per rank ({group.fqn(min(by_layer), rest)}, {sum(first)} heads): {first}"
        if len({tuple(v) for v in by_layer.values()}) > 1:
            totals = [sum(v[r] for v in by_layer.values()) for r in range(plan.tp)]
            held = (f"every rank runs {totals[0]} heads" if len(set(totals)) == 1
                    else f"ranks run {totals} heads")
            line += (f" (layers rotate which ranks hold the extra heads; {len(by_layer)} layers: {held} "
                     "over them)")
        out.append(line)
    return out


def folded(plan: Any, width: int = 120) -> str:
    """The plan with repeated layers printed once (see the module docstring)."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(f"autotp plan: tp={plan.tp}, profile={plan.profile}, workload batch={plan.batch} seq={plan.seq}")
    groups = layer_groups(plan)
    in_layers = {g.fqn(i, r) for g in groups for i in g.indices for r in g.params}
    heads = plan.attention if plan.attention is not None else _heads_by_module(plan)
    tied: dict[str, list[str]] = {}
    for alias, held in plan.aliases.items():
        tied.setdefault(held, []).append(alias)

    def param_table(title: str) -> Any:
        t = Table(title=title, title_justify="left")
        for col, justify in (("parameter", "left"), ("shape", "right"), ("layout", "left"), ("placement", "left"),
                             ("local shape", "right")):
            t.add_column(col, justify=justify, overflow="fold")
        return t

    for g in groups:
        n = len(g.indices)
        t = param_table(f"{g.name}: {n} layers, {len(g.params)} parameters each" if n > 1
                        else f"{g.name}: 1 layer, {len(g.params)} parameters")
        for rest in g.params:
            name = g.fqn(g.indices[0], rest)
            t.add_row(rest, "x".join(map(str, plan.shapes[name])), plan.roles[name], repr(unrotated(plan.params[name])),
                      _local_text(plan, name))
        console.print(t)
        for line in filter(None, [_rotation_note(plan, g), *_heads_note(plan, g, heads)]):
            console.print(line)
    grouped = {(g.stack, i) for g in groups for i in g.indices}
    rest = {m: v for m, v in heads.items() if (split_layer(m) or ("", -1, ""))[:2] not in grouped}
    for module, per_rank in rest.items():   # attention outside any numbered layer
        console.print(f"attention heads per rank ({module}, {sum(per_rank)} heads): {per_rank}")
    outside = [n for n in plan.params if n not in in_layers]
    if outside:
        t = param_table("outside the layers")
        for name in outside:
            t.add_row(name, "x".join(map(str, plan.shapes[name])), plan.roles[name], repr(plan.params[name]),
                      _local_text(plan, name))
            for alias in tied.get(name, []):
                t.add_row(alias, "x".join(map(str, plan.shapes[name])), f"{plan.roles[name]} (tied to {name})",
                          repr(plan.params[name]), _local_text(plan, name))
        console.print(t)
    for t in _comm_tables(plan, groups):
        console.print(t)
    for line in plan.summary_lines():
        console.print(line)
    return buf.getvalue()


def _heads_by_module(plan: Any) -> dict[str, list[int]]:
    """A plan saved before attention was recorded: heads read off the projections, by module."""
    return {name.rsplit(".", 2)[0]: v for name, v in plan.heads_per_rank().items()}


def _comm_tables(plan: Any, groups: list[LayerGroup]) -> list:
    """One table per layer group (the collectives each of its layers runs), then the rest once."""
    from rich.table import Table

    def table(title: str, last: str) -> Any:
        t = Table(title=title, title_justify="left")
        for col in ("op", "before (module: op)", "placement", "fwd MB/rank", "bwd MB/rank", "ms", last):
            t.add_column(col, overflow="fold")
        return t

    by_layer, outside = comms_by_layer(plan)
    once = list(outside)
    tables = []
    for g in groups:
        per = [Counter(k for k, _ in by_layer.get((g.stack, i), [])) for i in g.indices]
        common = per[0]
        for c in per[1:]:
            common = common & c
        for i in g.indices:   # what a layer runs beyond the group's common ones
            extra = Counter(k for k, _ in by_layer.get((g.stack, i), [])) - common
            for key, c in by_layer.get((g.stack, i), []):
                if extra[key] > 0:
                    extra[key] -= 1
                    once.append(c)
        shown: set = set()
        n = len(g.indices)
        t = table(f"collectives in each layer of {g.name} (x {n} layers)" if n > 1 else f"collectives in {g.name}",
                  "per layer")
        for key, c in by_layer.get((g.stack, g.indices[0]), []):
            if key in common and key not in shown:
                shown.add(key)
                kind, rest, op, src, dst, *_ = key
                t.add_row(kind, f"{rest}: {op}" if rest else op, f"{src}->{dst}", f"{c.fwd_bytes / 1e6:.2f}",
                          f"{c.bwd_bytes / 1e6:.2f}", f"{c.seconds * 1e3:.3f}", str(common[key]))
        if shown:
            tables.append(t)
    if once:
        t = table("collectives outside the repeated layers", "count")
        seen: Counter = Counter()
        first: dict = {}
        for c in once:   # identical ones (the vocab-parallel loss's all-reduces) on one row
            key = (c.kind, c.module, _NUMBERED.sub("", c.consumer), c.src, c.dst, round(c.fwd_bytes),
                   round(c.bwd_bytes))
            seen[key] += 1
            first.setdefault(key, c)
        for key, c in first.items():
            where = f"{c.module}: {c.consumer}" if c.module else c.consumer
            t.add_row(c.kind, where, f"{c.src}->{c.dst}", f"{c.fwd_bytes / 1e6:.2f}", f"{c.bwd_bytes / 1e6:.2f}",
                      f"{c.seconds * 1e3:.3f}", str(seen[key]))
        tables.append(t)
    return tables
