"""The captured program and how the later stages read it.

:class:`Capture` holds the exported program's graph (parameters lifted to placeholders), which
placeholder is which parameter, buffer or constant, the user inputs' names and the output
structure; :func:`module_path` and :func:`shape_of` read its nodes, :func:`flat_inputs` and
:func:`unflatten_outputs` carry a call's inputs and outputs across it.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx

from ..errors import ConfigError


@dataclass
class Capture:
    graph_module: fx.GraphModule
    param_names: dict[str, str]          # placeholder name -> parameter FQN
    buffer_names: dict[str, str]         # placeholder name -> buffer FQN
    constant_names: dict[str, str]       # placeholder name -> lifted constant name
    constants: dict[str, torch.Tensor]
    user_inputs: list[str]               # placeholder names of user inputs, in call order
    input_keys: list[str]                # the kwargs keys, same order as user_inputs
    constant_inputs: dict[str, Any]      # non-tensor kwargs traced as constants (use_cache=False)
    out_spec: Any
    range_constraints: dict[str, tuple[int, int]]   # "input_ids.1" -> (min, max)
    dim_symbols: dict[str, str] = field(default_factory=dict)  # sympy symbol name -> "batch"/"seq"
    #: every other symbol export's shapes may hold -> what the cost model prices it at: an
    #: expression of the input dims' symbols where export replaced it by one (a string), else its
    #: value in the example (an op's data-dependent size, a size export could not relate)
    symbol_hints: dict[str, int | str] = field(default_factory=dict)
    input_dims: dict[str, str] = field(default_factory=dict)   # "input_ids.1" -> its symbol name
    aliases: dict[str, str] = field(default_factory=dict)  # unused tied param FQN -> the FQN used
    signature: inspect.Signature | None = None   # model.forward's, to name positional inputs
    training: bool = True                # the model's mode at capture (dropout is in the graph or not)
    #: whether the program's outputs may be differentiated: False for a generation step, which
    #: generate runs under ``torch.no_grad()`` (its plan prices no backward and places no f)
    differentiable: bool = True
    model_name: str = "the model"
    #: the stacks captured cut and expanded (autotp.capture.expand), e.g. ("transformer.h",); () when whole
    expanded: tuple = ()
    #: input dims capture asked dynamic that torch.export fixed to the example's size ("input_ids.1"
    #: -> 11): the forward read the size as a number (a loop over the sequence, Mamba's scan on CPU),
    #: so the program holds that size only (autotp.capture.export.fixed_dims)
    fixed_dims: dict[str, int] = field(default_factory=dict)
    #: torch.export's guards on the input sizes (Python expressions over ``L['input_ids'].size()``)
    #: where export traced with unnamed dynamic dims and so did not prove them over the whole
    #: range: a chunked scan padded to its chunk branches on ``length % chunk`` and specializes a
    #: single chunk. A call whose sizes break one is not this program's (:func:`guards_hold`)
    guards: tuple[str, ...] = ()

    @property
    def output_names(self) -> list[str]:
        """Names of the flat outputs: the ModelOutput/dict keys where there are some."""
        context = getattr(self.out_spec, "context", None)
        n = self.out_spec.num_leaves
        if isinstance(context, (list, tuple)) and len(context) == n and all(isinstance(c, str) for c in context):
            return list(context)
        return [str(i) for i in range(n)]

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def static_lengths(self) -> frozenset[int]:
        """The sequence lengths this program holds as numbers where none is dynamic: the
        sequence dims (dim 1 and on of an input, as :attr:`dim_symbols` names them) that
        torch.export fixed (:attr:`fixed_dims`: Mamba's scan loops over the length). A static
        length is still a sequence: sequence parallelism may split the dim of that size
        (:func:`autotp.passes.rules.contract.along_sequence`). Empty where a sequence dim is
        dynamic, or where no length was asked dynamic (a one-token prompt)."""
        if "seq" in self.dim_symbols.values():
            return frozenset()
        return frozenset(size for key, size in self.fixed_dims.items() if int(key.rsplit(".", 1)[1]) >= 1)

    @property
    def output_nodes(self) -> list:
        """The graph's flat outputs, in :attr:`output_names`' order."""
        out = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        return pytree.tree_leaves(out.args[0])


#: what a guard may name besides the inputs' sizes (torch writes them as Python expressions)
_GUARD_NAMES = {"L", "size", "max", "min", "abs", "and", "or", "not", "True", "False"}


def input_guards(codes: Any, keys: Any) -> tuple[str, ...]:
    """The guards of ``codes`` (an exported program's ``_guards_code``) that read only the sizes
    of the inputs ``keys``; any other (a guard on a parameter, a name torch may add) is left out."""
    kept = []
    for code in codes or ():
        names = set(re.findall(r"L\['([^']+)'\]", code))
        rest = set(re.findall(r"[A-Za-z_]\w*", re.sub(r"L\['[^']+'\]", "L", code)))
        if names and names <= set(keys) and rest <= _GUARD_NAMES:
            kept.append(code)
    return tuple(kept)


_COMPILED_GUARDS: dict[tuple[str, ...], Any] = {}


def guards_hold(cap: "Capture", kwargs: dict[str, Any]) -> bool:
    """Do a call's input sizes satisfy every guard export traced ``cap`` under
    (:attr:`Capture.guards`)? A guard that cannot be read for this call counts as broken."""
    if not cap.guards:
        return True
    code = _COMPILED_GUARDS.get(cap.guards)
    if code is None:
        code = _COMPILED_GUARDS[cap.guards] = compile(" and ".join(f"({g})" for g in cap.guards), "<guards>", "eval")
    try:
        return bool(eval(code, {"__builtins__": {}, "max": max, "min": min, "abs": abs}, {"L": kwargs}))
    except Exception:   # an input missing or of another rank: not the call this program was traced for
        return False


def fits_call(cap: "Capture", kwargs: dict[str, Any]) -> bool:
    """Can ``cap``'s program compute a call with these inputs' sizes: every dim it holds fixed
    (:attr:`Capture.fixed_dims`) at the call's size, and every guard it keeps satisfied?"""
    for key, size in cap.fixed_dims.items():
        name, dim = key.rsplit(".", 1)
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > int(dim) and value.shape[int(dim)] != size:
            return False
    return guards_hold(cap, kwargs)


def _tied_aliases(model: torch.nn.Module, cap: Capture) -> dict[str, str]:
    """Tied parameters (GPT-2's wte and lm_head) are one tensor: the graph uses one name and
    leaves the other placeholder unused. Map the unused name to the used one."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    used = {cap.param_names[n.name] for n in cap.graph.nodes if n.op == "placeholder"
            and n.name in cap.param_names and n.users}
    aliases = {}
    for names in by_id.values():
        live = [n for n in names if n in used]
        for n in names:
            if n not in used and live:
                aliases[n] = live[0]
    return aliases


def module_path(node: fx.Node) -> str:
    """The dotted name of the module whose forward produced ``node`` ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        return _clean_path(path)
    return ""


#: a numbered child of a ModuleList: transformer.h.7, model.layers.12, encoder.layer.3
_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def numbered_layer(node: fx.Node) -> str | None:
    """The repeated layer (the outermost numbered child of a ModuleList on its module stack) whose
    forward produced ``node``; None outside every layer."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        match = _NUMBERED.match(_clean_path(path))
        if match:
            return match.group(1)
    return None


def layer_of(node: fx.Node, layers: list[str]) -> str | None:
    """The repeated layer (one of ``layers``, module paths) whose forward produced ``node``, or None."""
    path = module_path(node)
    for layer in layers:
        if path == layer or path.startswith(layer + "."):
            return layer
    return None


def _clean_path(path: str) -> str:
    # torch.export writes "L['self'].transformer.h[0].attn" style paths in some versions.
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def shape_of(node: Any) -> tuple[sympy.Expr, ...] | None:
    """A node's tensor shape as sympy expressions (cached in node.meta)."""
    if not isinstance(node, fx.Node):
        return None
    cached = node.meta.get("autotp_shape")
    if cached is not None:
        return cached
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    shape = tuple(to_sympy(d) for d in val.shape)
    node.meta["autotp_shape"] = shape
    return shape


def to_sympy(d: Any) -> sympy.Expr:
    if isinstance(d, torch.SymInt):
        return sympy.sympify(d.node.expr)
    return sympy.Integer(int(d))


def flat_inputs(capture: Capture, kwargs: dict[str, Any]) -> list[Any]:
    """The user's call kwargs in the captured order; traced constants filled in and checked."""
    unknown = set(kwargs) - set(capture.input_keys)
    if unknown:
        raise ConfigError(
            f"inputs {sorted(unknown)} were not part of the captured call {capture.input_keys}; "
            "pass the same keyword arguments as at capture"
        )
    flat = []
    for key in capture.input_keys:
        if key in capture.constant_inputs:
            value = kwargs.get(key, capture.constant_inputs[key])
            if value != capture.constant_inputs[key]:
                raise ConfigError(
                    f"{key}={value!r} differs from the captured {key}={capture.constant_inputs[key]!r}"
                )
            flat.append(value)
        elif key not in kwargs:
            raise ConfigError(f"missing input {key!r}: the graph was captured with {capture.input_keys}")
        else:
            flat.append(kwargs[key])
    return flat


def unflatten_outputs(capture: Capture, outputs: Any) -> Any:
    return pytree.tree_unflatten(list(outputs), capture.out_spec)


def op_name(target: Any) -> str:
    """An fx node's target as people and the ranks' agreement name it: ``aten.mm.default``, or a
    function's name."""
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_schema"):
        name = str(target).replace("aten::", "aten.")
    return name
