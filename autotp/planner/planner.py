"""A capture -> a :class:`~autotp.plan.Plan`: the graph indexed, the layout pinned, the
strategies solved (or a saved plan replayed) and the result written as a plan. What
:func:`autotp.plan`, :func:`autotp.parallelize` and the PTD-P planner (:mod:`autotp.ptd`) share.

A saved plan's placements on another program are held by :mod:`.replay`; the notes and errors
of sequence parallelism are :mod:`.sequence`'s, those of memory and of what stays whole
:mod:`.notes`', and ``host_reads=False``'s refusals :mod:`.host_reads`'."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from ..capture import Capture, gc_paused, module_path
from ..cost_model import get_profile
from ..cost_model.alignment import Align
from ..errors import ConfigError, MemoryLimitError, PlanError
from ..passes.activations import fuse_activations as activations_fused, fused_note
from ..passes.checkpoint import price_recomputation
from ..passes.norms import find_norms, fuse_norms as norms_fused, norms_note
from ..passes.pins import unholdable_pin
from ..passes.products import products_note
from ..passes.propagate import GraphIndex, Propagation, propagate
from ..passes.row_scales import RowScale, moved
from ..passes.solve import solve
from ..placements import REPLICATE, Placement
from ..plan.arguments import PlanArguments
from ..plan.flow import record_flows
from ..plan.plan import CommOp, DeferredExpressions, Plan, attention_heads, cost_expressions, role_of, unsplit_attention_note
from .experts import dispatch_note, expert_stacks, experts_note
from ..plan.expert_load import as_expert_load
from .expert_load import apply_load, check_load, load_notes, moe_blocks
from .host_reads import refuse_model_reads, refuse_pinned_reads
from .notes import replicated_note, unsplit_mixer_note, what_memory_takes
from .replay import under_pins
from .roles import _first_uses, _pinned
from .scales import narrower_scales, scales_note
from .siblings import fused_cheaper
from .sequence import no_sequence_region, sequence_fix, sequence_note, sequence_regions


@gc_paused()
def build_plan(cap: Capture, tp: int, *, batch: int, seq: int, profile: Any = None,
               layout: Mapping[str, Any] | None = None, plan: Plan | None = None,
               uneven: bool = True, gather_logits: bool | None = None,
               memory_limit: float | None = None,
               sequence_parallel: bool | None = None,
               input_placements: Mapping[str, Placement] | None = None,
               keep_split: frozenset[str] = frozenset(), align: Any = "profile",
               host_reads: bool = True,
               expert_dispatch: bool | None = None,
               fuse_activations: bool = True, fuse_norms: bool = True,
               fuse_products: bool = True, expert_load: Any = None,
               activation_checkpointing: bool = False,
               decided: "Decided | None" = None) -> tuple[Plan, GraphIndex, Propagation]:
    """The plan for a capture. ``memory_limit`` (bytes per rank; default: the profile's device
    memory) bounds training state + activations; a saved ``plan`` is replayed, not re-solved.

    ``input_placements`` (input name -> placement) says how inputs arrive on the ranks when
    not whole, and ``keep_split`` names outputs returned as they are split instead of gathered:
    a generation step's KV cache goes out and comes back split by head (autotp.generation).

    ``sequence_parallel``: may the solver split layer-norm/dropout/residual regions along the
    sequence (Korthikanti et al.)? None (default): wherever the cost model finds it cheaper;
    True: wherever a row-parallel product's partial sum meets an add, a dropout or a cast along
    the sequence (a PlanError where nothing can take it); False: never. It needs ``uneven``: a
    sequence shard is uneven whenever tp does not divide a call's length.

    ``gather_logits``: None (default) keeps the output named ``logits`` split by vocabulary
    where the call also returns a loss (labels given: training needs the loss, computed
    vocab-parallel, not the b*s*V logits) and gathers it otherwise; True always gathers, False
    never does.

    ``align``: which unaligned products the rewrite runs padded (an
    :class:`~autotp.cost_model.alignment.Align`, or None: none), so that they are priced at the
    rate they will run at; by default what ``parallelize`` does on the profile's device (a GPU
    profile pads those over its ridge's rows, a CPU one none).

    ``host_reads=False``: no layout that reads a device value on the host in a step (a rank
    running its own experts' rows alone reads how many it got: expert parallelism); the experts
    then run expert-TP or replicated. A layout pinning whole experts per rank, or an op of the
    model's own program that reads on the host whatever the layout, is a PlanError naming it.

    ``expert_dispatch``: where the tokens arrive split along the sequence, how a rank's experts
    get their (token, expert) rows under expert parallelism. None (default): by cost; True: by
    the all-to-all dispatch alone (the router on each rank's own tokens, each row sent to its
    expert's rank: Megatron's all-to-all token dispatcher); False: never by it (the tokens
    gathered whole for the experts, before the router or, where cheaper, after it, the router then
    running on each rank's own tokens and its top-k ids and weights all-gathered: Megatron's
    all-gather dispatcher). True needs sequence
    parallelism allowed (with ``sequence_parallel=False`` it is a ConfigError: under expert
    parallelism no plan is left); a later program of ``parallelize`` (another call's) whose tokens
    do not reach the experts split is planned by cost instead, with a note (api.py).

    ``fuse_activations`` (default True): activations the model writes out as pointwise arithmetic
    (GPT-2's tanh-GELU as ``mul``/``pow``/``add``/``tanh``) are planned, priced and run as the one
    ATen op that computes them (``aten.gelu``, ``aten.silu``; :mod:`autotp.passes.activations`), a
    plan note saying which; False keeps them as written. The plan's index then holds the fused
    capture (the capture given is not changed).

    ``fuse_norms`` (default True): an RMSNorm's statistic written out (``pow``, ``mean``, ``add``,
    ``rsqrt``, ``mul``) is planned, priced and run as one ``aten.rms_norm``
    (:mod:`autotp.passes.norms`), a plan note saying which; False keeps it as written. With
    ``sequence_parallel=False`` the statistics stay as written (a note says so): there a plan
    splits a norm's rows along the hidden dim (x squared gathered, each rank normalizing its
    columns), which ``aten.rms_norm``, keeping normalized dims whole, cannot.

    ``fuse_products`` (default True): sibling products (``linear``s of one input: q, k, v; gate,
    up) run as one product of their weights joined where the plan splits them alike and the cost
    model finds it cheaper (:mod:`autotp.planner.siblings`), a plan note saying which and which
    sets stay apart; False keeps them as written.

    ``expert_load``: the router's load expert parallelism is priced at (an
    :class:`~autotp.planner.expert_load.ExpertLoad`, or a mapping of each MoE layer's experts module
    to its rows per expert; :func:`autotp.measure_expert_load` measures one): each layer's
    experts, and the all-to-alls bringing and sending back their rows, at its busiest rank's rows, a note saying
    the load and what it did to the choice. None (default): a balanced router, ``T * k / tp``
    rows a rank. One that does not name the model's MoE layers and their experts is a ConfigError.

    ``activation_checkpointing``: price the run that recomputes each repeated layer in backward
    (``parallelize(..., activation_checkpointing=True)``, :func:`autotp.passes.checkpoint.price_recomputation`):
    one layer's activations held at a time and the layers' inputs kept, each layer's forward
    run twice; the memory limit and the plan's figures are then that run's.

    ``decided``: what this search chose on another rank of the group, for the same capture and
    arguments (:func:`decided`): the plan is rebuilt from it without searching, and is a PlanError
    where it does not rebuild to the same placements and collectives (the caller then plans
    itself: :mod:`autotp.distributed.plans`)."""
    expert_load = as_expert_load(expert_load)
    for name, flag in (("fuse_activations", fuse_activations), ("fuse_norms", fuse_norms),
                       ("fuse_products", fuse_products)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name}={flag!r}: {name} is True or False")
    activations, norms = [], []
    if fuse_activations:
        cap, activations = activations_fused(cap)
    kept = None
    if fuse_norms and sequence_parallel is not False:
        cap, norms = norms_fused(cap)
    elif fuse_norms and find_norms(cap.graph):
        kept = ("norms kept as written (sequence_parallel=False): without sequence parallelism a plan may "
                "split a norm's rows along the hidden dim, which aten.rms_norm cannot")
    notes = [n for n in (fused_note(activations), norms_note(norms), kept) if n]
    # what the programs built from the plan are built with (autotp/plan/arguments.py)
    arguments = PlanArguments(sequence_parallel=sequence_parallel, expert_dispatch=expert_dispatch,
                              gather_logits=gather_logits, host_reads=host_reads,
                              fuse_activations=fuse_activations, fuse_norms=fuse_norms,
                              fuse_products=fuse_products, uneven=uneven, expert_load=expert_load)

    def noted(result: Plan) -> Plan:
        result.notes.extend(notes)
        result.arguments = arguments
        return result

    def attempt(c: Capture) -> tuple[Plan, GraphIndex, Propagation]:
        return _build_plan(c, tp, batch=batch, seq=seq, profile=profile, layout=layout, plan=plan,
                           uneven=uneven, gather_logits=gather_logits, memory_limit=memory_limit,
                           sequence_parallel=sequence_parallel, input_placements=input_placements,
                           keep_split=keep_split, align=align, host_reads=host_reads,
                           expert_dispatch=expert_dispatch, expert_load=expert_load,
                           activation_checkpointing=activation_checkpointing, decided=decided)

    if decided is not None:   # its notes and arguments are the plan's already
        if fuse_products:
            (result, index, prop), _, _ = fused_cheaper(cap, tp, plan, attempt, only=decided.apart)
            return result, index, prop
        return attempt(cap)
    try:
        if fuse_products:   # sibling products joined where the plan splits them alike (planner/siblings.py)
            pins = None
            if plan is None and layout:   # a set its layout pins unalike runs apart (planner/siblings.py)
                pins = {cap.param_names[k]: p for k, p in _pinned(cap, layout, None).items()}
            (result, index, prop), products, apart = fused_cheaper(cap, tp, plan, attempt, pins)
            notes += [n for n in (products_note(products), apart) if n]
        else:
            result, index, prop = attempt(cap)
    except MemoryLimitError as exc:   # the plan without the limit it offers says the same
        without_limit = getattr(exc, "plan_without_limit", None)
        if without_limit is not None:
            exc.plan_without_limit = lambda: noted(without_limit())
        raise
    return noted(result), index, prop


def _build_plan(cap: Capture, tp: int, *, batch: int, seq: int, profile: Any, layout: Mapping[str, Any] | None,
                plan: Plan | None, uneven: bool, gather_logits: bool | None, memory_limit: float | None,
                sequence_parallel: bool | None, input_placements: Mapping[str, Placement] | None,
                keep_split: frozenset[str], align: Any, host_reads: bool,
                expert_dispatch: bool | None, expert_load: Any = None, activation_checkpointing: bool = False,
                decided: "Decided | None" = None) -> tuple[Plan, GraphIndex, Propagation]:
    """:func:`build_plan` on a capture as it is planned (its activations fused or not)."""
    prof = get_profile(profile)
    if align == "profile":
        align = Align.for_profile(prof) if 0 < prof.unaligned_flops < prof.flops else None
    limit = prof.memory if memory_limit is None else memory_limit
    names = cap.output_names
    split_logits = not gather_logits if gather_logits is not None else "loss" in names
    keep = frozenset(i for i, n in enumerate(names) if n in keep_split or (n == "logits" and split_logits))
    by_key = dict(zip(cap.input_keys, cap.user_inputs))
    arriving = {by_key[k]: p for k, p in (input_placements or {}).items()}
    if not (expert_dispatch is None or isinstance(expert_dispatch, bool)):
        raise ConfigError(f"expert_dispatch={expert_dispatch!r}: choose None (by cost), True (the all-to-all "
                          "dispatch) or False (the tokens gathered whole)")
    if expert_dispatch and not host_reads:
        raise ConfigError("expert_dispatch=True reads its split sizes on the host (a rank's experts' rows), which "
                          "host_reads=False forbids: leave expert_dispatch to the planner, or allow host_reads")
    if expert_dispatch and sequence_parallel is False:
        raise ConfigError("expert_dispatch=True sends the tokens a rank holds along the sequence to their experts' "
                          "ranks, and sequence_parallel=False leaves no token split along it: allow sequence "
                          "parallelism (None or True), or leave expert_dispatch to the planner")
    if sequence_parallel and not uneven:
        raise ConfigError("sequence_parallel=True needs uneven=True: a sequence shard is uneven whenever tp does "
                          "not divide a call's length; pass uneven=True, or leave sequence_parallel to the planner")

    experts = _experts_of(cap) if expert_load is not None else {}
    if expert_load is not None and plan is None:
        # checked where it is given; a plan's later programs (or a replay) price the layers it names
        check_load(expert_load, experts)

    def index_of(c: Capture) -> GraphIndex:
        index = GraphIndex.build(c, tp, batch, seq, uneven=uneven, sharded_outputs=keep,
                                 sequence_parallel=sequence_parallel is not False and uneven and tp > 1,
                                 input_placements=arriving, force_sequence=bool(sequence_parallel), align=align,
                                 host_reads=host_reads)
        index.expert_dispatch = expert_dispatch
        if expert_load is not None:   # each MoE layer's ops priced at its busiest rank's rows
            apply_load(index, expert_load, experts)
        if activation_checkpointing:
            price_recomputation(index)
        return index

    index = index_of(cap)
    pinned = _pinned(cap, layout, plan)
    if decided is not None:
        return _rebuilt(index, prof, pinned, plan, decided, index_of)
    if not host_reads:
        refuse_model_reads(cap)
        try:
            return _planned(cap, index, prof, pinned, plan, layout, limit, batch, seq, keep, index_of)
        except PlanError as exc:   # a pin that only a layout reading to the host could hold
            if not isinstance(exc, MemoryLimitError):
                refuse_pinned_reads(cap, pinned, tp, exc)
            raise
    return _planned(cap, index, prof, pinned, plan, layout, limit, batch, seq, keep, index_of)


def _planned(cap: Capture, index: GraphIndex, prof: Any, pinned: Mapping[str, Placement], plan: Plan | None,
             layout: Mapping[str, Any] | None, limit: float, batch: int, seq: int,
             keep: frozenset, index_of: Any = None) -> tuple[Plan, GraphIndex, Propagation]:
    """The plan on ``index``: ``plan`` replayed, or solved under ``pinned`` within ``limit``.
    ``index_of`` (a capture -> its GraphIndex, built as ``index`` was): where per-row scales of
    products' outputs (routing weights) are narrower on the products' inputs under the plan found,
    the capture with them moved there is planned too, and the cheaper predicted step kept
    (:mod:`autotp.passes.row_scales`)."""
    index, prop, notes = _placed(cap, index, prof, pinned, plan, layout, limit, batch, seq, keep)
    scales = narrower_scales(index, prop) if index_of is not None else []
    if scales:
        try:
            moved_index, moved_prop, moved_notes = _placed(cap, index_of(moved(index.capture, scales)), prof, pinned,
                                                           plan, layout, limit, batch, seq, keep)
        except PlanError:   # the moved program has no plan within the limit: the scales stay where they are
            moved_prop = None
        if moved_prop is not None and moved_prop.total_s < prop.total_s:
            notes = moved_notes + [scales_note(index, scales, prop.total_s - moved_prop.total_s)]
            index, prop = moved_index, moved_prop
            index.moved_scales = tuple(scales)
    return _written(index.capture, index, prop, prof, batch, seq, keep, layout, pinned, limit, notes, replayed=plan)


def _placed(cap: Capture, index: GraphIndex, prof: Any, pinned: Mapping[str, Placement], plan: Plan | None,
            layout: Mapping[str, Any] | None, limit: float, batch: int, seq: int,
            keep: frozenset) -> tuple[GraphIndex, Propagation, list[str]]:
    """``plan`` replayed on ``index``, or the solver's placements under ``pinned`` within
    ``limit``: (the index solved on, the propagation, notes)."""
    notes: list[str] = []
    if plan is not None:
        prop = under_pins(index, prof, pinned)
        if index.force_sequence and not sequence_regions(index, prop):
            raise PlanError(f"sequence_parallel=True, but {no_sequence_region(index, replayed=True)}. "
                            + sequence_fix(index))
    else:
        try:
            solution, index, more = _solve(index, prof, pinned, layout, limit)
        except MemoryLimitError as exc:
            error = what_memory_takes(exc, index, batch, seq)
            if getattr(exc, "without_limit", None) is not None:   # set by _solve
                # the plan memory_limit=inf gives: the fastest plan on the first index, solved already
                fastest, first_index = exc.without_limit

                @gc_paused()
                def without_limit() -> Plan:
                    fastest.warn_pruned()
                    return _written(cap, first_index, fastest.propagation, prof, batch, seq, keep, layout,
                                    pinned, float("inf"), [], replayed=None)[0]

                error.plan_without_limit = without_limit
            raise error from None
        notes += more
        prop = solution.propagation
        if solution.over_limit is not None:
            fast_s, fast_bytes = solution.over_limit
            notes.append(f"the fastest plan ({fast_s * 1e3:.3f} ms per step) needs {fast_bytes / 2**30:.2f} GiB "
                         f"per rank, over the memory limit of {limit / 2**30:.2f} GiB: this plan is slower but fits")
        if prop.infeasible:
            raise PlanError(f"no feasible plan: {prop.infeasible}")
    return index, prop, notes


def _written(cap: Capture, index: GraphIndex, prop: Propagation, prof: Any, batch: int, seq: int,
             keep: frozenset, layout: Mapping[str, Any] | None, pinned: Mapping[str, Placement], limit: float,
             notes: list[str], replayed: Plan | None) -> tuple[Plan, GraphIndex, Propagation]:
    """The plan of ``prop`` on ``index`` (its tp), solved here or ``replayed`` from a saved plan:
    parameters, roles, collectives, costs and notes."""
    names, plan, tp = cap.output_names, replayed, index.tp
    uses = _first_uses(cap)
    params, shapes, roles = {}, {}, {}
    nodes = {n.name: n for n in cap.graph.nodes}
    for placeholder, fqn in cap.param_names.items():
        if fqn in cap.aliases:
            continue
        node = nodes[placeholder]
        p = prop.params.get(placeholder, REPLICATE)
        params[fqn] = p
        shapes[fqn] = tuple(int(s) for s in node.meta["val"].shape)
        use = uses.get(placeholder)
        roles[fqn] = role_of(p, use[0] if use else None, use[1] if use else -1, node.meta["val"].dim())
    if plan is None and tp > 1:
        # which experts layout each MoE layer got, against the other one (autotp/planner/experts.py)
        notes += experts_note(index, prof, expert_stacks(cap), roles, shapes, prop.total_s, limit, pinned, uses)
    comms = [CommOp(c.kind, c.tensor, c.consumer, repr(c.src), repr(c.dst), c.fwd_bytes, c.bwd_bytes, c.seconds,
                    module_path(nodes[c.consumer]) if c.consumer in nodes else "")
             for c in prop.comms]
    if plan is None and tp > 1:
        # the layers whose tokens go to their experts by an all-to-all, or could, against the other way
        notes += dispatch_note(index, prof, comms, roles, prop.total_s, limit, pinned)
        # the router's load it was priced at, and the choice a balanced router would get
        notes += load_notes(index, prof, roles, shapes, prop.total_s, limit, pinned)
    dtype_bytes = next(iter(n.meta["val"].element_size() for n in cap.graph.nodes
                            if n.op == "placeholder" and n.name in cap.param_names), 4)
    result = Plan(tp=tp, profile=prof.name, batch=batch, seq=seq, params=params, shapes=shapes, roles=roles,
                  # plain floats: a cost an expression of the shapes left unevaluated is a sympy number
                  # (an inference program's), which the plan's JSON cannot hold
                  comms=comms, compute_s=float(prop.compute_s), comm_s=float(prop.comm_s),
                  optimizer_s=float(prop.update_s), dtype_bytes=dtype_bytes,
                  aliases=dict(cap.aliases),
                  sharded_outputs={names[i]: prop.placements[n] for i, n in enumerate(cap.output_nodes)
                                   if index.keeps_split(i, n, prop.placements.get(n))},
                  memory_bytes=float(prop.memory_bytes), activation_bytes=float(prop.activation_bytes),
                  layer_input_bytes=float(prop.layer_input_bytes), recomputed=bool(index.recomputed), memory_limit=limit,
                  expressions=(cost_expressions(index, prop, prof) if plan is None
                               else DeferredExpressions(lambda: cost_expressions(index, prop, prof))),
                  notes=notes,
                  attention=attention_heads(index, prop),
                  # a replay keeps the layout it is given, and its drawing (recording one costs
                  # 0.24 s of gpt2-xl's 0.63 s replay, paid per call signature)
                  flows=record_flows(index, prop) if plan is None else plan.flows)
    if plan is not None and tp > 1 and index.force_sequence:   # a later program's, forced as the first
        result.notes += [note for note in (sequence_note(index, prop),) if note]
    if plan is None and tp > 1:
        for note in (sequence_note(index, prop), replicated_note(result, layout),
                     unsplit_attention_note(index, prop, result.attention or {}), unsplit_mixer_note(index, result)):
            if note:
                result.notes.append(note)
    return result, index, prop


def _experts_of(cap: Capture) -> dict[str, int]:
    """experts module -> its number of experts, of every stack of experts the capture reads."""
    shapes = {fqn: tuple(n.meta["val"].shape) for n in cap.graph.nodes
              if n.op == "placeholder" for fqn in [cap.param_names.get(n.name)] if fqn is not None}
    return moe_blocks(expert_stacks(cap), shapes)


def _solve(index: GraphIndex, prof: Any, pinned: Mapping[str, Placement], layout: Any,
           limit: float) -> tuple[Any, GraphIndex, list[str]]:
    """The fastest plan within ``limit``: the solver's, on ``index`` (sequence parallelism
    forced where ``index.force_sequence``). Returns the solution, the index it was solved on
    and notes (where sequence parallelism is used, and why)."""
    notes: list[str] = []
    try:
        solution = solve(index, prof, pinned, memory_limit=limit)
    except PlanError as exc:
        _blame_pins(index, pinned, prof, layout)
        if isinstance(exc, MemoryLimitError):
            exc.without_limit = (exc.fastest, index)
        raise
    if index.force_sequence and not sequence_regions(index, solution.propagation):
        raise PlanError(f"sequence_parallel=True, but {no_sequence_region(index, replayed=False)}. "
                        + sequence_fix(index))
    return solution, index, notes


def _blame_pins(index: GraphIndex, pinned: Mapping[str, Placement], prof: Any,
                layout: Mapping[str, Any] | None) -> None:
    """Raise a PlanError naming the pin that no plan can hold, where one alone cannot."""
    blame = unholdable_pin(index, pinned, prof, layout) if pinned else None
    if blame is not None:
        raise PlanError(f"no feasible plan: {blame}")


@dataclass
class Decided:
    """What a plan's search chose (:func:`decided`), enough for another rank of the group to
    rebuild the same plan, graph index and propagation of the same capture without searching
    (``build_plan(..., decided=)``; :mod:`autotp.distributed.plans`): the plan itself; the sibling
    products' sets kept apart (``apart``, by their products' names; None where none was looked
    for) and the row scales moved (``scales``), which make the capture planned from the one given;
    each op's strategy, by its index among those offered it (``Propagation.picked``); and the
    propagation's :func:`digest`, which the rebuilt one must match. ``deferred``: the plan's cost
    expressions are left to the rebuilding rank (computed when first read). It travels as JSON
    (:meth:`to_json`): autotp loads no pickle."""
    plan: Plan
    apart: frozenset | None
    scales: tuple
    picked: dict[str, int]
    digest: str
    deferred: bool

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "apart": None if self.apart is None else sorted(self.apart),
                "scales": [asdict(scale) for scale in self.scales], "picked": self.picked, "digest": self.digest,
                "deferred": self.deferred}

    @classmethod
    def from_json(cls, doc: dict) -> "Decided":
        apart = None if doc["apart"] is None else frozenset(tuple(key) for key in doc["apart"])
        return cls(Plan.from_json(doc["plan"]), apart, tuple(RowScale(**scale) for scale in doc["scales"]),
                   {str(k): int(v) for k, v in doc["picked"].items()}, str(doc["digest"]), bool(doc["deferred"]))


def decided(plan: Plan, index: GraphIndex, prop: Propagation) -> Decided:
    """What :func:`build_plan` chose for ``plan`` (its index and propagation), to send."""
    deferred = isinstance(plan.expressions, DeferredExpressions)
    return Decided(replace(plan, expressions={}) if deferred else plan, index.apart, index.moved_scales,
                   dict(prop.picked), digest(index, prop), deferred)


def digest(index: GraphIndex, prop: Propagation) -> str:
    """A fingerprint of a propagation on its index: every value's placement, every parameter's,
    every collective and conversion, and the costs, over the capture's nodes in order."""
    h = hashlib.sha256()
    for node in index.capture.graph.nodes:
        h.update(f"{node.name}:{prop.placements.get(node)!r};".encode())
    h.update(repr(sorted(prop.params.items())).encode())
    # (an f flag and a kind may be of several types: each as its repr, so that any two compare)
    h.update(repr(sorted((node.name, repr(dst), repr(f), repr(kind))
                         for (node, dst, f), kind in prop.conversions.items())).encode())
    h.update(repr(prop.comms).encode())
    h.update(repr((prop.compute_s, prop.comm_s, prop.memory_bytes, prop.activation_bytes, prop.update_s)).encode())
    return h.hexdigest()


def _rebuilt(index: GraphIndex, prof: Any, pinned: Mapping[str, Placement], plan: Plan | None, given: Decided,
             index_of: Any) -> tuple[Plan, GraphIndex, Propagation]:
    """``given``'s plan on ``index`` (the capture it was planned from): the row scales it moved
    moved, each op given the strategy it chose, the walk's result checked against its digest."""
    if given.scales:
        index = index_of(moved(index.capture, list(given.scales)))
        index.moved_scales = given.scales
    nodes = {n.name: n for n in index.capture.graph.nodes}
    unknown = [name for name in given.picked if name not in nodes]
    if unknown:
        raise PlanError(f"the plan decided elsewhere names {unknown[0]}, which is no op of this capture")
    prop = propagate(index, pinned, prof, forced={nodes[name]: j for name, j in given.picked.items()},
                     exact=plan is not None)
    if prop.infeasible:
        raise PlanError(f"the plan decided elsewhere does not replay here: {prop.infeasible}")
    if digest(index, prop) != given.digest:
        raise PlanError("the plan decided elsewhere replays here to other placements, collectives or costs")
    result = given.plan
    if given.deferred:
        result.expressions = DeferredExpressions(lambda: cost_expressions(index, prop, prof))
    return result, index, prop
