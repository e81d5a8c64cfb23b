"""Rewrite: a plan's propagation -> one rank's GraphModule.

Input: the captured graph, its :class:`~autotp.passes.propagate.Propagation`, tp, this rank,
the TP process group and the device the program runs on.
Output: a ``GraphModule`` whose placeholders are the captured ones (parameters now take this
rank's shards) and in which

* every redistribution is a named ``call_module`` node (``f_3``, ``g_7``, ``all_gather_1``,
  ``scatter_2``, ...) wrapping the autograd Functions of :mod:`autotp.distributed.collectives`;
  the f and g whose all-reduce may write over its tensor are marked so (:mod:`.in_place`);
* every op's arguments are localized (view/split sizes, vocab ranges) by its rule's localizer;
* device arguments captured on the meta device point at the run device;
* with ``align`` (:class:`~autotp.cost_model.alignment.Align`), a matrix product whose local
  output width is off the GPU's 16-byte alignment runs padded to an aligned width and is sliced
  back (:func:`_padded_product`).
* a rank's rows of experts (``Routed``, held compactly) carry a row map, a node the op that made
  them adds (``GraphLocalContext.rows``), which the ops after them read and a conversion out of
  them scatters by.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from ..capture import gc_paused
from ..cost_model.alignment import Align, pads
from ..cost_model.work import differ
from ..errors import PlanError
from ..placements import (PARTIAL, Partial, Placement, Replicate, ReplicatePartialGrad, Routed, Shard, block_local_sizes, local_ranges,
                          local_size, owned_ranges)
from ..distributed import comm_modules as C
from ..distributed import experts as E
from ..distributed import expert_routing as ER
from ..distributed.experts import routed_scatter, sequence_runs, token_rows
from ..distributed.functional import grad_if, rank_slice
from ..distributed.rng import RandomOp, draws_random
from .fused_bias import fused_product
from .in_place import reduce_in_place
from .propagate import (GraphIndex, Propagation, _aliases_of, _conversion, _dim_size, _meta, _sharded_compute,
                        cut_from_whole, first_write, gather_parts, gathers_whole, map_args, storage_root, wants_f)
from .rules import LocalContext, aliases_first, is_routed, localizer_for, mutates_first
from .rules.dispatch_sizes import dispatches_tokens
from .rules.experts import sends_back
from .rules.local_routing import owns
from .rules.pointwise import reduce_scatters_tokens, scatters_tokens, sequence_factors
from .rules.registry import REGION_BOUNDS, op_name
from .rules.row_reads import GROUPED_MM, grouped_reader, inverse_permutations, permutes_rows
from .rules.token_rows import ASCENDING, token_maps

log = logging.getLogger(__name__)


class GraphLocalContext(LocalContext):
    """Localizes size arguments inside a graph: a symbolic size gets a node computing it."""

    def __init__(self, tp: int, rank: int, graph: fx.Graph, group: Any = None):
        super().__init__(tp, rank, group)
        self.graph = graph
        self.sizes: "SizeNodes | None" = None
        #: rows of experts (a Routed value, held compactly) -> the node of its row map
        self.rows: dict[fx.Node, fx.Node] = {}
        #: the current op's tensor inputs as the rank's graph holds them (after conversions)
        self.inputs: list[fx.Node] = []
        #: set by a localizer whose op makes rows of its own (a product's, a pick's, a reorder's)
        self.made_rows: fx.Node | None = None
        #: rows held by their tokens' ranks (``Routed(tokens=True)``) -> the node of every row's
        #: holder (one rank per global row id: every rank knows where each row is, from the shapes)
        self.owners: dict[fx.Node, fx.Node] = {}
        self.made_owners: fx.Node | None = None
        #: an expert layer's all-to-all dispatch, (offs, first expert, experts) -> (its plan, the
        #: row map and holders of the rows it sent): the combine back reuses them
        self.dispatches: dict[tuple, tuple] = {}
        #: the row map of rows a dispatch sent (its experts' rows) -> the same triple: rows an op
        #: on the experts' ranks made are sent back by it (a conversion, ``send_back``)
        self.sent: dict[fx.Node, tuple] = {}
        self._shared_rows: dict[tuple, fx.Node] = {}
        #: a rank's own rows routed alone (rules/local_routing.py): node -> (what its values are,
        #: its layer); a sort's outputs by position; each layer by its sorted rows' map; the last
        self.own: dict[fx.Node, tuple] = {}
        self.own_tuples: dict[fx.Node, tuple] = {}
        self.own_layers: dict[fx.Node, Any] = {}
        self.own_made: tuple | None = None
        self.own_outputs: tuple | None = None
        #: nodes a localizer left unread (a whole arange the rank's own positions replace): erased
        #: where nothing else reads them
        self.unused: list[fx.Node] = []
        #: the grouped product that reads the rows the current op gathers, as
        #: (its OpInfo, its strategy, its offs in the rank's graph): set by :func:`rewrite`
        self.grouped_reader: Any = None
        self.node: fx.Node | None = None   # the captured op being localized
        #: ``comm(module, *args)``: a node calling a communicating module (an all-to-all
        #: dispatch) the rank's graph holds; set by :func:`rewrite`
        self.comm: Any = None
        #: captured node -> its node in the rank's graph (the nodes made so far)
        self.env: dict[fx.Node, fx.Node] = {}

    def rows_of(self, node: fx.Node) -> fx.Node:
        """The row map of the routed value ``node``: the global row ids of its local rows."""
        found = self.rows.get(node)
        if found is None:
            raise PlanError(f"{node.name} is placed as routed rows of experts, but no op made its row map")
        return found

    def shared_rows(self, key: tuple, make: Any) -> fx.Node:
        """One node per ``key`` (the two products of a layer share their experts' rows and the
        bounds read once to make them):
        ``make()`` gives (function, args) of the node where none is made yet."""
        if key not in self._shared_rows:
            fn, args = make()
            self._shared_rows[key] = self.graph.call_function(fn, args)
        return self._shared_rows[key]

    def found_rows(self, key: tuple) -> fx.Node | None:
        """The node :meth:`shared_rows` made for ``key``, or None where none is made yet."""
        return self._shared_rows.get(key)

    def local(self, arg: Any, size: Any, shard: Shard) -> Any:
        if isinstance(arg, fx.Node):
            if isinstance(size, sympy.Expr) and size.is_Integer:
                return local_size(int(size), shard, self.tp, self.rank)
            return self.local_node(arg, size, shard)
        return super().local(arg, size, shard)

    def size(self, expr: Any) -> Any:
        return self.sizes(expr) if self.sizes is not None else super().size(expr)

    def local_node(self, full: fx.Node, size: Any, shard: Shard) -> fx.Node:
        """This rank's share of a dynamic size (a sequence shard), computed at run time from the
        node ``full`` holding the whole size: run k of N in contiguous runs, the first N % tp
        one longer, holds (N + tp - 1 - k) // tp."""
        if (shard.chunks, shard.unit, shard.tail) != (1, 1, 0):
            raise PlanError(
                f"cannot shard a dimension of symbolic size {size} (argument {full.name}) by "
                f"{shard!r}: a dynamic dim is split only in plain contiguous runs (sequence parallelism)"
            )
        run = (self.rank + shard.rotate) % self.tp
        padded = self.graph.call_function(operator.add, (full, self.tp - 1 - run))
        return self.graph.call_function(operator.floordiv, (padded, self.tp))


class SizeNodes:
    """Nodes that compute a dynamic size (a sympy expression in the batch and sequence symbols)
    at run time, from the inputs whose dims carry those symbols."""

    def __init__(self, capture: Any, graph: fx.Graph, env: dict):
        self.graph, self.env, self.sources, self.made = graph, env, {}, {}
        for node in capture.graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(val, torch.Tensor) and node.name not in capture.param_names:
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt):
                        self.sources.setdefault(sympy.sympify(size.node.expr), (node, d))

    def __call__(self, expr: sympy.Expr) -> Any:
        if expr.is_Integer:
            return int(expr)
        if expr in self.made:
            return self.made[expr]
        if expr.is_Symbol and expr in self.sources:
            node, d = self.sources[expr]
            out = self.graph.call_function(torch.ops.aten.sym_size.int, (self.env[node], d))
        elif expr.is_Mul or expr.is_Add:
            op = operator.mul if expr.is_Mul else operator.add
            terms = [self(t) for t in expr.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.graph.call_function(op, (out, t))
        else:
            raise PlanError(f"cannot compute the dynamic size {expr} at run time: no input carries it")
        self.made[expr] = out
        return out


@gc_paused()
def rewrite(index: GraphIndex, prop: Propagation, rank: int, group: Any,
            device: torch.device | None, rng: Any = None, align: Align | None = None) -> fx.GraphModule:
    """``rng``: an :class:`~autotp.distributed.rng.RNGTracker`; ops that draw random numbers then
    run under its replicated or sharded state, as their output placement calls for. ``align``:
    which products with an unaligned local output width run padded (None: none)."""
    cap = index.capture
    tp = index.tp
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    converted: dict[tuple, fx.Node] = {}
    counts: dict[str, int] = {}
    ctx = GraphLocalContext(tp, rank, graph, group)
    ctx.env = env
    sizes = ctx.sizes = SizeNodes(cap, graph, env)

    def comm_node(kind: str, x: fx.Node, module: nn.Module, *more: Any) -> fx.Node:
        n = counts.get(kind, 0)
        counts[kind] = n + 1
        name = f"{kind}_{n}"
        root.add_module(name, module)
        return graph.call_module(name, (x, *more))

    def full_size(meta: Any, shard: Shard) -> int | None:
        size = meta.shape[shard.dim]
        return int(size) if size.is_Integer else None   # None: dynamic, known at run time

    def gather(out: fx.Node, meta: Any, have: Shard) -> fx.Node:
        size = full_size(meta, have)
        # A dynamic dim's whole size cannot be read off a shard: the graph computes it.
        more = () if size is not None else (sizes(meta.shape[have.dim]),)
        return comm_node("all_gather", out, C.GatherFromTP(group, have, size), *more)

    def gather_tokens(out: fx.Node, rows: fx.Node, meta: Any, fused: bool) -> tuple[fx.Node, bool]:
        """A rank's tokens' rows ``[b*s_r, ...]`` (its ``b`` runs of ``s/tp`` positions, the row
        map :func:`token_rows` made) gathered whole: viewed as its run of the sequence ``[b, s_r,
        ...]``, all-gathered along it (runs of any length: each rank's is known from ``s``),
        flattened again. ``fused``: into sharded compute, the f in the gather's backward (a
        reduce-scatter of the gradient back to the rank's tokens). Returns (node, fused)."""
        _, dim, outer, seq, _, _, unit = rows.args
        rest = [sizes(s) for s in meta.shape[1:]]
        local = graph.call_function(sequence_runs, (out, outer))
        runs = Shard(dim, unit=unit)   # the runs the row map was computed from
        module = C.GatherIntoTP(group, runs, None) if fused else C.GatherFromTP(group, runs, None)
        whole = comm_node("all_gather_f" if fused else "all_gather", local, module, seq)
        return graph.call_function(torch.ops.aten.reshape.default, (whole, [-1, *rest])), fused

    def scatter_tokens(out: fx.Node, meta: Any, src: fx.Node) -> fx.Node:
        """A partial sum of rows ``[b*s, ...]`` reduce-scattered into the rank's tokens' rows
        (``Routed(0, tokens=True)``): viewed as ``[b, s, ...]``, reduce-scattered along the sequence
        (each rank's run of it, of any length; its backward the all-gather), flattened again to the
        rank's ``b`` runs of ``s/tp`` rows; its row map is the one a view of ``[b, s, ...]`` split
        along ``s`` to ``[b*s, ...]`` makes (shared with it: the rows meet row by row). OPT's MLP
        region on ``[b*s, h]``; an expert layer's combine at its narrowing cast. The
        mirror of :func:`gather_tokens`."""
        factors = sequence_factors(meta.shape[0], index.sequence)
        if factors is None:   # the rules offer the rows only where the size factors so
            known = ", ".join(sorted(map(str, index.sequence))) or "none"
            raise PlanError(f"cannot reduce-scatter the {meta.shape[0]} rows of {src.name} into a sequence split's "
                            f"tokens' rows: their count is no sequence times a batch in this program (its sequence "
                            f"dims: {known}), so no rank's run of the sequence says which rows are its own. The plan "
                            "was solved for another program, or a rule offered the rows where it should not (an "
                            "autotp bug: please report it); plan with sequence_parallel=False to keep the rows whole")
        outer, seq = factors
        rest = [sizes(s) for s in meta.shape[1:]]
        runs = graph.call_function(torch.ops.aten.reshape.default, (out, [sizes(outer), sizes(seq), *rest]))
        local = comm_node("reduce_scatter", runs, C.ReduceScatterToTP(group, Shard(1), None), sizes(seq))
        rows, owners = token_maps(ctx, local, 1, (outer,), seq, 1)
        rows.meta[ASCENDING] = True
        flat = graph.call_function(torch.ops.aten.reshape.default, (local, [-1, *rest]))
        ctx.rows[flat], ctx.owners[flat] = rows, owners
        return flat

    def slice_tokens(out: fx.Node, meta: Any) -> fx.Node:
        """A whole tensor of rows ``[b*s, ...]`` sliced to the rank's tokens' rows (``R ->
        Routed(0, tokens=True)``: a residual every rank holds, added to the rows): viewed as ``[b,
        s, ...]``, the rank's run of the sequence kept (its backward the all-gather along it),
        flattened; the row map that of the view that merged the same dims, as
        :func:`scatter_tokens` makes it."""
        factors = sequence_factors(meta.shape[0], index.sequence)
        if factors is None:   # propagate.conversion_seconds prices the slice only where the size factors so
            raise PlanError(f"cannot slice {meta.shape[0]} rows to a sequence split's tokens' rows: "
                            f"their count is no sequence times a batch")
        outer, seq = factors
        rest = [sizes(s) for s in meta.shape[1:]]
        runs = graph.call_function(torch.ops.aten.reshape.default, (out, [sizes(outer), sizes(seq), *rest]))
        local = comm_node("scatter", runs, C.ScatterToTP(group, Shard(1), None))
        rows, owners = token_maps(ctx, local, 1, (outer,), seq, 1)
        rows.meta[ASCENDING] = True
        flat = graph.call_function(torch.ops.aten.reshape.default, (local, [-1, *rest]))
        ctx.rows[flat], ctx.owners[flat] = rows, owners
        return flat

    def send_back(src: fx.Node, out: fx.Node) -> fx.Node:
        """Rows a layer's all-to-all dispatch sent (``P(sent 0)``), after an op its experts' ranks
        ran on them (gpt-oss's down product and its bias), sent back to their tokens' ranks by the
        reverse all-to-all on the layer's dispatch plan (no count read again): each lands in the
        row the dispatch took it from, so its row map and holders are the dispatched rows'."""
        found = ctx.sent.get(ctx.rows_of(out))
        if found is None:
            raise PlanError(f"{src.name} is placed as rows an all-to-all dispatch sent to their experts' ranks, but "
                            f"no dispatching product of its layer made its rows, so nothing says where to send them "
                            f"back; plan with expert_dispatch=False to combine the rows by a g")
        plan, rows, owners = found
        back = comm_node("all_to_all", out, E.CombineRows(group), plan)
        ctx.rows[back] = rows
        if owners is not None:   # rows the rank routed alone are all its own: no holders
            ctx.owners[back] = owners
        return back

    def convert(src: fx.Node, dst: Placement, f: bool) -> fx.Node:
        if tp == 1:
            # one rank holds every shard whole and every sum: each conversion and f/g is the
            # identity (run, it was a clone: the collectives' group-of-one path), so the rank's
            # program is the captured graph's own ops (a layout pinned at tp 1, DP alone)
            return env[src]
        key = (src, dst, f)
        if key in converted:
            return converted[key]
        meta = _meta(src)
        have = prop.placements[src]
        out = env[src]
        if isinstance(have, ReplicatePartialGrad):
            return out   # whole, its f made before it (propagate.copied_seconds)
        if isinstance(have, Routed) and have.tokens and not have.reordered and have.span == 1 \
                and isinstance(dst, Replicate):
            if ctx.rows_of(out).target is token_rows:
                out, fused = gather_tokens(out, ctx.rows_of(out), meta, f is True)
                if f:
                    if not fused:
                        converted.setdefault((src, dst, False), out)
                        out = comm_node("f", out, C.CopyToTP(group))
                converted[key] = out
                return out
            # not foreseen: rows the rules keep in sequence order with another row map; put in
            # place and summed (correct, twice the bytes of the all-gather the plan priced)
            log.warning("autotp: %s holds token rows without their sequence's row map; made whole by "
                        "scatter and all-reduce, not the all-gather the plan priced", src.name)
        if reduce_scatters_tokens(have, dst):
            out = converted[key] = scatter_tokens(out, meta, src)
            return out
        if sends_back(have, dst):
            out = converted[key] = send_back(src, out)
            return out
        if scatters_tokens(have, dst):
            out = converted[key] = slice_tokens(out, meta)
            return out
        if isinstance(have, Routed) and not isinstance(dst, Routed):
            # a rank's rows of experts put in place, zero elsewhere: a plain Partial
            shape = [sizes(s) for s in meta.shape]
            out = graph.call_function(routed_scatter, (out, ctx.rows_of(out), have.dim, have.span, shape))
            have = PARTIAL
        kind = _conversion(have, dst, _dim_size(meta, dst) or _dim_size(meta, have), tp)
        if gathers_whole(meta, have, dst, tp):
            out = converted[key] = gathered(src, dst, f, kind, meta, have, out)
            return out
        if kind == "g":
            out = comm_node("g", out, C.ReduceFromTP(group))
        elif kind == "scatter" and not _written_before(src, ctx.node) \
                and (made := _factory_at_local_size(graph, out, dst, meta, tp, rank)) is not None:
            out = made   # a slice of a tensor of one value is that tensor at the slice's size
            unsliced.append(env[src])
        elif kind == "scatter":
            out = comm_node("scatter", out, C.ScatterToTP(group, dst, full_size(meta, dst)))
        elif kind == "reduce_scatter":
            out = comm_node("reduce_scatter", out, C.ReduceScatterToTP(group, dst, full_size(meta, dst)))
        elif kind == "inf":
            raise PlanError(f"cannot turn {have} into {dst} for {src.name}")
        if f:
            if kind:   # the conversion alone serves a consumer that wants no f (a tailed product's tail)
                converted.setdefault((src, dst, False), out)
            out = comm_node("f", out, C.CopyToTP(group))
        converted[key] = out
        return out

    def gathered(src: fx.Node, dst: Placement, f: bool | str, kind: str, meta: Any, have: Shard,
                 local: fx.Node) -> fx.Node:
        """src (split as ``have``) made whole, or split as ``dst`` (a reshard), from the one
        all-gather of it that serves every consumer (the plan counts the same:
        :func:`~.propagate.gather_parts`). Where sharded compute reads src whole, that is the
        ``all_gather_f`` (its f fused in, its backward reduce-scattering the gradient's
        summands): a consumer in replicated compute, or a returned output (its gradient whole
        on every rank), reads it through ``grad_if`` (rank 0 alone adds its gradient); one that
        wants src split another way cuts the rank's part with ``rank_slice`` (its gradient
        zero-padded: a summand), or, where slicing cannot cut it, scatters what the replicated
        consumers read; the runs of a tailed product read it as it is (its tail, through
        ``grad_if``). Otherwise a plain all-gather, with an f after it for the runs of a tailed
        product, and a scatter for each split; a reshard that is src's one gather in the plan, and
        that one all-to-all moves, is that all-to-all (no gather)."""
        if kind == "reshard" and moved_by_all_to_all(src, meta, have):
            size = full_size(meta, have)
            more = () if size is not None else (sizes(meta.shape[have.dim]),)
            return comm_node("all_to_all", local, C.ReshardTP(group, have, dst, size), *more)
        if f is True:   # into sharded compute: the f fused in (backward reduce-scatters)
            size = full_size(meta, have)
            more = () if size is not None else (sizes(meta.shape[have.dim]),)
            return comm_node("all_gather_f", local, C.GatherIntoTP(group, have, size), *more)
        if gathered_into_compute(src):
            if kind == "reshard" and not cut_from_whole(dst):
                return comm_node("scatter", convert(src, Replicate(), False),
                                 C.ScatterToTP(group, dst, full_size(meta, dst)))
            whole = convert(src, Replicate(), True)
            if kind == "reshard":
                return graph.call_function(rank_slice, (whole, dst.dim, dst.chunks, dst.unit, dst.rotate,
                                                        tuple(dst.sizes), tp, rank))
            if f:   # "apart"
                return whole
            return graph.call_function(grad_if, (whole, int(rank == 0)))   # an int: one graph on every rank
        whole = converted.get((src, Replicate(), False))
        if whole is None:
            whole = converted[(src, Replicate(), False)] = gather(local, meta, have)
        if kind == "reshard":
            return comm_node("scatter", whole, C.ScatterToTP(group, dst, full_size(meta, dst)))
        if f:   # "apart": the runs of a tailed product read it through an f, its tail without
            return comm_node("f", whole, C.CopyToTP(group))
        return whole

    def moved_by_all_to_all(src: fx.Node, meta: Any, have: Shard) -> bool:
        """Whether the plan moves src's one gather, a reshard, by an all-to-all: what
        :func:`~.propagate.gather_parts` makes of src's conversions that gather it whole (the
        plan's listing, its bytes and the solver read the same)."""
        wanted = [(dst, f) for (node, dst, f) in prop.conversions
                  if node is src and gathers_whole(meta, have, dst, tp)]
        parts = gather_parts(have, wanted) if wanted else []
        return len(parts) == 1 and parts[0][0] == "all_to_all"

    def gathered_into_compute(src: fx.Node) -> bool:
        """Whether src is all-gathered whole into sharded compute (``all_gather_f``) by a
        conversion made already, or by one a consumer will make before anything ends the reuse
        of conversions (a grad/autocast region bound, an in-place write of src's storage)."""
        made = converted.get((src, Replicate(), True))
        if made is not None:
            return made.op == "call_module" and made.target.startswith("all_gather_f")
        here = at.get(ctx.node, -1)
        root = storage_root(src)
        users = sorted((u for u in src.users if at.get(u, -1) >= here), key=at.__getitem__)
        # a region bound converts afresh (before its own inputs); a write, after its own
        stop = next((at[n] - (n.target in REGION_BOUNDS) for n in order[here + 1:] if n.op == "call_function" and (
            n.target in REGION_BOUNDS or (mutates_first(n.target) and storage_root(n) is root))), len(order))
        for user in users:
            if at[user] > stop or user.op != "call_function" or user not in prop.chosen:
                continue
            strategy, info = prop.chosen[user], index.infos[user]
            sharded = _sharded_compute(strategy)
            for i, (inp, meta, want) in enumerate(zip(index.tensor_inputs[user], info.inputs, strategy.inputs)):
                if inp is src and wants_f(want, sharded, meta, inp in index.grads,
                                          apart=strategy.f_runs_only and i == 0) is True:
                    return True
        return False

    readers = {}
    unsliced: list[fx.Node] = []   # factories made again at a rank's size: erased where nothing else reads them

    def grouped_reader() -> tuple | None:
        product = readers.get(ctx.node)
        if product is None:
            return None
        offs = product.args[2] if len(product.args) > 2 else product.kwargs["offs"]
        return index.infos[product], prop.chosen[product], env[offs]

    ctx.grouped_reader = grouped_reader
    ctx.comm = lambda module, *args: comm_node(module.kind, args[0], module, *args[1:])
    order = _program_order(cap.graph, prop, readers)
    at = {n: i for i, n in enumerate(order)}
    for node in order:
        ctx.node = node
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            continue
        if node.op == "output":
            leaves, spec = pytree.tree_flatten(node.args[0])
            outs = []
            for i, a in enumerate(leaves):
                if isinstance(a, fx.Node):
                    have = prop.placements.get(a)
                    keep = index.keeps_split(i, a, have)
                    outs.append(convert(a, Replicate(), False) if isinstance(have, (Shard, Partial)) and not keep
                                else env[a])
                else:
                    outs.append(a)
            graph.output(pytree.tree_unflatten(outs, spec))
            continue
        if node.op == "get_attr":   # a data-dependent op's branch (torch.cond) or a constant
            _carry_attr(root, cap.graph_module, node.target)
        if node.op != "call_function" or node.target is operator.getitem:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.target is operator.getitem and env[node.args[0]] in ctx.rows:   # a split of routed rows
                ctx.rows[env[node]] = ctx.rows[env[node.args[0]]]
                if env[node.args[0]] in ctx.owners:
                    ctx.owners[env[node]] = ctx.owners[env[node.args[0]]]
            if node.target is operator.getitem and env[node.args[0]] in ctx.own_tuples:   # a local sort's
                ctx.own[env[node]] = ctx.own_tuples[env[node.args[0]]][node.args[1]]
            continue
        if node.target in REGION_BOUNDS:
            converted.clear()   # a conversion made under one grad/autocast mode is not reused under another
        strategy = prop.chosen[node]
        info = index.infos[node]
        tensor_inputs = index.tensor_inputs[node]
        sharded = _sharded_compute(strategy)
        replacements = []
        for i, (inp, meta, want) in enumerate(zip(tensor_inputs, info.inputs, strategy.inputs)):
            f = wants_f(want, sharded, meta, inp in index.grads, apart=strategy.f_runs_only and i == 0)
            replacements.append(convert(inp, want, f) if (f or prop.placements[inp] != want) else env[inp])
        if replacements and replacements[0] is not env[tensor_inputs[0]] and (
                mutates_first(node.target) or (aliases_first(node.target) and _view_alone_written(node))):
            # an in-place op on a converted tensor, or on a view of one (transformers' experts:
            # bmm(...).squeeze(-1), then add_(bias)), writes a copy of its own: not the conversion
            # other ops reuse, nor a collective's output, which autograd forbids writing in place,
            # even through a view
            replacements[0] = graph.call_function(torch.ops.aten.clone.default, (replacements[0],))
        if strategy.f_runs_only and wants_f(strategy.inputs[0], sharded, info.inputs[0], tensor_inputs[0] in index.grads):
            # A column-parallel product into a tailed shard (a fused multi-query k and v): the f
            # goes to the dealt runs' product alone; the tail is computed from x itself.
            x = tensor_inputs[0]
            plain = env[x] if prop.placements[x] == strategy.inputs[0] else convert(x, strategy.inputs[0], False)
            new = _tailed_product(graph, node.target, replacements[0], plain, replacements[1], strategy.output,
                                  info, ctx)
            new.meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}
            new.meta["autotp_placement"] = strategy.output
            env[node] = new
            continue
        it = iter(replacements)

        def swap(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return next(it) if _meta(a) is not None else env[a]
            return a

        args, kwargs = map_args(swap, node)
        target = node.target
        loc = localizer_for(target, strategy)
        ctx.inputs, ctx.made_rows, ctx.made_owners = replacements, None, None
        ctx.own_made = ctx.own_outputs = None
        if loc is not None:
            target, args, kwargs = loc(info, strategy, tuple(args), kwargs, ctx)
        if device is not None and isinstance(kwargs.get("device"), torch.device):
            kwargs["device"] = device
        if device is not None:   # positional too: aten.to.device(x, device, dtype)
            args = tuple(device if isinstance(a, torch.device) else a for a in args)
        if rng is not None and not isinstance(target, nn.Module) and draws_random(target, tuple(args), kwargs):
            outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
            # rows a rank holds alone draw their own mask, as a Shard's: its tokens' rows (a
            # sequence split flattened) and its experts' rows (each row on one rank; drawn from
            # the replicated state, every rank masked its different rows with one pattern)
            state = "sharded" if any(isinstance(p, (Shard, Routed)) for p in outs) else "replicated"
            target = RandomOp(target, state, rng)
        if isinstance(target, nn.Module):   # an op that communicates inside (vocab-parallel loss)
            kind = getattr(target, "kind", "op")
            n = counts.get(kind, 0)
            counts[kind] = n + 1
            root.add_module(f"{kind}_{n}", target)
            new = graph.call_module(f"{kind}_{n}", tuple(args), kwargs)
        elif (width := _padded_width(node, info, strategy, index, ctx, align)) is not None:
            new = _padded_product(graph, target, tuple(args), width, info, strategy, ctx)
        elif strategy.fused and replacements[0] is env[tensor_inputs[0]] and \
                (new := fused_product(graph, replacements[0], replacements[1], node.meta["val"].dim())) is not None:
            # the bias inside its product, as serial adds it (fused_bias.py); the bare product goes
            graph.erase_node(replacements[0])
            env[tensor_inputs[0]] = new   # read by this add alone: nothing reads it after
        else:
            new = graph.call_function(target, tuple(args), kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}
        new.meta["autotp_placement"] = strategy.output
        env[node] = new
        if ctx.own_made is not None:
            ctx.own[new] = ctx.own_made
        if ctx.own_outputs is not None:
            ctx.own_tuples[new] = ctx.own_outputs
        if mutates_first(node.target) and converted:
            # the tensor written (through any view of it) is no longer what its conversions made
            # before the write hold: a later reader converts it afresh
            written = storage_root(node)
            for key in [k for k in converted if storage_root(k[0]) is written]:
                del converted[key]
        if is_routed(strategy) and any(isinstance(p, Routed) for p in (
                strategy.output if isinstance(strategy.output, tuple) else (strategy.output,))):
            # the output's row map: the op's own (a product's, a pick's, a reorder's) or its routed input's
            source = next((r for r, p in zip(replacements, strategy.inputs) if isinstance(p, Routed)), None)
            ctx.rows[new] = ctx.made_rows if ctx.made_rows is not None else ctx.rows_of(source)
            owners = ctx.made_owners if ctx.made_owners is not None else ctx.owners.get(source)
            if owners is not None and not owns(strategy):   # rows a rank routed alone: all its own
                ctx.owners[new] = owners
    for made in dict.fromkeys(unsliced + ctx.unused):
        if not made.users:
            graph.erase_node(made)
    graph.lint()
    for node, new in env.items():   # the dims reduce_in_place reads (a broadcast operand's)
        if isinstance(new, fx.Node) and isinstance(val := node.meta.get("val"), torch.Tensor) \
                and new.meta.setdefault("autotp_ndim", val.dim()) != val.dim():
            new.meta["autotp_ndim"] = float("inf")   # two captured tensors of unlike dims: unknown
    remove_dead(graph)
    return reduce_in_place(fx.GraphModule(root, graph, class_name="ParallelGraph"))


#: calls that are not ATen ops and compute their result from their arguments alone (no write,
#: no collective, no read to the host, no random draw): the row maps and holders a localizer
#: makes (``ctx.made_owners`` of a reorder no later op reads), sizes and tuple reads. A helper
#: that checks what it reads on the host (``match_rows``, ``routed_reorder``'s count) or
#: communicates is not here, so it stays where it was put
_PURE_CALLS = frozenset({
    operator.getitem, getattr, operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
    operator.neg, E.take_rows, E.token_rows, E.token_owners, E.token_sum_owners, E.sequence_runs,
    ER.flat_rows, ER.token_flat_rows, ER.flat_tokens,
})
#: ATen ops torch's own purity check passes (its assertions it counts impure) that stay all the
#: same: those whose result's value or size is read to the host (``item``, ``nonzero``: a sync,
#: and what a compiled graph's unbacked sizes come from)
_HOST_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def is_dead(node: fx.Node) -> bool:
    """Whether ``node`` of a rank's program may go: nothing reads its result and running it has
    no effect. Only a ``call_function`` node: a pure ATen op (torch.fx's ``Node.is_impure`` says
    no write in place or ``out=``, no effectful or random op, no assertion; and not a draw by the
    project's notion, :func:`~autotp.distributed.rng.draws_random`, nor a read to the host) or
    one of :data:`_PURE_CALLS`. A ``call_module`` (every collective, a dropout under the RNG
    tracker, a communicating loss) always stays."""
    if node.users or node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims") and not node.is_impure() \
            and not draws_random(target, node.args, node.kwargs) and not any(t in target.tags for t in _HOST_TAGS)
    return target in _PURE_CALLS


def remove_dead(graph: fx.Graph) -> int:
    """Erase the nodes of a rank's program that nothing uses (:func:`is_dead`), to a fixpoint:
    one walk from the output back, since a node's inputs come before it, so each input is met
    after its last reader went. The rewrite's localizers replace uses (a rank's rows read by
    their own row map; a reorder's holders made for a dispatch that a g replaced), and what
    they leave unread would otherwise run on every step. Returns the count erased."""
    erased = 0
    for node in reversed(graph.nodes):
        if is_dead(node):
            graph.erase_node(node)
            erased += 1
    return erased


#: factories of a tensor of one value, by the position of their size argument
_CONSTANT_FACTORIES = {
    torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 0, torch.ops.aten.full.default: 0,
    torch.ops.aten.empty.memory_format: 0, torch.ops.aten.new_zeros.default: 1, torch.ops.aten.new_ones.default: 1,
    torch.ops.aten.new_full.default: 1, torch.ops.aten.new_empty.default: 1,
}


def _written_before(made: fx.Node, reader: fx.Node) -> bool:
    """Whether an in-place op writes ``made``'s storage (itself, or through a view of it) before
    ``reader`` runs: its values are then no longer the factory's one value, and a conversion for
    ``reader`` must slice them (DeepSeek-V3's MLA writes its keys into a ``new_empty`` through two
    slices and reads the whole; made again at the rank's size, attention read uninitialized keys)."""
    if made.target not in _CONSTANT_FACTORIES:   # only a factory is made again: no walk of the graph
        return False
    order = {n: i for i, n in enumerate(made.graph.nodes)}
    at = order.get(reader, len(order))
    return any(mutates_first(n.target) and order[n] < at for n in _aliases_of(made) if n is not made)


def _factory_at_local_size(graph: fx.Graph, made: fx.Node, dst: Placement, meta: Any, tp: int,
                           rank: int) -> fx.Node | None:
    """``made`` (a rank program's node) called again at this rank's size of ``dst``, where it
    makes a tensor of one value (``zeros``, ``full``, ``new_zeros``, ...) and the split dim is
    static: a recurrent layer's state buffer split as its state (``copy_``'s rule), made at its
    share instead of whole and sliced. None otherwise."""
    at = _CONSTANT_FACTORIES.get(made.target)
    size = meta.shape[dst.dim] if isinstance(dst, Shard) else None
    if at is None or size is None or not size.is_Integer or len(made.args) <= at \
            or not isinstance(made.args[at], (list, tuple)):
        return None
    shape = list(made.args[at])
    shape[dst.dim] = local_size(int(size), dst, tp, rank)
    return graph.call_function(made.target, (*made.args[:at], shape, *made.args[at + 1:]), dict(made.kwargs))




def _program_order(graph: fx.Graph, prop: Propagation, readers: dict) -> list[fx.Node]:
    """The captured graph's nodes in the order the rank's program runs them: as captured, but a
    gather of rows a rank takes at its own experts' rows (an ``index`` placed routed from whole
    inputs, :func:`~autotp.passes.rules.row_reads.grouped_reader`) moved, with the casts that carry
    its rows, to right before the grouped product that reads them, after the product's ``offs``
    that bound the rank's rows; and so a reorder of a rank's tokens' rows read by a product that
    sends them to their experts' ranks (the all-to-all dispatch), whose count is read with the
    dispatch's split sizes, the layer's one read, which needs ``offs``. ``readers`` gets each
    such gather's product."""
    order = list(graph.nodes)
    moved = []
    for node in order:
        strategy = prop.chosen.get(node)
        if node.target is not torch.ops.aten.index.Tensor or strategy is None \
                or not isinstance(strategy.output, Routed) or owns(strategy):
            continue   # (a gather by a rank's own positions runs where captured: rules/local_routing.py)
        x = strategy.inputs[0]
        found = grouped_reader(node)
        if x == Replicate():
            if found is None:
                raise PlanError(f"{node.name} is placed as routed rows gathered for a grouped product, "
                                f"but no grouped product alone reads it")
        elif not (isinstance(x, Routed) and x.tokens and found is not None
                  and dispatches_tokens(prop.chosen[found[1]])):
            continue   # any other reorder of routed rows runs where captured
        chain, product = found
        readers[node] = product
        moved.append(([node] + chain, product))
    reordered = [p for _, p in moved if dispatches_tokens(prop.chosen[p])]
    moved += _picks_after_dispatch(order, prop, reordered)
    # a product whose rows the rank routed alone makes the layer's one read itself (from the
    # counts its sort exchanged: no reorder moved in front of it), so a pick its bounds count
    # runs right after it, where that read is made
    own = [n for n in order if n not in reordered and op_name(n.target) in GROUPED_MM and n in prop.chosen
           and dispatches_tokens(prop.chosen[n])]
    after = _picks_after_dispatch(order, prop, own)
    for run, product in moved + after:
        for n in run:
            order.remove(n)
        at = order.index(product) + ((run, product) in after)
        order[at:at] = run
    return _inverses_first(order, prop)


def _inverses_first(order: list, prop: Propagation) -> list:
    """``order`` with the inverse of a reorder's permutation made before the reorder where the
    graph makes it only after (transformers' ``inv_perm[perm] = arange``, made after the routing
    weights' ``w[perm]``; :func:`~autotp.passes.rules.row_reads.inverse_permutations`): its
    backward then gathers by it (``distributed.functional.permute_rows``), not a copy of each row
    to its row. Moved, in their order, right before the reorder: the inverse and what it is made
    of after the reorder, where each is an integer op with no grad or autocast switch, randomness
    or output read by the reorder among them, nothing left between writes what they read, and
    nothing reads or views a tensor they write before the write (they depend on ``perm`` alone;
    nothing else moves)."""
    for reorder in [n for n in order if n in prop.chosen and permutes_rows(n)]:
        at = {n: i for i, n in enumerate(order)}
        made = [m for m in inverse_permutations(reorder.args[1][0]) if m in at]
        if not made or any(at[m] < at[reorder] for m in made):
            continue
        for inverse in made:
            run = _made_after(order, at, inverse, reorder)
            if run is not None:
                for n in run:
                    order.remove(n)
                here = order.index(reorder)
                order[here:here] = run
                break
    return order


def _made_after(order: list, at: dict, made: fx.Node, reorder: fx.Node) -> list | None:
    """The nodes ``made`` is made of that come after ``reorder`` in ``order``, ``made`` among them,
    in their order, where they may run before it (:func:`_inverses_first`); else None."""
    run, todo = set(), [made]
    while todo:
        n = todo.pop()
        if n in run or at[n] < at[reorder]:
            continue
        val = n.meta.get("val")
        if n is reorder or n.op != "call_function" or n.target in REGION_BOUNDS or draws_random(n.target, n.args, n.kwargs) \
                or (isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())):
            return None
        run.add(n)
        todo.extend(n.all_input_nodes)
    read = {a for n in run for a in n.all_input_nodes} - run
    for n in order[at[reorder]:at[made]]:
        if n not in run and n.op == "call_function" and mutates_first(n.target) and n.args and (
                n.args[0] in read or n.args[0] in run):
            return None   # a write to what the inverse reads, left between
    for write in (n for n in run if mutates_first(n.target)):
        written = write.args[0]
        if written not in run and (written.op != "call_function" or aliases_first(written.target)):
            return None   # a write that a view, an input or the tensor it views would show
        if any(u not in run and at[u] < at[write] for u in written.users):
            return None   # a read (or a view) of the written tensor before the write, left between
    return sorted(run, key=at.get)


def _picks_after_dispatch(order: list, prop: Propagation, products: list) -> list[tuple[list, fx.Node]]:
    """Picks of a stack of experts by the router's sorted ids counted by a dispatching product's
    ``offs`` (gpt-oss's biases, :func:`~autotp.passes.rules.routing.counted_by`), each as
    ``([pick], product)`` where nothing before the product reads it: their rows are the
    product's, bounded by the layer's one read, which the reorder of the rank's tokens' rows
    makes right before the product (or the product itself, where the rank routed its rows alone:
    the pick then runs right after it); picked earlier, they would read the bounds on their own."""
    from .rules.routing import counted_by

    at = {n: i for i, n in enumerate(order)}
    out = []
    for product in products:
        offs = product.args[2] if len(product.args) > 2 else product.kwargs["offs"]
        for node in order[:at[product]]:
            strategy = prop.chosen.get(node)
            if node.target is not torch.ops.aten.index.Tensor or strategy is None \
                    or not isinstance(strategy.output, Routed) or not isinstance(strategy.inputs[0], Shard):
                continue
            stack = _meta(node.args[0])
            if stack is None or stack.static(0) is None or len(node.args[1]) != 1 \
                    or counted_by(node.args[1][0], stack.static(0)) is not offs:
                continue
            read = {node.args[0], node.args[1][0]}
            written_between = any(mutates_first(n.target) and n.args and n.args[0] in read
                                  for n in order[at[node] + 1:at[product]] if n.op == "call_function")
            if all(at[u] > at[product] for u in node.users) and not written_between:
                out.append(([node], product))
    return out


def _view_alone_written(view: fx.Node) -> bool:
    """Whether the view's output is written in place and the viewed tensor is read by nothing
    after that write: then writing a copy is what the model computes. Where the tensor is read
    after (the write would show through it), no copy is made and autograd's refusal stands: an
    error, never a silently unwritten tensor."""
    write = first_write(view)
    if write is None:
        return False
    base = view.args[0]
    order = {n: i for i, n in enumerate(view.graph.nodes)}
    return all(u is view or order[u] < order[write] for u in base.users)


def _tailed_product(graph: fx.Graph, target: Any, x_f: fx.Node, x: fx.Node, w: fx.Node, out: Shard,
                    info: Any, ctx: GraphLocalContext) -> fx.Node:
    """``x @ W`` with W's output features in ``out``'s tailed layout, as one product per block's
    run (input ``x_f``, behind an f) and per block's tail (input ``x``), joined along the last
    dim. Each rank's gradient for x is then its runs' summand, all-reduced by the f, plus the
    tail's contribution, which is whole on every rank and so is not summed again."""
    aten = torch.ops.aten
    w_out = 0 if target is aten.linear.default else 1   # linear's W is [N, K]; mm/matmul's [K, N]
    size = int(info.output.shape[out.dim])
    block = size // out.chunks
    tail = out.tail * out.unit
    if out.whole:
        # Blocks held whole on every rank between dealt ones (Mamba2's one B and C beside its
        # heads' z, x and dt): a product per run of neighbouring blocks of one kind, the whole
        # ones from x itself
        pieces_of, blocks = [], 1
        for i, width in enumerate(block_local_sizes(size, out, ctx.tp, ctx.rank)):
            source = x if i in out.whole else x_f
            if pieces_of and pieces_of[-1][0] is source:
                pieces_of[-1] = (source, pieces_of[-1][1] + width)
            else:
                pieces_of.append((source, width))
    elif out.per_block:
        # One block per rank, its k and v whole on each rank of the block's set: their gradient
        # is whole there too, so x's gradient takes the tail's contribution once per block,
        # from the set's first rank, behind the f (the others' pass none back: grad_if).
        ranges = local_ranges(size, out, ctx.tp, ctx.rank)   # the run, then the tail
        run = sum(b - a for a, b in ranges) - tail
        owner = owned_ranges(size, out, ctx.tp, ctx.rank) == ranges
        tail_source = graph.call_function(grad_if, (x_f, int(owner)))   # an int: one graph on every rank
        pieces_of, blocks = [(x_f, run), (tail_source, tail)], 1
    else:
        run = ctx.local(block - tail, sympy.Integer(block - tail), Shard(0, 1, out.unit, out.rotate))
        pieces_of = [(x_f, run), (x, tail)]
        blocks = out.chunks
    pieces, offset = [], 0
    for _ in range(blocks):
        for source, width in pieces_of:
            if width:
                part = graph.call_function(aten.slice.Tensor, (w, w_out, offset, offset + width))
                pieces.append(graph.call_function(target, (source, part)))
                offset += width
    return graph.call_function(aten.cat.default, (pieces, -1))


#: products ``x [..., K] @ W`` with a 2-D weight, and the weight dim holding the output features
_PRODUCTS = {torch.ops.aten.mm.default: 1, torch.ops.aten.linear.default: 0, torch.ops.aten.matmul.default: 1}
#: views that need the strides they are handed to allow them (``reshape`` copies where they do not)
_STRICT_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _padded_width(node: fx.Node, info: Any, strategy: Any, index: GraphIndex, ctx: GraphLocalContext,
                  align: Align | None) -> int | None:
    """The aligned width every rank runs ``node``'s product at, or None where it runs as captured
    (see :mod:`autotp.cost_model.alignment`): a plain 2-D-weight product whose output width on
    some rank is unaligned, whose contracted width is aligned on every rank, over enough rows at
    the planning workload, and whose output no strict view would merge across its last dim (the
    sliced output's rows are the padded width apart)."""
    if align is None or node.target not in _PRODUCTS or len(info.inputs) != 2 or node.kwargs \
            or info.inputs[1].ndim != 2 or strategy.f_runs_only or info.output.ndim < 1:
        return None
    x, out = info.inputs[0], info.output
    n, k = out.shape[-1], x.shape[-1]
    if not (n.is_Integer and k.is_Integer):
        return None

    def widths(size: int, placement: Any, dim: int) -> list[int]:
        if isinstance(placement, Shard) and placement.dim == dim:
            return [local_size(size, placement, ctx.tp, r) for r in range(ctx.tp)]
        return [size]

    rows = sympy.prod(x.shape[:-1]).subs(index.env)
    if not rows.is_number:
        return None
    width = pads(widths(int(n), strategy.output, out.ndim - 1), widths(int(k), strategy.inputs[0], x.ndim - 1),
                 float(rows), align)
    if width is None or not all(_keeps_last_dim(node, user) for user in node.users):
        return None
    return width


def _keeps_last_dim(node: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` can read ``node``'s output with rows further apart than its width: any op
    but a strict view that merges the last dim with another (splitting it is fine)."""
    if user.op != "call_function" or user.target not in _STRICT_VIEWS:
        return True
    have, want = _meta(node), _meta(user)
    if have is None or want is None:
        return False
    tail = sympy.Integer(1)
    for size in reversed(want.shape):
        tail = tail * size
        if not differ(tail, sympy.sympify(have.shape[-1])):   # (not simplify's cost)
            return True
    return False


def _padded_product(graph: fx.Graph, target: Any, args: tuple, width: int, info: Any, strategy: Any,
                    ctx: GraphLocalContext) -> fx.Node:
    """``x @ W`` run at ``width`` output features: W's shard padded with zero features, the
    product, then the output sliced back to this rank's own width. The pad never leaves the
    product: the slice is all anything reads, W's gradient is the slice of the padded one, and
    the output's gradient reaches the product zero-padded to ``width``, so the backward products
    run aligned as well."""
    aten = torch.ops.aten
    x, w = args
    out = strategy.output
    last = info.output.ndim - 1
    n = int(info.output.shape[-1])
    mine = local_size(n, out, ctx.tp, ctx.rank) if isinstance(out, Shard) and out.dim == last else n
    w_out = _PRODUCTS[target]
    pad = [0, width - mine] if w_out == 1 else [0, 0, 0, width - mine]   # last dim first
    padded = graph.call_function(aten.constant_pad_nd.default, (w, pad))
    product = graph.call_function(target, (x, padded))
    return graph.call_function(aten.slice.Tensor, (product, last, 0, mine))


def _carry_attr(root: nn.Module, source: fx.GraphModule, target: str) -> None:
    """Put ``source``'s attribute ``target`` (a submodule or a tensor) on ``root`` at the same path."""
    *path, leaf = target.split(".")
    src, dst = source, root
    for part in path:
        src = getattr(src, part)
        if not hasattr(dst, part):
            dst.add_module(part, nn.Module())
        dst = getattr(dst, part)
    value = getattr(src, leaf)
    if isinstance(value, nn.Module):
        dst.add_module(leaf, value)
    elif isinstance(value, nn.Parameter):
        dst.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        dst.register_buffer(leaf, value)
    else:
        setattr(dst, leaf, value)
