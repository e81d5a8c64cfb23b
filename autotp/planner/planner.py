"""A capture -> a :class:`~autotp.plan.Plan`: the graph indexed, the layout pinned, the
strategies solved (or a saved plan replayed) and the result written as a plan. What
:func:`autotp.plan`, :func:`autotp.parallelize` and the PTD-P planner (:mod:`autotp.ptd`) share."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from ..capture import Capture, gc_paused, module_path
from ..cost_model import get_profile
from ..cost_model.alignment import Align
from ..errors import ConfigError, MemoryLimitError, PlanError
from .experts import dispatch_note, expert_stacks, experts_note
from ..passes.pins import unholdable_pin
from ..passes.propagate import GraphIndex, Propagation, propagate
from ..passes.row_scales import moved
from .scales import narrower_scales, scales_note
from ..passes.solve import solve
from ..placements import REPLICATE, Placement, Routed, Shard
from ..plan.flow import record_flows
from ..plan.plan import CommOp, DeferredExpressions, Plan, attention_heads, cost_expressions, role_of, unsplit_attention_note
from .roles import _first_uses, _pinned

log = logging.getLogger(__name__)


@gc_paused()
def build_plan(cap: Capture, tp: int, *, batch: int, seq: int, profile: Any = None,
               layout: Mapping[str, Any] | None = None, plan: Plan | None = None,
               uneven: bool = True, gather_logits: bool | None = None,
               memory_limit: float | None = None,
               sequence_parallel: bool | None = None,
               input_placements: Mapping[str, Placement] | None = None,
               keep_split: frozenset[str] = frozenset(), align: Any = "profile",
               host_reads: bool = True,
               expert_dispatch: bool | None = None) -> tuple[Plan, GraphIndex, Propagation]:
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
    do not reach the experts split is planned by cost instead, with a note (api.py)."""
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

    def index_of(c: Capture) -> GraphIndex:
        index = GraphIndex.build(c, tp, batch, seq, uneven=uneven, sharded_outputs=keep,
                                 sequence_parallel=sequence_parallel is not False and uneven and tp > 1,
                                 input_placements=arriving, force_sequence=bool(sequence_parallel), align=align,
                                 host_reads=host_reads)
        index.expert_dispatch = expert_dispatch
        return index

    index = index_of(cap)
    pinned = _pinned(cap, layout, plan)
    if not host_reads:
        _refuse_model_reads(cap)
        try:
            return _planned(cap, index, prof, pinned, plan, layout, limit, batch, seq, keep, index_of)
        except PlanError as exc:   # a pin that only a layout reading to the host could hold
            if not isinstance(exc, MemoryLimitError):
                _refuse_pinned_reads(cap, pinned, tp, exc)
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
    return _written(index.capture, index, prop, prof, batch, seq, keep, layout, pinned, limit, notes, replayed=plan)


def _placed(cap: Capture, index: GraphIndex, prof: Any, pinned: Mapping[str, Placement], plan: Plan | None,
            layout: Mapping[str, Any] | None, limit: float, batch: int, seq: int,
            keep: frozenset) -> tuple[GraphIndex, Propagation, list[str]]:
    """``plan`` replayed on ``index``, or the solver's placements under ``pinned`` within
    ``limit``: (the index solved on, the propagation, notes)."""
    notes: list[str] = []
    if plan is not None:
        prop = _under_pins(index, prof, pinned)
        if index.force_sequence and not sequence_regions(index, prop):
            raise PlanError(f"sequence_parallel=True, but {_no_sequence_region(index, replayed=True)}. "
                            + _sequence_fix(index))
    else:
        try:
            solution, index, more = _solve(index, prof, pinned, layout, limit)
        except MemoryLimitError as exc:
            error = _what_memory_takes(exc, index, batch, seq)
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


def _under_pins(index: GraphIndex, prof: Any, pinned: Mapping[str, Placement]) -> Propagation:
    """A saved plan's parameter placements on another capture (a later program of ``parallelize``:
    an inference call, a padded one, a generation step): the solver's plan of the activations
    under those placements held exactly, or the op-by-op greedy walk's where that is cheaper (the
    search cut at MAX_STATES) or the solver finds none. The greedy walk alone chose each op's
    placement without the conversions it leaves to later ops: Mixtral's inference program at batch
    64 reduce-scattered the attention's partial sum along the hidden dim into the residual add (half
    an all-reduce, half the add) and then all-gathered it twice for the norm, 2% slower by the
    cost model than the solver's plan under the same pins. Forced (``index.force_sequence``), a
    walk that splits fewer regions along the sequence than the solver's plan is not taken however
    cheap: Falcon's prefill step at tp 3 walked to its row-parallel products with x whole and
    gathered their pinned weights (through the transpose, which the solver never does), leaving
    no partial sum to reduce-scatter. Nor is a walk taken that moves a sharded parameter (a view of
    it converted, :meth:`GraphIndex.moves_parameter`, which the solver never does): the pin would
    hold in name only. Falcon's decode step at tp 4 walked its row-pinned weights through their
    transposes into an all-to-all to ``S(1)``, its inference call at a small workload all-gathered
    them, each cheaper by the cost model; where the solver finds no plan and the walk moves one,
    the program is a PlanError naming the weight."""
    greedy = propagate(index, pinned, prof, exact=True)
    moved = [] if greedy.infeasible else moved_parameters(index, greedy)
    try:
        solved = solve(index, prof, pinned, exact=True).propagation
    except PlanError as exc:
        if greedy.infeasible:
            raise PlanError(f"the given plan does not fit this model: {exc}") from exc
        if moved:
            param, placed, tensor, src, dst = moved[0]
            more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
            raise PlanError(
                f"under the plan's parameter placements this program ({index.capture.model_name}, tp={index.tp}) "
                f"runs only by moving {param}, placed {placed}: {tensor} would be converted {src} -> {dst} at run "
                f"time, so the placement would hold in name only{more} (the solver found no plan that keeps it: "
                f"{exc}). Pin {param} another way (layout=), or let the planner choose its layout") from exc
        # the walk is a path the search holds, so only a search cut at MAX_STATES loses it
        log.info("autotp: a later program is planned op by op (the solver found no plan under the given "
                 "placements: %s)", exc)
        return greedy
    if moved:
        return solved
    if index.force_sequence and not greedy.infeasible \
            and sequence_regions(index, greedy) < sequence_regions(index, solved):
        return solved
    return greedy if not greedy.infeasible and greedy.total_s < solved.total_s else solved


def moved_parameters(index: GraphIndex, prop: Propagation) -> list[tuple[str, Placement, str, Placement, Placement]]:
    """The sharded parameters ``prop`` moves at run time (:meth:`GraphIndex.moves_parameter`: a
    parameter, or a view of a sharded one, converted), as (parameter, its placement, the tensor
    converted, from, to)."""
    from ..passes.propagate import _meta

    nodes = {n.name: n for n in index.capture.graph.nodes}
    found = []
    for c in prop.comms:
        node = nodes.get(c.tensor)
        if node is None or node not in index.param_views:
            continue
        meta = _meta(node)
        if meta is not None and index.moves_parameter(node, c.src, c.dst, meta):
            root = node
            while root.name not in index.capture.param_names and root.args:
                root = root.args[0]
            found.append((index.capture.param_names.get(root.name, root.name), prop.params.get(root.name, REPLICATE),
                          c.tensor, c.src, c.dst))
    return found


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
    dtype_bytes = next(iter(n.meta["val"].element_size() for n in cap.graph.nodes
                            if n.op == "placeholder" and n.name in cap.param_names), 4)
    result = Plan(tp=tp, profile=prof.name, batch=batch, seq=seq, params=params, shapes=shapes, roles=roles,
                  comms=comms, compute_s=prop.compute_s, comm_s=prop.comm_s, optimizer_s=prop.update_s,
                  dtype_bytes=dtype_bytes,
                  aliases=dict(cap.aliases),
                  sharded_outputs={names[i]: prop.placements[n] for i, n in enumerate(cap.output_nodes)
                                   if index.keeps_split(i, n, prop.placements.get(n))},
                  memory_bytes=prop.memory_bytes, activation_bytes=prop.activation_bytes, memory_limit=limit,
                  expressions=(cost_expressions(index, prop, prof) if plan is None
                               else DeferredExpressions(lambda: cost_expressions(index, prop, prof))),
                  notes=notes,
                  attention=attention_heads(index, prop),
                  # a replay keeps the layout it is given, and its drawing (recording one costs
                  # 0.24 s of gpt2-xl's 0.63 s replay, paid per call signature)
                  flows=record_flows(index, prop) if plan is None else plan.flows)
    if plan is not None and tp > 1 and index.force_sequence:   # a later program's, forced as the first
        result.notes += [note for note in (_sequence_note(index, prop),) if note]
    if plan is None and tp > 1:
        for note in (_sequence_note(index, prop), _replicated_note(result, layout),
                     unsplit_attention_note(index, prop, result.attention or {}), _unsplit_mixer_note(index, result)):
            if note:
                result.notes.append(note)
    return result, index, prop


#: below this share of parameter bytes split across ranks, a plan says why and how to split more
SPLIT_SHARE_NOTED = 0.5


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
        raise PlanError(f"sequence_parallel=True, but {_no_sequence_region(index, replayed=False)}. "
                        + _sequence_fix(index))
    return solution, index, notes


def _no_sequence_region(index: GraphIndex, replayed: bool) -> str:
    """Why a forced program holds no region along the sequence, as a clause: it has no sequence
    dim, its fixed length is shorter than tp, or no partial sum meets an op along it (in a plan
    solved here, or under a saved plan's placements: ``replayed``)."""
    cap, tp = index.capture, index.tp
    lengths = sorted(cap.static_lengths)
    if not index.sequence and not lengths:
        return (f"this program ({cap.model_name}, tp={tp}) has no sequence dim to split: no input's length is "
                "dynamic or fixed by export (the example inputs' sequence dims are held static, or the model takes "
                "none)")
    if not sequence_to_split(cap, tp):
        return (f"this program ({cap.model_name}) holds its sequence at {_tokens(lengths)} (torch.export fixed the "
                f"length: the forward reads it as a number), fewer than tp={tp}: no split of it gives every rank a "
                "token")
    along = "a dynamic sequence dim" if not lengths else f"the sequence (held static at {_tokens(lengths)})"
    if replayed:
        return ("under the plan's parameter placements no row-parallel product's partial sum meets an add, a dropout "
                f"or a cast along {along} in this program ({cap.model_name}, tp={tp}): nothing here can be "
                "reduce-scattered along the sequence")
    return (f"no row-parallel product's partial sum meets an add, a dropout or a cast along {along} in this plan at "
            f"tp={tp} (no layer is split so that a reduce-scatter along the sequence can replace its all-reduce)")


def _tokens(lengths: list[int]) -> str:
    return " or ".join(f"{n} token{'s' if n != 1 else ''}" for n in lengths)


def _sequence_fix(index: GraphIndex) -> str:
    """What a user can do where a forced program holds no region along the sequence."""
    if sequence_to_split(index.capture, index.tp):
        return ("Pin a row-parallel layout (layout={'<glob>': 'row'}), or leave sequence_parallel to the planner "
                "(None)")
    return (f"Capture with a sequence of at least tp={index.tp} tokens (example_kwargs= with longer inputs), or leave "
            "sequence_parallel to the planner (None)")


def sequence_to_split(cap: Capture, tp: int) -> bool:
    """Whether a program has a sequence sequence parallelism may split at ``tp``: a dynamic
    sequence dim, or a length it holds as a number of at least ``tp`` tokens."""
    return "seq" in cap.dim_symbols.values() or any(n >= tp for n in cap.static_lengths)


#: ops of a model's program that read device values on the host whatever the layout: a value read
#: (``.item()``, ``bool(t)``, ``torch.equal``), an output sized by the values, transformers' grouped
#: experts fallback (its offsets, ``.tolist()``)
_READS_VALUES = ("aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default",
                 "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                 "aten.unique_dim.default", "aten.unique_consecutive.default",
                 "transformers.grouped_mm_fallback.default")


def _refuse_pinned_reads(cap: Capture, pinned: Mapping[str, Placement], tp: int, exc: PlanError) -> None:
    """``host_reads=False`` and no plan: where whole experts are pinned per rank (expert
    parallelism, whose rows a rank counts on the host), a PlanError that says so (Llama-4's
    experts, every token through every expert, hold such a pin without a read)."""
    stacks = expert_stacks(cap)
    whole = [stacks[p] for p, placement in pinned.items()
             if p in stacks and isinstance(placement, Shard) and placement.dim == 0]
    if whole and tp > 1:
        raise PlanError(f"host_reads=False, but the layout pins {whole[0]} to whole experts per rank (expert "
                        "parallelism), where a rank reads how many rows its experts got on the host every step: pin "
                        "'expert_column'/'expert_row' (expert-TP), or allow host_reads") from exc


def _refuse_model_reads(cap: Capture) -> None:
    """``host_reads=False``: a PlanError where the model's own program reads values on the host."""
    from ..passes.rules.registry import op_name

    reading: dict[str, None] = {}   # each op in each module once, in graph order
    for node in cap.graph.nodes:
        name = op_name(node.target) if node.op == "call_function" else ""
        is_sized = name == "aten.repeat_interleave.Tensor" and node.kwargs.get("output_size") is None
        if name in _READS_VALUES or is_sized:
            reading[f"{name} in {module_path(node) or 'the model'}"] = None
    if reading:
        fallback = any("grouped_mm_fallback" in r for r in reading)
        raise PlanError(
            f"host_reads=False, but the model's own program reads device values on the host, whatever the layout: "
            f"{'; '.join(list(reading)[:3])}{f' and {len(reading) - 3} more' if len(reading) > 3 else ''}. "
            + ("transformers runs its experts through grouped_mm_fallback where torch's grouped kernel does not take "
               "the dtype under capture (anything but bfloat16): run the model in bfloat16, or set "
               "config._experts_implementation = 'batched_mm'; " if fallback else "")
            + "or allow host_reads (the reads then stop the host each step)")


def _sequence_note(index: GraphIndex, prop: Propagation) -> str | None:
    """Where a plan runs regions split along the sequence, and whether by cost or forced."""
    regions = sequence_regions(index, prop)
    if not regions:
        return None
    how = "forced (sequence_parallel=True)" if index.force_sequence else "chosen by cost (cheaper than all-reducing there)"
    return (f"sequence parallelism in {regions} region{'s' if regions > 1 else ''}, {how}: layer norms, dropouts and "
            "residual adds run on s/tp tokens between a reduce-scatter and an all-gather along s (Megatron-SP's ḡ "
            "and f̄)")


def sequence_dropped(inputs: Mapping[str, Any], training: bool, step: str, cap: Capture, tp: int) -> str:
    """The note of a later program of ``parallelize`` planned by cost under
    ``sequence_parallel=True`` because it has no sequence to split (:func:`sequence_to_split`):
    a decode step's one token (``step="decode"``), lengths its capture holds static and not
    asked dynamic (a one-token prompt), or a length export fixed that is shorter than ``tp``."""
    if step:
        call = f"a generation {step} step"
    else:
        given = ", ".join(sorted(k for k, v in inputs.items() if v is not None))
        call = f"the call with {given} ({'training' if training else 'eval'} mode)"
    lengths = sorted(cap.static_lengths)
    if step == "decode":
        why = "it runs one token a row: there is no sequence to split (its cache stays split by head)"
    elif lengths:
        why = (f"its capture holds the sequence at {_tokens(lengths)} (torch.export fixed the length), fewer than "
               f"tp={tp}: no split of it gives every rank a token")
    else:
        why = "its capture holds every length static (a one-token prompt): there is no sequence dim to split"
    return (f"sequence_parallel=True does not apply to the program of {call}: {why}, so it is planned by cost "
            "(every program with a sequence to split is forced)")


def sequence_regions(index: GraphIndex, prop: Propagation) -> int:
    """How many regions of a propagation run split along the sequence: reduce-scatters of a
    Partial along a dynamic dim or along the length a program holds as a number
    (``Capture.static_lengths``: Mamba's capture on CPU), or into the tokens' rows of a sequence
    split flattened with the batch (``[b*s, h]``: OPT's MLP)."""
    from ..passes.propagate import _meta
    from ..passes.rules.registry import along_sequence

    nodes = {n.name: n for n in index.capture.graph.nodes}
    count = 0
    for c in prop.comms:
        if c.kind == "reduce_scatter" and isinstance(c.dst, Routed) and c.dst.tokens:
            count += 1
        elif c.kind == "reduce_scatter" and isinstance(c.dst, Shard) and c.tensor in nodes:
            meta = _meta(nodes[c.tensor])
            if meta is not None and (meta.static(c.dst.dim) is None or along_sequence(meta, c.dst.dim, index.sequence)):
                count += 1
    return count


def _what_memory_takes(exc: MemoryLimitError, index: GraphIndex, batch: int, seq: int) -> MemoryLimitError:
    """``exc`` (no plan fits the memory limit; the solver found what the fastest plan needs) with
    a message that says it: the bytes per rank, training state against activations, and what
    would bring them under the limit, the larger part's remedies first."""
    gib, limit, tp = 2 ** 30, exc.limit_bytes, index.tp
    state, acts = exc.state_bytes, exc.activation_bytes
    for_state = ("a larger tp, pipeline stages (autotp.plan(..., world=N) chooses tp x pp x dp) or data-parallel "
                 "sharding (autotp.runtime.fsdp.fully_shard) for the training state")
    for_acts = "a smaller batch or seq, or activation_checkpointing=True, for the activations"
    fixes = f"{for_state}; {for_acts}" if state >= acts else f"{for_acts}; {for_state}"
    message = (f"no plan fits the memory limit of {limit / gib:.2f} GiB per rank at tp={tp} (the slower plans that "
               f"shard more were searched too): the fastest plan needs {exc.needed_bytes / gib:.2f} GiB per rank, "
               f"training state {state / gib:.2f} GiB (weights, gradients, Adam's moments) and activations "
               f"{acts / gib:.2f} GiB at batch {batch}, seq {seq}. Use {fixes}; or raise memory_limit")
    return MemoryLimitError(message, exc.needed_bytes, state, acts, limit)


def _unsplit_mixer_note(index: GraphIndex, result: Plan) -> str | None:
    """Why a Mamba2 in-projection (``[z | x | B | C | dt]``, its ``x | B | C`` split again after
    the convolution: :func:`~autotp.passes.hints._grouped_pieces`) is not split by head where tp
    cannot deal its head groups: it is whole, or its z dealt and the rest whole (a tail). B's and
    C's rows, whole on every rank where there are fewer groups than ranks, must divide into as
    many parts as the heads: 6 heads beside a state of 4 make 2 groups, too few for tp 3."""
    import math

    import torch

    from ..passes.hints import _grouped_pieces, _piece_atoms
    from ..plan.plan import _projection

    cap, tp, uneven = index.capture, index.tp, index.uneven
    unsplit: list[tuple[str, Placement, int, int]] = []
    for node in cap.graph.nodes:
        if node.target is not torch.ops.aten.split_with_sizes.default or "val" not in node.args[0].meta:
            continue
        d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % node.args[0].meta["val"].dim()
        blocks = _piece_atoms(node, d, tp, uneven, None, nested_ok=True)
        if blocks is None or not any(inner for _, _, inner in blocks) or _grouped_pieces(node, d, tp, uneven, None):
            continue
        _, param = _projection(node.args[0], cap.param_names)
        placement = result.params.get(param)
        if param is not None and not (isinstance(placement, Shard) and placement.sizes):
            # as _grouped_pieces reads it: B and C (inner pieces of fewer atoms than ranks) whole,
            # the others dealt in as many head groups as divide every piece
            held = [inner and atoms < tp for _, atoms, inner in blocks]
            dealt = math.gcd(*(atoms for (_, atoms, _), h in zip(blocks, held) if not h))
            groups = math.gcd(dealt, *(width for (width, _, _), h in zip(blocks, held) if h))
            unsplit.append((param, placement, dealt, groups))   # dealt: x's and dt's heads (z counts elements)
    if not unsplit:
        return None
    param, placement, heads, groups = unsplit[0]
    fits = [t for t in range(2, groups + 1) if groups % t == 0 or uneven]
    why = f"fewer than tp={tp}" if groups < tp else f"not a multiple of tp={tp} (uneven=False)"
    n = len(unsplit)
    return (f"{n} Mamba2 in-projection{'s' if n > 1 else ''} ({param}: {placement}{', ...' if n > 1 else ''}) "
            f"not split by head, the mixer's scan unsplit: its {heads} heads and the rows of B and C divide "
            f"into {groups} head group{'s' if groups > 1 else ''} at most, {why}"
            + (f"; tp in {fits} splits it by head" if fits else "")
            + ". The model computes what the serial one does")


def _replicated_note(result: Plan, layout: Mapping[str, Any] | None) -> str | None:
    """Why most of the model stays whole, and how to force splits, when the solver left it so."""
    serial = result.serial_param_bytes()
    saved = serial - max(result.param_bytes_per_rank())
    share = saved / (serial * (1 - 1 / result.tp)) if serial else 1.0   # 1.0: every byte split tp ways
    if share >= SPLIT_SHARE_NOTED:
        return None
    return (f"most of the model runs replicated (the split saves {share:.0%} of what splitting everything "
            f"{result.tp} ways would): at this workload (batch={result.batch}, seq={result.seq}, profile "
            f"{result.profile}) the collectives a split needs cost more than the compute it saves. To split "
            "more: pin roles with layout={'<glob>': 'column'|'row'|'vocab'}, plan for the workload you will "
            "run (batch=, seq=), or pass the profile of the hardware (profile=)"
            + ("" if not layout else "; the given layout's pins are applied"))


def _blame_pins(index: GraphIndex, pinned: Mapping[str, Placement], prof: Any,
                layout: Mapping[str, Any] | None) -> None:
    """Raise a PlanError naming the pin that no plan can hold, where one alone cannot."""
    blame = unholdable_pin(index, pinned, prof, layout) if pinned else None
    if blame is not None:
        raise PlanError(f"no feasible plan: {blame}")
