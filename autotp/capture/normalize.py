"""The exported program -> a :class:`~autotp.capture.program.Capture`, normalized for the later stages.

The lifted inputs are named, the input dims' symbols and ranges read, higher-order regions
inlined (:mod:`autotp.capture.higher_order`) once the ops are in an order that depends on the
graph alone (:mod:`autotp.capture.canonical`), and the graph normalized: ``addmm``/``linear``
with a bias become a product followed by an ``add`` (so that a row-parallel bias can be added
once, after the all-reduce), ``_assert_tensor_metadata`` checks are dropped (they pin the
capture's device and dtype, which the rewritten per-rank graph must not), and the ops are named
afresh in graph order.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..errors import CaptureError
from .canonical import canonical_order
from .higher_order import inline_regions
from .program import input_guards, Capture

aten = torch.ops.aten


def _from_exported(ep: torch.export.ExportedProgram, kwargs: dict[str, Any], expanded: Any = None) -> Capture:
    """The Capture of ``ep``; ``expanded`` (autotp.capture.expand.Expanded): the whole model's
    graph and lifted inputs grown from ``ep``, a cut model's program."""
    sig = ep.graph_signature
    params, buffers, consts = {}, {}, {}
    from torch.export.graph_signature import InputKind

    if expanded is not None:
        params, buffers, consts = expanded.params, expanded.buffers, expanded.constants
        gm = expanded.graph_module
    else:
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                params[name] = spec.target
            elif spec.kind == InputKind.BUFFER:
                buffers[name] = spec.target
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                consts[name] = spec.target
        gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_lifted = len(params) + len(buffers) + len(consts)
    user_nodes = placeholders[n_lifted:]
    keys = list(kwargs.keys())
    if len(user_nodes) != len(keys):
        raise CaptureError(f"captured {len(user_nodes)} user inputs for {len(keys)} kwargs {keys}")
    constant_inputs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    ranges: dict[str, tuple[int, int]] = {}
    dim_symbols: dict[str, str] = {}
    input_dims: dict[str, str] = {}
    constraints = {str(sym): vr for sym, vr in ep.range_constraints.items()}
    for node, key in zip(user_nodes, keys):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                sym = str(size.node.expr)
                vr = constraints.get(sym)
                if vr is not None:
                    ranges[f"{key}.{d}"] = (int(vr.lower), _bound(vr.upper))
                input_dims[f"{key}.{d}"] = sym
                dim_symbols.setdefault(sym, "batch" if d == 0 else "seq")
    symbol_hints = _symbol_hints(gm)
    # one order whatever the process's string-hash seed (autotp.capture.canonical); before the
    # regions are inlined, while each is one op
    canonical_order(gm.graph, params)
    inline_regions(gm)   # no_grad/autocast blocks in forward become plain ops (autotp.capture.higher_order)
    _normalize(gm.graph)
    gm = _renamed(gm)
    return Capture(
        graph_module=gm,
        param_names=params,
        buffer_names=buffers,
        constant_names=consts,
        constants={k: v for k, v in ep.constants.items()},
        user_inputs=[n.name for n in user_nodes],
        input_keys=keys,
        constant_inputs=constant_inputs,
        out_spec=ep.call_spec.out_spec,
        range_constraints=ranges,
        dim_symbols=dim_symbols,
        input_dims=input_dims,
        symbol_hints={k: v for k, v in symbol_hints.items() if k not in dim_symbols},
        # unproven guards only: with named dims export has checked every guard over their ranges
        guards=input_guards(getattr(ep, "_guards_code", ()), keys) if getattr(ep, "_autotp_unnamed", False) else (),
    )


def _symbol_hints(gm: fx.GraphModule) -> dict[str, int | str]:
    """Every symbol export's shape environment knows: the expression export replaced it by
    (a string), else its value in the example (backed and, where recorded, data-dependent)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        sizes = val.shape if isinstance(val, torch.Tensor) else ()
        env = next((size.node.shape_env for size in sizes if isinstance(size, torch.SymInt)), None)
        if env is None:
            continue
        hints: dict[str, int | str] = {}
        backed = getattr(env, "backed_var_to_val", None)
        for table in (backed if backed is not None else getattr(env, "var_to_val", {}),
                      getattr(env, "unbacked_var_to_val", {})):
            for sym, value in table.items():
                try:
                    hints[str(sym)] = int(value)
                except (TypeError, ValueError):
                    pass
        for sym, expr in getattr(env, "replacements", {}).items():
            hints[str(sym)] = str(expr)
        return hints
    return {}


#: an unbounded dim's upper bound (Dim.DYNAMIC's int_oo)
UNBOUNDED = 1 << 62


def _bound(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):   # sympy's and torch's infinities
        return UNBOUNDED


try:   # generates the capture's Python code when it is first run or read, not at capture
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:   # pragma: no cover - present in every torch autotp supports
    _LazyGraphModule = fx.GraphModule


def _renamed(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph with its ops named afresh in graph order (``addmm``, ``addmm_1``, ...).
    torch.export's names count nodes it traced and later dropped; these depend on the graph
    alone, so a whole export and a cut-and-expanded one name every op alike (the plan's
    collectives name the tensors they apply to).

    Renamed in place, with the names fx would give the nodes of a fresh graph built in this
    order (a copy of gpt2-xl's graph costs 0.045 s, the renaming a tenth of it)."""
    graph = gm.graph
    names = fx.graph._Namespace()
    for node in graph.nodes:
        kept = node.op in ("placeholder", "get_attr", "output")
        name = names.create_name(node.name if kept else graph._target_to_str(node.target), None)
        names.associate_name_with_obj(name, node)
        node.name = name
    graph._graph_namespace = names
    out = _LazyGraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def _normalize(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, x, w = node.args[:3]
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (x, w))
                mm.meta = dict(node.meta)   # same shape, dtype and source module
            if _bias_after_view(graph, node, mm, bias):
                continue
            with graph.inserting_before(node):
                add = graph.call_function(aten.add.Tensor, (mm, bias))
                add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
        elif node.target is aten.linear.default and len(node.args) == 3 and node.args[2] is not None:
            x, w, bias = node.args
            with graph.inserting_before(node):
                lin = graph.call_function(aten.linear.default, (x, w))
                lin.meta = dict(node.meta)
                add = graph.call_function(aten.add.Tensor, (lin, bias))
                add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
    graph.lint()


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _bias_after_view(graph: fx.Graph, addmm: fx.Node, mm: fx.Node, bias: Any) -> bool:
    """``addmm`` on flattened tokens ``(b*s, n)`` whose only use views it back to ``(b, s, n)``:
    view the product first and add the bias to the view. The sum is the same; what changes is
    that a row-parallel Partial product now reaches the bias add with the sequence dim apart,
    so sequence parallelism can reduce-scatter it along s (it cannot split the merged b*s).
    Where x itself was flattened from ``(b, s, k)`` for the product (GPT-2's Conv1D), the two
    views and the product become one ``matmul`` of the 3-D x."""
    users = list(addmm.users)
    if len(users) != 1 or users[0].target not in _VIEWS or not isinstance(bias, fx.Node):
        return False
    view = users[0]
    out, b = view.meta.get("val"), bias.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 1
            and out.dim() >= 2 and out.shape[-1] == addmm.meta["val"].shape[-1]):
        return False
    flat = mm.args[0]
    whole = flat.args[0] if isinstance(flat, fx.Node) and flat.target in _VIEWS else None
    whole_val = whole.meta.get("val") if isinstance(whole, fx.Node) else None
    if isinstance(whole_val, torch.Tensor) and whole_val.dim() >= 3 and tuple(whole_val.shape[:-1]) == tuple(
            out.shape[:-1]) and whole_val.shape[-1] == flat.meta["val"].shape[-1]:
        # x viewed (b, s, k) -> (b*s, k), multiplied, viewed back: one matmul of the 3-D x, so the
        # sequence dim stays apart through the product too (a sequence shard reaches it and is
        # all-gathered into it in one collective with its f: Megatron-SP's f̄)
        with graph.inserting_before(view):
            product = graph.call_function(aten.matmul.default, (whole, mm.args[1]))
        product.meta = dict(view.meta)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in addmm.meta:
                product.meta[key] = addmm.meta[key]
        view.replace_all_uses_with(product)
        graph.erase_node(view)
        graph.erase_node(addmm)
        graph.erase_node(mm)
        if not flat.users:
            graph.erase_node(flat)
        view = product
    else:
        view.replace_input_with(addmm, mm)
    with graph.inserting_after(view):
        add = graph.call_function(aten.add.Tensor, (view, bias))
    add.meta = dict(view.meta)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):   # the bias belongs to the linear
        if key in addmm.meta:
            add.meta[key] = addmm.meta[key]
    view.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    if addmm.graph is graph and addmm in graph.nodes:
        graph.erase_node(addmm)
    return True
