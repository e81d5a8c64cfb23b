"""The planning arguments a plan's programs are built with, carried by the plan.

A plan fixes the parameters' placements; the programs ``parallelize`` builds from it (the first
call's and every later one's) are each planned under those placements, and how depends on more
than the placements: whether sequence parallelism is offered, forced or forbidden, how the experts
get their rows, whether a step may read on the host, which activations, norms and sibling products run fused, whether
shards may be uneven, whether the logits are gathered. :class:`PlanArguments` records them, so that
``parallelize(model, tp, plan=p)`` builds what ``parallelize(model, tp, <p's arguments>)`` builds,
from the plan alone or its JSON file; :func:`resolve` merges them with the arguments a call gives,
refusing one that contradicts the plan.

What stays a choice of the run, not the plan (docs/architecture.md, "The plan"): the device and its
profile (``profile=``, default the plan's), the workload the later programs are priced at
(``batch=``, ``seq=``, default the plan's), ``align_products``, ``activation_checkpointing``,
``memory_limit`` (a saved plan is replayed, not re-solved), ``seed``, ``rng``, ``backend``, ``pp``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError

#: an argument's value when the caller leaves it to the plan (or, without one, to the default)
_DEFAULTS = {"sequence_parallel": None, "expert_dispatch": None, "gather_logits": None, "host_reads": True,
             "fuse_activations": True, "fuse_norms": True, "fuse_products": True, "uneven": True, "expert_load": None}
#: those whose None is itself a choice (by cost): given None with a plan, they take the plan's
_BY_COST = ("sequence_parallel", "expert_dispatch", "gather_logits")


@dataclass(frozen=True)
class PlanArguments:
    """The arguments a plan was made with that change the programs built from it (each as
    :func:`autotp.plan` takes it; None: by cost)."""

    sequence_parallel: bool | None = None
    expert_dispatch: bool | None = None
    gather_logits: bool | None = None
    host_reads: bool = True
    fuse_activations: bool = True
    fuse_norms: bool = True
    fuse_products: bool = True
    uneven: bool = True
    #: the router's load expert parallelism was priced at (an :class:`autotp.ExpertLoad`; None: a
    #: balanced router), autotp/planner/expert_load.py
    expert_load: Any = None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.expert_load is None:
            del out["expert_load"]   # a file without it reads as before (a balanced router)
        else:
            out["expert_load"] = self.expert_load.to_json()
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "PlanArguments":
        """Fields a file lacks take their defaults (a file written before one was recorded)."""
        from .expert_load import ExpertLoad

        out = {f.name: doc[f.name] for f in fields(cls) if f.name in doc}
        if out.get("expert_load") is not None:
            out["expert_load"] = ExpertLoad.from_json(out["expert_load"])
        return cls(**out)

    def lines(self) -> list[str]:
        """What the plan's table says of them: sequence parallelism and the dispatch always,
        the others where they are not the defaults."""
        sp = {None: "by cost", True: "forced (sequence_parallel=True)", False: "forbidden (sequence_parallel=False)"}
        dispatch = {None: "by cost", True: "all-to-all, forced (expert_dispatch=True)",
                    False: "tokens gathered whole, never the all-to-all (expert_dispatch=False)"}
        out = [f"sequence parallelism: {sp[self.sequence_parallel]}; expert dispatch: {dispatch[self.expert_dispatch]}"]
        others = [f"{name}={value!r}" for name, value in self.to_json().items()
                  if name not in ("sequence_parallel", "expert_dispatch", "expert_load") and value != _DEFAULTS[name]]
        if others:
            out.append("planned with " + ", ".join(others))
        if self.expert_load is not None:
            out.append(f"expert load: {self.expert_load.source} ({len(self.expert_load.layers)} MoE layers)")
        return out


def resolve(plan: Any, **given: Any) -> dict[str, Any]:
    """The arguments a program is built with: without a plan (or with one saved before they were
    recorded), ``given``, a None of a flag taking its default; with one, the plan's, where
    ``given`` leaves them to it (None) or says the same. A given value that contradicts the plan's
    is a ConfigError naming both and the fix."""
    recorded = getattr(plan, "arguments", None)
    out = {}
    for name, value in given.items():
        if name == "expert_load":   # an ExpertLoad (a mapping given is made one), not a flag
            from .expert_load import as_expert_load

            value = as_expert_load(value)
        elif not (value is None or isinstance(value, bool)):   # a string "False" is truthy
            choices = "None (by cost), True or False" if name in _BY_COST else "True or False"
            raise ConfigError(f"{name}={value!r}: {name} is {choices}")
        if recorded is None:
            out[name] = _DEFAULTS[name] if value is None else value
            continue
        planned = getattr(recorded, name)
        if value is not None and value != planned:
            leave = ("drop the argument" if name not in _BY_COST
                     else f"pass {name}=None or drop it")
            if name == "expert_load":
                raise ConfigError(
                    f"expert_load={value!r} differs from the load the plan was priced at ({planned!r}), and its programs "
                    f"are built as planned: re-plan with autotp.plan(..., expert_load=...) and parallelize with "
                    f"that plan, or pass expert_load=None (or drop it) to build the plan's")
            raise ConfigError(
                f"{name}={value!r}, but the plan was made with {name}={planned!r}, and its programs are built as "
                f"planned: re-plan with autotp.plan(..., {name}={value!r}) and parallelize with that plan, or "
                f"{leave} to build the plan's")
        out[name] = planned
    return out
