"""What a plan records of how data flows through its repeated layers, for the figure.

Input: the graph index and the chosen propagation (at the end of ``build_plan``). Output: for
each distinct layer of each stack (``transformer.h.{0..47}``: usually one, T5's first blocks and a
dense layer before MoE ones differ), its *steps* in graph order as small frozen values:

* ``input``: a tensor entering the layer from outside (the residual stream; an encoder's output
  for a cross-attention). Masks, rotary tables and position biases are not drawn: an entering
  tensor counts when it is floating point and as wide as the layer's output.
* ``matmul`` / ``embedding`` / ``weight``: an op that uses parameters (a projection, a lookup, a
  norm's scale or a bias), with the parameters' names under the layer.
* ``attention``: ``scaled_dot_product_attention``, or the softmax over eager attention's scores.
* ``comm``: a collective of the plan (f, g, all_gather, scatter, reduce_scatter) on the edge
  from the tensor it converts to the op that needed it.
* ``output``: the layer's result, handed to what follows.

Each step names its *sources*: the earlier steps whose values reach it through ops that are not
drawn (views, pointwise ops, the residual add). Ops and placements are read off the chosen
strategies, nothing is assumed of the family. Layers whose steps are equal (node numbering and
the rotation of uneven shards aside) share one flow.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("autotp")

_ROTATION = re.compile(r"@\d+")
_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.(.*))?$")
#: ops that only re-present a parameter (a transpose for ``x @ W.T``, a dtype cast)
_PARAM_WAY = frozenset(("t", "transpose", "permute", "numpy_T", "mT", "_to_copy", "to", "alias", "view",
                        "_unsafe_view", "reshape", "expand", "contiguous", "clone", "detach"))
#: products with a weight (an op named for grouped_mm too: experts' kernels and their fallbacks)
_MATMULS = frozenset(("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "einsum"))
_NORMS = frozenset(("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm"))
_SOFTMAX = frozenset(("_softmax", "softmax", "_safe_softmax"))


@dataclass(frozen=True)
class FlowStep:
    kind: str                    # input, matmul, embedding, weight, attention, comm, output
    module: str                  # under the layer (attn.c_attn); "" for the layer itself
    op: str                      # the ATen op's name (addmm), or the collective's kind (f, g, ...)
    params: tuple[str, ...]      # parameter names under the layer
    output: str                  # placement of what flows out (a comm: "src->dst")
    sources: tuple[int, ...]     # indices of earlier steps whose values reach this one

    def to_json(self) -> dict:
        return {"kind": self.kind, "module": self.module, "op": self.op, "params": list(self.params),
                "output": self.output, "sources": list(self.sources)}

    @classmethod
    def from_json(cls, d: dict) -> "FlowStep":
        return cls(d["kind"], d["module"], d["op"], tuple(d["params"]), d["output"], tuple(d["sources"]))


@dataclass(frozen=True)
class Flow:
    """The steps of the layers ``stack.{indices}`` (equal for each of them)."""

    stack: str
    indices: tuple[int, ...]
    steps: tuple[FlowStep, ...]

    def to_json(self) -> dict:
        return {"stack": self.stack, "indices": list(self.indices), "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, d: dict) -> "Flow":
        return cls(d["stack"], tuple(d["indices"]), tuple(FlowStep.from_json(s) for s in d["steps"]))


def _base(node: Any) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _text(p: Any) -> str:
    if isinstance(p, (tuple, list)):
        p = next((x for x in p if x is not None), None)
    return _ROTATION.sub("", repr(p)) if p is not None else "R"


def _layer_of(node: Any) -> tuple[str, int, str] | None:
    from ..capture import module_path

    m = _LAYER.match(module_path(node))
    return (m.group(1), int(m.group(2)), m.group(3) or "") if m else None


def record_flows(index: Any, prop: Any) -> list[Flow] | None:
    """The flows of every stack's distinct layers (see the module docstring). They only serve
    the figure: a graph this reading does not foresee logs why and records none (the figure then
    says so), rather than failing the plan."""
    try:
        return _record_flows(index, prop)
    except Exception as exc:   # noqa: BLE001 - a drawing aid must not stop planning
        log.warning("autotp: the plan records no layer flows for plan.figure(): %s: %s", type(exc).__name__, exc)
        return None


def _record_flows(index: Any, prop: Any) -> list[Flow]:
    cap = index.capture
    layers: dict[tuple[str, int], list] = {}
    where: dict = {}
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        parts = _layer_of(node)
        if parts is not None:
            layers.setdefault(parts[:2], []).append(node)
            where[node] = parts
    flows: dict[tuple, list[int]] = {}
    for (stack, i), nodes in layers.items():
        steps = _layer_steps(nodes, {n: where[n][2] for n in nodes}, cap.param_names, prop, index)
        if steps and any(s.kind != "input" and s.kind != "output" for s in steps):
            flows.setdefault((stack, tuple(steps)), []).append(i)
    return [Flow(stack, tuple(ix), steps) for (stack, steps), ix in flows.items()]


def _joined(node: Any, param_names: dict) -> list[str]:
    """The parameters a ``cat`` joins for one product (sibling products fused,
    autotp/passes/products.py: q | k | v drawn as one product of the three), or none."""
    if node.op != "call_function" or _base(node) != "cat" or not node.all_input_nodes:
        return []
    if not all(a.op == "placeholder" and a.name in param_names for a in node.all_input_nodes):
        return []
    return [param_names[a.name] for a in node.all_input_nodes]


def _params_of(node: Any, param_names: dict) -> list[str]:
    """Parameters ``node`` uses, directly or through ops that only re-present them (or join them)."""
    out = []
    for arg in node.all_input_nodes:
        seen = 0
        while arg.op == "call_function" and _base(arg) in _PARAM_WAY and arg.all_input_nodes and seen < 8:
            arg, seen = arg.all_input_nodes[0], seen + 1
        if arg.op == "placeholder" and arg.name in param_names:
            out.append(param_names[arg.name])
        out += _joined(arg, param_names)
    return out


def _comm_into(index: Any, prop: Any, by_tensor: dict, exact: dict) -> Any:
    """``(arg, consumer) -> the Comms, in order, the consumer reads arg through``. A conversion
    is made once per (tensor, placement, f) and read by every consumer that wants the same (q, k
    and v all read the f placed before q): decided as the propagation decides it. The gathers of
    one tensor read its one all-gather (``gather_parts``), a split cut or scattered from it."""
    from ..cost_model.symbolic import conversion_kinds
    from ..passes.propagate import _sharded_compute, gathers_whole, wants_f

    def into(arg: Any, consumer: Any) -> list:
        strat, info = prop.chosen.get(consumer), index.infos.get(consumer)
        if strat is None or info is None or arg.name not in by_tensor:
            return list(exact.get((arg.name, consumer.name), ()))
        sharded = _sharded_compute(strat)
        for i, (inp, meta, want) in enumerate(zip(index.tensor_inputs.get(consumer, ()), info.inputs, strat.inputs)):
            if inp is not arg:
                continue
            f = wants_f(want, sharded, meta, inp in index.grads, apart=strat.f_runs_only and i == 0)
            if (inp, want, f) not in prop.conversions:
                continue
            if gathers_whole(meta, prop.placements.get(inp), want, index.tp):
                return [c for c in by_tensor[arg.name] if c.kind in ("all_gather", "all_gather_f")
                        or (c.kind in ("scatter", "reshard", "all_to_all") and c.dst == want) or (c.kind == "f" and f)
                        or (c.kind in ("grad_if", "rank_slice") and c.consumer == consumer.name)]
            kinds = conversion_kinds(prop.conversions[(inp, want, f)] or None, f)
            found = [next((c for c in by_tensor[arg.name] if c.kind == k and c.dst == want), None) for k in kinds]
            return [c for c in found if c is not None]
        return list(exact.get((arg.name, consumer.name), ()))

    return into


def _layer_steps(nodes: list, rest_of: dict, param_names: dict, prop: Any, index: Any) -> list[FlowStep]:
    by_tensor: dict = {}
    for c in prop.comms:
        by_tensor.setdefault(c.tensor, []).append(c)
    exact: dict = {}
    for c in prop.comms:
        exact.setdefault((c.tensor, c.consumer), []).append(c)
    comm_into = _comm_into(index, prop, by_tensor, exact)
    inside = set(nodes)
    steps: list[FlowStep] = []
    step_of: dict = {}        # node -> step index (a drawn op)
    inputs: dict = {}         # outside node -> input step index
    comm_step: dict = {}      # (tensor, consumer) -> step index
    memo: dict = {}
    out_nodes = [n for n in nodes if any(u not in inside for u in n.users)]
    width = _last_dim(out_nodes[-1]) if out_nodes else None

    named = {n.name: n for n in nodes}

    def _module_of(consumer: str) -> str:
        return rest_of.get(named.get(consumer), "")

    def param_only(n: Any) -> bool:   # a transpose of a weight, a join: part of the step that uses it
        return (_base(n) in _PARAM_WAY and bool(_params_of_self(n))) or bool(_joined(n, param_names))

    def _params_of_self(n: Any) -> list[str]:
        a = n
        while a.op == "call_function" and _base(a) in _PARAM_WAY and a.all_input_nodes:
            a = a.all_input_nodes[0]
        return [param_names[a.name]] if a.op == "placeholder" and a.name in param_names else []

    def resolve(arg: Any, consumer: Any) -> tuple[int, ...]:
        """The steps whose values reach ``consumer`` through its input ``arg``."""
        chain = comm_into(arg, consumer)
        if not chain:
            return through(arg)
        src = None
        for c in chain:   # a conversion's collective, then its f
            if id(c) not in comm_step:
                src = through(arg) if src is None else src
                comm_step[id(c)] = len(steps)
                steps.append(FlowStep("comm", _module_of(c.consumer), c.kind, (),
                                      f"{_ROTATION.sub('', repr(c.src))}->{_ROTATION.sub('', repr(c.dst))}", src))
            src = (comm_step[id(c)],)
        return src

    def through(arg: Any) -> tuple[int, ...]:
        if arg in step_of:
            return (step_of[arg],)
        if arg.op == "placeholder" or arg not in inside or _joined(arg, param_names):
            if arg.op == "placeholder" and arg.name in param_names or _joined(arg, param_names):
                return ()
            val = arg.meta.get("val")
            if (getattr(val, "is_floating_point", lambda: False)() and val.dim() >= 2 and width is not None
                    and _last_dim(arg) == width):
                if arg not in inputs:
                    inputs[arg] = len(steps)
                    steps.append(FlowStep("input", "", "", (), _text(prop.placements.get(arg)), ()))
                return (inputs[arg],)
            return ()
        if arg in memo:
            return memo[arg]
        memo[arg] = ()   # cycles cannot occur in a graph; this only guards re-entry
        found: list[int] = []
        for a in arg.all_input_nodes:
            for s in resolve(a, arg):
                if s not in found:
                    found.append(s)
        memo[arg] = tuple(found)
        return memo[arg]

    for n in nodes:
        base = _base(n)
        params = [] if param_only(n) else _params_of(n, param_names)
        strat = prop.chosen.get(n)
        scores = base in _SOFTMAX and _scores(n)
        if not params and not scores and base != "scaled_dot_product_attention":
            continue
        kind = ("attention" if not params else "matmul" if base in _MATMULS or "grouped_mm" in base else
                "embedding" if base == "embedding" else "weight")
        rest = rest_of[n]
        sources: list[int] = []
        for a in n.all_input_nodes:
            for s in resolve(a, n):
                if s not in sources:
                    sources.append(s)
        out = _text(prop.placements.get(n, strat.output if strat is not None else None))
        names = tuple(_under(p) for p in params)
        k = sources[0] if len(sources) == 1 else -1
        prev = steps[k] if k >= 0 else None
        if kind == "weight" and prev is not None and prev.kind == "matmul" and prev.module == rest:
            # a bias added straight after its projection (no collective between): part of that step
            steps[k] = FlowStep(prev.kind, prev.module, prev.op, prev.params + names, out, prev.sources)
            step_of[n] = k
            continue
        step_of[n] = len(steps)
        steps.append(FlowStep(kind, rest, base, names, out, tuple(s for s in sources)))
    if out_nodes:
        srcs: list[int] = []
        for n in out_nodes:
            if width is not None and _last_dim(n) != width:
                continue
            for s in ((step_of[n],) if n in step_of else through(n)):
                if s not in srcs:
                    srcs.append(s)
        # the result is what the layer's last op produced
        steps.append(FlowStep("output", "", "", (), _text(prop.placements.get(out_nodes[-1])), tuple(srcs)))
    return steps


def _under(fqn: str) -> str:
    """A parameter's name under its layer (transformer.h.3.attn.c_attn.weight -> attn.c_attn.weight)."""
    m = _LAYER.match(fqn)
    return (m.group(3) or fqn) if m else fqn


def _last_dim(node: Any) -> Any:
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    if not shape:
        return None
    last = shape[-1]
    return int(last) if isinstance(last, int) else str(last)


def _scores(node: Any) -> bool:
    """A softmax over attention scores [..., heads, s, s]: its last two dims are dynamic."""
    val = node.meta.get("val")
    return val is not None and val.dim() >= 3 and not any(isinstance(s, int) for s in val.shape[-2:])
