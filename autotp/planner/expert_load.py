"""The routing load a plan prices expert parallelism at: the rows each MoE layer's experts get.

Under expert parallelism a rank runs the (token, expert) rows routed to its own experts, so a
step waits, layer by layer (each layer's combine is a collective), for the rank whose experts got
the most. A balanced router (a trained one, held so by its load-balancing loss) deals every rank
``T * k / tp`` rows, and that is what the cost model assumes by default; a skewed one (a random
router: correlated hidden states pick the same few experts) can give one rank several times that.
Expert-TP is balanced by construction (every rank a slice of every expert, every row).

:class:`ExpertLoad` says how many rows each expert of each MoE layer gets (counts or fractions: only
their ratios matter), by the experts module's name (the module holding the 3-D stacks,
``model.layers.0.mlp.experts``). :func:`measure_expert_load` counts them from the serial model's own
top-k on a batch; a user may give them (``ExpertLoad({...})``, or a plain mapping). The planner
(:func:`shares`) turns a layer's counts into the share of its rows each rank's experts get under
the expert-parallel layout (the stack's Shard(0): contiguous runs, uneven where tp does not divide
the experts), and the cost model (``OpInfo.expert_share``, ``cost_model/work.local_shape``) prices
the ops on a rank's experts' rows, the all-to-all that brings them, the one that sends them back
and the dispatch plan's kernels on them at the busiest rank's share instead of ``1/tp``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..plan.expert_load import ExpertLoad


# ---- measuring it -----------------------------------------------------------------------------
def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, number of experts) of every module holding its own 3-D parameter: a stack of
    experts, ``[experts, out, in]``."""
    out = []
    for name, module in model.named_modules():
        stacks = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if stacks:
            out.append((name, module, stacks[0].shape[0]))
    return out


def top_k_index(args: Sequence) -> torch.Tensor | None:
    """The router's top-k ids among an experts module's call arguments (transformers calls it as
    ``experts(hidden, top_k_index, top_k_weights)``): its 2-D integer tensor."""
    return next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() == 2),
                None)


def routed_ids(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, int]]:
    """experts module -> (its top-k ids on ``batch``: ``[tokens, k]``, its number of experts), from
    one forward of the serial model (no gradient), read by a forward pre-hook on each experts module."""
    seen: dict[str, torch.Tensor] = {}
    stacks = expert_modules(model)

    def reader(name: str):
        def hook(module, args) -> None:   # returns None: the call's arguments stay as they are
            index = top_k_index(args)
            if index is not None:
                seen[name] = index.detach().cpu()
        return hook

    hooks = [module.register_forward_pre_hook(reader(name)) for name, module, _ in stacks]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return {name: (seen[name], experts) for name, _, experts in stacks if name in seen}


def measure_expert_load(model: nn.Module, batch: Mapping[str, Any]) -> ExpertLoad:
    """The rows each expert of each MoE layer of ``model`` gets on ``batch`` (the keyword inputs
    of one call, ``model(**batch)``), from the serial model's own routing: pass it as
    ``autotp.plan(..., expert_load=...)`` or ``parallelize(..., expert_load=...)`` to price
    expert parallelism at the rank its experts load most. The model must hold real weights (its
    router decides); a ConfigError where no experts module is called with a router's top-k."""
    if not isinstance(batch, Mapping):
        raise ConfigError(f"measure_expert_load(model, batch): batch is the keyword inputs of one call "
                          f"(model(**batch)), not {type(batch).__name__}")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ConfigError("measure_expert_load runs the serial model's routers: the model is on the meta device; "
                          "measure on a model with its weights (or give the rows per expert yourself)")
    ids = routed_ids(model, batch)
    if not ids:
        raise ConfigError("measure_expert_load: no module holding a stack of experts ([experts, out, in]) was "
                          "called with a router's top-k ids (experts(hidden, top_k_index, top_k_weights)); give "
                          "the rows per expert yourself, or plan with expert_load=None (a balanced router)")
    counts = {name: torch.bincount(index.reshape(-1), minlength=experts).tolist()
              for name, (index, experts) in ids.items()}
    tokens, k = next(iter(ids.values()))[0].shape
    return ExpertLoad(counts, f"measured: the serial model's top-{k} on {tokens} tokens")


# ---- what the planner does with it ------------------------------------------------------------
def shares(rows: Sequence[float], tp: int) -> tuple[float, ...]:
    """The share of a layer's rows each rank's experts get under expert parallelism (the stack's
    Shard(0): contiguous runs of experts, uneven where tp does not divide them); they sum to 1."""
    from ..placements import Shard, local_ranges

    total = sum(rows)
    return tuple(sum(sum(rows[lo:hi]) for lo, hi in local_ranges(len(rows), Shard(0), tp, r)) / total
                 for r in range(tp))


def check_load(load: ExpertLoad, experts: Mapping[str, int]) -> None:
    """A ConfigError where ``load`` does not describe the MoE layers of the model planned
    (``experts``: experts module -> its number of experts): a layer it names that the model lacks,
    a layer of the model it leaves out, or a count of experts that differs."""
    have = sorted(experts)
    if not have:
        raise ConfigError("expert_load was given, but the model has no MoE layer (no stack of experts): "
                          "drop expert_load")
    unknown = [m for m in load.modules if m not in experts]
    if unknown:
        raise ConfigError(f"expert_load names {', '.join(map(repr, unknown))}, which is not an MoE layer of this "
                          f"model; its experts modules are {', '.join(map(repr, have))}: key the rows per "
                          f"expert by those (autotp.measure_expert_load(model, batch) does)")
    missing = [m for m in have if m not in load.modules]
    if missing:
        raise ConfigError(f"expert_load leaves out the MoE layer(s) {', '.join(map(repr, missing))}: give every "
                          f"layer's rows per expert (autotp.measure_expert_load(model, batch) counts them all), or "
                          f"pass expert_load=None for a balanced router")
    for module, rows in load.layers:
        if len(rows) != experts[module]:
            raise ConfigError(f"expert_load[{module!r}] has {len(rows)} counts, but that layer has "
                              f"{experts[module]} experts: give one count per expert")


def moe_blocks(stacks: Mapping[str, str], shapes: Mapping[str, tuple]) -> dict[str, int]:
    """experts module -> its number of experts, from the planner's stacks of experts
    (placeholder -> parameter name, :func:`autotp.planner.experts.expert_stacks`)."""
    return {fqn.rsplit(".", 1)[0]: shapes[fqn][0] for fqn in stacks.values()}


def apply_load(index: Any, load: ExpertLoad | None, experts: Mapping[str, int]) -> None:
    """Mark every op of each MoE block of ``index`` (the experts module's parent: the router, the
    dispatch, the experts and the combine) with the share of the block's rows each rank's experts
    get (``OpInfo.expert_share``); None clears them (a balanced router). The cost model uses it on
    a rank's experts' rows alone (``Routed`` rows held by their experts' ranks)."""
    from ..capture import module_path

    blocks = {}
    if load is not None:
        for module, rows in load.layers:
            if module in experts:
                blocks[module.rsplit(".", 1)[0] if "." in module else module] = shares(rows, index.tp)
    for node, info in index.infos.items():
        path = module_path(node)
        info.expert_share = next((s for block, s in blocks.items() if path == block or path.startswith(block + ".")),
                                 None)
    index.expert_load = load if blocks else None
    index._compute.clear()
    index._activation.clear()


def _layouts(stacks: Mapping[str, str], params: Mapping[str, Any]) -> dict[str, str]:
    """experts module -> its layout ("expert", "expert_tp", "replicate" or "mixed") under a
    propagation's placements (``params``: placeholder -> placement)."""
    from ..placements import Shard

    kinds: dict[str, set] = {}
    for placeholder, fqn in stacks.items():
        p = params.get(placeholder)
        kind = ("expert" if isinstance(p, Shard) and p.dim == 0 else "expert_tp" if isinstance(p, Shard)
                else "replicate")
        kinds.setdefault(fqn.rsplit(".", 1)[0], set()).add(kind)
    return {m: next(iter(k)) if len(k) == 1 else "mixed" for m, k in kinds.items()}


def load_notes(index: Any, profile: Any, roles: Mapping[str, str], shapes: Mapping[str, tuple],
               chosen_s: float, memory_limit: float | None, pinned: Mapping[str, Any]) -> list[str]:
    """The plan's note of the load it was priced at (none without one): :func:`load_note`, with
    the choice the same solve makes at a balanced router (the index with every share cleared)."""
    from dataclasses import replace

    from .experts import expert_stacks, layer_layouts
    from ..errors import AutotpError
    from ..passes.solve import solve

    load = index.expert_load
    if load is None:
        return []
    stacks = expert_stacks(index.capture)
    balanced_index = replace(index, infos={n: replace(i, expert_share=None) for n, i in index.infos.items()},
                             expert_load=None, _strategies={})
    try:
        prop = solve(balanced_index, profile, pinned, memory_limit=memory_limit).propagation
        balanced, balanced_s = _layouts(stacks, prop.params), prop.total_s
    except (AutotpError, ValueError):
        balanced, balanced_s = None, None
    return [load_note(load, index.tp, layer_layouts(roles, shapes), balanced, balanced_s, chosen_s)]


def load_note(load: ExpertLoad, tp: int, layouts: Mapping[str, str],
              balanced: Mapping[str, str] | None, balanced_s: float | None, chosen_s: float) -> str:
    """The plan's note of the load: per MoE layer, the busiest rank's rows over the mean; and what
    the load did to the choice (``balanced``: the layouts the same solve picks at a balanced
    router, and its predicted step)."""
    from .experts import WORDS, _layers_text

    skew = {module: max(shares(rows, tp)) * tp for module, rows in load.layers}
    if len(skew) <= 4:
        said = ", ".join(f"{module} {x:.2f}x" for module, x in skew.items())
    else:
        top = max(skew, key=skew.get)
        said = f"{min(skew.values()):.2f}x to {skew[top]:.2f}x over {len(skew)} MoE layers ({top} the most)"
    head = (f"expert load ({load.source}): under expert parallelism each MoE layer's busiest rank gets max / mean = "
            f"{said} of a balanced router's rows; the experts' ops, and the all-to-alls bringing their rows and "
            f"sending them back, are priced there (expert-TP is balanced by construction)")
    if balanced is None:
        return head
    changed: dict[tuple, list[str]] = {}
    for module in sorted(layouts):
        if balanced.get(module) != layouts[module]:
            changed.setdefault((balanced.get(module), layouts[module]), []).append(module)
    if not changed:
        kinds = sorted({WORDS.get(k, k) for k in layouts.values()})
        return head + f" — the choice is the one a balanced router gets ({', '.join(kinds)})"
    moves = "; ".join(f"{_layers_text(modules)} {WORDS.get(after, after)}, not {WORDS.get(before, before)}"
                      for (before, after), modules in changed.items())
    return head + (f" — it changed the choice: {moves} (a balanced router's plan, priced at a balanced router: "
                   f"{balanced_s * 1e3:.3f} ms; this plan at this load: {chosen_s * 1e3:.3f} ms)")
