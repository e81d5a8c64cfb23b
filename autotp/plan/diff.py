"""Two plans compared: what a user reads when choosing between tp 4 and 8, or checking what a
pinned layout or another workload costs.

``Plan.diff(other)`` -> :class:`PlanDiff`: the parameters whose layout changed, the collectives
added or removed per layer, and the change in predicted step time (compute, communication) and
memory per rank. Layers fold as in :mod:`autotp.plan_view`: a change every layer of a stack shares
is one line (``transformer.h.{0..47}.attn.c_attn.weight``). The rotation of uneven shards is not
a change of layout (it only says which rank holds the extra head).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .view import _NUMBERED, _ROTATION, indices_text, split_layer, unrotated



@dataclass(frozen=True)
class LayoutChange:
    name: str        # a parameter, or a folded range of them (transformer.h.{0..47}.attn.c_attn.weight)
    before: str      # "column S(1x3/64)"; "absent" where the plan has no such parameter
    after: str


@dataclass(frozen=True)
class CommChange:
    where: str       # the layers (transformer.h.{0..47}) or "outside the layers"
    sign: str        # "+" added, "-" removed
    count: int       # per layer (or per step outside the layers)
    what: str        # "g before attn.c_proj: view_default (P->R)"


@dataclass(frozen=True)
class PlanDiff:
    before: Any
    after: Any
    layouts: tuple[LayoutChange, ...]
    collectives: tuple[CommChange, ...]
    names: tuple[str, str] = ("A", "B")

    def __str__(self) -> str:
        a, b = self.before, self.after
        na, nb = self.names
        ca, cb = a.cost, b.cost
        lines = [f"plan diff: {na} (tp={a.tp}, profile={a.profile}, batch={a.batch} seq={a.seq}) -> "
                 f"{nb} (tp={b.tp}, profile={b.profile}, batch={b.batch} seq={b.seq})"]
        if a.arguments is not None and b.arguments is not None and a.arguments != b.arguments:
            # the arguments each plan's programs are built with (autotp/plan/arguments.py)
            was, now = (vars(p.arguments) for p in (a, b))   # an expert load as its summary (ExpertLoad's repr)
            lines.append("planned with: " + ", ".join(f"{k} {was[k]!r} -> {now[k]!r}" for k in was if was[k] != now[k]))
        lines.append(f"predicted step: {_ms(ca['step_s'], cb['step_s'])} (compute {_ms(ca['compute_s'], cb['compute_s'])}, "
                     f"communication {_ms(ca['comm_s'], cb['comm_s'])})")
        lines.append(f"memory per rank (largest): {_gib(a.memory_bytes, b.memory_bytes)}; parameters per rank "
                     f"(largest): {_mb(max(ca['param_bytes_per_rank']), max(cb['param_bytes_per_rank']))}")
        kinds = sorted(set(a.comm_counts()) | set(b.comm_counts()))
        counts = ", ".join(f"{k} {a.comm_counts().get(k, 0)} -> {b.comm_counts().get(k, 0)}" for k in kinds) or "none"
        lines.append(f"collectives per step: {counts}; sent per rank "
                     f"{_mb(ca['comm_bytes_per_step'], cb['comm_bytes_per_step'])}")
        if self.layouts:
            lines.append(f"layouts changed ({len(self.layouts)}):")
            width = max(len(c.name) for c in self.layouts)
            lines += [f"  {c.name:<{width}}  {c.before} -> {c.after}" for c in self.layouts]
        else:
            lines.append("layouts changed: none")
        if self.collectives:
            lines.append("collectives added (+) / removed (-):")
            lines += [f"  {c.where}: {c.sign} {c.what}" + (f" x {c.count}" if c.count > 1 else "")
                      + (" per layer" if c.where != "outside the layers" else "") for c in self.collectives]
        else:
            lines.append("collectives added or removed: none")
        return "\n".join(lines)


def _delta(x: float, y: float) -> str:
    return f" ({(y - x) / x:+.1%})" if x else ""


def _ms(x: float, y: float) -> str:
    return f"{x * 1e3:.3f} -> {y * 1e3:.3f} ms{_delta(x, y)}"


def _gib(x: float, y: float) -> str:
    return f"{x / 2**30:.2f} -> {y / 2**30:.2f} GiB{_delta(x, y)}"


def _mb(x: float, y: float) -> str:
    return f"{x / 1e6:.1f} -> {y / 1e6:.1f} MB{_delta(x, y)}"


def _layout(plan: Any, name: str) -> str:
    if name not in plan.params:
        return "absent"
    return f"{plan.roles[name]} {unrotated(plan.params[name])!r}"


def _fold(items: dict[tuple, list[int]]) -> list[tuple[str, tuple]]:
    """(stack, rest, *what) -> indices, as (folded name, what), in first-seen order."""
    out = []
    for (stack, rest, *what), ix in items.items():
        name = f"{stack}.{ix[0]}" if len(ix) == 1 else f"{stack}.{indices_text(ix)}"
        out.append((f"{name}.{rest}" if rest else name, tuple(what)))
    return out


def _comm_counters(plan: Any) -> dict[tuple[str, int] | None, Counter]:
    """(stack, index) -> Counter of the layer's collectives (without bytes: a collective whose
    size changed is neither added nor removed); None -> those outside the layers."""
    out: dict = {}
    for c in plan.comms:
        parts = split_layer(c.module) if c.module else None
        layer, rest = (parts[:2], parts[2]) if parts else (None, c.module)
        op = _NUMBERED.sub("", c.consumer)
        where = f"{rest}: {op}" if rest else op
        key = f"{c.kind} before {where} ({_ROTATION.sub('', c.src)}->{_ROTATION.sub('', c.dst)})"
        out.setdefault(layer, Counter())[key] += 1
    return out


def diff(before: Any, after: Any, names: tuple[str, str] = ("A", "B")) -> PlanDiff:
    changed: dict[tuple, list[int]] = {}
    outside: list[LayoutChange] = []
    for name in list(before.params) + [n for n in after.params if n not in before.params]:
        x, y = _layout(before, name), _layout(after, name)
        if x == y:
            continue
        parts = split_layer(name)
        if parts is None or not parts[2]:
            outside.append(LayoutChange(name, x, y))
        else:
            changed.setdefault((parts[0], parts[2], x, y), []).append(parts[1])
    layouts = [LayoutChange(n, x, y) for n, (x, y) in _fold(changed)] + outside
    ca, cb = _comm_counters(before), _comm_counters(after)
    per_layer: dict[tuple, list[int]] = {}
    once: list[CommChange] = []
    for layer in list(ca) + [k for k in cb if k not in ca]:
        a, b = ca.get(layer, Counter()), cb.get(layer, Counter())
        for sign, moved in (("-", a - b), ("+", b - a)):
            for what, n in moved.items():
                if layer is None:
                    once.append(CommChange("outside the layers", sign, n, what))
                else:
                    per_layer.setdefault((layer[0], "", sign, n, what), []).append(layer[1])
    comms = [CommChange(where, sign, n, what) for where, (sign, n, what) in _fold(per_layer)] + once
    return PlanDiff(before, after, tuple(layouts), tuple(comms), names)
