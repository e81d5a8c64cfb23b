"""The pipeline, nothing else: capture -> propagate/solve -> plan -> rewrite -> ParallelModule.

``plan``, ``parallelize`` and ``from_pretrained`` are thin entry points: the planner is
:func:`autotp.planner.build_plan`, head checks :mod:`autotp.passes.attention`, a checkpoint's
reading :mod:`autotp.runtime.checkpoint.loading`, the ranks' agreement :mod:`autotp.distributed.agreement`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Mapping

import torch
from torch import nn

from .arguments import check_flag, check_planning
from .capture import example_like, fits_call, lengths_of, on_meta, seq_bounds, shape_twin
from .capture import cache as capture_cache
from .capture.cache import capture as capture_model   # once per structure; see its docs
from .cost_model import PROFILES, get_profile
from .cost_model.alignment import Align
from .cost_model.pipeline import cut_layers, layer_costs
from .errors import ConfigError, MemoryLimitError, PlanError
from .generation import capture_step
from .passes.attention import check_heads
from .passes.checkpoint import checkpoint_layers
from .passes.propagate import GraphIndex, Propagation
from .passes.rewrite import rewrite
from .plan import Plan
from .plan.arguments import resolve
from .planner.experts import forced_dispatch_dropped
from .planner.planner import Decided, build_plan, decided as decided_of
from .planner.sequence import sequence_dropped, sequence_to_split
from .distributed.agreement import _agreed_seed, _on_every_rank_or_none
from .distributed.captures import AGREED, captured_once, placed
from .distributed.plans import planned_once
from .distributed.rng import RNGTracker

log = logging.getLogger("autotp")


def check_tp(tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    return tp


def _planning_seq(model: nn.Module, seq: int | None, seq_range: tuple[int, int] | None = None) -> int:
    """The workload's sequence length (``seq``, else the default), with a warning when it is
    longer than the captured program takes: the plan then prices a workload the model cannot
    run (its layouts still serve every length it can)."""
    if seq is None:
        return _default_seq(model)
    longest = seq_bounds(model, seq_range)[1]
    if seq > longest:
        why = "the seq_range asked" if seq_range is not None else "its config's maximum positions"
        log.warning("autotp: planning for seq=%d, but %s takes at most %d tokens (%s): the costs are those of "
                    "a workload it cannot run; pass seq= up to %d for the plan of what will run",
                    seq, type(model).__name__, longest, why, longest)
    return seq


def _default_seq(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return min(getattr(config, name), 1024)
    return 1024


def plan(model: nn.Module, tp: int | None = None, *, batch: int = 8, seq: int | None = None, profile: Any = None,
         layout: Mapping[str, Any] | None = None, uneven: bool = True, gather_logits: bool | None = None,
         example_inputs: tuple = (), example_kwargs: dict | None = None,
         memory_limit: float | None = None, sequence_parallel: bool | None = None,
         seq_range: tuple[int, int] | None = None, world: int | None = None,
         gpus_per_node: int = 8, host_reads: bool = True,
         expert_dispatch: bool | None = None, fuse_activations: bool = True,
         fuse_norms: bool = True, fuse_products: bool = True, expert_load: Any = None,
         activation_checkpointing: bool = False) -> "Plan | PipelinePlan":
    """Choose a plan for ``model`` at ``tp`` without any process group (a meta model works).

    ``world=N`` (with ``gpus_per_node``) chooses tensor x pipeline x data parallelism for N GPUs
    instead and returns an :class:`autotp.ptd.PipelinePlan` (t, p, d, micro-batch, schedule,
    predicted step time, bubble, memory per GPU and why; ``batch`` is the global batch, ``tp``
    fixes t). It plans only; ``parallelize(model, **pplan.parallelize_kwargs())`` runs the choice,
    pipeline stages included.

    ``gather_logits``: by default logits stay split by vocabulary in a call that returns a loss
    (labels given, as in the default example inputs: the b*s*V all-gather is not paid) and are
    gathered in one without; True or False fixes it (see :func:`build_plan`).
    ``memory_limit``: bytes per rank the plan may use (default: the profile's device memory).
    ``sequence_parallel``: see :func:`build_plan` (default: offered, chosen by cost).
    ``seq_range=(min, max)``: sequence lengths the captured program accepts (default: 2 up to
    the config's maximum positions, else as wide as torch.export allows).
    ``host_reads=False``: only layouts whose step reads no device value on the host (see
    :func:`parallelize`). ``expert_dispatch``: see :func:`build_plan` (default: by cost).
    ``fuse_activations``, ``fuse_norms``, ``fuse_products``: see :func:`parallelize`.
    ``expert_load``: the router's load expert parallelism is priced at (default None: a balanced
    router); :func:`autotp.measure_expert_load` measures it, see :func:`build_plan`.
    ``activation_checkpointing=True``: price the run :func:`parallelize` makes with it (each
    repeated layer recomputed in backward: less memory, each layer's forward twice)."""
    if not isinstance(activation_checkpointing, bool):
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: it is True or False")
    batch, seq, layout, memory_limit = check_planning(batch, seq, layout, memory_limit)
    host_reads = check_flag("host_reads", host_reads)
    fuse_activations = check_flag("fuse_activations", fuse_activations)
    fuse_norms = check_flag("fuse_norms", fuse_norms)
    fuse_products = check_flag("fuse_products", fuse_products)
    if world is not None:
        from .ptd import plan_ptd

        return plan_ptd(model, world, gpus_per_node=gpus_per_node, batch=batch, seq=_planning_seq(model, seq),
                        profile=profile, tp=None if tp is None else check_tp(tp))
    if tp is None:
        raise ConfigError("autotp.plan needs tp (or world= to choose tensor x pipeline x data parallelism)")
    tp = check_tp(tp)
    cap = capture_model(model, example_inputs, example_kwargs, seq_range=seq_range)
    check_heads(cap, tp, uneven)
    if profile is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        runs = _default_profile(device) if device.type != "meta" else None
        if runs is not None and runs != get_profile(None).name:
            log.info("autotp.plan uses the default profile %s; parallelize on this model's device (%s) "
                     "would default to %s: pass profile= to both to plan what runs",
                     get_profile(None).name, device, runs)
    result, _, _ = build_plan(cap, tp, batch=batch, seq=_planning_seq(model, seq, seq_range), profile=profile,
                              layout=layout, uneven=uneven, gather_logits=gather_logits,
                              memory_limit=memory_limit, sequence_parallel=sequence_parallel, host_reads=host_reads,
                              expert_dispatch=expert_dispatch, fuse_activations=fuse_activations,
                              fuse_norms=fuse_norms, fuse_products=fuse_products, expert_load=expert_load,
                              activation_checkpointing=activation_checkpointing)
    return result


def _align(align_products: Any, device: torch.device, profile: Any) -> Align | None:
    """Which products the rewrite pads (see :func:`parallelize`)."""
    if align_products is True:
        return Align()
    if align_products is False or (align_products is None and device.type != "cuda"):
        return None
    if align_products is None:
        return Align.for_profile(get_profile(profile or _default_profile(device)))
    raise ConfigError(f"align_products={align_products!r}: choose None (pad unaligned products on CUDA where "
                      "they are large enough to pay), True (pad every one) or False (pad none)")


def _default_profile(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device)
    for key, prof in (("H100", "h100-dgx"), ("H200", "h200"), ("A100", "a100-dgx"), ("V100", "v100-dgx2h")):
        if key in name:
            return prof
    return "h100-dgx"


def parallelize(model: nn.Module, tp: int, *, plan: Plan | None = None, layout: Mapping[str, Any] | None = None,
                profile: Any = None, batch: int | None = None, seq: int | None = None, uneven: bool | None = None,
                gather_logits: bool | None = None, memory_limit: float | None = None,
                example_inputs: tuple = (), example_kwargs: dict | None = None,
                device: torch.device | str | None = None,
                backend: str | None = None, seed: int | None = None,
                activation_checkpointing: bool = False,
                sequence_parallel: bool | None = None,
                seq_range: tuple[int, int] | None = None, pp: int = 1, microbatches: int | None = None,
                schedule: str | None = None, virtual: int = 1,
                stage_layers: Any = None, rng: str = "torch",
                align_products: bool | None = None, host_reads: bool | None = None,
                expert_dispatch: bool | None = None, fuse_activations: bool | None = None,
                fuse_norms: bool | None = None, fuse_products: bool | None = None,
                expert_load: Any = None) -> "ParallelModule":
    """Split ``model`` over this rank's TP group; see the module docs and docs/architecture.md.

    ``plan``: a plan made before (:func:`plan`, or ``Plan.from_json``) to run instead of planning
    here. Its programs are built with the arguments it was made with (``plan.arguments``:
    ``sequence_parallel``, ``expert_dispatch``, ``gather_logits``, ``host_reads``,
    ``fuse_activations``, ``fuse_norms``, ``fuse_products``, ``uneven``, ``expert_load``), so that they are the ones ``parallelize``
    with those arguments builds; each of them left unset (None) takes the plan's, and one given
    that contradicts the plan's is a ConfigError (re-plan with it, or drop it). ``profile``,
    ``batch`` and ``seq`` (the device and workload later programs' activations are priced at)
    default to the plan's and may be given: they are the run's. ``align_products``,
    ``activation_checkpointing``, ``seed``, ``rng`` and the pipeline's arguments are the run's too;
    ``memory_limit`` does not move a saved plan's placements. A plan saved before its arguments
    were recorded (plan file version 1) is built with the arguments given, as before.

    Without a plan: ``batch`` defaults to 8, ``uneven``, ``host_reads``, ``fuse_activations``,
    ``fuse_norms`` and ``fuse_products`` to True, and :func:`plan` documents each.

    ``pp > 1`` also cuts it into ``pp`` pipeline stages (a world of ``dp * pp * tp`` ranks) and
    returns this rank's stage, a :class:`~autotp.runtime.pipeline.PipelineModule` whose
    ``step(**batch)`` trains on ``microbatches`` micro-batches (default ``pp``) under
    ``schedule`` (``"1f1b"`` by default, ``"gpipe"``, or ``"interleaved1f1b"`` with ``virtual``
    chunks per stage), run by ``torch.distributed.pipelining``. The repeated layers are cut into
    chunks by the cost model, or ``stage_layers=[n0, n1, ...]`` (one count per chunk, in order).

    ``activation_checkpointing=True`` recomputes each repeated layer in backward instead of
    keeping its activations (autotp.passes.checkpoint); the plan is priced so (its memory, the
    memory limit it is held to, the recomputation's time). ``sequence_parallel``: see
    :func:`build_plan` (default: offered, chosen by cost; ``True`` forces it in every program
    with a sequence to split, a length export fixed included, and is a PlanError where the first
    has none; ``False`` forbids it in every program).

    ``seed`` seeds dropout in the rewritten graph (default: TP rank 0's ``torch.initial_seed()``,
    shared with its group): replicated regions draw the same masks on every TP rank, sharded
    regions their own (autotp.distributed.rng). ``rng="torch"`` draws them from torch's generator
    in eager calls and counter-based under torch.compile; ``rng="counter"`` counter-based in both
    (slower in eager; a compiled program then draws exactly the eager program's masks).

    ``align_products``: a matrix product whose output width on a rank is off the GPU's 16-byte
    alignment (GPT-2's 50257-word head split 8 ways: 6282 or 6283 rows) runs padded to an
    aligned width, its output sliced back, every result unchanged
    (:mod:`autotp.cost_model.alignment`). ``None`` (default): on a CUDA device, for products
    over at least the profile's :func:`~autotp.cost_model.alignment.padding_rows` rows at the
    planning workload; ``True``: every such product, on any device; ``False``: none.

    ``host_reads=False``: the plan takes only layouts whose steady-state step reads no device
    value on the host (a read stops the host until the device has run everything queued before
    it). Expert parallelism reads how many rows each rank's experts got (one read per expert
    layer), so the experts run expert-TP (or replicated); a layout pinning whole experts per
    rank, or a model op that reads on the host whatever the layout, is a PlanError naming it.
    Default True: the planner weighs a read's price like any other cost.

    ``expert_dispatch``: where the tokens arrive split along the sequence, whether expert
    parallelism's (token, expert) rows reach their experts by the all-to-all dispatch (True),
    by gathering the tokens whole (False), or as the cost model finds cheaper (None, default);
    in every program (see :func:`build_plan`), but that a later program whose tokens reach the
    experts whole, where True leaves no plan, is planned by cost, with a logged note.

    ``fuse_activations`` (default True): an activation the model writes out as pointwise ops
    (GPT-2's tanh-GELU: ``mul``, ``pow``, ``add``, ``tanh``, about 18 kernels forward and backward)
    runs as the one ATen op that computes it (``aten.gelu``: one kernel each way), in every
    program, tp 1 included (:mod:`autotp.passes.activations`); the plan's notes say what was
    fused. ``False`` runs the ops as the model writes them.

    ``fuse_norms`` (default True): an RMSNorm the model writes out (``pow``, ``mean``, ``add``,
    ``rsqrt``, ``mul``: HF's Llama and its kin) runs its statistic as one ``aten.rms_norm`` (on
    CUDA one kernel each way; on CPU the same ops in the same order), the model's casts and weight
    multiply kept as written (:mod:`autotp.passes.norms`); ``False`` runs the ops as written, as
    ``sequence_parallel=False`` does (see :func:`~autotp.planner.build_plan`).

    ``fuse_products`` (default True): sibling products, ``linear``s of one input (Llama's q, k, v
    projections, its gate and up), run as one product of their weights joined at each step, its
    output split back (:mod:`autotp.passes.products`): one product forward and one input-gradient
    product backward instead of three, no ``add``s of their input gradients, a wider and faster
    product on each rank. The parameters stay the model's own. Where the siblings cannot be split
    alike (fewer kv heads than ranks) or a layout pins them unalike (one ``row``), the plan runs
    them apart (the cheaper of the two plans, or the pins' reading);
    the plan's notes say what was fused. ``False`` runs them as written.


    ``expert_load``: the router's load expert parallelism is priced at (an :class:`autotp.ExpertLoad`
    from :func:`autotp.measure_expert_load`, or a mapping of each MoE layer's experts module to its
    rows per expert; default None: a balanced router). See :func:`~autotp.planner.build_plan`."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if torch.device(device).type == "meta":
        raise ConfigError("parallelize needs real weights: the model is on the meta device "
                          "(use autotp.plan for planning only, or autotp.from_pretrained to load a checkpoint)")
    return _parallelize(model, tp, None, plan=plan, layout=layout, profile=profile, batch=batch, seq=seq,
                        uneven=uneven, gather_logits=gather_logits, memory_limit=memory_limit,
                        example_inputs=example_inputs, example_kwargs=example_kwargs, device=device,
                        backend=backend, seed=seed, activation_checkpointing=activation_checkpointing,
                        sequence_parallel=sequence_parallel, seq_range=seq_range, pp=pp,
                        microbatches=microbatches, schedule=schedule, virtual=virtual,
                        stage_layers=stage_layers, rng=rng, align_products=align_products, host_reads=host_reads,
                        expert_dispatch=expert_dispatch, fuse_activations=fuse_activations,
                        fuse_norms=fuse_norms, fuse_products=fuse_products, expert_load=expert_load)


def _parallelize(model: nn.Module, tp: int, weights: Any, *, plan: Plan | None, layout: Mapping[str, Any] | None,
                 profile: Any, batch: int | None, seq: int | None, uneven: bool | None, gather_logits: bool | None,
                 memory_limit: float | None, example_inputs: tuple, example_kwargs: dict | None,
                 device: torch.device | str, backend: str | None, seed: int | None,
                 activation_checkpointing: bool, sequence_parallel: bool | None = None,
                 seq_range: tuple[int, int] | None = None, pp: int = 1, microbatches: int | None = None,
                 schedule: str | None = None, virtual: int = 1,
                 stage_layers: Any = None, rng: str = "torch",
                 align_products: bool | None = None, host_reads: bool | None = None,
                 expert_dispatch: bool | None = None, fuse_activations: bool | None = None,
                 fuse_norms: bool | None = None, fuse_products: bool | None = None,
                 expert_load: Any = None) -> "ParallelModule":
    from .distributed.mesh import get_mesh
    from .runtime.module.module import ParallelModule
    from .runtime.module.outline import layer_paths
    from .runtime.pipeline.stage import PipelineModule, check_pipeline

    tp = check_tp(tp)
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigError(f"plan= takes an autotp.Plan (autotp.plan(...), or autotp.Plan.from_json(text)), not "
                          f"{type(plan).__name__}")
    # the programs are built with the plan's arguments (autotp/plan/arguments.py)
    planned_with = resolve(plan, sequence_parallel=sequence_parallel, expert_dispatch=expert_dispatch,
                           gather_logits=gather_logits, host_reads=host_reads, fuse_activations=fuse_activations,
                           fuse_norms=fuse_norms, fuse_products=fuse_products, uneven=uneven,
                           expert_load=expert_load)
    sequence_parallel, expert_dispatch = planned_with["sequence_parallel"], planned_with["expert_dispatch"]
    expert_load = planned_with["expert_load"]
    gather_logits, host_reads, uneven = planned_with["gather_logits"], planned_with["host_reads"], planned_with["uneven"]
    fuse_activations, fuse_norms = planned_with["fuse_activations"], planned_with["fuse_norms"]
    fuse_products = planned_with["fuse_products"]
    if batch is None:   # the workload later programs are priced at: the plan's, unless given
        batch = plan.batch if plan is not None else 8
    if seq is None and plan is not None:
        seq = plan.seq
    if profile is None and plan is not None:
        if plan.profile in PROFILES:
            profile = plan.profile
        else:   # a profile object of the planner's (calibrated): its name alone does not price
            log.info("autotp: the plan was priced with profile %r, which is not a named profile; later programs "
                     "are priced with this device's default (pass profile= to price them with it)", plan.profile)
    batch, seq, layout, memory_limit = check_planning(batch, seq, layout, memory_limit)
    if pp == 1 and stage_layers is not None:
        raise ConfigError("stage_layers= cuts the layers into pipeline chunks: it needs pp > 1")
    if pp != 1:
        microbatches, schedule, virtual = check_pipeline(pp, microbatches, schedule, virtual)
    if plan is not None and plan.tp != tp:
        raise ConfigError(f"the plan was made for tp={plan.tp}, not tp={tp}")
    if rng not in ("torch", "counter"):
        raise ConfigError(f"rng={rng!r}: choose 'torch' (torch's generator in eager calls, counter-based under "
                          "torch.compile) or 'counter' (counter-based in both)")
    device = torch.device(device)
    profile = profile or _default_profile(device)
    align = _align(align_products, device, profile)

    def shared_capture(module: nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
                       agreed: bool = False) -> Any:
        """``capture_model(module, ...)`` made on TP rank 0, the other ranks loading it (or
        taking it from their own capture cache): autotp/distributed/captures.py. ``agreed``:
        a later program's, of a model the ranks' first programs were checked alike on."""
        args = (module, example_inputs, example_kwargs)
        key = AGREED if agreed else capture_cache.key_of(*args, seq_range=seq_range)
        inputs = {**dict(enumerate(example_inputs)), **(example_kwargs or {})}
        return captured_once(mesh, lambda: capture_model(*args, seq_range=seq_range), placed(key, module, inputs),
                             held=lambda: capture_cache.lookup(*args, seq_range=seq_range),
                             keep=lambda cap: capture_cache.adopt(cap, *args, seq_range=seq_range))

    # What each kind of call runs: its capture, then its plan (each on every rank or none: the
    # plan searched on TP rank 0 and rebuilt on the others, autotp/distributed/plans.py), then
    # this rank's program of it. The first call's is made below; a ParallelModule asks build()
    # for others.
    def prepare(cap: Any) -> tuple:
        result, index, prop = planned_once(mesh, lambda given: planned(
            cap, decided=given, seq=_planning_seq(model, seq, seq_range), layout=layout, plan=plan,
            gather_logits=gather_logits, sequence_parallel=sequence_parallel,
            # a pipeline stage checks its own share of the memory (runtime/pipeline/stage.py)
            memory_limit=memory_limit if pp == 1 else float("inf")), lambda made: decided_of(*made).to_json())
        chunk_layers = None
        if pp > 1:   # a pipeline's cut: the repeated layers dealt to its chunks by the plan's costs, or as asked
            layers = layer_paths(model)
            chunk_layers = cut_layers(layer_costs(index, prop, get_profile(profile), layers), layers, pp, virtual,
                                      stage_layers)
        return result, index, prop, chunk_layers

    def capture_call(inputs: dict, training: bool, step: Any) -> Any:
        was = twin.training
        twin.train(training)
        def call_capture(keep: Any) -> Any:
            if step is not None:
                return captured_once(mesh, lambda: capture_step(twin, step, own_lengths=bool(keep)),
                                     placed(AGREED, twin))
            example = example_like(inputs, seq_bounds(twin, seq_range), keep=keep)
            if on_meta(twin):   # export only needs shapes; a meta model indexes its buffers with them
                example = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example.items()}
            return shared_capture(twin, example_kwargs=example, agreed=True)

        try:
            # a dim the first capture found fixed keeps the call's size
            call_cap = call_capture(cap.fixed_dims if step is None else ())
            if not fits_call(call_cap, inputs):
                # a program traced at the example's lengths holds them only (a loop over the
                # sequence) or guards their residue class (a chunked scan): trace at the call's
                call_cap = call_capture(lengths_of(inputs))
        finally:
            twin.train(was)
        return call_cap

    def plan_call(call_cap: Any, inputs: dict, training: bool, step: Any) -> tuple:
        # forbidden stays forbidden and forced stays forced, in every program with a sequence to
        # split (a length export fixed is one where it has a token for every rank): a decode step
        # (one token a row), a one-token prompt or a fixed length under tp has none, and is
        # planned by cost, its plan saying why. The first program has no such way out: its
        # capture is the user's to lengthen, so there it is a PlanError (planner._solve)
        kind = "" if step is None else "prefill" if step.cache is None else "decode"
        unsplit = sequence_parallel is True and tp > 1 and (kind == "decode" or not sequence_to_split(call_cap, tp))
        notes = [sequence_dropped(inputs, training, kind, call_cap, tp)] if unsplit else []
        # a generation step returns its logits whole whatever gather_logits says for calls:
        # generate picks each token from the whole row (StepSpec.keep_split keeps the cache)
        call = dict(seq=seq or _default_seq(twin), plan=result, memory_limit=memory_limit,
                    gather_logits=True if step is not None else gather_logits,
                    input_placements=step.input_placements if step else None,
                    keep_split=step.keep_split(call_cap) if step else frozenset(),
                    sequence_parallel=None if unsplit else sequence_parallel)

        def make(given: Any) -> tuple:
            if given is not None:   # TP rank 0's plan, with the dispatch it was planned with and its notes
                chosen, dispatch, said = given
                return (*planned(call_cap, dispatch=dispatch, decided=chosen, **call), dispatch, said)
            dispatch = expert_dispatch
            try:
                call_plan, *rest = planned(call_cap, **call)
            except PlanError as forced:
                if expert_dispatch is not True or isinstance(forced, MemoryLimitError):
                    raise
                # the all-to-all dispatch takes tokens split along the sequence: a program whose plan
                # under the first's placements finds no dispatch cuts each rank's rows from the tokens
                # gathered whole, as a plan by cost does there (exact); the user is told
                dispatch = None
                call_plan, *rest = planned(call_cap, dispatch=None, **call)
                notes.append(forced_dispatch_dropped(inputs, training, step is not None, forced))
            call_plan.notes += notes
            return (call_plan, *rest, dispatch, notes)

        *made, _, notes = planned_once(mesh, make, lambda made: (decided_of(*made[:3]).to_json(), made[3], made[4]))
        return (*made, notes)

    def planned(call_cap: Any, dispatch: bool | None = expert_dispatch, decided: dict | None = None,
                **call: Any) -> tuple:
        """A capture's plan, graph index and propagation: the first call's and every later one's
        (``call``: what differs between them), the heads checked first; ``decided``: rebuilt from
        what TP rank 0's search chose (``Decided.to_json()``: autotp/distributed/plans.py)."""
        check_heads(call_cap, tp, uneven)
        if decided is not None:
            decided = Decided.from_json(decided)
        return build_plan(call_cap, tp, batch=batch, profile=profile, uneven=uneven, align=align,
                          host_reads=host_reads, expert_dispatch=dispatch, fuse_activations=fuse_activations,
                          fuse_norms=fuse_norms, fuse_products=fuse_products, expert_load=expert_load,
                          activation_checkpointing=activation_checkpointing, decided=decided, **call)

    def program(index: GraphIndex, prop: Propagation) -> Any:
        gm = rewrite(index, prop, mesh.tp_rank, mesh.tp_group, device, tracker, align)
        return checkpoint_layers(gm, tracker) if activation_checkpointing else gm

    said: set[str] = set()   # the later programs' notes logged so far

    def build(inputs: dict, training: bool, step: Any = None) -> tuple:
        """Another call signature's program under the same parameter layout (``result``); with
        ``step`` (an autotp.generation.StepSpec), a generation step's program instead."""
        call_cap = _on_every_rank_or_none(mesh, lambda: capture_call(inputs, training, step))
        call_plan, call_index, call_prop, notes = _on_every_rank_or_none(
            mesh, lambda: plan_call(call_cap, inputs, training, step))
        for note in notes:   # on one rank, each once (a decode step's, say, for every decode program)
            if mesh.tp_rank == 0 and mesh.dp_rank == 0 and note not in said:
                log.warning("autotp plan note: %s", note)
            said.add(note)
        return call_cap, call_plan, program(call_index, call_prop)

    # The groups, then on them: the first plan (every rank or none) and the dropout seed, agreed.
    mesh = get_mesh(tp, backend=backend, pp=pp)
    cap = _on_every_rank_or_none(mesh, lambda: shared_capture(model, example_inputs, example_kwargs))
    result, index, prop, chunk_layers = _on_every_rank_or_none(mesh, lambda: prepare(cap))
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        for note in result.notes:   # once per parallelize, on one rank
            log.warning("autotp plan note: %s", note)
    agreed_seed = _agreed_seed(mesh, seed)
    tracker = RNGTracker(agreed_seed, mesh.tp_rank, mesh.dp_rank, device, counter_based=rng == "counter")
    # later captures read a weightless copy: the rank program keeps no reference to the model's
    # own tensors (the whole serial model on every rank), so dropping the model frees them
    twin = shape_twin(model)

    source = weights(mesh, model) if weights is not None else None
    with source or contextlib.nullcontext():
        if mesh.pp > 1:
            limit = get_profile(profile).memory if memory_limit is None else memory_limit
            return PipelineModule(cap, result, program(index, prop), mesh, model, device, microbatches=microbatches,
                                  schedule=schedule, virtual=virtual, chunk_layers=chunk_layers, weights=source,
                                  memory_limit=limit)
        return ParallelModule(cap, result, program(index, prop), mesh, model, device, weights=source, build=build)


def _agreed(what: str, fn: Any) -> Any:
    """``fn()``, its failure agreed on by every rank of the world (one small all-gather): a rank
    that cannot read the checkpoint folder raises, and so does every other, naming it, instead of
    going on into collectives the failed rank never joins."""
    from .errors import CheckpointError
    from .runtime.checkpoint import dcp_safety

    own: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - raised on every rank below, this rank's own chained
        own, result = exc, None
    try:
        dcp_safety.agree_on(what, None if own is None else dcp_safety.describe(own))
    except CheckpointError as agreed:
        raise agreed from own
    return result


def from_pretrained(path: str, tp: int, *, model_class: Any = None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, progress: bool = True,
                    **parallelize_kwargs: Any) -> "ParallelModule":
    """Parallelize a HuggingFace checkpoint folder without ever holding the whole model.

    The model is built from ``path``'s config on the meta device (``model_class(config)``: a
    model class or any callable; default: the class the config names in ``architectures``, so
    masked-LM and seq2seq checkpoints load as such, else ``AutoModelForCausalLM``), captured and
    planned there; each rank then reads only its own
    slices of the safetensors files (:mod:`autotp.runtime.checkpoint`). ``dtype`` defaults to
    the config's. Other keywords are :func:`parallelize`'s."""
    from .runtime.checkpoint.loading import open_checkpoint

    model, weights = _agreed(f"the opening of {path}", lambda: open_checkpoint(path, model_class, dtype, progress))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    defaults = {name: p.default for name, p in inspect.signature(parallelize).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "device"}   # one source of defaults
    return _parallelize(model, tp, weights, device=device, **{**defaults, **parallelize_kwargs})
