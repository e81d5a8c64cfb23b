"""A rank program cut into pipeline chunks (:func:`cut`): which ops each chunk computes, what it
receives and what it sends on (see :mod:`autotp.runtime.pipeline.stage` for the rules and why).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ...capture import layer_of, module_path
from ...errors import ConfigError


@dataclass
class Chunk:
    """One chunk of a rank program: its graph and what feeds it, in the graph's placeholder
    order (parameters, buffers, constants by their program positions, then what it receives)."""

    index: int
    graph: fx.GraphModule
    params: list[int]       # positions in the program's parameter placeholders
    buffers: list[int]
    constants: list[int]
    receives: list[str]     # the names of the values it receives (model inputs, activations)
    sends: list[str]


def _is_tensor(node: fx.Node, root: nn.Module) -> bool:
    val = node.meta.get("val")
    if val is not None:
        return isinstance(val, torch.Tensor)
    # nodes the rewrite made: collectives and localized ops give tensors, size arithmetic does
    # not; an item of a layer call's results (activation checkpointing) is what the called
    # graph returns there
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        call, i = node.args[0], node.args[1]
        inner = _called_graph(call, root)
        if inner is not None:
            out = next(n for n in inner.graph.nodes if n.op == "output").args[0]
            item = out[i] if isinstance(out, (tuple, list)) else out
            return isinstance(item, fx.Node) and _is_tensor(item, inner)
        return True
    if node.op == "call_module" and node.users and all(u.target is operator.getitem for u in node.users):
        return False    # a tuple of results: its items travel
    return not (node.op == "call_function" and getattr(node.target, "__module__", "") in ("_operator", "operator")) \
        and node.target is not torch.ops.aten.sym_size.int


def _called_graph(node: fx.Node, root: nn.Module) -> fx.GraphModule | None:
    """The graph a call_module node runs (through a checkpointed layer's wrapper), or None."""
    if node.op != "call_module":
        return None
    module = root.get_submodule(node.target)
    for candidate in (module, getattr(module, "inner", None)):
        if isinstance(candidate, fx.GraphModule):
            return candidate
    return None


def cut(gm: fx.GraphModule, counts: tuple[int, int, int], chunk_of_layer: dict[str, int], chunks: int,
        output_index: int, fixed: dict[int, Any] | None = None, device: torch.device | str = "cpu") -> list[Chunk]:
    """``gm`` (a rank program: ``counts`` = its parameter, buffer and constant placeholders, then
    the model's inputs) cut into ``chunks`` chunks; the last returns output ``output_index``.
    ``fixed``: the model inputs traced as constants (``use_cache=False``), by input position,
    written into the chunks instead of sent. See the module docs."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    n_params, n_buffers, n_constants = counts
    params = placeholders[:n_params]
    locals_ = placeholders[:n_params + n_buffers + n_constants]
    inputs = placeholders[n_params + n_buffers + n_constants:]
    fixed_values = {inputs[i]: v for i, v in (fixed or {}).items()}
    user = [x for x in inputs if x not in fixed_values]
    output = next(n for n in nodes if n.op == "output")
    target = fx.node.map_arg(output.args[0], lambda a: a)
    target = list(target) if isinstance(target, (list, tuple)) else [target]
    loss = target[output_index]
    if not isinstance(loss, fx.Node):
        raise ConfigError("the program's loss output is not computed by the graph; a pipeline trains on the loss")

    # what each node depends on: a parameter (w), a model input (u)
    w: dict[fx.Node, bool] = {}
    u: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op == "placeholder":
            w[n], u[n] = n in params, n in user
        elif n.op != "output":
            ins = n.all_input_nodes
            w[n] = any(w[x] for x in ins)
            u[n] = any(u[x] for x in ins)
    act = {n for n in nodes if n.op not in ("placeholder", "output") and w[n] and u[n]}

    # an in-place op (T5's shift of the labels: zeros, then copy_ and fill_ into slices of
    # them) is read by no one: it runs wherever the tensor it writes runs
    writers = _writers(nodes)

    # the ancestors of the loss: nothing else is computed
    needed: set[fx.Node] = set()
    stack = [loss]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
            stack.extend(writers.get(n, ()))


    layers = list(chunk_of_layer)
    in_layer: dict[fx.Node, int] = {}  # an activation of a layer: its chunk
    chunk: dict[fx.Node, int | None] = {}
    for n in nodes:
        if n not in act:
            continue
        layer = layer_of(n, layers)
        if layer is not None:
            in_layer[n] = chunk_of_layer[layer]
        ins = [chunk[x] for x in n.all_input_nodes if x in act and chunk[x] is not None]
        cands = ins + ([in_layer[n]] if n in in_layer else [])
        chunk[n] = max(cands) if cands else None
    for n in reversed(nodes):     # an activation of no layer that reads none: where it is first read
        if n in act and chunk[n] is None:
            readers = [chunks - 1 if r.op == "output" else chunk.get(r) for r in n.users]
            readers = [c for c in readers if c is not None]
            chunk[n] = min(readers) if readers else chunks - 1
    for n in nodes:               # nothing runs before what it reads
        if n in act:
            ins = [chunk[x] for x in n.all_input_nodes if x in act]
            if ins and max(ins) > chunk[n]:
                if n in in_layer:
                    raise ConfigError(f"the pipeline cannot cut the program before {n.name} ({module_path(n)}): it "
                                      "reads a value the model computes later, outside its layers")
                chunk[n] = max(ins)
    if chunk[loss] is None or loss not in act:
        raise ConfigError("the loss does not depend on the model's inputs and parameters; nothing to pipeline")

    emit: list[set[fx.Node]] = [set() for _ in range(chunks)]
    receives: list[set[fx.Node]] = [set() for _ in range(chunks)]
    local_in: list[set[fx.Node]] = [set() for _ in range(chunks)]
    boxed: dict[fx.Node, str] = {}    # numbers that travel: node -> "int", "float" or "bool"

    def require(c: int, x: fx.Node) -> None:
        if x in fixed_values:
            return
        if x.op == "placeholder":
            (receives if x in user else local_in)[c].add(x)
            return
        if x in act and chunk[x] == c:
            return
        if x in act and chunk[x] > c:
            raise ConfigError(f"the pipeline cut is inconsistent: chunk {c} reads {x.name}, made in chunk {chunk[x]}")
        if x in act:       # made in an earlier chunk: it travels (a number as a one-element tensor)
            receives[c].add(x)
            if not _is_tensor(x, gm):
                boxed[x] = _kind(x)
            return
        if x in emit[c]:
            return
        emit[c].add(x)     # computed again here (no parameter, or parameters alone)
        for y in [*x.all_input_nodes, *writers.get(x, ())]:
            require(c, y)

    for n in nodes:
        if n in act and n in needed:
            emit[chunk[n]].add(n)
            for y in n.all_input_nodes:
                require(chunk[n], y)
            for y in writers.get(n, ()):
                if y not in act or chunk[y] != chunk[n]:
                    raise ConfigError(f"the pipeline cannot cut between {n.name} and the in-place {y.name} that "
                                      "writes into it")
    require(chunks - 1, loss)

    order = {n: i for i, n in enumerate(nodes)}
    made_before = lambda x, c: x in user or chunk[x] < c   # noqa: E731
    recv: list[list[fx.Node]] = [list(user)]
    for c in range(1, chunks):
        later = set().union(*receives[c:])
        recv.append(sorted((x for x in later if made_before(x, c)), key=order.get))
    out: list[Chunk] = []
    for c in range(chunks):
        g = fx.Graph()
        env: dict[fx.Node, Any] = dict(fixed_values)
        for p in locals_:
            if p in local_in[c]:
                env[p] = g.placeholder(p.name)
                env[p].meta = dict(p.meta)
        for x in recv[c]:
            env[x] = g.placeholder(f"in_{x.name}")
            env[x].meta = dict(x.meta)
            if x in boxed:
                env[x] = g.call_function(_unbox, (env[x], boxed[x]))
        for n in nodes:
            if n in emit[c]:
                env[n] = g.node_copy(n, lambda a: env[a])
        sends = recv[c + 1] if c + 1 < chunks else []
        sent = tuple(g.call_function(_box, (env[x], boxed[x], str(device))) if x in boxed else env[x] for x in sends)
        g.output(env[loss] if c == chunks - 1 else sent)
        graph = fx.GraphModule(gm, g, class_name=f"PipelineChunk{c}")
        pos = {p: i for i, p in enumerate(placeholders)}
        mine = [p for p in locals_ if p in local_in[c]]
        out.append(Chunk(
            c, graph,
            params=[pos[p] for p in mine if pos[p] < n_params],
            buffers=[pos[p] - n_params for p in mine if n_params <= pos[p] < n_params + n_buffers],
            constants=[pos[p] - n_params - n_buffers for p in mine if pos[p] >= n_params + n_buffers],
            receives=[x.name for x in recv[c]], sends=[x.name for x in sends]))
    return out


def _kind(node: fx.Node) -> str:
    """What a number that travels is: "int", "float" or "bool" (an int when nothing says)."""
    val = node.meta.get("val")
    if isinstance(val, (bool, torch.SymBool)):
        return "bool"
    if isinstance(val, (float, torch.SymFloat)):
        return "float"
    return "int"


def _box(value: Any, kind: str, device: str) -> torch.Tensor:
    """A number as the one-element tensor a pipeline stage can send."""
    return torch.tensor([value], dtype=torch.float64 if kind == "float" else torch.int64, device=device)


def _unbox(t: torch.Tensor, kind: str) -> Any:
    value = t.item()
    return bool(value) if kind == "bool" else float(value) if kind == "float" else int(value)


def _writers(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each node written in place by later ops (through views of it): node -> those ops."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        base = n.args[0]
        while base.op == "call_function" and _is_view(base) and base.args and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        out.setdefault(base, []).append(n)
    return out


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write
