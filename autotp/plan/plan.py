"""Plan: what autotp decided, in a form a person can read and a program can reload.

A plan holds every parameter's placement and role (column, row, vocab, replicate), every
collective with its bytes per step, and the predicted cost per rank. ``print(plan)`` shows it
as tables, repeated layers folded (``table(full=True)``: every row); ``figure()`` draws one
layer, ``diff(other)`` compares two plans; ``to_json``/``from_json`` round-trip it (versioned
JSON, no pickle).
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..placements import Placement, Replicate, Shard, from_json, local_size, to_json
from .arguments import PlanArguments
from .flow import Flow
from .schema import check_document

#: 2: the planning arguments its programs are built with (``arguments``); version 1 files, which
#: lack them, still load (``arguments`` None: parallelize then builds with the arguments it is given)
SCHEMA_VERSION = 2
#: 3: a plan priced at a router's load records it (``arguments.expert_load``, autotp/planner/expert_load.py);
#: one without stays version 2, which readers before it still read
LOAD_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class CommOp:
    kind: str            # f, g, all_gather, scatter, reduce_scatter
    tensor: str          # the graph node it applies to
    consumer: str        # the op that needed it
    src: str
    dst: str
    fwd_bytes: float     # per rank per step, at the planning workload
    bwd_bytes: float
    seconds: float
    module: str = ""     # the module whose op needed it (transformer.h.0.attn.c_proj)


class DeferredExpressions(Mapping):
    """A plan's cost expressions, computed when first read: the plan replayed for another call
    signature's program is rarely printed, and its expressions cost a tenth of the replay.
    Copied and pickled as the dict it reads as."""

    def __init__(self, make: Callable[[], dict[str, str]]):
        self._make: Callable[[], dict[str, str]] | None = make
        self._value: dict[str, str] | None = None

    def _get(self) -> dict[str, str]:
        if self._value is None:
            self._value, self._make = self._make(), None
        return self._value

    def __getitem__(self, key: str) -> str:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())

    def __reduce__(self) -> tuple:
        return dict, (dict(self._get()),)


@dataclass
class Plan:
    tp: int
    profile: str
    batch: int
    seq: int
    params: dict[str, Placement]                    # FQN -> placement (full: dim, chunks, unit)
    shapes: dict[str, tuple[int, ...]]              # FQN -> full shape
    roles: dict[str, str]                           # FQN -> column | row | vocab | replicate | shard
    comms: list[CommOp] = field(default_factory=list)
    compute_s: float = 0.0
    comm_s: float = 0.0
    dtype_bytes: int = 4
    optimizer_s: float = 0.0         # ... of compute_s: the optimizer step on the parameters a rank holds
    aliases: dict[str, str] = field(default_factory=dict)   # tied name -> FQN held
    sharded_outputs: dict[str, Placement] = field(default_factory=dict)  # outputs returned split
    memory_bytes: float = 0.0        # predicted per rank (largest): training state + activations
    activation_bytes: float = 0.0    # ... of which activations kept for backward
    #: ... of which the layers' inputs activation checkpointing keeps (0 without it): a pipeline
    #: stage holds one per layer and micro-batch in flight, and one layer's recomputation besides
    layer_input_bytes: float = 0.0
    #: whether those figures price activation checkpointing (each repeated layer recomputed in
    #: backward: its inputs kept, one layer's activations held at a time, its forward run twice)
    recomputed: bool = False
    memory_limit: float | None = None
    #: the predicted costs as sympy expressions (strings) in the symbols b (batch) and s (sequence)
    expressions: Mapping[str, str] = field(default_factory=dict)   # or DeferredExpressions
    notes: list[str] = field(default_factory=list)   # why the plan is what it is, where not obvious
    #: module of each attention op that runs split by heads -> heads each rank computes (None:
    #: a plan saved before this was recorded; heads are then read off the parameters alone)
    attention: dict[str, list[int]] | None = None
    #: how data flows through each distinct layer (:mod:`autotp.plan_flow`), for the figure
    #: (None: a plan saved before this was recorded)
    flows: list | None = None
    #: the arguments its programs are built with (:mod:`autotp.plan.arguments`; None: a plan saved
    #: before they were recorded, built with the arguments parallelize is given)
    arguments: PlanArguments | None = None

    # ---- the arguments it was made with (None where not recorded) ------------------------
    def _argument(self, name: str) -> Any:
        return None if self.arguments is None else getattr(self.arguments, name)

    sequence_parallel = property(lambda self: self._argument("sequence_parallel"),
                                 doc="sequence_parallel as planned: True forced, False forbidden, None by cost")
    expert_dispatch = property(lambda self: self._argument("expert_dispatch"),
                               doc="expert_dispatch as planned: True the all-to-all, False never, None by cost")
    gather_logits = property(lambda self: self._argument("gather_logits"))
    host_reads = property(lambda self: self._argument("host_reads"))
    fuse_activations = property(lambda self: self._argument("fuse_activations"))
    fuse_norms = property(lambda self: self._argument("fuse_norms"))
    fuse_products = property(lambda self: self._argument("fuse_products"))
    uneven = property(lambda self: self._argument("uneven"))
    expert_load = property(lambda self: self._argument("expert_load"),
                           doc="the router's load expert parallelism was priced at (None: a balanced router)")

    # ---- what users inspect -------------------------------------------------------------
    @property
    def param_layouts(self) -> dict[str, str]:
        """Every parameter's role under each of its names (a tied pair under both)."""
        out = dict(self.roles)
        for alias, held in self.aliases.items():
            if held in self.roles:
                out[alias] = self.roles[held]
        return out

    @property
    def cost(self) -> dict[str, Any]:
        per_rank = self.param_bytes_per_rank()
        return {
            "compute_s": self.compute_s,
            "optimizer_s": self.optimizer_s,
            "comm_s": self.comm_s,
            "step_s": self.compute_s + self.comm_s,
            "param_bytes_per_rank": per_rank,
            "param_bytes_serial": self.serial_param_bytes(),
            "comm_bytes_per_step": sum(c.fwd_bytes + c.bwd_bytes for c in self.comms),
            "memory_bytes_per_rank": self.memory_bytes,
            "state_bytes_per_rank": self.memory_bytes - self.activation_bytes,
            "activation_bytes_per_rank": self.activation_bytes,
            "memory_limit": self.memory_limit,
            "expressions": dict(self.expressions),
        }

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        shape = list(self.shapes[name])
        p = self.params[name]
        if isinstance(p, Shard):
            shape[p.dim] = local_size(shape[p.dim], p, self.tp, rank)
        return tuple(shape)

    def param_bytes_per_rank(self) -> list[int]:
        out = []
        for rank in range(self.tp):
            total = 0
            for name in self.params:
                n = 1
                for s in self.local_shape(name, rank):
                    n *= s
                total += n
            out.append(total * self.dtype_bytes)
        return out

    def serial_param_bytes(self) -> int:
        total = 0
        for shape in self.shapes.values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total * self.dtype_bytes

    def heads_per_rank(self) -> dict[str, list[int]]:
        """For each column-parallel projection split by whole heads (atoms wider than one
        element) inside a module whose attention really runs split by heads: how many of the
        module's query heads each rank runs attention for, uneven where tp does not divide the
        head count. Read off the attention ops themselves (``Plan.attention``), so a fused
        projection that deals whole groups of heads (Falcon's k and v inside each group) counts
        the groups' query heads, and a k or v projection counts the query heads it serves. Empty
        when no attention is split (a q projection cut by heads whose output is gathered before
        attention does not count). A plan saved before attention was recorded counts the
        projection's own atoms instead."""
        out = {}
        for name, p in self.params.items():
            if not (isinstance(p, Shard) and p.unit > 1 and self.roles.get(name) == "column"
                    and len(self.shapes[name]) > 1):
                continue
            if self.attention is not None:
                module = next((m for m in self.attention if name.startswith(m + ".")), None)
                if module is not None:
                    out[name] = list(self.attention[module])
                continue
            size = self.shapes[name][p.dim]
            if p.sizes:   # blocks of unequal size: the first (the query heads) in groups of sizes[0] heads
                query = Shard(p.dim, 1, p.unit * p.sizes[0], p.rotate)
                out[name] = [local_size(size * p.sizes[0] // p.parts, query, self.tp, r) // p.unit
                             for r in range(self.tp)]
                continue
            per_block = [local_size(size, p, self.tp, r) // (p.chunks * p.unit) for r in range(self.tp)]
            # blocks of a fused q|k|v hold one rank's heads each; blocks with a tail (k and v
            # kept whole) are groups of query heads, each adding its own
            out[name] = [(n - p.tail) * p.chunks if p.tail else n for n in per_block]
        return out

    def comm_seconds(self) -> dict[str, float]:
        """Predicted seconds per step spent in each kind of collective."""
        out: dict[str, float] = {}
        for c in self.comms:
            out[c.kind] = out.get(c.kind, 0.0) + c.seconds
        return out

    def comm_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.comms:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        return counts

    # ---- printing -------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.table()

    def table(self, full: bool = False) -> str:
        """The plan as text: repeated layers folded into one table each (what varies across
        them said in a line), the parameters outside them, the collectives per layer and per
        step, predicted time and memory (:mod:`autotp.plan_view`); ``full``: every parameter of
        every layer and every collective, one row each."""
        if not full:
            from .view import folded

            return folded(self)
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=120, force_terminal=False, color_system=None)
        head = Table(title=f"autotp plan: tp={self.tp}, profile={self.profile}, workload batch={self.batch} seq={self.seq}")
        head.add_column("parameter")
        head.add_column("shape", justify="right")
        head.add_column("layout")
        head.add_column("placement")
        head.add_column("local shape (rank 0)", justify="right")
        tied: dict[str, list[str]] = {}
        for alias, held in self.aliases.items():
            tied.setdefault(held, []).append(alias)
        for name, p in self.params.items():
            head.add_row(name, "x".join(map(str, self.shapes[name])), self.roles[name], repr(p),
                         "x".join(map(str, self.local_shape(name, 0))))
            for alias in tied.get(name, []):   # the same tensor under another name
                head.add_row(alias, "x".join(map(str, self.shapes[name])), f"{self.roles[name]} (tied to {name})",
                             repr(p), "x".join(map(str, self.local_shape(name, 0))))
        console.print(head)
        comms = Table(title="communication per step")
        for col in ("op", "before (module: op)", "tensor", "placement", "fwd MB/rank", "bwd MB/rank", "ms"):
            comms.add_column(col)
        for c in self.comms:
            where = f"{c.module}: {c.consumer}" if c.module else c.consumer
            comms.add_row(c.kind, where, c.tensor, f"{c.src}->{c.dst}", f"{c.fwd_bytes / 1e6:.2f}",
                          f"{c.bwd_bytes / 1e6:.2f}", f"{c.seconds * 1e3:.3f}")
        console.print(comms)
        heads = self.attention if self.attention is not None else self.heads_per_rank()
        if heads:
            first = next(iter(heads))
            uneven = sorted({tuple(v) for v in heads.values()})
            note = "" if len(uneven) == 1 else f" (layers rotate which ranks hold the extra heads; {len(heads)} layers)"
            console.print(f"attention heads per rank ({first}, {sum(heads[first])} heads): {heads[first]}{note}")
        for line in self.summary_lines():
            console.print(line)
        return buf.getvalue()

    def diff(self, other: "Plan | str", names: tuple[str, str] = ("A", "B")) -> Any:
        """What changes from this plan to ``other`` (a Plan, or a plan's JSON text): layouts,
        collectives per layer, predicted step time and memory (an
        :class:`autotp.plan_diff.PlanDiff`; print it)."""
        from .diff import diff

        if isinstance(other, str):
            other = Plan.from_json(other)
        if not isinstance(other, Plan):
            raise ConfigError(f"plan.diff takes another Plan (or its JSON text, Plan.to_json()), not "
                              f"{type(other).__name__}: plan.diff(autotp.plan(model, tp=...)) or "
                              "plan.diff(Plan.from_json(text))")
        return diff(self, other, names)

    def figure(self, path: Any = None, layer: str | None = None) -> str:
        """One repeated layer drawn as data flows through it (SVG): the matrices and their split,
        the activations' placements, f and g where the plan puts them (:mod:`autotp.figure`).
        Written to ``path`` if given; the SVG text is returned. ``layer``: which recorded layer
        (default: the one most layers repeat)."""
        from .figure import figure

        return figure(self, path, layer)

    def summary_lines(self) -> list[str]:
        """The totals both tables end with: collectives, predicted step, memory, notes."""
        cost = self.cost
        per_rank = ", ".join(f"{b / 1e6:.1f}" for b in cost["param_bytes_per_rank"])
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.comm_counts().items())) or "none"
        lines = [
            f"collectives: {counts}",
            f"predicted step: {cost['step_s'] * 1e3:.3f} ms (compute {cost['compute_s'] * 1e3:.3f} ms, of which "
            f"the optimizer {cost['optimizer_s'] * 1e3:.3f} ms, "
            f"communication {cost['comm_s'] * 1e3:.3f} ms); {cost['comm_bytes_per_step'] / 1e6:.1f} MB sent per rank",
            f"parameter MB per rank: [{per_rank}] vs serial {cost['param_bytes_serial'] / 1e6:.1f}",
            f"memory per rank (largest): {_size(self.memory_bytes)} = training state "
            f"{_size(self.memory_bytes - self.activation_bytes)} (weights, gradients, Adam) + activations "
            f"{_size(self.activation_bytes)}"
            + (" (layers recomputed in backward: their inputs kept, one layer's activations at a time)"
               if self.recomputed else "") + (f"; limit {_size(self.memory_limit)}" if self.memory_limit else ""),
        ]
        for kind, seconds in sorted(self.comm_seconds().items(), key=lambda kv: -kv[1]):
            lines.append(f"  communication {kind}: {seconds * 1e3:.3f} ms")
        lines += self.arguments.lines() if self.arguments is not None else []
        lines += [f"{key}(b, s) = {expr}" for key, expr in self.expressions.items()]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"output {name!r} is returned split as {p} (not gathered)" for name, p in self.sharded_outputs.items()]
        return lines

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> str:
        doc = {
            "autotp_plan": (LOAD_VERSION if self.arguments is not None and self.arguments.expert_load is not None
                            else SCHEMA_VERSION),
            "tp": self.tp, "profile": self.profile, "batch": self.batch, "seq": self.seq,
            "dtype_bytes": self.dtype_bytes,
            "params": {k: {"placement": to_json(p), "shape": list(self.shapes[k]), "role": self.roles[k]}
                       for k, p in self.params.items()},
            "aliases": self.aliases,
            "sharded_outputs": {k: to_json(v) for k, v in self.sharded_outputs.items()},
            "comms": [c.__dict__ for c in self.comms],
            "compute_s": self.compute_s, "comm_s": self.comm_s, "optimizer_s": self.optimizer_s,
            "memory_bytes": self.memory_bytes, "activation_bytes": self.activation_bytes,
            "layer_input_bytes": self.layer_input_bytes, "recomputed": self.recomputed, "memory_limit": self.memory_limit,
            "expressions": dict(self.expressions), "notes": self.notes,
            "attention": self.attention,
        }
        if self.arguments is not None:
            doc["arguments"] = self.arguments.to_json()
        if self.flows is not None:
            doc["flows"] = [f.to_json() for f in self.flows]
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not an autotp plan: invalid JSON ({exc})") from None
        version = doc.get("autotp_plan") if isinstance(doc, dict) else None
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ConfigError(
                f"autotp plan schema version {version!r} is not supported (this autotp reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); re-create the plan with autotp.plan(...)"
            )
        check_document(doc)   # every field's type and range, named where one is wrong
        try:
            plan = cls._from_doc(doc)
            for name in plan.params:   # every placement describes its parameter's shape on every rank
                for rank in range(plan.tp):
                    plan.local_shape(name, rank)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise ConfigError(f"malformed autotp plan (version {version}): {type(exc).__name__}: {exc}; "
                              "re-create the plan with autotp.plan(...)") from None
        return plan

    @classmethod
    def _from_doc(cls, doc: dict) -> "Plan":
        params = {k: from_json(v["placement"]) for k, v in doc["params"].items()}
        return cls(
            tp=doc["tp"], profile=doc["profile"], batch=doc["batch"], seq=doc["seq"], params=params,
            shapes={k: tuple(v["shape"]) for k, v in doc["params"].items()},
            roles={k: v["role"] for k, v in doc["params"].items()},
            comms=[CommOp(**c) for c in doc.get("comms", [])],
            compute_s=doc.get("compute_s", 0.0), comm_s=doc.get("comm_s", 0.0),
            optimizer_s=doc.get("optimizer_s", 0.0),
            dtype_bytes=doc.get("dtype_bytes", 4), aliases=doc.get("aliases", {}),
            sharded_outputs={k: from_json(v) for k, v in doc.get("sharded_outputs", {}).items()},
            memory_bytes=doc.get("memory_bytes", 0.0), activation_bytes=doc.get("activation_bytes", 0.0),
            layer_input_bytes=doc.get("layer_input_bytes", 0.0), recomputed=doc.get("recomputed", False), memory_limit=doc.get("memory_limit"), expressions=doc.get("expressions", {}),
            notes=doc.get("notes", []), attention=doc.get("attention"),
            flows=None if doc.get("flows") is None else [Flow.from_json(f) for f in doc["flows"]],
            arguments=None if doc.get("arguments") is None else PlanArguments.from_json(doc["arguments"]),
        )


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def role_of(placement: Placement, first_use: Any, arg_pos: int, ndim: int | None = None) -> str:
    """Name a parameter's layout in the paper's words, from the op that uses it first (``ndim``:
    the parameter's, where known: a stack of experts' matrices split by whole experts is "expert", split
    inside every expert "expert_column" (its output features) or "expert_row" (its input features))."""
    import torch

    aten = torch.ops.aten
    if isinstance(placement, Replicate) or placement is None:
        return "replicate"
    if not isinstance(placement, Shard):
        return repr(placement)
    d = placement.dim
    # a stack read whole by a batched product, each matrix applied to its own rows (Llama-4's
    # experts, [experts, in, out]), is a stack of experts as a grouped product's is
    stack_product = first_use is aten.bmm.default and arg_pos == 1 and ndim == 3
    if d == 0 and ndim is not None and ndim >= 2 and (
            (first_use is aten.transpose.int and arg_pos == 0 and ndim == 3)
            or (first_use is aten.index.Tensor and arg_pos == 0)
            or (str(first_use) in ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
                and arg_pos == 1) or stack_product):
        return "expert"   # expert parallelism: whole experts per rank
    if d in (1, 2) and ndim == 3:
        # expert tensor parallelism: a split inside every expert's matrix. transformers keeps a
        # stack [experts, out, in] (read transposed by the grouped product, or picked per row
        # for bmm); a grouped product, or a bmm, reading the stack itself takes it as [experts, in, out].
        out_dim = {aten.transpose.int: 1, aten.index.Tensor: 1}.get(first_use, 2 if str(first_use) in (
            "aten._grouped_mm.default", "transformers.grouped_mm_fallback.default") or stack_product else None)
        if out_dim is not None and arg_pos in (0, 1):
            return "expert_column" if d == out_dim else "expert_row"
    if first_use in (aten.mm.default, aten.matmul.default) and arg_pos == 1 and ndim in (None, 2):
        return "column" if d == 1 else "row"
    if first_use is aten.linear.default and arg_pos == 1:
        return "column" if d == 0 else "row"
    if first_use in (aten.numpy_T.default, aten.t.default) and arg_pos == 0:
        return "column" if d == 0 else "row"   # ``x @ weight.T`` (Falcon): weight [out, in] as linear's
    if first_use is aten.embedding.default and arg_pos == 0:
        return "vocab" if d == 0 else "column"
    return "column"  # a 1-D parameter split along a column-parallel output (its bias)


def attention_heads(index: Any, prop: Any) -> dict[str, list[int]]:
    """Module -> heads per rank, for each attention op the propagation runs split by heads:
    ``scaled_dot_product_attention`` with q split on a static dim before [s, d], or the softmax
    of eager attention's scores [..., heads, s, s] split on a static dim before the two sequence
    dims. Read off the chosen strategies, so a projection cut by heads whose output is gathered
    before attention shows nothing."""
    import torch

    from ..capture import module_path

    aten = torch.ops.aten
    softmaxes = (aten._softmax.default, aten.softmax.int)
    out: dict[str, list[int]] = {}
    for node, strat in prop.chosen.items():
        info = index.infos[node]
        meta = info.inputs[0] if info.inputs else None
        scores = node.target in softmaxes and meta.ndim >= 3 and not any(s.is_Integer for s in meta.shape[-2:])
        if not (scores or node.target is aten.scaled_dot_product_attention.default):
            continue
        p = strat.inputs[0]
        if not isinstance(p, Shard) or p.dim >= meta.ndim - 2 or meta.static(p.dim) is None:
            continue
        size = meta.static(p.dim)
        out.setdefault(module_path(node), [local_size(size, p, index.tp, r) for r in range(index.tp)])
    return out


#: ops a projection's output passes through on its way to attention's q, k and v (one tensor in)
_HEAD_WAY = frozenset(("view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
                       "expand", "broadcast_to", "flatten", "clone", "contiguous", "slice", "select", "split", "split_with_sizes",
                       "getitem", "_to_copy", "to", "index", "mul", "div", "add", "sub", "neg", "cat"))
_PROJECTIONS = frozenset(("mm", "addmm", "bmm", "matmul", "linear"))


def _op_base(node: Any) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def _projection(node: Any, params: Any) -> Any:
    """The matmul that produced ``node`` through shape and selection ops, and the parameter it
    multiplies by (a placeholder in ``params``, through a transpose), or (None, None)."""
    seen = 0
    while node is not None and node.op == "call_function" and seen < 40:
        base = _op_base(node)
        if base in _PROJECTIONS:
            for arg in node.all_input_nodes:
                p = arg
                while p.op == "call_function" and _op_base(p) in ("t", "transpose", "permute", "numpy_T", "mT",
                                                                  "_to_copy"):
                    p = p.all_input_nodes[0]
                if p.op == "placeholder" and p.name in params:
                    return node, params[p.name]
            return node, None
        if base not in _HEAD_WAY or not node.all_input_nodes:
            return None, None
        node = node.all_input_nodes[0]
        seen += 1
    return None, None


def unsplit_attention_note(index: Any, prop: Any, split: Mapping[str, Any]) -> str | None:
    """A note for a plan whose attention runs whole (every head on every rank) somewhere: which
    modules, their query and key/value heads read off ``scaled_dot_product_attention``'s
    inputs, and what kept them whole where the graph shows it: q, k and v from one fused
    projection whose groups, dealt to sets of ranks, would leave a rank without a head or deal
    unevenly under ``uneven=False``; otherwise the cost model's
    choice. ``split``: the plan's split attention modules."""
    import torch

    from ..capture import module_path

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    cap = index.capture
    whole: dict[str, tuple] = {}
    for node in prop.chosen:
        if node.target is not sdpa or module_path(node) in split or len(node.args) < 3:
            continue
        q, k = node.args[0], node.args[1]
        qm, km = q.meta.get("val"), k.meta.get("val")
        if qm is None or km is None or qm.dim() < 3:
            continue
        heads = (int(qm.shape[-3]) if isinstance(qm.shape[-3], int) else None,
                 int(km.shape[-3]) if isinstance(km.shape[-3], int) else None)
        (q_mm, q_param), (k_mm, _) = _projection(q, cap.param_names), _projection(k, cap.param_names)
        fused = q_param if q_mm is not None and q_mm is k_mm else None
        out = q_mm.meta.get("val") if fused is not None else None
        if out is not None and heads[0] and isinstance(qm.shape[-1], int) and isinstance(out.shape[-1], int):
            # a fused q|k|v of h query and kv key/value heads of d features has (h + 2 kv) d outputs
            # (attention may see k and v repeated to h heads: multi-query expanded)
            rest = out.shape[-1] // qm.shape[-1] - heads[0]
            if out.shape[-1] % qm.shape[-1] == 0 and rest > 0 and rest % 2 == 0:
                heads = (heads[0], rest // 2)
        whole.setdefault(module_path(node), (heads, fused))
    if not whole or index.tp < 2:
        return None
    path, ((h, kv), fused) = next(iter(whole.items()))
    where = f"{len(whole)} attention module{'s' if len(whole) > 1 else ''} ({path}{', ...' if len(whole) > 1 else ''})"
    heads = f"{h} query heads and {kv} key/value head{'s' if kv > 1 else ''}" if h and kv else "its heads"
    per_set = -(-index.tp // kv) if kv else 0   # ranks in a group's set, where groups are dealt to sets
    grouped = fused is not None and h and kv and 1 < kv < index.tp and h // kv < index.tp
    what = (f"q, k and v come from one fused projection ({fused}) of {kv} key/value group"
            f"{'s' if kv > 1 else ''} of {h // kv} query heads each" if grouped else "")
    if grouped and h // kv < per_set:
        why = (f"{what}: dealing each group to its own set of ranks (up to {per_set} of the {index.tp}) "
               "would leave a rank without a query head")
    elif grouped and not index.uneven and (index.tp % kv or (h // kv) % (index.tp // kv)):
        why = (f"{what}: dealing each group to its own set of the {index.tp} ranks is uneven, and "
               "uneven=False forbids it")
    else:
        why = "the cost model found splitting it by head costs more than it saves at this workload"
    return (f"attention runs unsplit, every head on every rank, in {where}: {heads}; {why}. The rest of the "
            "plan splits as shown and the model computes what the serial one does")


def param_bytes_per_rank(index: Any, prop: Any) -> list[int]:
    """Per-rank parameter bytes of a propagation (used by the solver's memory limit)."""
    cap = index.capture
    out = [0] * index.tp
    for node in cap.graph.nodes:
        if node.op != "placeholder" or node.name not in cap.param_names:
            continue
        val = node.meta["val"]
        p = prop.params.get(node.name)
        for rank in range(index.tp):
            n = val.numel()
            if isinstance(p, Shard):
                size = int(val.shape[p.dim])
                n = n // size * local_size(size, p, index.tp, rank)
            out[rank] += n * val.element_size()
    return out


def cost_expressions(index: Any, prop: Any, profile: Any) -> dict[str, str]:
    """The plan's predicted compute and communication seconds per step as sympy expressions in
    b and s (the graph's dynamic batch and sequence dims), for the profile's rates. Each op's
    roofline branch is the one taken at the planning workload: the expression is exact there
    and near it, and a polynomial everywhere.

    Per-op terms repeat layer after layer, so equal terms are counted, then built once."""
    import collections

    import sympy

    from ..cost_model.symbolic import bytes_expr, collective_time_expr, compute_time_expr
    from ..passes.propagate import (_meta, at_load, internal_copy_seconds, layout_copy_seconds, load_share,
                                    sends_own_order, table_split)
    from ..passes.rules.experts import sends_back
    from ..passes.rules.gathered_rows import gathers_rows, rank_rows_work

    rename = {}
    for name, role in index.capture.dim_symbols.items():
        rename[sympy.Symbol(name, integer=True, positive=True)] = sympy.Symbol("b" if role == "batch" else "s",
                                                                               integer=True, positive=True)
    compute: collections.Counter = collections.Counter()
    first: dict = {}
    for node, strat in prop.chosen.items():
        info = index.infos[node]
        if gathers_rows(strat):   # a rank's own tokens' rows (GraphIndex.compute_time)
            info, strat = rank_rows_work(info, strat)
        key = (info.cost_key, strat)
        compute[key] += 1
        first.setdefault(key, (info, strat))
        if node in index.recomputed and info.grad_inputs:   # its forward again (GraphIndex.compute_time)
            info = info.forward_only()
            key = (info.cost_key, strat)
            compute[key] += 1
            first.setdefault(key, (info, strat))
    comm: collections.Counter = collections.Counter()
    nodes = {n.name: n for n in index.capture.graph.nodes}
    inside: collections.Counter = collections.Counter()
    # an internal collective's key with how its op lays its rows out (a table read by columns: its
    # split; an expert all-to-all: whether the rank's own routing ordered them) -> count
    laid: collections.Counter = collections.Counter()
    for c in prop.comms:
        # inside an op (vocab-parallel cross-entropy, an expert dispatch, a local routing's counts:
        # its internal ones, in order; an op is its own collective's consumer), not a conversion
        if c.consumer == c.tensor and prop.chosen[nodes[c.tensor]].internal:
            internal = prop.chosen[nodes[c.tensor]].internal
            kind, meta = internal[inside[c.tensor] % len(internal)]
            # an expert dispatch's (or combine's) all-to-all at the router's load (internal_bytes)
            share = load_share(index, nodes[c.tensor]) if kind == "all_to_all" else None
            key = ("g" if kind == "all_reduce" else kind, meta, True, None, None, share)
            comm[key] += 1
            if nodes[c.tensor] in index.recomputed:   # run again in the recomputation, forward only
                comm[key[:2] + (False,) + key[3:]] += 1
            laid[(key, table_split(prop.chosen[nodes[c.tensor]]), sends_own_order(prop.chosen[nodes[c.tensor]]))] += 1
            inside[c.tensor] += 1
        else:
            share = load_share(index, nodes[c.tensor]) if sends_back(c.src, c.dst) else None   # the reverse one
            comm[(c.kind, _meta(nodes[c.tensor]), nodes[c.tensor] in index.grads, c.src, c.dst, share)] += 1
            if nodes[c.tensor] in index.converted_again:   # ... and a conversion's (propagate.pay)
                comm[(c.kind, _meta(nodes[c.tensor]), False, c.src, c.dst, share)] += 1
    compute_total = sympy.Add(*(n * compute_time_expr(*first[k], profile, index.tp, index.env, index.align)
                                for k, n in compute.items())) + prop.update_s   # the optimizer step: constant
    # every collective's tensor at the bytes of its own dtype, as propagation prices it
    # (propagate.moved_bytes): a float32 tensor of a bf16 model at 4 bytes an element
    full = lambda meta: bytes_expr(meta, profile.dtype_bytes, index.train_dtype)  # noqa: E731
    compute_total += sympy.Add(*(n * internal_copy_seconds(key[0], at_load(full(key[1]), key[5], index.tp), profile,
                                                           key[1].shape[0] if key[1].shape else 1, index.tp,
                                                           key[1].shape[1] if len(key[1].shape) > 1 else 1,
                                                           split, alone, key[5])
                                 for (key, split, alone), n in laid.items()))   # internal: the rows laid out
    comm_total = sympy.Add(*(n * (collective_time_expr(kind, at_load(full(meta), share, index.tp), profile, index.tp,
                                                       grad)
                                  + layout_copy_seconds(kind, meta, src, dst, at_load(full(meta), share, index.tp),
                                                        profile, index.tp, grad, index, share))
                             for (kind, meta, grad, src, dst, share), n in comm.items()))
    return {key: str(expr.xreplace(rename).evalf(6)) for key, expr in (("compute_s", compute_total),
                                                                      ("comm_s", comm_total))}
