"""The routing load a plan records: the rows each MoE layer's experts get (a value of the plan).

:class:`ExpertLoad` holds them by the experts module's name (the module holding the 3-D stacks,
``model.layers.0.mlp.experts``), counts or fractions (only their ratios matter), with where they
came from; :func:`as_expert_load` reads ``expert_load=`` as the planner takes it. How a load is
measured and priced: :mod:`autotp.planner.expert_load`. It sits with the plan, below the planner,
because the plan's arguments and its JSON hold one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class ExpertLoad:
    """Rows per expert of each MoE layer: ``layers`` is ((experts module, (rows of expert 0, ...)), ...),
    sorted by module; ``source`` says where they come from (shown in the plan's notes)."""

    layers: tuple[tuple[str, tuple[float, ...]], ...]
    source: str = "given"

    def __init__(self, layers: "Mapping[str, Sequence[float]] | tuple", source: str = "given"):
        items = layers.items() if isinstance(layers, Mapping) else layers
        out = []
        for name, counts in items:
            if not isinstance(name, str):
                raise ConfigError(f"expert_load: layer {name!r} is not a module name (the experts module, "
                                  f"such as 'model.layers.0.mlp.experts')")
            try:
                rows = tuple(float(c) for c in counts)
            except (TypeError, ValueError):
                raise ConfigError(f"expert_load[{name!r}] = {counts!r}: give the rows (or fractions of them) each "
                                  f"expert gets, one number per expert") from None
            if not rows or any(not (r >= 0) or r == float("inf") for r in rows) or sum(rows) <= 0:
                raise ConfigError(f"expert_load[{name!r}] = {list(counts)!r}: the rows each expert gets must be "
                                  f"finite, non-negative and not all zero")
            out.append((name, rows))
        if not out:
            raise ConfigError("expert_load names no MoE layer: give each layer's rows per expert, or pass "
                              "expert_load=None for a balanced router")
        object.__setattr__(self, "layers", tuple(sorted(out)))
        object.__setattr__(self, "source", str(source))

    def __getitem__(self, module: str) -> tuple[float, ...]:
        return dict(self.layers)[module]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {"layers": {name: list(rows) for name, rows in self.layers}, "source": self.source}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "ExpertLoad":
        return cls(doc["layers"], doc.get("source", "given"))

    def __repr__(self) -> str:
        busiest = max(max(rows) * len(rows) / sum(rows) for _, rows in self.layers)
        return f"ExpertLoad({len(self.layers)} MoE layers, {self.source}; busiest expert {busiest:.2f}x the mean)"


def as_expert_load(value: Any) -> "ExpertLoad | None":
    """``expert_load=`` as the planner takes it: None (a balanced router), an :class:`ExpertLoad`,
    or a mapping of experts module -> rows per expert."""
    if value is None or isinstance(value, ExpertLoad):
        return value
    if isinstance(value, Mapping):
        return ExpertLoad(value)
    raise ConfigError(f"expert_load={value!r}: pass autotp.measure_expert_load(model, batch), a mapping of each "
                      f"MoE layer's experts module to its rows per expert, or None (a balanced router)")
