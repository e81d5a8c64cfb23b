"""What a plan file may hold: :func:`check_document` checks every field of a
:meth:`autotp.plan.Plan.to_json` document (its type, its range, the fields it must agree with)
before a Plan is built from it, so that a damaged or hand-edited file is refused with one
``ConfigError`` naming the field, instead of loading and failing later, raw, in the table,
the figure, the diff or a run.
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..placements import ROUTED_FLAGS, from_json

__all__ = ["check_document"]

_COMM_TEXT = ("kind", "tensor", "consumer", "src", "dst")
_COMM_NUMBERS = ("fwd_bytes", "bwd_bytes", "seconds")
_FLOW_TEXT = ("kind", "module", "op", "output")


class _Field:
    """A checker at one place of the document (``where``: ``params['wte.weight'].shape[1]``)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def at(self, key: Any) -> "_Field":
        return _Field(f"{self.where}[{key!r}]" if self.where else str(key))

    def dot(self, name: str) -> "_Field":
        return _Field(f"{self.where}.{name}" if self.where else name)

    def fail(self, value: Any, wanted: str) -> None:
        shown = repr(value)
        raise ConfigError(f"malformed autotp plan: {self.where} is {shown[:80] + '...' if len(shown) > 80 else shown}, "
                          f"expected {wanted}; re-create the plan with autotp.plan(...) (or mend the file)")

    def integer(self, value: Any, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.fail(value, f"an integer >= {low}")
        return value

    def number(self, value: Any, positive: bool = False, infinite: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                or (math.isinf(value) and not infinite) or value < 0 or (positive and value == 0):
            self.fail(value, ("a positive" if positive else "a non-negative") + (" number" if infinite
                                                                                 else " finite number"))
        return float(value)

    def text(self, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(value, "a string")
        return value

    def mapping(self, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail(value, "an object")
        return value

    def sequence(self, value: Any) -> list:
        if not isinstance(value, list):
            self.fail(value, "a list")
        return value

    def flag(self, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(value, "true or false")
        return value


def check_document(doc: dict) -> None:
    """Raise ConfigError naming the first field of ``doc`` (a plan's JSON, parsed) that a Plan
    cannot hold: a wrong type, a count below one, a cost that is NaN, infinite or negative, a
    placement of a dim the parameter lacks, an alias of a parameter the plan does not hold."""
    root = _Field("")
    for key in ("tp", "profile", "batch", "seq", "params"):
        if key not in doc:
            root.dot(key).fail("(missing)", "the field every plan has")
    tp = root.dot("tp").integer(doc["tp"], 1)
    root.dot("profile").text(doc["profile"])
    root.dot("batch").integer(doc["batch"], 1)
    root.dot("seq").integer(doc["seq"], 1)
    if "dtype_bytes" in doc:
        root.dot("dtype_bytes").integer(doc["dtype_bytes"], 1)
    params = root.dot("params").mapping(doc["params"])
    for name, entry in params.items():
        here = root.dot("params").at(name)
        entry = here.mapping(entry)
        for key in ("placement", "shape", "role"):
            if key not in entry:
                here.dot(key).fail("(missing)", "the field every parameter has")
        shape = [here.dot("shape").at(i).integer(n) for i, n in enumerate(here.dot("shape").sequence(entry["shape"]))]
        here.dot("role").text(entry["role"])
        _placement(here.dot("placement"), entry["placement"], len(shape), tp)
    aliases = root.dot("aliases").mapping(doc.get("aliases", {}))
    for name, target in aliases.items():
        if root.dot("aliases").at(name).text(target) not in params:
            root.dot("aliases").at(name).fail(target, "a parameter the plan holds")
    for name, p in root.dot("sharded_outputs").mapping(doc.get("sharded_outputs", {})).items():
        _placement(root.dot("sharded_outputs").at(name), p, None, tp)
    for i, comm in enumerate(root.dot("comms").sequence(doc.get("comms", []))):
        here = root.dot("comms").at(i)
        comm = here.mapping(comm)
        unknown = sorted(set(comm) - set(_COMM_TEXT) - set(_COMM_NUMBERS) - {"module"})
        if unknown:
            here.dot(unknown[0]).fail(comm[unknown[0]], "no such field (a collective has "
                                      f"{', '.join(_COMM_TEXT + _COMM_NUMBERS)} and module)")
        for key in _COMM_TEXT + _COMM_NUMBERS:
            if key not in comm:
                here.dot(key).fail("(missing)", "the field every collective has")
        for key in _COMM_TEXT + ("module",) * ("module" in comm):
            here.dot(key).text(comm[key])
        for key in _COMM_NUMBERS:
            here.dot(key).number(comm[key])
    for key in ("compute_s", "comm_s", "optimizer_s", "memory_bytes", "activation_bytes", "layer_input_bytes"):
        if key in doc:
            root.dot(key).number(doc[key])
    if "recomputed" in doc:
        root.dot("recomputed").flag(doc["recomputed"])
    if doc.get("memory_limit") is not None:
        root.dot("memory_limit").number(doc["memory_limit"], positive=True, infinite=True)
    for key, expr in root.dot("expressions").mapping(doc.get("expressions", {})).items():
        root.dot("expressions").at(key).text(expr)
    for i, note in enumerate(root.dot("notes").sequence(doc.get("notes", []))):
        root.dot("notes").at(i).text(note)
    if doc.get("attention") is not None:
        for module, heads in root.dot("attention").mapping(doc["attention"]).items():
            here = root.dot("attention").at(module)
            counts = [here.at(r).integer(n) for r, n in enumerate(here.sequence(heads))]
            if len(counts) != tp:
                here.fail(heads, f"one head count per rank ({tp})")
    if doc.get("flows") is not None:
        for i, flow in enumerate(root.dot("flows").sequence(doc["flows"])):
            _flow(root.dot("flows").at(i), flow)
    if doc.get("arguments") is not None:
        _arguments(root.dot("arguments"), doc["arguments"])


def _arguments(here: _Field, doc: Any) -> None:
    """The planning arguments (:class:`autotp.plan.arguments.PlanArguments`): each a flag, those
    decided by cost also null."""
    from dataclasses import fields

    from .arguments import _BY_COST, PlanArguments

    doc = here.mapping(doc)
    known = [f.name for f in fields(PlanArguments)]
    for key, value in doc.items():
        if key not in known:
            here.dot(key).fail(value, f"no such argument (a plan records {', '.join(known)})")
        if key == "expert_load":   # autotp/planner/expert_load.py: rows per expert of each MoE layer
            _expert_load(here.dot(key), value)
        elif not (value is None and key in _BY_COST):
            here.dot(key).flag(value)


def _expert_load(here: _Field, doc: Any) -> None:
    """An :class:`autotp.ExpertLoad`'s JSON: ``layers`` (experts module -> rows per expert), ``source``."""
    from ..errors import ConfigError
    from .expert_load import ExpertLoad

    doc = here.mapping(doc)
    try:
        ExpertLoad.from_json(doc)
    except (ConfigError, KeyError, TypeError, AttributeError) as exc:
        here.fail(doc, f"an expert load: {{'layers': {{experts module: [rows per expert, ...]}}, 'source': text}} "
                       f"({exc})")


def _placement(here: _Field, p: Any, ndim: int | None, tp: int) -> None:
    """A placement's JSON (``autotp.placements.to_json``) of a tensor of ``ndim`` dims (None: unknown)."""
    p = here.mapping(p)
    kind = p.get("kind")
    if kind == "replicate":
        return
    if kind == "partial":
        if "routed" in p:   # Routed (autotp/placements.py): rows of (token, expert) pairs
            here.dot("routed").integer(p["routed"])
            for key, least in (("span", 1), ("unit", 1), ("heads", 0)):
                if key in p:
                    here.dot(key).integer(p[key], least)
            for key in ROUTED_FLAGS:
                if key in p:
                    here.dot(key).flag(p[key])
            try:   # the marks' combinations Routed accepts (a mark without the one it needs)
                from_json(p)
            except ValueError as exc:
                here.fail(p, f"marks Routed accepts together ({exc})")
        return
    if kind != "shard":
        here.dot("kind").fail(kind, "'shard', 'partial' or 'replicate'")
    if "dim" not in p:
        here.dot("dim").fail("(missing)", "the dim a shard splits")
    dim = here.dot("dim").integer(p["dim"])
    if ndim is not None and dim >= ndim:
        here.dot("dim").fail(dim, f"a dim of the parameter's {ndim}")
    for key, low in (("chunks", 1), ("unit", 1), ("rotate", 0), ("tail", 0), ("outer", -1)):
        if key in p:
            here.dot(key).integer(p[key], low)
    if "per_block" in p:
        here.dot("per_block").flag(p["per_block"])
    for i, size in enumerate(here.dot("sizes").sequence(p.get("sizes", []))):
        here.dot("sizes").at(i).integer(size, 1)
    for i, block in enumerate(here.dot("whole").sequence(p.get("whole", []))):
        here.dot("whole").at(i).integer(block)


def _flow(here: _Field, flow: Any) -> None:
    flow = here.mapping(flow)
    for key in ("stack", "indices", "steps"):
        if key not in flow:
            here.dot(key).fail("(missing)", "the field every flow has")
    here.dot("stack").text(flow["stack"])
    indices = here.dot("indices").sequence(flow["indices"])
    if not indices:
        here.dot("indices").fail(indices, "the indices of the layers the flow is of (at least one)")
    for i, n in enumerate(indices):
        here.dot("indices").at(i).integer(n)
    steps = here.dot("steps").sequence(flow["steps"])
    if not steps:
        here.dot("steps").fail(steps, "the layer's steps (at least one)")
    for i, step in enumerate(steps):
        at = here.dot("steps").at(i)
        step = at.mapping(step)
        for key in _FLOW_TEXT + ("params", "sources"):
            if key not in step:
                at.dot(key).fail("(missing)", "the field every step has")
        for key in _FLOW_TEXT:
            at.dot(key).text(step[key])
        for j, name in enumerate(at.dot("params").sequence(step["params"])):
            at.dot("params").at(j).text(name)
        for j, source in enumerate(at.dot("sources").sequence(step["sources"])):
            if at.dot("sources").at(j).integer(source) >= i:
                at.dot("sources").at(j).fail(source, f"an earlier step's index (< {i})")
