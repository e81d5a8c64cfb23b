"""Propagation: given a choice of placement for each weight matrix, find every tensor's
placement, the strategy of every op, the collectives that join them, and their cost.

Input: a :class:`~autotp.capture.Capture`'s graph, tp, and ``decisions``: for each parameter
placeholder of 2+ dims, ``Replicate()`` or ``Shard(d)`` (its chunks/unit are settled by the
op that first uses it). Parameters not decided (biases, norm weights) are free: they take the
placement the op using them asks for, since they are sharded once, at load.

Output: a :class:`Propagation`. Ops are visited in graph order; each takes the strategy with
the least cost: redistributing its inputs plus its own compute. The invariants that make the
rewritten program compute the serial one are the conjugate pair:

* **f** (identity forward, all-reduce backward) wherever a replicated float tensor feeds
  sharded compute (an op whose output is Shard or Partial): its gradient there is a summand;
* **g** (all-reduce forward, identity backward) wherever a Partial must become whole.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx

from ..capture import Capture, shape_of
from ..cost_model.devices import DeviceProfile
from ..cost_model.saved import Kept, kept, kept_root
from ..cost_model.symbolic import (kept_bytes, collective_bytes, collective_time, compute_time,
                                   conversion_kinds, evaluate, nbytes, numel, numel_expr)
from ..placements import (PARTIAL, REPLICATE, Partial, Placement, Replicate, ReplicatePartialGrad, Routed, Shard, divides, is_even,
                          local_ranges, local_size, max_local_size, resharded_by_all_to_all, same_placement)
from .fused_bias import bias_add, takes_as_made
from .hints import column_hint, index_picks, row_hint
from .rules import OpInfo, Strategy, TensorMeta, strategies
from .rules.row_reads import GROUPED_MM, grouped_reader, permutes_rows, reads_host, reads_rows
from .rules.experts import sends_back
from .rules.gathered_rows import gathers_rows, rank_rows_work, row_copies
from .rules.local_routing import sorted_ids_experts
from .rules.routing import INVERTERS, SORTS, counted_pick, makes_inverse, router_experts
from .rules.pointwise import reduce_scatters_tokens, scatters_tokens, sequence_factors
from .rules.registry import aliases_first, mutates_first, op_name

aten = torch.ops.aten
INF = math.inf


@dataclass(frozen=True)
class Comm:
    """One collective the plan inserts: ``kind`` applied to ``tensor`` (a node name)."""

    kind: str            # f, g, all_gather, scatter, reduce_scatter, reshard, all_to_all
    tensor: str
    src: Placement
    dst: Placement
    consumer: str        # the first op that needed it
    full_bytes: int      # size of the whole tensor at the planning workload
    fwd_bytes: float     # bytes each rank sends, forward
    bwd_bytes: float     # ... and backward
    seconds: float       # forward + backward


@dataclass
class Propagation:
    tp: int
    placements: dict[fx.Node, Any]
    chosen: dict[fx.Node, Strategy]
    params: dict[str, Placement]                 # placeholder name -> resolved placement
    conversions: dict[tuple, str]                # (node, dst, needs_f) -> kind
    comms: list[Comm]
    compute_s: float
    comm_s: float
    memory_bytes: float = 0.0      # training state + activations on the largest rank
    activation_bytes: float = 0.0  # ... of which activations kept for backward
    layer_input_bytes: float = 0.0  # ... of which layers' inputs activation checkpointing keeps
    update_s: float = 0.0          # ... of compute_s: the optimizer step on the parameters held
    infeasible: str | None = None
    pending: tuple | None = None   # (op, number of strategies): where an exploring walk stopped
    #: op name -> the index of the strategy it took among those its inputs' placements offered it
    #: (what ``forced`` gives): the walk replayed elsewhere from names alone (a plan sent to
    #: another rank, :class:`autotp.planner.planner.Decided`)
    picked: dict[str, int] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return INF if self.infeasible else self.compute_s + self.comm_s


def _hinted_symbols(hints: Mapping[str, int | str], env: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
    """Values for the shape symbols that are not input dims (``Capture.symbol_hints``): one
    export replaced by an expression of the dims is that expression at the workload ``env``;
    the others keep their example value."""
    names = {str(sym): sym for sym in env}
    out: dict[sympy.Symbol, int] = {}
    for name, hint in hints.items():
        sym = sympy.Symbol(name, integer=True, positive=True)
        if sym in env:
            continue
        if isinstance(hint, str):
            try:
                expr = sympy.sympify(hint, locals=names)
                value = expr.subs(env)
            except (sympy.SympifyError, TypeError, ValueError):
                continue
            if not value.free_symbols and value.is_number and value > 0:
                out[sym] = int(value)
        elif hint > 0:
            out[sym] = hint
    return out


def dispatch_allows(info: OpInfo, strategy: Strategy, dispatch: bool) -> bool:
    """Whether ``strategy`` keeps to ``dispatch`` (:attr:`GraphIndex.expert_dispatch`): False
    offers no strategy that sends rows of the tokens' ranks (``Routed(tokens=True)``) to their
    experts' ranks (the all-to-all dispatch: a product whose rows arrive as token rows and leave as
    its experts' rows), so the experts' rows are cut from the tokens gathered whole; the router,
    its softmax and top-k may still run on each rank's own tokens, their ids and weights then
    all-gathered (Megatron's all-gather dispatcher), where that is cheaper. True offers the ops
    reading the (token, expert) rows gathered for a grouped product (the product and the casts
    before it, ``OpInfo.x_gathered``) no routed output but from token rows: whole experts per rank
    take their rows by the all-to-all alone (expert-TP and replicated experts stay offered)."""
    def tokens(p: Any) -> bool:
        return isinstance(p, Routed) and p.tokens

    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    if dispatch is False:
        return not (any(tokens(p) for p in strategy.inputs)
                    and any(isinstance(p, Routed) and not p.tokens for p in outs))
    if not info.x_gathered or not any(isinstance(p, Routed) for p in outs):
        return True
    return bool(strategy.inputs) and tokens(strategy.inputs[0])


@dataclass
class GraphIndex:
    """What propagation needs of a graph, computed once per (capture, tp)."""

    capture: Capture
    tp: int
    env: Mapping[sympy.Symbol, int]
    infos: dict[fx.Node, OpInfo] = field(default_factory=dict)
    tensor_inputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    uneven: bool = False
    sharded_outputs: frozenset = frozenset()   # output leaf positions returned split, not gathered
    #: the nodes that may carry a gradient (:func:`grad_nodes`); f is paid on those alone
    grads: frozenset = frozenset()
    #: user input placeholder -> its placement on the ranks (default: whole on every rank); a
    #: generation step's KV cache comes in split by head, as the step before returned it
    input_placements: Mapping[str, Placement] = field(default_factory=dict)
    #: sequence parallelism forced (``sequence_parallel=True``, at tp > 1 with ``uneven``): see
    #: :meth:`build`. Set where the program has no sequence to split too, so that the planner
    #: can say so (a PlanError naming it) instead of planning by cost unsaid
    force_sequence: bool = False
    #: the sizes of the sequence dims a fresh shard may split: their symbols, or the lengths a
    #: program holds as numbers (``Capture.static_lengths``); empty where sequence parallelism is
    #: not offered (:func:`~.rules.contract.along_sequence`)
    sequence: frozenset = frozenset()
    #: which unaligned products the rewrite pads (:class:`~autotp.cost_model.alignment.Align`;
    #: None: none), priced as they will run
    align: Any = None
    #: parameters and the views of them (``numpy_T``, ``t``, ``view``: ops returning an alias of
    #: their first argument): a sharded one is never gathered at run time (:meth:`moves_parameter`)
    param_views: frozenset = frozenset()
    #: ops that write their first argument's storage in place, directly or through views of it,
    #: where the tensor is read after the write: that argument is never converted (:meth:`moves_written`)
    written_first: frozenset = frozenset()
    #: the tensors those ops write (each view chain's first tensor)
    written_roots: frozenset = frozenset()
    #: may a strategy read a value on the host (``host_reads=False`` forbids it): a rank running
    #: its own experts' rows alone reads how many are its own, so none of those is offered
    #: (:func:`~.rules.row_reads.reads_host`); rows whose row map the shapes give (a merge of the
    #: batch with a split dim in its order, ``Routed(tokens=True)``) read nothing and stay
    host_reads: bool = True
    #: how expert parallelism's rows reach their experts where the tokens arrive split along the
    #: sequence: None, by cost; True, by the all-to-all dispatch alone (whole experts per rank
    #: never read rows cut from the tokens gathered whole); False, never by it (no strategy holds
    #: the tokens as rows of their own ranks: they are gathered whole). See :func:`dispatch_allows`
    expert_dispatch: bool | None = None
    #: how the planner made this index's capture from the one it was given (what another rank
    #: rebuilds the plan from, :class:`autotp.planner.planner.Decided`): the sibling products' sets
    #: it kept apart (None: it looked for none) and the row scales it moved to their products' inputs
    apart: frozenset | None = None
    moved_scales: tuple = ()
    #: bias adds that may be added inside their product (:func:`.fused_bias.bias_add`)
    bias_adds: frozenset = frozenset()
    #: the float dtype the model trains in (:func:`training_dtype`): a collective of a float of
    #: another dtype, a conversion or one an op runs inside itself (``Strategy.internal``: the
    #: vocabulary-parallel loss's float32 sums in a bf16 model), is priced at that dtype's own
    #: bytes (:func:`moved_bytes`)
    train_dtype: Any = None
    #: the router's load the MoE layers are priced at (an ``autotp.planner.expert_load.ExpertLoad``,
    #: set with each op's ``OpInfo.expert_share`` by ``apply_load``); None: a balanced router
    expert_load: Any = None
    #: activation checkpointing priced (:func:`autotp.passes.checkpoint.price_recomputation`): each
    #: op of a repeated layer -> the share of its kept activations that counts (1 / the layers: one
    #: layer's are held at a time, while backward recomputes it), its forward run twice; and the
    #: tensors checkpoint keeps instead (the storage roots of what a layer reads that it did not
    #: make, each counted whole at the op that makes it)
    recomputed: Mapping[fx.Node, float] = field(default_factory=dict)
    layer_inputs: frozenset = frozenset()
    #: ... and the tensors whose conversions run again in the recomputation, their forward
    #: collectives re-run (a g's all-reduce, an all-gather): those whose first reader is an op of
    #: a repeated layer, the layer the rewrite's communication nodes join
    #: (:func:`autotp.passes.checkpoint.checkpoint_layers`)
    converted_again: frozenset = frozenset()
    _strategies: dict = field(default_factory=dict)
    #: (op, its inputs' placements) -> the rule's strategies before this index's filters: a pure
    #: function of the op and the placements, so an index copied with other filters
    #: (``dataclasses.replace(index, expert_dispatch=..., _strategies={})``: the planner's notes
    #: solve again the other way) shares it and never calls a rule twice for one input
    _rules: dict = field(default_factory=dict)
    _compute: dict = field(default_factory=dict)
    _activation: dict = field(default_factory=dict)
    _conversion_cost: dict = field(default_factory=dict)

    def strategies(self, node: fx.Node, actual: tuple) -> list[Strategy]:
        key = (node, actual)
        found = self._strategies.get(key)
        if found is None:
            found = self._rules.get(key)
            if found is None:
                found = self._rules[key] = strategies(self.infos[node], actual)
            if not self.host_reads:
                found = [s for s in found if not reads_host(self.infos[node], s)]
            if self.expert_dispatch is not None:
                found = [s for s in found if dispatch_allows(self.infos[node], s, self.expert_dispatch)]
            if node in self.bias_adds:
                found = [self._fused(node, s, actual) for s in found]
            self._strategies[key] = found
        return found

    def _fused(self, node: fx.Node, strat: Strategy, actual: tuple) -> Strategy:
        """``strat`` marked ``fused`` where it takes the product as made (no conversion, no f):
        the rewrite then adds the bias inside the product (:mod:`.fused_bias`)."""
        x = self.tensor_inputs[node][0]
        f = wants_f(strat.inputs[0], _sharded_compute(strat), self.infos[node].inputs[0], x in self.grads)
        return replace(strat, fused=True) if takes_as_made(strat, actual, f) else strat

    def compute_time(self, node: fx.Node, strat: Strategy, profile: DeviceProfile) -> float:
        info = self.infos[node]
        twice = node in self.recomputed
        key = (info.cost_key, strat, profile, twice)   # equal across layers
        found = self._compute.get(key)
        if found is None:
            if gathers_rows(strat):   # a rank's own tokens' rows, before the all-gather inside
                info, strat = rank_rows_work(info, strat)
            found = compute_time(info, strat, self.env, profile, self.tp, self.align)
            if twice and info.grad_inputs:   # its forward again, in backward (no gradient of its own)
                found += compute_time(info.forward_only(), strat, self.env, profile, self.tp, self.align)
            self._compute[key] = found
        return found

    def _kept_items(self, node: fx.Node, profile: DeviceProfile) -> tuple:
        inputs = self.tensor_inputs[node]
        return kept(self.infos[node], tuple(i in self.grads for i in inputs), profile.dropout_mask_bytes)

    def _keepers(self, profile: DeviceProfile) -> tuple[dict, dict]:
        """(storage root -> the ops whose backward keeps it, op -> the roots it makes that are kept:
        itself or the ``getitem`` of one of its outputs), through views (:func:`kept_root`)."""
        key = ("keepers", profile)
        found = self._activation.get(key)
        if found is None:
            keepers: dict = {}
            for node in self.capture.graph.nodes:
                if node.op != "call_function" or node not in self.infos:
                    continue
                for item in self._kept_items(node, profile):
                    if item.source == "output":
                        keepers.setdefault(node, set()).add(node)
                    elif item.source == "input":
                        keepers.setdefault(kept_root(self.tensor_inputs[node][item.index]), set()).add(node)
            made: dict = {}
            for root in keepers:
                maker = root.args[0] if root.target is operator.getitem else root
                if root.op == "call_function" and maker in self.infos:
                    made.setdefault(maker, []).append(root)
            found = self._activation[key] = (keepers, made)
        return found

    def activation_bytes(self, node: fx.Node, strat: Strategy, profile: DeviceProfile,
                         converted: frozenset = frozenset()) -> float:
        """Bytes ``node`` adds to what autograd keeps for backward, on the largest rank, so that
        each storage is counted once (autograd keeps a tensor once, however many ops keep it):

        - a tensor several ops keep (a norm's input, kept by its statistic and by its scaling;
          the product that attention's ``v`` and ... view; rotary's cos and sin, kept in every
          layer) at the op that makes it, at the placement ``strat`` gives it;
        - a tensor one op keeps at that op: whole where it arrives as made (a view keeps its
          whole storage: attention keeping ``v``, a third of the fused q/k/v product, keeps all
          of it), or the copy it reads where it arrives converted (``converted``: the positions
          of those inputs; the all-gathered input of a product under sequence parallelism);
        - the tensors it makes for its backward alone (statistics, masks, the loss's log-softmax).

        A parameter is never counted (training state). The solver (per op) and the walk pricing
        a plan (:func:`propagate`) add the same figures. Not seen: a tensor several ops keep is
        counted as made even where they all read it converted (then the copy is counted too)."""
        return self._activation_parts(node, strat, profile, converted)[0]

    def _activation_parts(self, node: fx.Node, strat: Strategy, profile: DeviceProfile,
                          converted: frozenset) -> tuple[float, float]:
        """(:meth:`activation_bytes`, of it what ``node`` makes that activation checkpointing keeps as
        a layer's input: ``layer_inputs``, whole, once each; 0 without it) of ``node``. The second
        does not depend on ``converted``; the walk (:func:`propagate`) sums it into
        ``Propagation.layer_input_bytes``."""
        key = (node, strat, profile, converted)
        found = self._activation.get(key)
        if found is not None:
            return found
        info = self.infos[node]
        env, tp = self.env, self.tp
        keepers, made = self._keepers(profile)
        total = kept_inputs = 0.0
        outs = info.output if isinstance(info.output, tuple) else (info.output,)
        for root in made.get(node, ()):
            if root not in self.layer_inputs and (len(keepers[root]) > 1 or node in keepers[root]):
                i = root.args[1] if root is not node else 0
                if i < len(outs) and outs[i] is not None:
                    total += kept_bytes(Kept("output", i), info, strat, env, profile, tp)
        for root in self.layer_inputs & self._made_roots(node):   # kept by checkpoint, whole
            i = root.args[1] if root is not node else 0
            if i < len(outs) and outs[i] is not None:
                kept_inputs += kept_bytes(Kept("output", i), info, strat, env, profile, tp)
        inputs = self.tensor_inputs[node]
        counted: set = set()
        for item in self._kept_items(node, profile):
            if item.source == "new":
                total += kept_bytes(item, info, strat, env, profile, tp)
            if item.source != "input":
                continue
            tensor = inputs[item.index]
            root = kept_root(tensor)
            if root.op == "placeholder" and root.name in self.capture.param_names:
                continue   # training state
            maker = root.args[0] if root.target is operator.getitem else root
            made_here = root.op == "call_function" and maker in self.infos
            if made_here and (len(keepers.get(root, ())) > 1 or root in self.layer_inputs):
                continue   # counted where it is made
            if item.index in converted:
                if tensor not in counted:
                    counted.add(tensor)
                    total += kept_bytes(item, info, strat, env, profile, tp)
            elif root not in counted:
                counted.add(root)
                total += kept_bytes(item, info, strat, env, profile, tp, _meta(root))
        found = self._activation[key] = (total * self.recomputed.get(node, 1.0) + kept_inputs, kept_inputs)
        return found

    def _made_roots(self, node: fx.Node) -> set:
        """The storage roots ``node`` makes: itself, or the ``getitem`` nodes of its outputs."""
        return {node} | {u for u in node.users if u.target is operator.getitem}

    @classmethod
    def build(cls, capture: Capture, tp: int, batch: int, seq: int, uneven: bool = False,
              sharded_outputs: frozenset = frozenset(), sequence_parallel: bool = False,
              input_placements: Mapping[str, Placement] | None = None,
              force_sequence: bool = False, align: Any = None, host_reads: bool = True) -> "GraphIndex":
        """``sequence_parallel``: rules may split the sequence dim afresh (a reduce-scatter along
        s where a Partial meets an add, a dropout or a cast); needs ``uneven``, since lengths are
        known at run time. ``force_sequence``: where they may, they must (a Partial meeting an
        elementwise op along the sequence is reduce-scattered, never all-reduced whole)."""
        env = {}
        for sym, role in capture.dim_symbols.items():
            env[sympy.Symbol(sym, integer=True, positive=True)] = batch if role == "batch" else seq
        env.update(_hinted_symbols(getattr(capture, "symbol_hints", {}), env))
        index = cls(capture, tp, env, uneven=uneven, sharded_outputs=frozenset(sharded_outputs),
                    input_placements=dict(input_placements or {}), grads=grad_nodes(capture))
        sequence = frozenset(sym for sym in env if sequence_parallel and capture.dim_symbols.get(sym.name) == "seq")
        if sequence_parallel and not sequence:
            # a length export fixed (a loop over the sequence) is still a sequence: its dim may be split
            sequence = frozenset(sympy.Integer(n) for n in capture.static_lengths)
        index.sequence = sequence
        index.force_sequence = force_sequence and sequence_parallel
        index.align = align
        index.host_reads = host_reads
        constant = _constants(capture)
        train_dtype = index.train_dtype = training_dtype(capture)
        contiguous: dict[fx.Node, bool] = {}
        for node in capture.graph.nodes:
            contiguous[node] = _contiguous(node, contiguous)
            if node.op == "call_function" and node.target is not operator.getitem:
                info, inputs = _op_info(node, tp, uneven, capture.param_names, constant)
                index.infos[node], index.tensor_inputs[node] = info, inputs
                info.sequence = sequence
                info.force_sequence = force_sequence and bool(sequence)
                info.train_dtype = train_dtype
                info.grad_inputs = tuple(i in index.grads for i in inputs)
                info.grad_uses = _grad_uses(node, index.grads)
                info.strided_inputs = tuple(not contiguous.get(i, True) for i in inputs)
        for node, info in list(index.infos.items()):
            if info.gathers_expert_rows:   # rows its reader's routed strategies alone can take
                chain, product = grouped_reader(node)
                for reader in (*chain, product):
                    index.infos[reader].x_gathered = True
        index.bias_adds = frozenset(n for n in index.infos if bias_add(n, capture.param_names))
        index.param_views = _param_views(capture)
        index.written_first = written_in_place(capture.graph)
        index.written_roots = frozenset(storage_root(n) for n in index.written_first)
        return index

    def moves_parameter(self, node: fx.Node, have: Any, want: Any, meta: TensorMeta) -> bool:
        """Whether converting ``node`` from ``have`` to ``want`` moves a parameter at run time,
        which the solver never chooses: any change of a parameter's own placement (it is sharded
        at load), or a gather of a view of a sharded one (a row-parallel weight read through its
        transpose, Falcon's ``x @ w.T``: gathered, its pin would hold in name only and the product
        run whole), or any change of a join of parameters (sibling products fused: placed where it
        is made, as :func:`propagate` holds it; at tp 1 a whole join sliced to a product's blocks
        did not replay). Slicing a replicated parameter's view is local and allowed."""
        if node not in self.param_views or same_placement(have, want, _dim_size(meta, want), self.tp):
            return False
        return (node.name in self.capture.param_names or node.target is aten.cat.default
                or not isinstance(have, Replicate))

    def moves_written(self, node: fx.Node, position: int, have: Any, want: Any, meta: TensorMeta) -> bool:
        """Whether converting input ``position`` of ``node`` from ``have`` to ``want`` would leave an
        in-place write in a copy: ``node`` writes its first argument (``copy_`` into a slice of a
        tensor, ``masked_fill_``), or is a view written later, and the tensor is read after the write
        (Gated DeltaNet's chunk loop: ``attn[..., i, :i] = ...``, each row read by the next). A
        conversion is a tensor of its own (a collective's output, which autograd also refuses to
        write through a view): the write would miss the tensor the later reads take. The solver
        never chooses it; the written tensor is placed as its writer wants where it is made."""
        return (position == 0 and node in self.written_first
                and not same_placement(have, want, _dim_size(meta, want), self.tp))

    def writes_keep(self, root: fx.Node, placed: Any) -> bool:
        """Whether every in-place write through a view of ``root`` (:attr:`written_first`) can
        land in it placed ``placed``: each view on the way keeps it with no conversion (its first
        such strategy, as the op-by-op walk takes it), and each write is a ``copy_``, which takes
        its destination's placement whatever its source's (Gated DeltaNet's decode step writes
        each token's output so into ``core_attn_out[:, :, i]`` of a ``zeros_like`` split by head)."""
        if isinstance(placed, tuple):
            return False
        todo = [(root, placed)]
        while todo:
            node, have = todo.pop()
            for user in node.users:
                if user not in self.written_first or not user.args or user.args[0] is not node:
                    continue
                if mutates_first(user.target):
                    if user.target is not torch.ops.aten.copy_.default:
                        return False
                    continue
                if len(self.tensor_inputs[user]) != 1:
                    return False
                kept = next((s for s in self.strategies(user, (have,)) if s.inputs[0] == have), None)
                if kept is None or isinstance(kept.output, tuple):
                    return False
                todo.append((user, kept.output))
        return True

    def numel_env(self) -> Mapping:
        return self.env

    def keeps_split(self, position: int, node: fx.Node, have: Any) -> bool:
        """Output leaf ``position`` (the value of ``node``, placed ``have``) is returned split, not
        gathered: the caller asked for it (:attr:`sharded_outputs`, vocab-sharded logits) and it
        is split on a static dim, whose whole size the returned DTensor can state. An output
        split along a dynamic dim (logits along the sequence, under sequence parallelism) is
        gathered: its whole size differs from call to call."""
        if position not in self.sharded_outputs or not isinstance(have, Shard):
            return False
        meta = _meta(node)
        return meta is not None and meta.static(have.dim) is not None


def _param_views(capture: Capture) -> frozenset:
    """The parameters and the nodes that are views of one, through any chain of views, and
    parameters joined for one product (sibling products fused, autotp/passes/products.py): split,
    a join is its weights' shards, which a gather would turn into a weight moved each step."""
    found: set[fx.Node] = set()
    for node in capture.graph.nodes:
        if node.op == "placeholder" and node.name in capture.param_names:
            found.add(node)
        elif (node.op == "call_function" and node.args and node.args[0] in found
              and aliases_first(node.target)):
            found.add(node)
        elif node.op == "call_function" and _joined_weight_reader(node, capture.param_names) is not None:
            found.add(node)
    return frozenset(found)


def first_write(node: fx.Node) -> fx.Node | None:
    """The first in-place op that writes ``node``'s output, directly or through views of it."""
    writes = []
    for user in node.users:
        if user.op == "call_function" and user.args and user.args[0] is node:
            if mutates_first(user.target):
                writes.append(user)
            elif aliases_first(user.target) and (inner := first_write(user)) is not None:
                writes.append(inner)
    order = {n: i for i, n in enumerate(node.graph.nodes)} if len(writes) > 1 else None
    return min(writes, key=order.__getitem__) if order else (writes[0] if writes else None)


def _aliasing(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(node.args) and (aliases_first(node.target) or
                                                             mutates_first(node.target))


def storage_root(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` views or writes (itself where it is no view)."""
    while _aliasing(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def written_in_place(graph: fx.Graph) -> frozenset:
    """The ops whose first argument must not be converted (:meth:`GraphIndex.moves_written`): an
    in-place op writing through a view (``copy_`` into ``attn[..., i, :i]``) and the views between
    it and the tensor viewed, where that tensor (or a view of it not made from the write) is read
    after the write. An in-place op on a tensor itself needs none: capture hands its later readers
    the op's output, which the rewrite makes the written copy."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    found: set[fx.Node] = set()
    for write in graph.nodes:
        if not (_aliasing(write) and mutates_first(write.target) and isinstance(write.args[0], fx.Node)):
            continue
        chain, node = [write], write.args[0]
        while _aliasing(node) and isinstance(node.args[0], fx.Node):
            chain.append(node)
            node = node.args[0]
        if len(chain) == 1:   # written itself, not through a view
            continue
        made_after = _aliases_of(write)
        if any(order[u] > order[write] and u not in made_after
               for member in _aliases_of(node) - made_after for u in member.users):
            found.update(chain)
    return frozenset(found)


def _aliases_of(node: fx.Node) -> set[fx.Node]:
    """``node`` and every view or in-place op over its storage made from it."""
    seen, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen and _aliasing(user) and user.args[0] in seen:
                seen.add(user)
                todo.append(user)
    return seen


def training_dtype(capture: Capture) -> torch.dtype | None:
    """The float dtype most of the model's parameters hold: the dtype it trains in."""
    counts: dict[torch.dtype, int] = {}
    for node in capture.graph.nodes:
        if node.op == "placeholder" and node.name in capture.param_names:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                counts[val.dtype] = counts.get(val.dtype, 0) + val.numel()
    return max(counts, key=counts.get) if counts else None


_STRIDING_VIEWS = frozenset({aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
                             aten.numpy_T.default, aten.broadcast_to.default, aten.diagonal.default})
_KEEPING_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
                            aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.alias.default,
                            aten.detach.default, aten.flatten.using_ints, aten.unflatten.int})


def _contiguous(node: fx.Node, known: Mapping[fx.Node, bool]) -> bool:
    """Is ``node``'s value laid out densely in order? Views that reorder or broadcast make a
    strided tensor, a slice of an inner dim too; views that only regroup keep their input's
    layout; every computed tensor is dense (a reshape of a strided one copies)."""
    if node.op != "call_function":
        return True
    if node.target in _STRIDING_VIEWS:
        return False
    if node.target in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
        dim = node.args[1] if len(node.args) > 1 else 0
        src = node.args[0]
        first = all(s == 1 for s in (shape_of(src) or ())[:dim]) if isinstance(src, fx.Node) and isinstance(dim, int) \
            and dim >= 0 else False
        return (dim == 0 or first) and known.get(src, True)
    if node.target in _KEEPING_VIEWS or node.target is operator.getitem:
        src = node.args[0]
        return known.get(src, True) if isinstance(src, fx.Node) else True
    return True


def _grad_uses(node: fx.Node, grads: frozenset) -> int:
    """How many uses of ``node`` send a gradient back into it (autograd sums them)."""
    if node not in grads:
        return 0
    if isinstance(node.meta.get("val"), (list, tuple)):
        # pieces (a split's): each its own gradient, joined by the op's backward, never summed
        return 1
    return sum(1 for user in node.users if user in grads)


def _meta(node: fx.Node) -> TensorMeta | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        memo = node.meta.get("autotp_meta")   # (val, meta): the meta of this very value
        if memo is not None and memo[0] is val:
            return memo[1]
        meta = TensorMeta(shape_of(node), val.dtype)
        node.meta["autotp_meta"] = (val, meta)
        return meta
    return None


def _out_meta(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _meta(node)
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        from ..capture import to_sympy

        return tuple(TensorMeta(tuple(to_sympy(d) for d in v.shape), v.dtype) for v in val)
    return None


def map_args(fn: Any, node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s args and kwargs with ``fn`` applied to every leaf, in pytree order (tuples,
    lists and dicts rebuilt as plain ones): pytree.tree_map's result at a fifth of its cost,
    for the few container types an ATen call's arguments hold."""
    def walk(a: Any) -> Any:
        if type(a) is tuple or isinstance(a, list):
            out = [walk(x) for x in a]
            return tuple(out) if type(a) is tuple else out
        if isinstance(a, dict):
            return {k: walk(v) for k, v in a.items()}
        return fn(a)

    return tuple(walk(a) for a in node.args), {k: walk(v) for k, v in node.kwargs.items()}


def _layer_index(fqn: str) -> int:
    match = re.search(r"\.(\d+)\.", fqn)
    return int(match.group(1)) if match else 0


def _constants(capture: Capture):
    """node -> the value of the lifted constant it reads (through ``lift_fresh_copy`` and
    ``detach_``), or None."""
    def value(node: Any) -> torch.Tensor | None:
        while isinstance(node, fx.Node) and node.target in (aten.lift_fresh_copy.default, aten.detach_.default,
                                                             aten.detach.default):
            node = node.args[0]
        if not isinstance(node, fx.Node) or node.op != "placeholder" or node.name not in capture.constant_names:
            return None
        found = capture.constants.get(capture.constant_names[node.name])
        return found if isinstance(found, torch.Tensor) and found.device.type != "meta" else None

    return value


def _op_info(node: fx.Node, tp: int, uneven: bool, param_names: Mapping[str, str],
             constant: Any = None) -> tuple[OpInfo, list[fx.Node]]:
    inputs: list[fx.Node] = []
    metas: list[TensorMeta] = []

    def swap(a: Any) -> Any:
        if isinstance(a, fx.Node):
            m = _meta(a)
            if m is not None:
                inputs.append(a)
                metas.append(m)
                return m
        return a

    args, kwargs = map_args(swap, node)
    info = OpInfo(node.target, tuple(args), kwargs, tuple(metas), _out_meta(node), tp, uneven=uneven)
    if node.target in (aten.numpy_T.default, aten.t.default) and isinstance(info.output, TensorMeta) \
            and info.output.ndim == 2:
        # A transposed weight (Falcon's ``x @ weight.T``): the product's column hint names the
        # blocks of this transpose's dim 1, its output features.
        users = [u for u in node.users if u.target in (aten.mm.default, aten.matmul.default)
                 and len(u.args) > 1 and u.args[1] is node]
        if users and isinstance(_out_meta(users[0]), TensorMeta):
            rotate = _layer_index(param_names.get(getattr(node.args[0], "name", ""), ""))
            c, u, t, sizes, whole = column_hint(users[0], _out_meta(users[0]).ndim - 1, tp, uneven, constant)
            info.hints[1] = (c, u, rotate, t, False, sizes, whole)
            # dim 0 holds the contracted features: a row-parallel product finds them in whole heads
            x = users[0].args[0]
            if isinstance(x, fx.Node) and shape_of(x) is not None:
                c, u = row_hint(x, len(shape_of(x)) - 1, tp, uneven)
                info.hints[0] = (c, u, rotate, 0, c > 1)   # blocks only from groups of heads
    if node.target in (aten.mm.default, aten.linear.default, aten.embedding.default, aten.bmm.default,
                       aten.matmul.default) or op_name(node.target) in GROUPED_MM:
        out = info.output
        if isinstance(out, TensorMeta):
            # Layers rotate which rank takes an uneven split's extra head, so that parameter
            # memory evens out across ranks over the depth of the model.
            weight = node.args[1] if node.target is not aten.embedding.default else node.args[0]
            if isinstance(weight, fx.Node) and weight.target in (aten.numpy_T.default, aten.t.default):
                weight = weight.args[0]   # the transpose's hint rotates by the same layer
            rotate = _layer_index(param_names.get(getattr(weight, "name", ""), ""))
            c, u, t, sizes, whole = column_hint(node, out.ndim - 1, tp, uneven, constant)
            info.hints[out.ndim - 1] = (c, u, rotate, t, False, sizes, whole)
            x = node.args[0]
            if node.target in (aten.mm.default, aten.linear.default, aten.matmul.default) \
                    and isinstance(x, fx.Node) and shape_of(x) is not None:
                # x's contracted features: a row-parallel product that splits them afresh (its
                # weight free, x converted) finds them in whole heads, as Falcon's transpose does
                k = len(shape_of(x)) - 1
                c, u = row_hint(x, k, tp, uneven)
                info.input_hints[(0, k)] = (c, u, rotate, 0, c > 1)   # blocks only from groups of heads
    if node.target is aten.cat.default and isinstance(info.output, TensorMeta):
        # weights joined for one product (sibling products fused, autotp/passes/products.py):
        # the joined dim splits as the product's output is read, each weight its blocks
        reader = _joined_weight_reader(node, param_names)
        if reader is not None:
            weight = node.args[0][0]
            rotate = _layer_index(param_names.get(weight.name, ""))
            c, u, t, sizes, whole = column_hint(reader, _out_meta(reader).ndim - 1, tp, uneven, constant)
            info.hints[0] = (c, u, rotate, t, False, sizes, whole)
    if mutates_first(node.target):
        info.writes_alone = _written_alone(node)
    if node.target is aten.index.Tensor:
        info.picks = index_picks(node, constant)
        info.counted_pick = counted_pick(node)
        reader = grouped_reader(node)
        info.gathers_expert_rows = reader is not None
        if reader is not None:   # the product's experts and offs: what its dispatch is planned from
            info.routing_experts, info.offs_bytes = _product_experts(reader[1])
        info.permutes_rows = permutes_rows(node)
        info.row_copies = row_copies(node)
    if (node.target in SORTS or node.target in (aten.argsort.default, aten.argsort.stable)) and node.args:
        info.routing_experts = router_experts(node.args[0]) or 0
    if node.target in SORTS or node.target in INVERTERS:
        info.inverts = makes_inverse(node)
    elif node.target in (aten.histc.default, aten.bincount.default) and node.args:
        info.routing_experts = sorted_ids_experts(node.args[0]) or 0
    info.reads_rows = reads_rows(node)
    stack = node.args[0] if node.args else None
    if node.target in (aten.transpose.int, aten.index.Tensor) and getattr(stack, "op", None) == "placeholder" \
            and stack.name in param_names and isinstance(info.output, TensorMeta) and info.output.ndim >= 3 \
            and len(shape_of(stack) or ()) == 3:
        # a stack of experts' matrices, transposed or picked per row: a fresh split of a matrix
        # dim (expert tensor parallelism) takes its blocks from how the product's output is read
        rotate = _layer_index(param_names.get(stack.name, ""))
        for d in range(1, info.output.ndim):
            c, u, t, sizes, whole = column_hint(node, d, tp, uneven, constant)
            info.hints[d] = (c, u, rotate, t, False, sizes, whole)
    return info, inputs


def _joined_weight_reader(node: fx.Node, param_names: Mapping[str, str]) -> fx.Node | None:
    """The op whose output's last dim ``node`` joins, where ``node`` joins parameters along dim 0
    for one product (sibling products fused, autotp/passes/products.py): their 2-D weights
    (``cat([Wq, Wk, Wv])``) read by that ``linear`` alone, or their biases read by the ``add``
    of that product alone; else None."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    parts = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim != 0 or not isinstance(parts, (list, tuple)) or len(parts) < 2 or len(node.users) != 1:
        return None
    ndims = {len(shape_of(p) or ()) if isinstance(p, fx.Node) else -1 for p in parts}
    if not all(isinstance(p, fx.Node) and p.op == "placeholder" and p.name in param_names for p in parts) \
            or ndims not in ({1}, {2}):
        return None
    reader = next(iter(node.users))
    if not isinstance(_out_meta(reader), TensorMeta) or len(reader.args) < 2 or reader.args[1] is not node:
        return None
    if ndims == {2} and reader.target is aten.linear.default:
        return reader
    product = reader.args[0]
    if ndims == {1} and reader.target is aten.add.Tensor and isinstance(product, fx.Node) \
            and product.target is aten.linear.default:
        return reader
    return None


def _written_alone(node: fx.Node) -> bool:
    """Whether ``node`` (an in-place op) writes a tensor that nothing else reads: computed by an
    op that makes a tensor of its own (not a view nor an in-place op, whose output is another's
    storage; not a program input, which the caller sees), used by ``node`` alone. A conversion of
    it for ``node`` then loses no update: what is read after is ``node``'s own output."""
    dest = node.args[0] if node.args else None
    return (isinstance(dest, fx.Node) and dest.op == "call_function" and len(dest.users) == 1
            and dest.target is not operator.getitem   # a piece of a split: a view
            and not aliases_first(dest.target) and not mutates_first(dest.target))


def _conversion(src: Any, dst: Placement, size: int | None, tp: int) -> str | None:
    """The collective that turns ``src`` into ``dst`` (None: nothing to do; 'inf': impossible)."""
    if any(isinstance(p, Routed) and p.own for p in (src, dst)):
        # a rank's rows routed alone (index values local positions): nothing converts them
        return None if src == dst else "inf"
    if isinstance(src, ReplicatePartialGrad):
        # whole already; its gradient a summand, which only the f it stands for may sum
        # (:func:`copied_seconds`): read as Replicate by sharded compute, never split
        return None if isinstance(dst, (Replicate, ReplicatePartialGrad)) else "inf"
    if same_placement(src, dst, size, tp) or (isinstance(src, Routed) and dst == PARTIAL):
        return None   # a routed Partial is a Partial as it is
    if sends_back(src, dst):
        return "all_to_all"   # rows the dispatch sent, back to their tokens' ranks (rewrite.send_back)
    if isinstance(src, Routed) and src.tokens and not src.reordered and src.span == 1 and isinstance(dst, Replicate):
        return "all_gather"   # a rank's tokens in sequence order: its run of it, gathered (rewrite.gather_tokens)
    if reduce_scatters_tokens(src, dst):
        # a Partial of flattened tokens into the rank's own: along the sequence of (b, s, ...) (rewrite)
        return "reduce_scatter"
    if scatters_tokens(src, dst):
        return "scatter"   # a whole tensor of flattened tokens sliced to the rank's own (rewrite.slice_tokens)
    if isinstance(dst, Shard) and dst.whole and not dst.tail and isinstance(src, Replicate):
        return "scatter"   # blocks held whole are sliced whole (a conv weight of Mamba2's one B and C)
    if isinstance(dst, Partial) or (isinstance(dst, Shard) and dst.holds_whole):
        return "inf"   # a tail is made whole by the product that computes it, never by a collective
    if any(isinstance(p, Shard) and p.outer >= 0 for p in (src, dst)):
        return "inf"   # blocks on a dim of their own: the collectives move one dim
    if isinstance(src, Partial):
        return "g" if isinstance(dst, Replicate) else "reduce_scatter"
    if isinstance(src, Shard):
        return "all_gather" if isinstance(dst, Replicate) else "reshard"
    return "scatter"


def _sharded_compute(strategy: Strategy) -> bool:
    """Whether the op's replicated float inputs get an f: its output is split or a summand, or
    whole with its gradient a summand (:class:`~autotp.placements.ReplicatePartialGrad`)."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    return any(isinstance(p, (Shard, Partial, ReplicatePartialGrad)) for p in outs)


def copied_seconds(want: Any, f: bool | str, grad: bool) -> float | None:
    """Seconds to read a :class:`~autotp.placements.ReplicatePartialGrad` tensor as ``want``
    with an f or not: nothing where an f is wanted (the f it stands for was made before: its
    summands are what sharded compute sends back) or no gradient flows; impossible otherwise
    (replicated compute sends back a whole gradient from every rank, which that f would count
    tp times), as is any other placement."""
    if isinstance(want, ReplicatePartialGrad) or (isinstance(want, Replicate) and (f is True or not grad)):
        return 0.0
    return INF


def _dim_size(meta: TensorMeta, p: Any) -> int | None:
    return meta.static(p.dim) if isinstance(p, Shard) else None


def load_share(index: "GraphIndex", node: fx.Node | None) -> float | None:
    """The busiest rank's share of the rows of the MoE block ``node`` is computed in, under the
    router's load the plan is priced at (the largest of its ``OpInfo.expert_share``,
    ``planner/expert_load.apply_load``); None at a balanced router or outside an MoE block."""
    info = index.infos.get(node) if node is not None else None
    share = getattr(info, "expert_share", None)
    return max(share) if share else None


def at_load(full: Any, share: float | None, tp: int) -> Any:
    """The bytes an all-to-all of an MoE layer's (token, expert) rows (``full``: all of them) is
    priced at: the rank that receives most sets its time (the dispatch), and the same rank sends
    those rows back (the combine), ``share`` of them (the busiest rank's, :func:`load_share`),
    ``share * tp`` of a balanced router's ``1/tp``; a balanced router's where ``share`` is None."""
    return full if share is None else full * share * tp


def conversion_seconds(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Any,
                       want: Placement, f: bool, grad: bool = True, share: float | None = None) -> float:
    """Forward + backward seconds to turn ``have`` into ``want`` (plus an f); inf if impossible.
    ``grad``: whether a gradient flows back through the tensor (else its backward is free).
    ``share``: the busiest rank's share of the tensor's MoE block's rows (:func:`load_share` of
    the node making it): the reverse all-to-all of rows the dispatch sent (:func:`sends_back`) is
    priced at it (:func:`at_load`), as the dispatch's own all-to-all is (:func:`internal_bytes`)."""
    if isinstance(have, ReplicatePartialGrad):
        return copied_seconds(want, f, grad)
    share = share if sends_back(have, want) else None   # no other conversion moves a rank's experts' rows
    key = (meta, have, want, f, grad, profile, share)
    found = index._conversion_cost.get(key)
    if found is None:
        kind = _conversion(have, want, _dim_size(meta, want) or _dim_size(meta, have), index.tp)
        if scatters_tokens(have, want) and sequence_factors(meta.shape[0], index.sequence) is None:
            kind = "inf"   # rows that are no flattened [batch, sequence]: no run of the sequence to slice
        if kind == "inf":
            found = INF
        else:
            found = 0.0
            full = at_load(moved_bytes(index, profile, meta), share, index.tp)
            for k in conversion_kinds(kind, f):
                fw, bw = collective_time(k, full, profile, index.tp, grad)
                found += fw + bw + layout_copy_seconds(k, meta, have, want, full, profile, index.tp, grad, index, share)
        index._conversion_cost[key] = found
    return found


def read_seconds(kind: str, full: Any, profile: DeviceProfile, tp: int, grad: bool = True) -> Any:
    """Seconds of the memory-bound work of a consumer that reads an ``all_gather_f`` made for
    another (:func:`gather_parts`): its gradient, whole-sized, is added to the gather's (on rank
    0 alone through ``grad_if``, the largest rank's cost); a ``rank_slice`` also copies the rank's
    part out (forward) and pads its gradient back with zeros to the whole size (backward)."""
    moved = 2 * full / tp if kind == "rank_slice" else 0   # the cut: read and write the rank's part
    kernels = 1 if kind == "rank_slice" else 0
    if grad:
        moved += 3 * full   # the add of a whole-sized gradient: two reads, one write
        kernels += 1
        if kind == "rank_slice":
            moved += full + 2 * full / tp   # zeros of the whole size, the rank's part copied in
            kernels += 2
    return moved / profile.bandwidth("elementwise") + kernels * profile.launch_s


def layout_copy_seconds(kind: str, meta: TensorMeta, have: Any, want: Any, full: float, profile: DeviceProfile,
                        tp: int, grad: bool = True, index: "GraphIndex | None" = None,
                        share: float | None = None) -> float:
    """Seconds the rank spends copying a collective's tensor into place, forward and backward:
    backends gather and scatter along dim 0, so a collective along an inner dim with a dim of
    more than one element before it (the hidden of ``(b, s, h)``), or an uneven split, puts
    the whole tensor in order with one copy (read and write) on each side that moves it. An even
    split after at most :data:`~autotp.distributed.gather_scatter.ROWS_COALESCED` leading rows at
    the workload of ``index`` (the sequence of ``(b, s, h)`` at a batch of a few) copies nothing:
    it moves row by row, one collective a row in one coalesced call
    (:func:`~autotp.distributed.gather_scatter._rows_collective`), which NCCL runs as one kernel (its
    grouped collectives aggregated), the one launch and the ring's steps the collective's own price
    counts already (:func:`~autotp.cost_model.symbolic.collective_time`); the same bytes cross the
    links. Without ``index`` the rows are not known and the copy is priced. A read of a shared gather
    (``grad_if``, ``rank_slice``) moves nothing: its copies are :func:`read_seconds`. Rows the
    dispatch sent, sent back (:func:`~.rules.experts.sends_back`, ``full`` at the router's load,
    ``share`` the busiest rank's): the gathers around the reverse all-to-all
    (:func:`dispatched_rows_seconds`)."""
    if kind in ("grad_if", "rank_slice"):
        return read_seconds(kind, full, profile, tp, grad) if tp > 1 else 0.0
    if tp <= 1:
        return 0.0
    if kind == "all_to_all" and isinstance(have, Shard) and isinstance(want, Shard):
        return all_to_all_copy_seconds(meta, have, want, full, profile, tp, grad)
    if kind == "all_to_all" and sends_back(have, want):
        rows = numel_expr(meta.shape[:1])
        if index is not None and not getattr(full, "free_symbols", None):   # priced at the workload, not in b and s
            rows = numel(meta.shape[:1], index.env)
        return dispatched_rows_seconds(full, rows, profile, tp, share, grad, alone=have.alone)
    shard = have if kind in ("all_gather", "all_gather_f", "reshard") else want
    if isinstance(shard, Routed) and shard.tokens and not shard.reordered:
        # a rank's tokens' rows: gathered along the sequence of (b, s, ...), an inner dim, after b rows
        factors = sequence_factors(meta.shape[0], index.sequence) if index is not None else None
        rows = factors[0] if factors is not None else None
        shard, inner = Shard(0), True
    elif not isinstance(shard, Shard):
        return 0.0
    else:
        inner = any(size != 1 for size in meta.shape[:shard.dim])
        rows = numel_expr(meta.shape[:shard.dim])
    size = meta.static(shard.dim)
    uneven = size is not None and not _even(meta, shard, tp)
    if not (inner or uneven):
        return 0.0
    from ..cost_model.symbolic import COLLECTIVES
    from ..distributed.gather_scatter import ROWS_COALESCED

    moved = sum(1 for i, c in enumerate(COLLECTIVES[kind]) if c in ("all_gather", "reduce_scatter")
                and (i == 0 or grad))
    if not uneven and rows is not None and index is not None and evaluate(rows, index.env) <= ROWS_COALESCED:
        return 0.0
    return moved * 2 * full / profile.bandwidth("elementwise")


def all_to_all_copy_seconds(meta: TensorMeta, have: Shard, want: Shard, full: Any, profile: DeviceProfile, tp: int,
                            grad: bool = True) -> Any:
    """Seconds a reshard by all-to-all (:func:`~autotp.distributed.collectives.reshard_tp`) spends
    laying out its blocks, forward and backward (the backward the mirror: the same copies): the
    rank's part (1/tp of the tensor) staged rank-major by the split it is sent as, unless that
    split has only dims of size one before it (a view then), and the blocks received laid out by
    the split they came as, on the same terms, where both splits give each rank one run in rank
    order, even or not (:func:`_ordered`). Other splits, or one dim dealt two ways, are cut and
    put in place run by run: a copy on both sides. Each copy reads and writes the rank's part: on
    the rank holding the most, its part under ``have`` where it is sent (backward: received), its
    part under ``want`` where it is received (backward: sent); run by run, a rank's part of an
    average size (1/tp of the tensor each side), as before the sizes were counted (pricing the
    largest rank's turns Phi-3-medium's tie at tp 8, tests/passes/test_families_plan.py)."""
    def inner(shard: Shard) -> bool:
        return any(size != 1 for size in meta.shape[:shard.dim])

    def part(shard: Shard) -> Any:   # the largest rank's share of the tensor
        size = meta.static(shard.dim)
        return full * max_local_size(size, shard, tp) / size if size else full / tp

    if have.dim == want.dim or not all(_ordered(meta.static(p.dim), p, tp) for p in (have, want)):
        moved = 2 * full / tp
    else:
        moved = int(inner(want)) * part(have) + int(inner(have)) * part(want)
    return (1 + int(grad)) * 2 * moved / profile.bandwidth("elementwise")


def reshard_seconds(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Shard, want: Shard,
                    grad: bool) -> float:
    """Forward + backward seconds of a reshard by one all-to-all: (tp-1)/tp² of the tensor sent
    by each rank each way, where a gather and a cut sends (tp-1)/tp of it, and its copies."""
    full = moved_bytes(index, profile, meta)
    fw, bw = collective_time("all_to_all", full, profile, index.tp, grad)
    return fw + bw + layout_copy_seconds("all_to_all", meta, have, want, full, profile, index.tp, grad)


def _product_experts(product: fx.Node) -> tuple[int, int]:
    """(experts, element size of its ``offs``) of a grouped product (its stack of experts'
    matrices ``[experts, in, out]``, through a transpose); (0, 0) where either is not known."""
    stack = product.args[1] if len(product.args) > 1 else None
    offs = product.args[2] if len(product.args) > 2 else product.kwargs.get("offs")
    stack_val = getattr(stack, "meta", {}).get("val")
    offs_val = getattr(offs, "meta", {}).get("val")
    if not (isinstance(stack_val, torch.Tensor) and isinstance(offs_val, torch.Tensor) and stack_val.ndim == 3
            and isinstance(stack_val.shape[0], int)):
        return 0, 0
    return stack_val.shape[0], offs_val.element_size()


def _experts_may_take_rows(node: fx.Node, place: Mapping[fx.Node, Any]) -> bool:
    """Whether the grouped product that reads the rows ``node`` gathers (``h[idx]``) may run them
    as its experts' own: its stack of experts (through a transpose) free, or split by whole
    experts (``Shard(0)``), as placed so far."""
    from .rules.row_reads import grouped_reader

    found = grouped_reader(node)
    if found is None:
        return True
    stack = found[1].args[1]
    while isinstance(stack, fx.Node) and stack.op == "call_function" and stack.target is torch.ops.aten.transpose.int:
        stack = stack.args[0]
    have = place.get(stack)
    return have is None or have == REPLICATE or (isinstance(have, Shard) and have == Shard(0))


def moved_bytes(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta) -> int:
    """Bytes of the whole tensor ``meta`` at the planning workload as a collective moves it, a
    conversion (f, g, gathers, reduce-scatters, all-to-alls) or an op's own: a float of the dtype
    the model trains in at the profile's ``dtype_bytes``, another float (RMSNorm's float32 squares
    and statistics, a float32 combine of experts, the loss's sums in a bf16 model) and an integer at
    their own size (:func:`~autotp.cost_model.symbolic.element_bytes`)."""
    return nbytes(meta, index.env, profile.dtype_bytes, index.train_dtype)


def internal_seconds(index: "GraphIndex", profile: DeviceProfile, strat: Strategy, node: fx.Node | None = None) -> float:
    """Seconds of the collectives an op runs inside itself (vocab-parallel cross-entropy), and the
    copies that lay their tensors out (:func:`internal_copy_seconds`). An expert dispatch's
    all-to-all under a router's load (``node``'s ``OpInfo.expert_share``) is priced at the busiest
    rank's rows: it receives (and, reversed backward, sends) ``max share`` of them, not ``1/tp``."""
    total = 0.0
    for kind, meta in strat.internal:
        full = internal_bytes(index, profile, kind, meta, node)
        rows = numel(meta.shape[:1], index.env)
        share = load_share(index, node) if kind == "all_to_all" else None
        total += internal_collective_seconds(index, profile, kind, full, node) \
            + internal_copy_seconds(kind, full, profile, rows, index.tp, _width(meta, index.env), table_split(strat),
                                    sends_own_order(strat), share)
    return total


def internal_collective_seconds(index: "GraphIndex", profile: DeviceProfile, kind: str, full: Any,
                                node: fx.Node | None) -> float:
    """Forward + backward seconds of an op's internal collective of ``full`` bytes, its forward
    twice where the op's layer is recomputed in backward (activation checkpointing)."""
    fw, bw = collective_time(kind, full, profile, index.tp)
    return fw + bw + (fw if node is not None and node in index.recomputed else 0.0)


def internal_bytes(index: "GraphIndex", profile: DeviceProfile, kind: str, meta: TensorMeta,
                   node: fx.Node | None) -> float:
    """The bytes an op's internal collective of ``kind`` is priced at: the tensor's
    (:func:`moved_bytes`), an expert dispatch's all-to-all's scaled from a balanced router's
    ``1/tp`` of the rows to the busiest rank's share (``OpInfo.expert_share``)."""
    full = moved_bytes(index, profile, meta)
    return at_load(full, load_share(index, node), index.tp) if kind == "all_to_all" else full


def table_split(strat: Strategy) -> tuple:
    """(rows, columns): the splits of a table read by columns (rules/nn.py), as its localizer
    hands them to ``EmbeddingByColumns``; Megatron's where the strategy reads none."""
    rows, out = strat.inputs[0] if strat.inputs else None, strat.output
    if isinstance(rows, Shard) and isinstance(out, Shard):
        return rows, out.with_dim(1)
    return Shard(0), Shard(1)


def _width(meta: TensorMeta, env: Any) -> int:
    """The size of ``meta``'s dim 1 (a table's width), 1 where it has none or it is not static."""
    try:
        return int(numel(meta.shape[1:2], env))
    except TypeError:
        return 1


def _internal_dst(kind: str, strat: Strategy) -> Any:
    """The placement an op's internal collective leaves its tensor in, as the plan shows it: an
    expert dispatch's rows as the op's output; a table read by columns (rules/nn.py) split by
    columns; a sum all-reduced (or rows all-gathered) whole."""
    if kind == "all_to_all":
        return strat.output
    if kind == "all_to_all_columns":
        return strat.output.with_dim(1)
    return REPLICATE


def table_by_columns_copies(full: Any, rows: Any, tp: int, hidden: int, have: Shard = Shard(0),
                            want: Shard = Shard(1)) -> tuple[Any, int]:
    """(bytes, kernels) of the copies around a row-split table read by columns (rules/nn.py's
    ``all_to_all_columns``, :class:`~autotp.distributed.functional.EmbeddingByColumns`) on the
    rank holding the most rows (``rows``: the vocabulary, split as ``have``; ``hidden``: the
    table's width, split as ``want``; ``full``: the whole table's bytes), as
    ``exchange._all_to_all`` runs them for splits that give each rank one run in rank order:
    forward, the rank's ``[V/tp, h]`` rows packed into ``tp`` column blocks, one strided copy per
    width of the hidden's split (one where tp divides the hidden, two where it does not: a hidden
    of 20 on 3 ranks is 7, 7 and 6 columns), the blocks received in rank order taken as the
    ``[V, h/tp]`` table (no copy); backward, the ``[V, h/tp]`` gradient sent as it is, and the
    ``tp`` blocks received joined back into the rank's rows by one copy. Each side reads and
    writes the rank's rows once. Other splits (interleaved, rotated) go run by run: each side
    reads and writes the rank's rows once and its ``[V, h/tp]`` columns once, a kernel a run."""
    if tp <= 1:
        return 0, 0
    rows, hidden = int(rows), int(hidden)
    share = full * max_local_size(rows, have, tp) / rows
    if _ordered(rows, have, tp) and _ordered(hidden, want, tp):
        packs = len(_widths(hidden, want, tp))   # forward; backward joins the blocks by one copy
        return 2 * 2 * share, packs + 1
    columns = full * max_local_size(hidden, want, tp) / hidden
    runs = sum(len(local_ranges(rows, have, tp, r)) + len(local_ranges(hidden, want, tp, r)) for r in range(tp))
    return 2 * 2 * (share + columns), 2 * runs


def _widths(size: int, shard: Shard, tp: int) -> list[int]:
    """The widths of ``shard``'s parts of a dim of ``size`` on ``tp`` ranks, in rank order, each
    run of ranks of one width once (empty parts left out): the strided copies that lay a tensor
    out rank by rank along it (``shards._Split.blocks``)."""
    out: list[int] = []
    for r in range(tp):
        n = local_size(size, shard, tp, r)
        if n and (not out or out[-1] != n):
            out.append(n)
    return out


def _ordered(size: Any, shard: Shard, tp: int) -> bool:
    """Whether ``shard`` gives every rank at most one run of a dim of ``size``, the runs in rank
    order tiling it (``shards._Split.ordered``); where the size is known at run time only, a
    plain shard is (the sequence's)."""
    if size is None:
        return shard.chunks == 1 and not (shard.rotate or shard.tail or shard.sizes or shard.per_block)
    stop = 0
    for r in range(tp):
        ranges = local_ranges(size, shard, tp, r)
        if len(ranges) > 1 or (ranges and ranges[0][0] != stop):
            return False
        stop = ranges[0][1] if ranges else stop
    return stop == size


def internal_copy_seconds(kind: str, full: Any, profile: DeviceProfile, rows: Any = 0, tp: int = 1,
                          hidden: int = 1, split: tuple | None = None, alone: bool = False,
                          share: float | None = None) -> Any:
    """Seconds of the work around an internal collective on every rank: the rows of every rank's
    tokens all-gathered (``all_gather_rows``, ``rows`` of them) are put in their sorted order by
    one gather of the whole tensor forward, and the gradient in rank order by one backward (each
    reading its positions and the rows); the order is computed first on every rank from the
    ``rows`` sorted rows' holders (``distributed/gathered_rows.GatherRowsTP``): their holders
    gathered (an int64 each), then laid out rank by rank by a counting pass over the ``tp``
    ranks (:func:`~autotp.cost_model.routing.gathered_rows_layout_work`). The rank's own rows
    before the all-gather are the op's compute (``routing.gathered_rows_work``). A table read
    by columns (``all_to_all_columns``, ``rows`` by ``hidden``, split as ``split``, rows then
    columns, None: Megatron's): :func:`table_by_columns_copies`. An expert dispatch's (or
    combine's) all-to-all of ``rows`` (token, expert) rows, ``full`` their bytes at the router's
    load (:func:`at_load` of ``share``): the rows gathered before it is sent and after it arrives,
    forward and backward (:func:`dispatched_rows_seconds`; ``alone``: the rank's own routing
    ordered its rows, :func:`sends_own_order`)."""
    if kind == "all_to_all":
        return dispatched_rows_seconds(full, rows, profile, tp, share, alone=alone)
    if kind == "all_to_all_columns":
        moved, launches = table_by_columns_copies(full, rows, tp, hidden, *(split or ()))
        return moved / profile.bandwidth("elementwise") + launches * profile.launch_s
    if kind != "all_gather_rows":
        return 0.0
    from ..cost_model.routing import gathered_rows_layout_work

    return _work_seconds(gathered_rows_layout_work(rows, full, tp), profile)


def _work_seconds(work: Any, profile: DeviceProfile) -> Any:
    """Seconds of ``work``'s kernels (an ``OpWork``: bytes per kernel class, launches): an
    expression in b and s for the plan's expressions, else a float (the solver adds it to every
    state's time; a sympy number there turned that into sympy arithmetic, a tenth of a search)."""
    seconds = sympy.sympify(sum(b / profile.bandwidth(cls) for cls, b in work.moved) + work.launches * profile.launch_s)
    return seconds if seconds.free_symbols else float(seconds)


def sends_own_order(strat: Strategy) -> bool:
    """Whether ``strat`` dispatches rows a rank's own routing ordered (``Routed.alone``): they
    leave in the order they lie and come back into it (``expert_routing.local_dispatch_plan``:
    no gather of the rank's own rows on either side of the all-to-all)."""
    x = strat.inputs[0] if strat.inputs else None
    return isinstance(x, Routed) and x.alone


def dispatched_rows_seconds(full: Any, rows: Any, profile: DeviceProfile, tp: int, share: float | None = None,
                            grad: bool = True, alone: bool = False) -> Any:
    """Seconds of the row gathers around an all-to-all of an MoE layer's ``rows`` (token, expert)
    rows on the busiest rank (:func:`~autotp.cost_model.routing.dispatched_rows_work`): ``full``
    their bytes as the all-to-all is priced, at the router's load (:func:`at_load` of ``share``,
    the busiest rank's share; None: a balanced router's), whose rows it receives; it sends its
    own tokens' ``1/tp`` of them, whatever the load. ``grad``: the backward's mirror too;
    ``alone``: the rows it sends lie in their sending order already (its own routing's)."""
    from ..cost_model.routing import dispatched_rows_work

    if tp <= 1:
        return 0.0
    whole = full if share is None else full / (share * tp)   # a share is at least 1/tp: the largest of tp
    return _work_seconds(dispatched_rows_work(whole, rows, tp, share, grad, alone), profile)


def param_memory(index: "GraphIndex", profile: DeviceProfile, node: fx.Node, placement: Any) -> float:
    """Bytes a parameter's training state takes on the largest rank (weight, gradient, optimizer)."""
    val = node.meta["val"]
    frac = 1.0
    if isinstance(placement, Shard):
        size = int(val.shape[placement.dim])
        frac = max_local_size(size, placement, index.tp) / size
    return profile.state_bytes_per_param * val.numel() * frac


def param_update_seconds(index: "GraphIndex", profile: DeviceProfile, node: fx.Node, placement: Any) -> float:
    """Seconds the optimizer step spends on a parameter's state on the largest rank (see
    :meth:`DeviceProfile.update_time`): splitting a parameter saves this time, not only memory."""
    return profile.update_time(param_memory(index, profile, node, placement) / profile.state_bytes_per_param)


def wants_f(want: Any, sharded: bool, meta: TensorMeta, grad: bool = True, apart: bool = False) -> bool | str:
    """f goes where a replicated float tensor feeds sharded compute: its gradient is a summand.
    A tensor that carries no gradient (``grad`` False: see :func:`grad_nodes`) needs none.
    ``apart``: an f that must stay apart from an all-gather before it (``"apart"``, not True): a
    tailed product reads the gathered tensor both through the f (its runs) and without (its
    tail, whose gradient is whole on every rank already), so the two cannot be one collective."""
    f = isinstance(want, Replicate) and sharded and meta.is_float and grad
    return "apart" if f and apart else f


def serves_without_f(kind: str | None, f: bool | str) -> bool:
    """Does a conversion made for a consumer that wants an f also serve a consumer of the same
    placement that wants none? Its collective runs first and the f after it, and the rewrite reuses
    the collective's output (a g shared by a column-parallel q_proj and a k_proj run whole), unless
    the f is fused into an all-gather (all_gather_f: another backward; the gathers of a split
    tensor share one all-gather otherwise, see :func:`gather_parts`). The plan and the solver
    then count the collective once, as the rank runs it."""
    return bool(kind) and bool(f) and not (kind == "all_gather" and f is True)


def gathers_whole(meta: TensorMeta, have: Any, want: Placement, tp: int) -> bool:
    """Whether turning a tensor placed ``have`` into ``want`` all-gathers it whole: a split tensor
    made whole, or split another way (a reshard: gathered, then cut). The conversions of one
    tensor that do share one all-gather (:func:`gather_parts`)."""
    return isinstance(have, Shard) and _conversion(
        have, want, _dim_size(meta, want) or _dim_size(meta, have), tp) in ("all_gather", "reshard")


def cut_from_whole(dst: Shard) -> bool:
    """Whether a rank's part of ``dst`` can be cut from the whole tensor by plain slicing
    (:func:`~autotp.distributed.functional.rank_slice`): no tail, no blocks held whole by every
    rank or dealt per block."""
    return not (dst.tail or dst.whole or dst.per_block)


def gather_parts(have: Shard, wanted: list) -> list[tuple[str, Placement, tuple]]:
    """What the rank runs for ``wanted``, the conversions ``(want, f)`` of one tensor split as
    ``have`` that each gather it whole (:func:`gathers_whole`), first made first: each part
    ``(kind, dst, the conversion it is listed for)``. One all-gather serves them all, as the
    rewrite makes them. Where sharded compute reads the tensor whole (f True), it is the
    ``all_gather_f`` (the f fused in: its backward reduce-scatters summands); a replicated
    consumer reads it through ``grad_if`` and a reshard cuts its part with ``rank_slice``,
    listed under those names: they move no bytes, and cost the copies :func:`read_seconds`
    prices; a split slicing cannot cut is scattered. Otherwise a plain all-gather, an f after it
    for a consumer that wants one apart (a tailed product's runs), a scatter for each split. A
    reshard alone (nothing reads the tensor whole) gathers nothing: it is one ``all_to_all``
    where one moves it (:func:`~autotp.placements.resharded_by_all_to_all`), each rank sending
    the others the blocks of its part they want, else listed as one ``reshard`` (its all-gather
    and scatter)."""
    fused = next((e for e in wanted if e[1] is True), None)
    if fused is not None:
        return [("all_gather_f", REPLICATE, fused)] + [
            ("grad_if" if not isinstance(e[0], Shard) else "rank_slice" if cut_from_whole(e[0]) else "scatter",
             e[0], e) for e in wanted if e is not fused]
    if len(wanted) == 1 and isinstance(wanted[0][0], Shard):
        want = wanted[0][0]
        return [("all_to_all" if resharded_by_all_to_all(have, want) else "reshard", want, wanted[0])]
    return ([("all_gather", REPLICATE, wanted[0])] + [("f", REPLICATE, e) for e in wanted if e[1]]
            + [("scatter", e[0], e) for e in wanted if isinstance(e[0], Shard)])


def gather_part_seconds(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Shard, kind: str,
                        dst: Placement, grad: bool) -> float:
    """Forward + backward seconds of one part of :func:`gather_parts`."""
    if kind in ("grad_if", "rank_slice"):
        return read_seconds(kind, moved_bytes(index, profile, meta), profile, index.tp, grad)
    if kind == "all_to_all":
        return reshard_seconds(index, profile, meta, have, dst, grad)
    src = REPLICATE if kind in ("f", "scatter") else have
    return conversion_seconds(index, profile, meta, src, dst, kind in ("f", "all_gather_f"), grad)


def added_seconds(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Any, paid: Any,
                  want: Placement, f: bool | str, grad: bool, share: float | None = None) -> float:
    """Seconds a conversion of a tensor placed ``have`` to ``(want, f)`` adds to the conversions
    of it made already (``paid``: ``(want, f)`` pairs): nothing if made; for a gather, what it
    adds to the one all-gather the gathers share (:func:`gather_parts`: a consumer that reads an
    ``all_gather_f`` made for another costs its copies alone, an ``all_gather_f`` made after a
    plain all-gather replaces it); else its own collectives (``share``: as
    :func:`conversion_seconds` takes it)."""
    if (want, f) in paid:
        return 0.0
    tp = index.tp
    if not gathers_whole(meta, have, want, tp):
        return conversion_seconds(index, profile, meta, have, want, f, grad, share)
    before = sorted((e for e in paid if gathers_whole(meta, have, e[0], tp)), key=repr)
    return (gathers_seconds(index, profile, meta, have, before + [(want, f)], grad)
            - gathers_seconds(index, profile, meta, have, before, grad))


def pay(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Any, paid: frozenset,
        want: Placement, f: bool | str, grad: bool, share: float | None = None,
        again: bool = False) -> tuple[float, frozenset]:
    """(seconds added, conversions paid after) for a conversion to ``(want, f)`` of a tensor
    placed ``have`` whose conversions ``paid`` are made: the solver's and the walk's one rule. A
    conversion that also serves a consumer wanting no f (:func:`serves_without_f`) pays that one
    too: free, but where it is a gather read from a shared ``all_gather_f`` (a tailed product's
    tail reads it through ``grad_if``). ``share``: the busiest rank's share of the tensor's MoE
    block's rows (:func:`load_share`), which the reverse all-to-all is priced at. ``again``: the
    tensor's conversions run again in a recomputed layer (``GraphIndex.converted_again``): their
    forward is paid twice (the same conversions priced with no gradient)."""
    seconds, after = _paid(index, profile, meta, have, paid, want, f, grad, share)
    if again:
        seconds += _paid(index, profile, meta, have, paid, want, f, False, share)[0]
    return seconds, after


def _paid(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Any, paid: frozenset,
          want: Placement, f: bool | str, grad: bool, share: float | None) -> tuple[float, frozenset]:
    seconds = added_seconds(index, profile, meta, have, paid, want, f, grad, share)
    paid = paid | {(want, f)}
    kind = _conversion(have, want, _dim_size(meta, want) or _dim_size(meta, have), index.tp)
    if serves_without_f(kind, f) and (want, False) not in paid:
        if gathers_whole(meta, have, want, index.tp):
            seconds += added_seconds(index, profile, meta, have, paid, want, False, grad)
        paid = paid | {(want, False)}
    return seconds, paid


def gathers_seconds(index: "GraphIndex", profile: DeviceProfile, meta: TensorMeta, have: Shard, wanted: list,
                    grad: bool) -> float:
    """Seconds of the collectives :func:`gather_parts` lists for ``wanted`` (0 for none)."""
    if not wanted:
        return 0.0
    key = ("gathers", meta, have, frozenset(wanted), grad, profile)
    found = index._conversion_cost.get(key)
    if found is None:
        found = index._conversion_cost[key] = sum(gather_part_seconds(index, profile, meta, have, kind, dst, grad)
                                                  for kind, dst, _ in gather_parts(have, wanted))
    return found


_NO_GRAD_OPS = frozenset(getattr(aten, name).default for name in ("detach", "detach_", "lift_fresh_copy")
                         if hasattr(aten, name))


def grad_nodes(cap: Capture) -> frozenset[fx.Node]:
    """The nodes whose value may carry a gradient: those reached from a parameter or a float
    user input through float ops, outside ``torch.no_grad()`` regions and ``detach``. Buffers,
    lifted constants (a KV cache's empty start) and integer tensors carry none. Conservative:
    anything unclear counts as carrying one (then f is kept: correct either way). A program that
    is never differentiated (``Capture.differentiable`` False: a generation step) has none."""
    if not cap.differentiable:
        return frozenset()
    user = set(cap.user_inputs)
    found: set[fx.Node] = set()
    enabled = True
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if node.name in cap.param_names or (node.name in user and isinstance(val, torch.Tensor)
                                                and val.is_floating_point()):
                found.add(node)
            continue
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            # a constant mode is known; a restored one (``prev``, a node) may be on
            enabled = node.args[0] if isinstance(node.args[0], bool) else True
            continue
        if not enabled or node.target in _NO_GRAD_OPS:
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals):
            continue
        if any(isinstance(a, fx.Node) and a in found for a in node.all_input_nodes):
            found.add(node)
    return frozenset(found)


def propagate(index: GraphIndex, decisions: Mapping[str, Placement], profile: DeviceProfile,
              forced: Mapping[fx.Node, int] | None = None, explore: bool = False,
              exact: bool = False) -> Propagation:
    """See the module docstring. ``decisions`` maps parameter placeholder names to placements:
    a plain ``Shard(d)`` decides the dim alone (a layout's "column", "row"), its blocks and atoms
    then read off the graph, unless ``exact`` (a plan's own placements, which a later program
    must hold as they are: plain runs of single elements where the plan says so).

    ``forced`` (the solver's answer) gives, for every op, the index of its strategy in its
    rule's list; without it each op greedily takes its cheapest strategy (the index each op took
    either way is the result's ``picked``). With ``explore`` the
    walk stops at the first op ``forced`` has no choice for and reports it in ``pending``
    (tests enumerate the whole decision space this way)."""
    tp = index.tp
    cap = index.capture
    place: dict[fx.Node, Any] = {}
    chosen: dict[fx.Node, Strategy] = {}
    picked: dict[str, int] = {}   # op name -> the index of its strategy among those offered it
    unresolved: dict[fx.Node, Any] = {}   # param node -> None (free) or Shard(d) (dim decided)
    params: dict[str, Placement] = {}
    conversions: dict[tuple, str] = {}
    comms: list = []   # Comm, or the gathers of one tensor (_Gathers), which a later gather may change
    gathered: dict[fx.Node, _Gathers] = {}
    compute = comm = memory = activations = update = layer_inputs = 0.0
    env = index.env
    joined = {n for n in index.param_views if n.name not in cap.param_names and n.target is aten.cat.default}

    def record(node: fx.Node, meta: TensorMeta, dst: Placement, f: bool, consumer: fx.Node) -> None:
        nonlocal comm
        key = (node, dst, f)
        if key in conversions:
            return
        kind = _conversion(place[node], dst, _dim_size(meta, dst) or _dim_size(meta, place[node]), tp)
        conversions[key] = kind or ""
        if isinstance(place[node], ReplicatePartialGrad):
            return   # read as it is: its f was made before it (copied_seconds)
        if serves_without_f(kind, f):
            conversions.setdefault((node, dst, False), kind)
        full = moved_bytes(index, profile, meta)
        share = load_share(index, node) if sends_back(place[node], dst) else None
        if share is not None:   # the busiest rank sends back the rows it received
            full = at_load(full, share, tp)
        grad = node in index.grads
        again = node in index.converted_again   # its forward again in the recomputation (pay)
        if gathers_whole(meta, place[node], dst, tp):   # one all-gather serves every gather of node
            group = gathered.get(node)
            if group is None:
                group = gathered[node] = _Gathers(node, place[node], meta, full, grad, again)
                comms.append(group)
            comm += group.add((dst, f), consumer.name, index, profile)
            if serves_without_f(kind, f):   # its tail reads it too (pay)
                comm += group.add((dst, False), consumer.name, index, profile)
            return
        for k in conversion_kinds(kind, f):
            fw_b, bw_b = collective_bytes(k, full, tp, grad)
            seconds = sum(sum(collective_time(k, full, profile, tp, g))
                          + layout_copy_seconds(k, meta, place[node], dst, full, profile, tp, g, index, share)
                          for g in ((grad, False) if again else (grad,)))
            comm += seconds
            comms.append(Comm(k, node.name, place[node], dst, consumer.name, full, fw_b, bw_b, seconds))

    def infeasible(why: str) -> Propagation:
        return Propagation(tp, place, chosen, params, conversions, _listed(comms), compute + update, comm, memory,
                           activations, update_s=update, infeasible=why)

    for node in cap.graph.nodes:
        if node.op == "placeholder":
            if node.name in cap.param_names:
                val = node.meta["val"]
                decided = decisions.get(node.name)
                # a plan's own placements hold for every parameter, 1-D ones (norm weights)
                # included: they were sliced at load, so a later program cannot choose anew
                if decided is not None and (val.dim() >= 2 or exact):
                    if isinstance(decided, Shard) and (exact or (decided.chunks, decided.unit) != (1, 1)):
                        place[node] = decided          # fully given (a loaded plan)
                        params[node.name] = decided
                        memory += param_memory(index, profile, node, decided)
                        update += param_update_seconds(index, profile, node, decided)
                    else:
                        place[node] = decided
                        if isinstance(decided, Shard):
                            unresolved[node] = decided
                        else:
                            params[node.name] = decided
                            memory += param_memory(index, profile, node, decided)
                            update += param_update_seconds(index, profile, node, decided)
                else:
                    place[node] = None
                    unresolved[node] = None
            else:
                place[node] = index.input_placements.get(node.name, REPLICATE)
            continue
        if node.op == "output":
            for i, out in enumerate(pytree.tree_leaves(node.args)):
                if isinstance(out, fx.Node) and isinstance(place.get(out), (Shard, Partial)):
                    if index.keeps_split(i, out, place[out]):
                        continue   # the caller asked to keep it split (vocab-sharded logits)
                    record(out, _meta(out), REPLICATE, False, node)
            continue
        if node.op != "call_function":
            place[node] = REPLICATE
            continue
        if node.target is operator.getitem:
            src = place.get(node.args[0])
            place[node] = src[node.args[1]] if isinstance(src, tuple) else REPLICATE
            continue

        info = index.infos[node]
        inputs = index.tensor_inputs[node]
        actual = tuple(place[i] for i in inputs)
        options = offered = index.strategies(node, actual)
        if forced is not None:
            j = forced.get(node)
            if j is None and explore:
                return Propagation(tp, place, chosen, params, conversions, _listed(comms), compute, comm, memory,
                                   activations, pending=(node, len(options)))
            if j is None or j >= len(options):
                return infeasible(f"the solver's strategy {j} for {node.name} is not among its {len(options)}")
            options = [options[j]]
        elif node in index.written_roots:
            # a tensor written in place through a view later, which no conversion may reach
            # (GraphIndex.moves_written): whole, which every write can take, or split where the
            # views keep the split down to each write and each write takes it (GraphIndex.writes_keep)
            options = [s for s in options if s.output == REPLICATE or index.writes_keep(node, s.output)] or options
        elif info.gathers_expert_rows and not _experts_may_take_rows(node, place):
            # rows gathered for a grouped product whose stack is split otherwise here (expert-TP:
            # a later program replaying its plan): this walk does not look ahead to the product,
            # which takes such rows routed by its expert-parallel strategies alone
            options = [s for s in options if not isinstance(s.output, Routed)] or options
        best, best_cost = None, INF
        for strat in options:
            sharded = _sharded_compute(strat)
            cost = index.compute_time(node, strat, profile) + internal_seconds(index, profile, strat, node)
            for i, (inp, meta, want) in enumerate(zip(inputs, info.inputs, strat.inputs)):
                f = wants_f(want, sharded, meta, inp in index.grads, apart=strat.f_runs_only and i == 0)
                if isinstance(want, Shard) and not index.uneven and not _even(meta, want, tp):
                    cost = INF
                elif inp in unresolved:
                    have = unresolved[inp]
                    if isinstance(want, Partial) or (
                        have is not None and not (isinstance(want, Shard) and want.dim == have.dim)
                    ):
                        cost = INF
                    elif f:
                        cost += collective_time("f", moved_bytes(index, profile, meta), profile, tp)[1]
                elif (inp.name in cap.param_names or inp in joined) \
                        and not same_placement(place[inp], want, _dim_size(meta, want), tp):
                    # a parameter is never moved at run time: it is sharded at load, and nor is a
                    # join of parameters (sibling products fused: its weights' shards, which the
                    # solver never gathers either, GraphIndex.param_views). (The solver
                    # never gathers a view of one either, GraphIndex.moves_parameter; this walk,
                    # which replays a plan for another call op by op without looking ahead, may:
                    # falcon-new at tp 4 reached its row-parallel product with x whole, where only
                    # the weight's transpose gathered fits)
                    cost = INF
                elif index.moves_written(node, i, place[inp], want, meta):
                    cost = INF   # an in-place write lands in the tensor later ops read, not a copy
                elif (inp, want, f) not in conversions:   # one made is reused; a gather may share one
                    made = frozenset(gathered[inp].wanted) if inp in gathered else frozenset()
                    cost += pay(index, profile, meta, place[inp], made, want, f, inp in index.grads,
                                load_share(index, inp), inp in index.converted_again)[0]
                if cost == INF:
                    break
            if cost < best_cost:
                best, best_cost = strat, cost
        if best is None:
            return infeasible(f"no strategy fits {node.name} ({node.target}) with inputs {list(actual)}")
        chosen[node] = best
        picked[node.name] = next(j for j, s in enumerate(offered) if s is best)
        compute += index.compute_time(node, best, profile)
        kept_now, inputs_now = index._activation_parts(node, best, profile, frozenset(
            i for i, (inp, meta, want) in enumerate(zip(inputs, info.inputs, best.inputs))
            if inp in place and not same_placement(place[inp], want, _dim_size(meta, want), tp)))
        activations += kept_now
        memory += kept_now
        layer_inputs += inputs_now
        for kind, meta in best.internal:
            full = internal_bytes(index, profile, kind, meta, node)
            seconds = internal_collective_seconds(index, profile, kind, full, node)
            # memory-bound work, not the link's
            share = load_share(index, node) if kind == "all_to_all" else None
            compute += internal_copy_seconds(kind, full, profile, numel(meta.shape[:1], env), tp, _width(meta, env),
                                             table_split(best), sends_own_order(best), share)
            fw_b, bw_b = collective_bytes(kind, full, tp)
            comm += seconds
            comms.append(Comm(kind, node.name, best.inputs[0], _internal_dst(kind, best), node.name, full, fw_b,
                              bw_b, seconds))
        sharded = _sharded_compute(best)
        for i, (inp, meta, want) in enumerate(zip(inputs, info.inputs, best.inputs)):
            f = wants_f(want, sharded, meta, inp in index.grads, apart=best.f_runs_only and i == 0)
            if inp in unresolved:
                del unresolved[inp]
                place[inp] = want
                params[inp.name] = want
                memory += param_memory(index, profile, inp, want)
                update += param_update_seconds(index, profile, inp, want)
            if f or place[inp] != want:
                record(inp, meta, want, f, node)
        place[node] = best.output
    for node, have in unresolved.items():   # parameters no op used
        place[node] = REPLICATE
        params[node.name] = REPLICATE
        if cap.param_names[node.name] not in cap.aliases:   # a tied name holds no memory of its own
            memory += param_memory(index, profile, node, REPLICATE)
            update += param_update_seconds(index, profile, node, REPLICATE)
    return Propagation(tp, place, chosen, params, conversions, _listed(comms), compute + update, comm, memory,
                       activations, update_s=update, picked=picked, layer_input_bytes=layer_inputs)


class _Gathers:
    """The gathers of one tensor a propagation has made so far (:func:`gather_parts`) and the
    collectives they list."""

    def __init__(self, node: fx.Node, have: Shard, meta: TensorMeta, full: float, grad: bool,
                 again: bool = False) -> None:
        self.node, self.have, self.meta, self.full, self.grad = node, have, meta, full, grad
        self.again = again   # recomputed: each collective's forward again (pay)
        self.wanted: dict[tuple, str] = {}   # (want, f) -> the consumer that first wanted it
        self.comms: list[Comm] = []

    def add(self, want: tuple, consumer: str, index: "GraphIndex", profile: DeviceProfile) -> float:
        """Adds a gather; returns the seconds it adds (negative where an all_gather_f replaces a
        plain all-gather dearer than what it adds)."""
        before = sum(c.seconds for c in self.comms)
        self.wanted[want] = consumer
        self.comms = []
        for kind, dst, entry in gather_parts(self.have, list(self.wanted)):
            fw_b, bw_b = collective_bytes(kind, self.full, index.tp, self.grad)
            seconds = sum(gather_part_seconds(index, profile, self.meta, self.have, kind, dst, g)
                          for g in ((self.grad, False) if self.again else (self.grad,)))
            self.comms.append(Comm(kind, self.node.name, self.have, dst, self.wanted[entry], self.full, fw_b, bw_b,
                                   seconds))
        return sum(c.seconds for c in self.comms) - before


def _listed(comms: list) -> list[Comm]:
    return [c for entry in comms for c in (entry.comms if isinstance(entry, _Gathers) else (entry,))]


def _even(meta: TensorMeta, shard: Shard, tp: int) -> bool:
    size = meta.static(shard.dim)
    if size is None or not divides(size, shard):
        return False
    return is_even(size, shard, tp)
