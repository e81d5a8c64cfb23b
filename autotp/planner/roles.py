"""A layout's roles as placements: ``layout={"*.c_attn.weight": "column", ...}`` (Megatron's words:
column, row, vocab, replicate) or a saved plan, turned into the placements the planner pins,
by how the graph first uses each parameter."""
from __future__ import annotations

import fnmatch
import operator
from typing import Any, Mapping

import torch

from ..capture import Capture
from ..errors import ConfigError
from ..passes.propagate import _joined_weight_reader
from ..placements import REPLICATE, Placement, Shard
from ..plan.plan import Plan, role_of


#: "expert": whole experts per rank (expert parallelism); "expert_column" / "expert_row": every expert's
#: matrix split as a column- / row-parallel linear is (expert tensor parallelism: gate|up column, down row).
#: Two words, not one "expert_tp", so that the plan's table names each matrix's split as it does a dense
#: MLP's and a pin says which matrix is cut which way.
ROLES = ("column", "row", "vocab", "replicate", "expert", "expert_column", "expert_row")
#: product -> the weight dim holding its output features (a head's vocabulary rows)
_OUTPUT_ROWS = {torch.ops.aten.linear.default: 0, torch.ops.aten.mm.default: 1, torch.ops.aten.matmul.default: 1}


def _first_uses(cap: Capture) -> dict[str, tuple[Any, int]]:
    """Parameter placeholder -> (the op that first reads it, the argument it is). A weight joined
    with its siblings for one product (autotp/passes/products.py: ``linear(x, cat([Wq, Wk, Wv]))``)
    is read by that product as its weight: its rows are the joined weight's, so a layout's role
    means for it what it means for the product the model wrote."""
    out: dict[str, tuple[Any, int]] = {}
    for node in cap.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        reader = _joined_weight_reader(node, cap.param_names)
        if reader is not None:
            for part in node.args[0]:
                out.setdefault(part.name, (reader.target, 1))
            continue
        for pos, a in enumerate(node.args):
            if getattr(a, "op", None) == "placeholder" and a.name in cap.param_names and a.name not in out:
                out[a.name] = (node.target, pos)
    return out


def _role_to_placement(role: str | Placement, fqn: str, ndim: int, use: tuple[Any, int] | None) -> Placement:
    if not isinstance(role, str):
        return role
    if role == "replicate":
        return REPLICATE
    if role not in ROLES:
        raise ConfigError(f"layout for {fqn}: unknown role {role!r}; use one of {ROLES} or a Placement")
    for d in range(ndim):
        if role_of(Shard(d), use[0] if use else None, use[1] if use else -1, ndim) == role:
            return Shard(d)
    if role == "vocab" and use is not None and use[1] == 1 and use[0] in _OUTPUT_ROWS:
        # an untied output head: its vocabulary rows are the product's output features, which
        # Megatron splits as a column-parallel linear (the plan names it "column")
        return Shard(_OUTPUT_ROWS[use[0]])
    if role == "expert":
        raise ConfigError(f"layout for {fqn}: role 'expert' (whole experts per rank) applies to a stack of experts' "
                          f"weights ([experts, out, in], read by an MoE layer's experts); {fqn} is {ndim}-D and "
                          f"first used by {getattr(use[0], '__name__', use[0]) if use else 'nothing'}: pin 'column', "
                          "'row' or 'replicate' instead")
    if role in ("expert_column", "expert_row"):
        raise ConfigError(f"layout for {fqn}: role {role!r} (every expert's matrix split, expert tensor parallelism) "
                          f"applies to a stack of experts' weights ([experts, out, in], read by an MoE layer's "
                          f"experts); {fqn} is {ndim}-D and first used by "
                          f"{getattr(use[0], '__name__', use[0]) if use else 'nothing'}: pin "
                          f"{'column' if role == 'expert_column' else 'row'!r} or 'replicate' instead")
    if ndim == 3 and role in ("column", "row"):
        raise ConfigError(f"layout for {fqn}: role {role!r} splits a matrix; {fqn} is a stack of experts' matrices "
                          f"([experts, out, in]): pin 'expert_{role}' (each expert's matrix split {role}-wise, expert "
                          "tensor parallelism), 'expert' (whole experts per rank) or 'replicate'")
    raise ConfigError(f"layout for {fqn}: role {role!r} does not apply to how the model uses it")


def _pinned(cap: Capture, layout: Mapping[str, Any] | None, plan: Plan | None) -> dict[str, Placement]:
    """Placeholder -> the placement pinned by ``plan`` (every parameter) or by ``layout``'s globs
    (the first glob matching any of a parameter's names: a tied parameter answers to each)."""
    pinned: dict[str, Placement] = {}
    uses = _first_uses(cap)
    layout = dict(layout or {})
    for pattern, role in layout.items():
        if isinstance(role, str) and role not in ROLES:
            raise ConfigError(f"layout for {pattern}: unknown role {role!r}; use one of {ROLES} or a Placement")
    names_of: dict[str, list[str]] = {}
    for alias, held in cap.aliases.items():
        names_of.setdefault(held, [held]).append(alias)
    every_name = set(cap.param_names.values())
    unmatched = [p for p in layout if not any(fnmatch.fnmatchcase(n, p) for n in every_name)]
    if unmatched and plan is None:
        shown = ", ".join(sorted(every_name)[:6])
        raise ConfigError(
            f"layout pattern(s) {unmatched} match no parameter of {cap.model_name}: patterns are globs over the "
            f"names named_parameters() shows (e.g. {shown}, ...); a tied parameter answers to each of its names"
        )
    nodes = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    for placeholder, fqn in cap.param_names.items():
        node = nodes[placeholder]
        if fqn in cap.aliases:
            continue
        if plan is not None:
            if fqn not in plan.params:
                raise ConfigError(f"the plan has no entry for parameter {fqn}; it was made for another model")
            pinned[placeholder] = plan.params[fqn]
            continue
        names = names_of.get(fqn, [fqn])
        for pattern, role in layout.items():
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                if node.meta["val"].dim() >= 2:
                    pinned[placeholder] = _role_to_placement(role, fqn, node.meta["val"].dim(), uses.get(placeholder))
                break
    return pinned
