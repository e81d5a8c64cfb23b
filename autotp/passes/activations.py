"""Activations written out as arithmetic, run as the one ATen op that computes them.

Models spell activations as chains of pointwise ops: GPT-2's tanh-GELU (``0.5 * x * (1 + tanh(
sqrt(2/pi) * (x + 0.044715 * x**3)))``) is captured as eight ATen nodes (``mul``, ``pow``, ``mul``,
``add``, ``mul``, ``tanh``, ``add``, ``mul``), and eager PyTorch runs each as a kernel forward and
one or two backward: about 18 kernels a layer, each a pass over the MLP's activation. One
``aten.gelu(x, approximate="tanh")`` computes the same function in one kernel forward and one
backward (``gelu_backward``), in float32 inside the kernel where the chain rounds after every op.

Input: a :class:`~autotp.capture.Capture`. Output (:func:`fuse_activations`): a copy whose graph has
each recognized region replaced by its op, and what was fused. The capture itself is unchanged
(a capture is cached per structure and read by every plan of it).

A region is found from a tensor ``x``: the pointwise ops (:data:`MEANING`) whose tensor operands are
``x`` or the region's own nodes, every other operand a Python number, all of ``x``'s shape and
floating dtype, closed under its root (every node but the root read only inside the region). Its
value is built as a sympy expression in ``x`` and decided **symbolically** (:func:`identify`):
expanded (function arguments too) into terms ``c * x**k * f(polynomial in x)``, with ``tanh(y)``
written ``2 * sigmoid(2y) - 1`` and the logistic function written out (``1 / (1 + exp(-y))``,
through ``div``, ``reciprocal`` or ``1 / ...``) written ``sigmoid(y)``, so that every spelling of
a GELU (``0.5 * x * (1 + tanh(...))``, ``x * 0.5 * ...``, ``x * sigmoid(2y)``, ``pow(x, 3)`` or
``x * x * x``, the constant as ``math.sqrt(2 / math.pi)`` or a literal) and of a SiLU
(``x * sigmoid(x)``, ``x / (1 + exp(-x))``) reaches one form, compared term by term with each known
op's (:data:`KNOWN`). Coefficients must agree to :data:`REL_TOL` (the ten significant digits models
write ``0.7978845608`` with); a different constant (``0.0447``) is another function and stays as
written. QuickGELU (``x * sigmoid(1.702 x)``) is no ATen op's function (``gelu`` is exact or
tanh, ``silu`` has no scale) and stays as written: no fusion that is not the same math. Nothing
here reads a module's or a model's name: the rule is the value the ops compute.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import sympy
import torch
from torch import fx

from ..capture.program import module_path

try:   # generates the copy's Python code when it is first run or read, as the capture's
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:   # pragma: no cover - present in every torch autotp supports
    _LazyGraphModule = fx.GraphModule

aten = torch.ops.aten

#: relative difference within which a region's coefficient equals a known op's: a literal written
#: to ten significant digits (FastGELU's 0.7978845608 for sqrt(2/pi): 3.6e-12) agrees, 0.0447 for
#: 0.044715 (3.5e-4) does not
REL_TOL = 1e-9
#: regions larger than this are not decided (no known op is written in more nodes: HF's GELU takes
#: 8, FastGELU's 9), nor any with other than one tanh, sigmoid or erf: what is expanded stays small
MAX_NODES = 16

_X = sympy.Symbol("x", real=True)
_sigmoid = sympy.Function("sigmoid")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _power(e: Any) -> sympy.Expr | None:
    """A small integer exponent as sympy's Integer (``pow(x, 3.0)`` is ``x**3``); None otherwise."""
    if _number(e) and float(e).is_integer() and 0 <= e <= 8:
        return sympy.Integer(int(e))
    return None


def _alpha(kwargs: dict) -> Any:
    alpha = kwargs.get("alpha", 1)
    return sympy.Float(alpha) if _number(alpha) else None


#: pointwise op -> (its value from its operands' values and kwargs; None where not expressible)
MEANING: dict[Any, Callable[..., sympy.Expr | None]] = {
    aten.add.Tensor: lambda a, b, kw: None if _alpha(kw) is None else a + _alpha(kw) * b,
    aten.add.Scalar: lambda a, b, kw: None if _alpha(kw) is None else a + _alpha(kw) * b,
    aten.sub.Tensor: lambda a, b, kw: None if _alpha(kw) is None else a - _alpha(kw) * b,
    aten.sub.Scalar: lambda a, b, kw: None if _alpha(kw) is None else a - _alpha(kw) * b,
    aten.rsub.Scalar: lambda a, b, kw: None if _alpha(kw) is None else b - _alpha(kw) * a,
    aten.rsub.Tensor: lambda a, b, kw: None if _alpha(kw) is None else b - _alpha(kw) * a,
    aten.mul.Tensor: lambda a, b, kw: None if kw else a * b,
    aten.mul.Scalar: lambda a, b, kw: None if kw else a * b,
    aten.div.Tensor: lambda a, b, kw: None if kw or b == 0 else a / b,
    aten.div.Scalar: lambda a, b, kw: None if kw or b == 0 else a / b,
    aten.neg.default: lambda a, kw: None if kw else -a,
    aten.square.default: lambda a, kw: None if kw else a ** 2,
    aten.tanh.default: lambda a, kw: None if kw else 2 * _sigmoid(2 * a) - 1,   # one form for both
    aten.sigmoid.default: lambda a, kw: None if kw else _sigmoid(a),
    aten.erf.default: lambda a, kw: None if kw else sympy.erf(a),
    aten.exp.default: lambda a, kw: None if kw else sympy.exp(a),
    aten.reciprocal.default: lambda a, kw: None if kw else 1 / a,
}
#: pow(x, e) takes its exponent as a number, not an operand to expand
_POW = aten.pow.Tensor_Scalar
#: a region computes one of these only if it holds one (no known op is a polynomial)
_TRANSCENDENTAL = frozenset({aten.tanh.default, aten.sigmoid.default, aten.erf.default, aten.exp.default})


@dataclass(frozen=True)
class Known:
    """A one-kernel op and the function it computes of ``x``."""

    name: str                 # as a plan note says it
    target: Any
    kwargs: tuple             # (name, value) pairs of the op's keyword arguments
    value: sympy.Expr


_C = math.sqrt(2 / math.pi)
#: the ops a region may be replaced by, each by the function it computes
KNOWN = (
    Known("tanh-GELU", aten.gelu.default, (("approximate", "tanh"),),
          sympy.Float(0.5) * _X * (1 + sympy.tanh(sympy.Float(_C) * (_X + sympy.Float(0.044715) * _X ** 3)))),
    Known("GELU", aten.gelu.default, (), sympy.Float(0.5) * _X * (1 + sympy.erf(sympy.Float(math.sqrt(0.5)) * _X))),
    Known("SiLU", aten.silu.default, (), _X * _sigmoid(_X)),
)


@dataclass(frozen=True)
class Fused:
    """One region replaced: its op's name, the module that computed it (its root's) and its size."""

    op: str
    module: str
    nodes: int


# ---- the symbolic decision -----------------------------------------------------------------------

def _terms(expr: sympy.Expr) -> list[tuple[tuple, list[float]]] | None:
    """``expr`` (expanded) as terms ``c * x**k * f(...)``: per term its structure (k, and each
    function's name with its argument's structure) and its numbers (c, and the arguments'); None
    where a term is of another shape (a power of a function, a function of a non-polynomial)."""
    out = []
    numbers_max = 0.0
    for term in sympy.Add.make_args(sympy.expand(expr, deep=True)):
        coeff, rest = term.as_coeff_Mul()
        if not coeff.is_number:
            return None
        k, funcs = 0, []
        for factor in sympy.Mul.make_args(rest):
            if factor == 1:
                continue
            base, exp = factor.as_base_exp()
            if base == _X and exp.is_Integer and exp >= 0:
                k += int(exp)
            elif isinstance(factor, sympy.Function) and len(factor.args) == 1:
                inner = _terms(factor.args[0])
                if inner is None or any(fs for (_, fs), _ in inner):
                    return None
                funcs.append((type(factor).__name__, tuple(s for s, _ in inner), [n for _, ns in inner for n in ns]))
            else:
                return None
        funcs.sort(key=lambda f: (f[0], f[1]))
        numbers = [float(coeff)] + [n for f in funcs for n in f[2]]
        numbers_max = max(numbers_max, abs(float(coeff)))
        out.append(((k, tuple((f[0], f[1]) for f in funcs)), numbers))
    # terms that cancel to a rounding (0.5x - 0.5x written through different products) are none
    out = [(s, ns) for s, ns in out if abs(ns[0]) > 1e-12 * numbers_max]
    return sorted(out, key=lambda t: repr(t[0]))


def _same(a: list | None, b: list | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    for (sa, na), (sb, nb) in zip(a, b):
        if sa != sb or len(na) != len(nb):
            return False
        if not all(math.isclose(u, v, rel_tol=REL_TOL, abs_tol=0.0) for u, v in zip(na, nb)):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _known_terms() -> tuple:
    return tuple((known, _terms(_canonical(known.value))) for known in KNOWN)


def _logistic(power: sympy.Expr) -> sympy.Expr | None:
    """``1 / (a + b exp(c))`` (numbers ``a``, ``b`` of one sign) as ``sigmoid(-c - log(b/a)) / a``,
    the same function; None for any other power."""
    if not (power.is_Pow and power.exp == -1):
        return None
    a, b, c = sympy.Integer(0), None, None
    for term in sympy.Add.make_args(sympy.expand(power.base)):
        coeff, rest = term.as_coeff_Mul()
        if rest == 1:
            a += coeff
        elif isinstance(rest, sympy.exp) and b is None:
            b, c = coeff, rest.args[0]
        else:
            return None
    if b is None or a == 0 or not (b / a) > 0:
        return None
    return _sigmoid(-c - sympy.log(b / a)) / a


def _canonical(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` in the form regions are compared in: ``tanh(y)`` as ``2 * sigmoid(2y) - 1``, and
    the logistic function written out (``1 / (1 + exp(-y))``: SiLU as ``x / (1 + exp(-x))``) as
    ``sigmoid(y)``."""
    expr = expr.replace(sympy.tanh, lambda y: 2 * _sigmoid(2 * y) - 1)
    return expr.replace(lambda e: _logistic(e) is not None, _logistic)


def identify(value: sympy.Expr) -> Known | None:
    """The known op whose function of ``x`` ``value`` is (built from :data:`MEANING`), or None."""
    terms = _terms(_canonical(value))
    return next((known for known, want in _known_terms() if _same(terms, want)), None)


# ---- regions in a graph --------------------------------------------------------------------------

def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in MEANING or node.target is _POW)


def _sizes(val: torch.Tensor) -> tuple:
    """A tensor's sizes as expressions (a dynamic dim's symbol), compared without a guard."""
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in val.shape)


def _alike(node: fx.Node, x: torch.Tensor) -> bool:
    val = _tensor(node)
    return val is not None and val.dtype == x.dtype and _sizes(val) == _sizes(x)


def _closure(x: fx.Node, order: dict) -> list[fx.Node]:
    """Every pointwise node computed from ``x`` and numbers alone, in graph order."""
    x_val = _tensor(x)
    inside, heap, seen = {x}, [(order[u], u) for u in x.users], set()
    heapq.heapify(heap)
    while heap:
        _, node = heapq.heappop(heap)
        if node in seen:
            continue
        seen.add(node)
        if not _pointwise(node) or not _alike(node, x_val):
            continue
        if not all(a in inside for a in node.all_input_nodes):
            continue
        if not all(isinstance(a, fx.Node) or _number(a) for a in node.args):
            continue
        inside.add(node)
        for user in node.users:
            heapq.heappush(heap, (order[user], user))
    inside.discard(x)
    return sorted(inside, key=order.get)


def _region(root: fx.Node, closure: set, x: fx.Node) -> list[fx.Node] | None:
    """``root`` and its ancestors in ``closure``, where none but ``root`` is read outside them."""
    region, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node in region or node is x:
            continue
        region.add(node)
        stack.extend(a for a in node.all_input_nodes if a in closure or a is x)
        if len(region) > MAX_NODES:
            return None
    if any(u not in region for n in region if n is not root for u in n.users):
        return None
    return list(region)


def _key(x: fx.Node, region: list[fx.Node], order: dict) -> tuple:
    """The region's structure (ops, operand wiring, numbers), to decide each structure once."""
    nodes = sorted(region, key=order.get)
    index = {n: i for i, n in enumerate(nodes)}
    index[x] = -1

    def arg(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, fx.Node) else ("num", type(a).__name__, a)

    return tuple((str(n.target), tuple(arg(a) for a in n.args), tuple(sorted(n.kwargs.items()))) for n in nodes)


@functools.lru_cache(maxsize=1024)
def _decide(key: tuple) -> Known | None:
    """The known op a region of structure ``key`` computes (see :func:`_key`), or None."""
    values: list[sympy.Expr] = []
    targets = {str(t): t for t in (*MEANING, _POW)}

    def operand(a: tuple) -> sympy.Expr:
        if a[0] == "node":
            return _X if a[1] < 0 else values[a[1]]
        return sympy.Float(a[2]) if a[1] == "float" else sympy.Integer(a[2])

    for target, args, kwargs in key:
        operands = [operand(a) for a in args]
        t = targets[target]
        if t is _POW:
            power = _power(args[1][2]) if args[1][0] == "num" else None
            if power is None or kwargs:
                return None
            value = operands[0] ** power
        else:
            try:
                value = MEANING[t](*operands, dict(kwargs))
            except TypeError:   # operands not as this rule reads them (another arity)
                return None
        if value is None:
            return None
        values.append(value)
    return identify(values[-1])


def find_regions(graph: fx.Graph) -> list[tuple[fx.Node, list[fx.Node], Known]]:
    """(x, the region's nodes, the op it computes) for every region of ``graph`` that computes
    a known op of ``x``; regions are disjoint."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    taken: set = set()
    found = []
    for x in graph.nodes:
        x_val = _tensor(x)
        if x_val is None or not x_val.is_floating_point() or not any(_pointwise(u) for u in x.users):
            continue
        closure = _closure(x, order)
        inside = set(closure)
        if not any(n.target in _TRANSCENDENTAL for n in closure):
            continue
        for root in reversed(closure):   # the largest region first
            if root in taken:
                continue
            region = _region(root, inside, x)
            if region is None or taken.intersection(region) or sum(n.target in _TRANSCENDENTAL for n in region) != 1:
                continue
            known = _decide(_key(x, region, order))
            if known is not None:
                found.append((x, region, known))
                taken.update(region)
    return found


def fuse_graph(graph: fx.Graph) -> list[Fused]:
    """Replace every recognized region of ``graph`` (in place) by its op; what was fused."""
    fused = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for x, region, known in find_regions(graph):
        root = max(region, key=order.get)
        with graph.inserting_before(root):
            op = graph.call_function(known.target, (x,), dict(known.kwargs))
        op.meta = dict(root.meta)   # same value, shape and dtype; the root's module (its layer)
        root.replace_all_uses_with(op)
        fused.append(Fused(known.name, module_path(root) or root.name, len(region)))
        for node in sorted(region, key=order.get, reverse=True):
            graph.erase_node(node)
    if fused:
        graph.lint()
    return fused


def fuse_activations(cap: Any) -> tuple[Any, list[Fused]]:
    """A copy of capture ``cap`` with its activation regions fused, and what was fused; ``cap``
    itself where there is none. Memoized on ``cap`` (a capture is built once per structure and
    planned many times: serial, each tp, each program)."""
    return fused_capture(cap, "_fused_activations", lambda graph: bool(find_regions(graph)), fuse_graph)


def fused_capture(cap: Any, memo: str, found: Callable[[fx.Graph], bool],
                  fuse: Callable[[fx.Graph], list[Fused]]) -> tuple[Any, list[Fused]]:
    """A copy of capture ``cap`` whose graph ``fuse`` has rewritten in place, and what it fused;
    ``cap`` itself where ``found`` finds nothing to fuse in its graph. Memoized on ``cap`` under
    ``memo`` (the capture itself is not changed: it is cached per structure and read by every plan)."""
    result = cap.__dict__.get(memo)
    if result is not None:
        return result
    if not found(cap.graph):   # most models: nothing to copy
        cap.__dict__[memo] = (cap, [])
        return cap, []
    graph = fx.Graph()
    graph.output(graph.graph_copy(cap.graph, {}))   # the copy keeps the nodes' names and metadata
    fused = fuse(graph)
    gm = _LazyGraphModule(cap.graph_module, graph)
    gm.meta.update(cap.graph_module.meta)
    result = (replace(cap, graph_module=gm), fused)
    cap.__dict__[memo] = result
    return result


def fused_note(fused: list[Fused]) -> str | None:
    """The plan's note of what was fused (None where nothing was)."""
    if not fused:
        return None
    by_op: dict[str, list[Fused]] = {}
    for f in fused:
        by_op.setdefault(f.op, []).append(f)
    parts = []
    for name, regions in by_op.items():
        sizes = sorted({f.nodes for f in regions})
        ops = "/".join(str(s) for s in sizes)
        parts.append(f"{len(regions)} {name} region{'s' if len(regions) > 1 else ''} of {ops} pointwise ops "
                     f"({regions[0].module}{', ...' if len(regions) > 1 else ''})")
    return (f"activations fused: {', '.join(parts)} each run as one ATen op (one kernel forward, one backward); "
            "fuse_activations=False keeps them as the model writes them")
