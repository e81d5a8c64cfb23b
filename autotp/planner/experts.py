"""Why each MoE layer got the experts layout it got: the solver's choice against the other one.

The solver picks, per layer, among the strategies the rules offer for a stack of experts (whole
experts per rank, every expert's matrices split, or replicated; autotp/passes/rules/experts.py).
Its plan says which each layer got; this module says by how much the other layout loses, by
solving again with every MoE layer's stacks pinned to it (an exact solve of the rest around the
pins, so the figure is the difference of two optimal plans, not of two greedy walks).

What the cost model finds different between the two (autotp/cost_model/symbolic.py):

* expert parallelism: a grouped product costs the largest rank's share of experts,
  ``ceil(experts / tp) / experts`` of the rows at uniform routing (uneven where tp does not divide
  the experts; ranks without an expert idle); the rows between the products (the activation, the
  routing weights' product, the inverse sort, the top-k sum) are Routed, a rank's own rows alone,
  ``1/tp`` of them;
* expert tensor parallelism: every product and every op between them on ``1/tp`` of each
  expert's features (the largest share where tp does not divide them); the rows are all there;
* the same collectives: x's gradient all-reduced (f) before the first product, the combine a g
  of the ``[tokens, hidden]`` output, the routing weights' gradient summed.

So at an even split the two share the same FLOPs and rows; they differ by how each product's
shape meets the roofline (expert parallelism runs whole experts' matrices on ``1/tp`` of the rows,
expert-TP a slice of every expert's on all of them) and by the imbalance where tp does not divide
the experts or their features. The
combine's ops on Partial rows cost their whole size on every rank (``shard_fraction``). Equal
prices keep the first strategy the rules offer (the solver keeps the first found), which is
expert parallelism.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import AutotpError
from ..placements import Placement, Shard

#: the experts layouts by role, in words
WORDS = {
    "expert": "expert-parallel",
    "expert_tp": "expert-TP",
    "replicate": "replicated",
}


def layer_layouts(roles: Mapping[str, str], shapes: Mapping[str, tuple]) -> dict[str, str]:
    """Module of each stack of experts -> its layout ("expert", "expert_tp", "replicate" or "mixed")."""
    out: dict[str, set] = {}
    for fqn, role in roles.items():
        if len(shapes.get(fqn, ())) != 3:
            continue
        module = fqn.rsplit(".", 1)[0]
        kind = "expert_tp" if role in ("expert_column", "expert_row") else role
        out.setdefault(module, set()).add(kind)
    return {m: (next(iter(k)) if len(k) == 1 else "mixed") for m, k in out.items()
            if k & {"expert", "expert_tp"} or module_is_experts(m)}


def module_is_experts(module: str) -> bool:
    return module.rsplit(".", 1)[-1] == "experts"


def _layers_text(modules: list[str]) -> str:
    from ..plan.view import indices_text, split_layer

    parts = [split_layer(m) for m in modules]
    if len(modules) > 1 and all(parts) and len({(p[0], p[2]) for p in parts}) == 1:
        stack, _, rest = parts[0]
        return f"{stack}.{indices_text([p[1] for p in parts])}.{rest}"
    return ", ".join(modules)


def _describe(kind: str, experts: int, tp: int, split: tuple[str, str] = ("column", "row")) -> str:
    if kind == "expert":
        per = [experts // tp + (1 if r < experts % tp else 0) for r in range(tp)]
        idle = per.count(0)
        held = (f"{per[0]} per rank" if len(set(per)) == 1 else f"{max(per)} on the busiest rank"
                + (f", {idle} idle" if idle else ""))
        return f"expert-parallel ({experts} experts, {held})"
    if kind == "expert_tp":
        return f"expert-TP (every expert's gate|up {split[0]}, down {split[1]}: 1/{tp} of each expert per rank)"
    return WORDS.get(kind, kind)


def experts_note(index: Any, profile: Any, stacks: Mapping[str, str], roles: Mapping[str, str],
                 shapes: Mapping[str, tuple], chosen_s: float, memory_limit: float | None,
                 pinned: Mapping[str, Placement], uses: Mapping[str, Any]) -> list[str]:
    """One line per layout the MoE layers got, with what the other layout would cost.

    ``stacks``: placeholder -> parameter name of every 3-D stack of experts; ``roles``/``shapes``:
    the plan's; ``chosen_s``: the plan's predicted step; ``pinned``: the user's pins (a layer
    whose stacks are pinned is not compared: the pin decided it)."""
    from .roles import _role_to_placement
    from ..passes.solve import solve

    if not stacks or index.tp <= 1:
        return []
    layouts = layer_layouts(roles, shapes)
    if not layouts or any(p in pinned for p in stacks):
        return []
    alternatives = {}
    for other in ("expert", "expert_tp"):
        if all(kind == other for kind in layouts.values()):
            continue
        if other == "expert" and not index.host_reads:
            alternatives[other] = "not allowed (host_reads=False: a rank reads how many rows its experts got)"
            continue
        pins = dict(pinned)
        seen: set = set()
        try:
            for placeholder, fqn in stacks.items():   # in the order the graph reads them
                module = fqn.rsplit(".", 1)[0]
                # a layer's first stack is its up (gate|up) projection, column; the next its down, row
                role = other if other == "expert" else "expert_row" if module in seen else "expert_column"
                seen.add(module)
                pins[placeholder] = _role_to_placement(role, fqn, 3, uses.get(placeholder))
            alternatives[other] = solve(index, profile, pins, memory_limit=memory_limit).propagation.total_s
        except (AutotpError, ValueError) as err:
            alternatives[other] = f"not possible ({str(err).split(':')[0]})"
    by_kind: dict[str, list[str]] = {}
    for module, kind in layouts.items():
        by_kind.setdefault(kind, []).append(module)
    lines = []
    for kind, modules in by_kind.items():
        experts = shapes[next(f for f in stacks.values() if f.startswith(modules[0] + "."))][0]
        # the chosen expert-TP's split of the layer's stacks, in graph order: gate|up, then down
        split = tuple(roles[f].removeprefix("expert_") for f in stacks.values() if f.startswith(modules[0] + "."))
        line = (f"experts {_layers_text(modules)}: "
                f"{_describe(kind, experts, index.tp, *([split] if kind == 'expert_tp' and len(split) == 2 else []))}")
        versus = []
        for other, cost in alternatives.items():
            if other == kind:
                continue
            name = _describe(other, experts, index.tp)
            if isinstance(cost, str):
                versus.append(f"{name} {cost}")
            elif cost == float("inf"):
                versus.append(f"{name} not feasible here")
            else:
                delta = cost - chosen_s
                versus.append(f"{'cheaper than' if delta > 0 else 'tied with' if delta == 0 else 'dearer than'} "
                              f"{name} by {abs(delta) * 1e3:.3f} ms/step (every MoE layer so: {cost * 1e3:.3f} ms)")
        lines.append(line + (" — " + "; ".join(versus) if versus else ""))
    return lines


def expert_stacks(cap: Any) -> dict[str, str]:
    """Placeholder -> name of every parameter read as a stack of experts' matrices (3-D, read by
    a pick per row, a per-matrix transpose, a grouped product, or whole by a batched product as
    its matrices: Llama-4's experts, every token through every expert)."""
    from .roles import _first_uses
    from ..passes.rules.row_reads import GROUPED_MM
    from ..passes.rules.registry import op_name
    import torch

    aten = torch.ops.aten
    out = {}
    uses = _first_uses(cap)
    for node in cap.graph.nodes:   # graph order
        fqn = cap.param_names.get(node.name) if node.op == "placeholder" else None
        if fqn is None or fqn in cap.aliases or node.meta["val"].dim() != 3:
            continue
        use = uses.get(node.name)
        if use and (use[0] in (aten.transpose.int, aten.index.Tensor) or op_name(use[0]) in GROUPED_MM
                    or (use[0] is aten.bmm.default and use[1] == 1)):
            out[node.name] = fqn
    position = {n: i for i, n in enumerate(cap.graph.nodes)}
    first_read = {p: min((position[u] for u in node.users), default=0)
                  for node in cap.graph.nodes if node.name in out for p in [node.name]}
    return dict(sorted(out.items(), key=lambda kv: first_read[kv[0]]))


def is_etp(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim in (1, 2)


def _versus(cost: Any, chosen_s: float, name: str) -> str:
    """``cheaper than <name> by ... ms/step (...)``: the chosen plan against a re-solve."""
    if isinstance(cost, str):
        return f"{name} {cost}"
    if cost == float("inf"):
        return f"{name} not feasible here"
    delta = cost - chosen_s
    return (f"{'cheaper than' if delta > 0 else 'tied with' if delta == 0 else 'dearer than'} {name} by "
            f"{abs(delta) * 1e3:.3f} ms/step (every MoE layer so: {cost * 1e3:.3f} ms)")


def _solved_with(index: Any, profile: Any, pinned: Mapping[str, Placement], memory_limit: float | None,
                 dispatch: bool) -> tuple[Any, Any]:
    """(the predicted step, the propagation) of the plan solved again with
    ``expert_dispatch=dispatch``, or (why not, None)."""
    from dataclasses import replace

    from ..passes.solve import solve

    try:
        prop = solve(replace(index, expert_dispatch=dispatch, _strategies={}), profile, pinned,
                     memory_limit=memory_limit).propagation
    except (AutotpError, ValueError) as err:
        return f"not possible ({str(err).split(':')[0]})", None
    return prop.total_s, prop


def _solved_without_sending_back(index: Any, profile: Any, pinned: Mapping[str, Placement],
                                 memory_limit: float | None) -> Any:
    """The predicted step of the plan solved again with no expert's output row sent back to its
    token's rank by the reverse all-to-all (the combine inside a grouped product,
    ``rules/experts.combine_back``, or a conversion of the rows sent after an op on their experts'
    ranks, ``rules/experts.sends_back``): the combine then by a g; or why not."""
    from dataclasses import fields

    from ..passes.propagate import GraphIndex
    from ..passes.rules.experts import is_sent, sends_back
    from ..passes.solve import solve

    class _NoSendingBack(GraphIndex):
        def strategies(self, node: Any, actual: tuple) -> list:
            return [s for s in super().strategies(node, actual)
                    if not any(sends_back(have, want) for have, want in zip(actual, s.inputs))
                    and not (any(is_sent(p) for p in s.inputs) and _to_tokens(s.output))]

    state = {f.name: getattr(index, f.name) for f in fields(index) if f.init}
    try:
        return solve(_NoSendingBack(**{**state, "_strategies": {}}), profile, pinned,
                     memory_limit=memory_limit).propagation.total_s
    except (AutotpError, ValueError) as err:
        return f"not possible ({str(err).split(':')[0]})"


def _to_tokens(output: Any) -> bool:
    from ..placements import Routed

    return isinstance(output, Routed) and output.tokens


#: the all-to-all dispatch, and the other way, in words
DISPATCH = "the all-to-all dispatch (each row sent from its token's rank to its expert's)"
GATHER = "gathering the tokens whole (each rank's rows cut from them)"
#: the combine by the reverse all-to-all's other way, in words
COMBINE_G = "the g of the combine (each expert's output row summed where it was made)"


def dispatch_note(index: Any, profile: Any, comms: list, roles: Mapping[str, str], chosen_s: float,
                  memory_limit: float | None, pinned: Mapping[str, Placement]) -> list[str]:
    """How each MoE layer under expert parallelism gets its (token, expert) rows where the tokens
    arrive split along the sequence, and by how much that beats the other way (the plan solved
    again with ``expert_dispatch`` the other way round, the user's pins kept): the layers whose
    rows go to their experts' ranks by an all-to-all (``comms``: the plan's CommOps, with its
    bytes), and the layers whose split tokens are gathered whole (before the router, or after it
    where it runs on each rank's own tokens, their ids and weights all-gathered)."""
    a2a = [c for c in comms if c.kind == "all_to_all" and str(c.src).startswith("P(tokens")]
    backs = [c for c in comms if c.kind == "all_to_all" and str(c.dst).startswith("P(tokens")]
    if a2a:
        modules = [c.module for c in a2a]
        sent = max(c.fwd_bytes for c in a2a)
        cost = _solved_with(index, profile, pinned, memory_limit, False)[0]
        # (where the router runs, on each rank's own tokens or on all of them made whole, is the
        # solver's choice too: the plan's collectives say which)
        out = [f"experts {_layers_text(modules)}: the tokens arrive split along the sequence, and each (token, "
               f"expert) row goes from its token's rank to its expert's by an all-to-all "
               f"({sent / 1e6:.2f} MB/rank each way per layer, the reverse one backward), not gathered whole"
               f"{_forced(index)} — " + _versus(cost, chosen_s, GATHER)]
        if backs:
            back = max(c.fwd_bytes for c in backs)
            out.append(f"experts {_layers_text([c.module for c in backs])}: each expert's output row goes back to "
                       f"its token's rank by the reverse all-to-all ({back / 1e6:.2f} MB/rank each way per layer), "
                       f"where the routing weights' product and the top-k sum run on the rank's own tokens: no g "
                       f"of the combine — "
                       + _versus(_solved_without_sending_back(index, profile, pinned, memory_limit), chosen_s,
                                 COMBINE_G))
        return out
    whole = {fqn.rsplit(".", 1)[0] for fqn, role in roles.items() if role == "expert"}
    # an all-gather in the experts' layer (the block holding their MoE block): the layer runs split
    # along the sequence somewhere, so its tokens may reach the experts split; the plan solved
    # with the dispatch says whether they can
    gathered = sorted({m for c in comms if c.kind in ("all_gather", "all_gather_f")
                       for m in whole for layer in [m.rsplit(".", 2)[0]] if c.module.startswith(layer + ".")})
    if not gathered:
        return []
    cost, prop = _solved_with(index, profile, pinned, memory_limit, True)
    if prop is not None and not any(c.kind == "all_to_all" and not isinstance(c.dst, Shard) for c in prop.comms):
        return []   # the all-to-all cannot take these layers' rows (their tokens do not arrive as rows)
    # the router on each rank's own tokens, their top-k ids and weights (or probabilities) then
    # all-gathered, where a token row is all-gathered in the layer; on every token otherwise
    own_tokens = any(c.kind in ("all_gather", "all_gather_f") and str(c.src).startswith("P(tokens")
                     and c.module.startswith(m.rsplit(".", 2)[0] + ".") for c in comms for m in gathered)
    where = "after the router, which runs on each rank's own tokens" if own_tokens else "before the router"
    return [f"experts {_layers_text(gathered)}: the tokens, split along the sequence in the layer, are gathered "
            f"whole {where}{_forced(index)} — " + _versus(cost, chosen_s, DISPATCH)]


def _forced(index: Any) -> str:
    return "" if index.expert_dispatch is None else f" (expert_dispatch={index.expert_dispatch})"


def forced_dispatch_dropped(inputs: Mapping[str, Any], training: bool, generation: bool, why: Exception) -> str:
    """The note of a later program (another call's: inference, a padded call, a generation
    step) planned by cost where ``expert_dispatch=True`` could not hold: the all-to-all takes
    tokens split along the sequence, which this program's plan under the first's placements
    holds whole (sequence parallelism by cost, or a program with no sequence to split),
    so each rank's (token, expert) rows are cut from the tokens gathered whole, as a plan by cost
    makes them (exact)."""
    call = "a generation step" if generation else \
        f"the call with {', '.join(sorted(k for k, v in inputs.items() if v is not None))} " \
        f"({'training' if training else 'eval'} mode)"
    return (f"expert_dispatch=True does not hold in the program of {call}: its tokens do not reach the experts "
            f"split along the sequence (its plan under the first's placements holds them whole), so the "
            f"program is planned by cost and each rank's experts take their rows from the tokens gathered whole "
            f"(exact; forced, it failed: {why})")
