"""Mixtures of experts: which of transformers' experts implementations a capture runs.

An MoE layer's experts module dispatches on its config's ``_experts_implementation``:
``"grouped_mm"`` (transformers' default: rows sorted by expert, one grouped product) and
``"batched_mm"`` (each row's expert weights picked, one batched product) are single programs
torch.export captures; ``"eager"`` loops over the experts that received tokens, a Python loop
over data (``nonzero``) that export cannot capture. A model set to ``"eager"`` is captured
running ``"grouped_mm"`` instead, the same sums in another order, with one warning per model
class; the model itself is left as it is. Any other implementation (a GPU kernel library's) is
captured as it is, and a failure names ``experts_implementation`` and the fix.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

log = logging.getLogger(__name__)

#: implementations export captures as one program
CAPTURABLE = ("grouped_mm", "batched_mm")
#: what an uncapturable one is captured as
INSTEAD = "grouped_mm"
_warned: set[str] = set()


def experts_configs(model: torch.nn.Module) -> list:
    """The configs that choose the experts implementation of ``model``'s experts modules (those
    transformers' ``use_experts_implementation`` dispatches), each once."""
    found: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "_is_expert_parallel") and hasattr(config, "_experts_implementation"):
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def capturable_experts(model: torch.nn.Module) -> Iterator[None]:
    """While ``model`` is captured, experts set to ``"eager"`` run ``"grouped_mm"``."""
    changed = []
    for config in experts_configs(model):
        if getattr(config, "_experts_implementation", None) in (None, "eager"):
            changed.append((config, config._experts_implementation_internal))
            config._experts_implementation_internal = INSTEAD
    if changed and type(model).__name__ not in _warned:
        _warned.add(type(model).__name__)
        log.warning("autotp: %s's experts_implementation='eager' loops over the experts in Python, which "
                    "torch.export cannot capture; autotp captures its experts with experts_implementation=%r "
                    "(the same sums, in another order; the model itself is unchanged)",
                    type(model).__name__, INSTEAD)
    try:
        yield
    finally:
        for config, before in changed:
            config._experts_implementation_internal = before


def experts_hint(model: torch.nn.Module) -> str:
    """What a failed capture's error adds where the model's experts run an implementation
    autotp does not know to capture."""
    impls = sorted({str(c._experts_implementation) for c in experts_configs(model)} - set(CAPTURABLE) - {"eager"})
    if not impls:
        return ""
    return (f" Its experts run experts_implementation={impls[0]!r}, which autotp does not capture: call "
            f"model.set_experts_implementation('grouped_mm') (or 'batched_mm') before parallelizing.")


#: torch.topk's error where k exceeds the size of the dim it picks from (eager, and under export)
_TOPK_ERRORS = ("k not in range for dimension", "selected index k out of range")


def top_k_problem(model: torch.nn.Module, exc: BaseException) -> str | None:
    """Where a capture failed in ``torch.topk`` asked for more entries than its dim holds: what
    to tell the user (the model's config asking each token for more experts than a layer has,
    named by its fields where they can be found), else None."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 8:
        chain.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    if not any(e in text for text in chain for e in _TOPK_ERRORS):
        return None
    found = []
    configs = [*experts_configs(model), getattr(model, "config", None)]
    for config in {id(c): c for c in configs if c is not None}.values():
        fields = {k: v for k, v in vars(config).items() if isinstance(v, int) and not isinstance(v, bool)}
        picks = {k: v for k, v in fields.items() if "per_tok" in k or k.replace("_", "").endswith("topk")}
        counts = {k: v for k, v in fields.items()   # the routed experts, not the shared ones every token runs
                  if k.endswith("experts") and "per_tok" not in k and "shared" not in k}
        found += [f"{type(config).__name__}.{k}={v} > {c}={n}" for k, v in picks.items() for c, n in counts.items()
                  if 0 < n < v]
    cause = (f"the config asks each token for more experts than a layer has ({'; '.join(found)}); set the first "
             "to at most the second" if found else
             "a top-k larger than what it picks from (in a mixture of experts: a config asking each token for "
             "more experts than a layer has); lower that k to at most the dim's size")
    return (f"{type(model).__name__}'s forward calls torch.topk with k larger than the dim it picks from, in the "
            f"serial model as in a capture: {cause}")
