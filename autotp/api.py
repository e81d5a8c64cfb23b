"""The pipeline, nothing else: capture -> propagate/solve -> plan -> rewrite -> ParallelModule."""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import re
import inspect
import logging
import operator
from typing import Any, Mapping

import torch
from torch import nn

from .capture import Capture, example_like, gc_paused, module_path, on_meta, seq_bounds, shape_twin
from .generation import capture_step
from .capture.cache import capture as capture_model   # once per structure; see its docs
from .cost_model import get_profile
from .errors import ConfigError, DisagreementError, PlanError
from .passes.checkpoint import checkpoint_layers
from .passes.propagate import GraphIndex, Propagation, propagate
from .passes.rewrite import rewrite
from .passes.solve import solve
from .placements import REPLICATE, Placement, Replicate, Shard
from .plan import (CommOp, DeferredExpressions, Plan, attention_heads, cost_expressions, role_of,
                   unsplit_attention_note)
from .runtime.rng import RNGTracker

log = logging.getLogger("autotp")

ROLES = ("column", "row", "vocab", "replicate")
#: product -> the weight dim holding its output features (a head's vocabulary rows)
_OUTPUT_ROWS = {torch.ops.aten.linear.default: 0, torch.ops.aten.mm.default: 1}


def check_tp(tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    return tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_head_counts(cap: Capture) -> dict[str, int]:
    """Module -> number of query heads of each attention op in the graph, read off the op's
    operands (not a config's attribute names): ``scaled_dot_product_attention``'s q is
    ``[..., heads, s, d]``; eager attention's softmax of scores is ``[..., heads, s, s]``."""
    aten = torch.ops.aten
    found: dict[str, int] = {}
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            val = node.args[0].meta.get("val")
        elif node.target in (aten._softmax.default, aten.softmax.int):
            val = node.args[0].meta.get("val")
            if not (isinstance(val, torch.Tensor) and val.dim() >= 3
                    and all(isinstance(d, torch.SymInt) for d in val.shape[-2:])):
                continue
        else:
            continue
        if isinstance(val, torch.Tensor) and val.dim() >= 3 and not isinstance(val.shape[-3], torch.SymInt):
            found.setdefault(module_path(node), int(val.shape[-3]))
    return found


def check_heads(cap: Capture, tp: int, uneven: bool) -> None:
    """Heads are the dimension Megatron splits attention by: name it when it does not divide."""
    counts = attention_head_counts(cap)
    if not counts:
        return
    where, heads = min(counts.items(), key=lambda kv: kv[1])
    where = where or "the model"
    if tp > heads:
        raise PlanError(
            f"tp={tp} exceeds the {heads} attention heads of {where} (read off its attention op): a rank "
            f"would hold no head; choose tp <= {heads}"
        )
    if heads % tp and not uneven:
        raise PlanError(
            f"{heads} attention heads ({where}) cannot be split {tp} ways evenly with uneven=False; "
            f"choose tp in {_divisors(heads)} or pass uneven=True"
        )


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


def _first_uses(cap: Capture) -> dict[str, tuple[Any, int]]:
    out: dict[str, tuple[Any, int]] = {}
    for node in cap.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        for pos, a in enumerate(node.args):
            if getattr(a, "op", None) == "placeholder" and a.name in cap.param_names and a.name not in out:
                out[a.name] = (node.target, pos)
    return out


def _role_to_placement(role: str | Placement, fqn: str, ndim: int, use: tuple[Any, int] | None) -> Placement:
    if not isinstance(role, str):
        return role
    if role == "replicate":
        return REPLICATE
    if role not in ROLES:
        raise ConfigError(f"layout for {fqn}: unknown role {role!r}; use one of {ROLES} or a Placement")
    for d in range(ndim):
        if role_of(Shard(d), use[0] if use else None, use[1] if use else -1) == role:
            return Shard(d)
    if role == "vocab" and use is not None and use[1] == 1 and use[0] in _OUTPUT_ROWS:
        # an untied output head: its vocabulary rows are the product's output features, which
        # Megatron splits as a column-parallel linear (the plan names it "column")
        return Shard(_OUTPUT_ROWS[use[0]])
    raise ConfigError(f"layout for {fqn}: role {role!r} does not apply to how the model uses it")


def _pinned(cap: Capture, layout: Mapping[str, Any] | None, plan: Plan | None) -> dict[str, Placement]:
    """Placeholder -> the placement pinned by ``plan`` (every parameter) or by ``layout``'s globs
    (the first glob matching any of a parameter's names: a tied parameter answers to each)."""
    pinned: dict[str, Placement] = {}
    uses = _first_uses(cap)
    layout = dict(layout or {})
    for pattern, role in layout.items():
        if isinstance(role, str) and role not in ROLES:
            raise ConfigError(f"layout for {pattern}: unknown role {role!r}; use one of {ROLES} or a Placement")
    names_of: dict[str, list[str]] = {}
    for alias, held in cap.aliases.items():
        names_of.setdefault(held, [held]).append(alias)
    every_name = set(cap.param_names.values())
    unmatched = [p for p in layout if not any(fnmatch.fnmatchcase(n, p) for n in every_name)]
    if unmatched and plan is None:
        shown = ", ".join(sorted(every_name)[:6])
        raise ConfigError(
            f"layout pattern(s) {unmatched} match no parameter of {cap.model_name}: patterns are globs over the "
            f"names named_parameters() shows (e.g. {shown}, ...); a tied parameter answers to each of its names"
        )
    nodes = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    for placeholder, fqn in cap.param_names.items():
        node = nodes[placeholder]
        if fqn in cap.aliases:
            continue
        if plan is not None:
            if fqn not in plan.params:
                raise ConfigError(f"the plan has no entry for parameter {fqn}; it was made for another model")
            pinned[placeholder] = plan.params[fqn]
            continue
        names = names_of.get(fqn, [fqn])
        for pattern, role in layout.items():
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                if node.meta["val"].dim() >= 2:
                    pinned[placeholder] = _role_to_placement(role, fqn, node.meta["val"].dim(), uses.get(placeholder))
                break
    return pinned


@gc_paused()
def build_plan(cap: Capture, tp: int, *, batch: int, seq: int, profile: Any = None,
               layout: Mapping[str, Any] | None = None, plan: Plan | None = None,
               uneven: bool = True, gather_logits: bool | None = None,
               memory_limit: float | None = None,
               sequence_parallel: bool | None = None,
               input_placements: Mapping[str, Placement] | None = None,
               keep_split: frozenset[str] = frozenset()) -> tuple[Plan, GraphIndex, Propagation]:
    """The plan for a capture. ``memory_limit`` (bytes per rank; default: the profile's device
    memory) bounds training state + activations; a saved ``plan`` is replayed, not re-solved.

    ``input_placements`` (input name -> placement) says how inputs arrive on the ranks when
    not whole, and ``keep_split`` names outputs returned as they are split instead of gathered:
    a generation step's KV cache goes out and comes back split by head (autotp.generation).

    ``sequence_parallel``: may the solver split layer-norm/dropout/residual regions along the
    sequence (Korthikanti et al.)? None (default): only when the fastest plan without it does not
    fit the memory limit; True: whenever the cost model prefers it; False: never.

    ``gather_logits``: None (default) keeps the output named ``logits`` split by vocabulary
    where the call also returns a loss (labels given: training needs the loss, computed
    vocab-parallel, not the b*s*V logits) and gathers it otherwise; True always gathers, False
    never does."""
    prof = get_profile(profile)
    limit = prof.memory if memory_limit is None else memory_limit
    names = cap.output_names
    split_logits = not gather_logits if gather_logits is not None else "loss" in names
    keep = frozenset(i for i, n in enumerate(names) if n in keep_split or (n == "logits" and split_logits))
    by_key = dict(zip(cap.input_keys, cap.user_inputs))
    arriving = {by_key[k]: p for k, p in (input_placements or {}).items()}
    index = GraphIndex.build(cap, tp, batch, seq, uneven=uneven, sharded_outputs=keep,
                             sequence_parallel=bool(sequence_parallel), input_placements=arriving)
    pinned = _pinned(cap, layout, plan)
    notes: list[str] = []
    if plan is not None:
        prop = propagate(index, pinned, prof, exact=True)
        if prop.infeasible:
            raise PlanError(f"the given plan does not fit this model: {prop.infeasible}")
    else:
        try:
            solution = solve(index, prof, pinned, memory_limit=limit)
            fits = solution.over_limit is None
        except PlanError:
            solution, fits = None, False
        if sequence_parallel is None and uneven and not fits:
            # Memory is the reason for sequence parallelism: the layer norms' and dropouts'
            # activations shrink to s/tp tokens. (Offered always, the cost model would also pick
            # it where its pointwise savings outweigh the extra all-gather; see architecture.md.)
            index = GraphIndex.build(cap, tp, batch, seq, uneven=uneven, sharded_outputs=keep,
                                     sequence_parallel=True, input_placements=arriving)
            first = solution
            try:
                solution = solve(index, prof, pinned, memory_limit=limit)
            except PlanError:
                if first is None:
                    raise
                solution = first
            if solution is not first and any(c.kind == "reduce_scatter" for c in solution.propagation.comms):
                notes.append("sequence parallelism: without it no plan fits the memory limit as fast; layer "
                             "norms, dropouts and residual adds run on s/tp tokens between a reduce-scatter "
                             "and an all-gather along s")
        elif solution is None:
            solution = solve(index, prof, pinned, memory_limit=limit)   # raises the PlanError again
        prop = solution.propagation
        if solution.over_limit is not None:
            fast_s, fast_bytes = solution.over_limit
            notes.append(f"the fastest plan ({fast_s * 1e3:.3f} ms per step) needs {fast_bytes / 2**30:.2f} GiB "
                         f"per rank, over the memory limit of {limit / 2**30:.2f} GiB: this plan is slower but fits")
        if prop.infeasible:
            raise PlanError(f"no feasible plan: {prop.infeasible}")
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
        roles[fqn] = role_of(p, use[0] if use else None, use[1] if use else -1)
    comms = [CommOp(c.kind, c.tensor, c.consumer, repr(c.src), repr(c.dst), c.fwd_bytes, c.bwd_bytes, c.seconds,
                    module_path(nodes[c.consumer]) if c.consumer in nodes else "")
             for c in prop.comms]
    dtype_bytes = next(iter(n.meta["val"].element_size() for n in cap.graph.nodes
                            if n.op == "placeholder" and n.name in cap.param_names), 4)
    result = Plan(tp=tp, profile=prof.name, batch=batch, seq=seq, params=params, shapes=shapes, roles=roles,
                  comms=comms, compute_s=prop.compute_s, comm_s=prop.comm_s, dtype_bytes=dtype_bytes,
                  aliases=dict(cap.aliases),
                  sharded_outputs={names[i]: prop.placements[n] for i, n in enumerate(cap.output_nodes)
                                   if i in keep and isinstance(prop.placements.get(n), Shard)},
                  memory_bytes=prop.memory_bytes, activation_bytes=prop.activation_bytes, memory_limit=limit,
                  expressions=(cost_expressions(index, prop, prof) if plan is None
                               else DeferredExpressions(lambda: cost_expressions(index, prop, prof))),
                  notes=notes,
                  attention=attention_heads(index, prop))
    if plan is None and tp > 1:
        for note in (_replicated_note(result, layout), unsplit_attention_note(index, prop, result.attention or {})):
            if note:
                result.notes.append(note)
    return result, index, prop


#: below this share of parameter bytes split across ranks, a plan says why and how to split more
SPLIT_SHARE_NOTED = 0.5


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


def plan(model: nn.Module, tp: int | None = None, *, batch: int = 8, seq: int | None = None, profile: Any = None,
         layout: Mapping[str, Any] | None = None, uneven: bool = True, gather_logits: bool | None = None,
         example_inputs: tuple = (), example_kwargs: dict | None = None,
         memory_limit: float | None = None, sequence_parallel: bool | None = None,
         seq_range: tuple[int, int] | None = None, world: int | None = None,
         gpus_per_node: int = 8) -> "Plan | PipelinePlan":
    """Choose a plan for ``model`` at ``tp`` without any process group (a meta model works).

    ``world=N`` (with ``gpus_per_node``) chooses tensor x pipeline x data parallelism for N GPUs
    instead and returns an :class:`autotp.ptd.PipelinePlan` (t, p, d, micro-batch, schedule,
    predicted step time, bubble, memory per GPU and why; ``batch`` is the global batch, ``tp``
    fixes t). It plans only: autotp does not run pipeline stages yet.

    ``gather_logits``: by default logits stay split by vocabulary in a call that returns a loss
    (labels given, as in the default example inputs: the b*s*V all-gather is not paid) and are
    gathered in one without; True or False fixes it (see :func:`build_plan`).
    ``memory_limit``: bytes per rank the plan may use (default: the profile's device memory).
    ``sequence_parallel``: see :func:`build_plan` (default: only when memory calls for it).
    ``seq_range=(min, max)``: sequence lengths the captured program accepts (default: 2 up to
    the config's maximum positions, else as wide as torch.export allows)."""
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
                              memory_limit=memory_limit, sequence_parallel=sequence_parallel)
    return result


def _default_profile(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device)
    for key, prof in (("H100", "h100-dgx"), ("H200", "h100-dgx"), ("A100", "a100-dgx"), ("V100", "v100-dgx2h")):
        if key in name:
            return prof
    return "h100-dgx"


def parallelize(model: nn.Module, tp: int, *, plan: Plan | None = None, layout: Mapping[str, Any] | None = None,
                profile: Any = None, batch: int = 8, seq: int | None = None, uneven: bool = True,
                gather_logits: bool | None = None, memory_limit: float | None = None,
                example_inputs: tuple = (), example_kwargs: dict | None = None,
                device: torch.device | str | None = None,
                backend: str | None = None, seed: int | None = None,
                activation_checkpointing: bool = False,
                sequence_parallel: bool | None = None,
                seq_range: tuple[int, int] | None = None, pp: int = 1, microbatches: int | None = None,
                schedule: str | None = None, virtual: int = 1,
                stage_layers: Any = None, rng: str = "torch") -> "ParallelModule":
    """Split ``model`` over this rank's TP group; see the module docs and docs/architecture.md.

    ``pp > 1`` also cuts it into ``pp`` pipeline stages (a world of ``dp * pp * tp`` ranks) and
    returns this rank's stage, a :class:`~autotp.runtime.pipeline.PipelineModule` whose
    ``step(**batch)`` trains on ``microbatches`` micro-batches (default ``pp``) under
    ``schedule`` (``"1f1b"`` by default, ``"gpipe"``, or ``"interleaved1f1b"`` with ``virtual``
    chunks per stage), run by ``torch.distributed.pipelining``. The repeated layers are cut into
    chunks by the cost model, or ``stage_layers=[n0, n1, ...]`` (one count per chunk, in order).

    ``activation_checkpointing=True`` recomputes each repeated layer in backward instead of
    keeping its activations (autotp.passes.checkpoint). ``sequence_parallel``: see
    :func:`build_plan` (default: offered only when memory calls for it).

    ``seed`` seeds dropout in the rewritten graph (default: TP rank 0's ``torch.initial_seed()``,
    shared with its group): replicated regions draw the same masks on every TP rank, sharded
    regions their own (autotp.runtime.rng). ``rng="torch"`` draws them from torch's generator
    in eager calls and counter-based under torch.compile; ``rng="counter"`` counter-based in both
    (slower in eager; a compiled program then draws exactly the eager program's masks)."""
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
                        stage_layers=stage_layers, rng=rng)


def _parallelize(model: nn.Module, tp: int, weights: Any, *, plan: Plan | None, layout: Mapping[str, Any] | None,
                 profile: Any, batch: int, seq: int | None, uneven: bool, gather_logits: bool | None,
                 memory_limit: float | None, example_inputs: tuple, example_kwargs: dict | None,
                 device: torch.device | str, backend: str | None, seed: int | None,
                 activation_checkpointing: bool, sequence_parallel: bool | None = None,
                 seq_range: tuple[int, int] | None = None, pp: int = 1, microbatches: int | None = None,
                 schedule: str | None = None, virtual: int = 1,
                stage_layers: Any = None, rng: str = "torch") -> "ParallelModule":
    from .runtime.mesh import get_mesh
    from .runtime.module import ParallelModule
    from .runtime.pipeline import check_pipeline

    tp = check_tp(tp)
    if pp == 1 and stage_layers is not None:
        raise ConfigError("stage_layers= cuts the layers into pipeline chunks: it needs pp > 1")
    if pp != 1:
        microbatches, schedule, virtual = check_pipeline(pp, microbatches, schedule, virtual)
    mesh = get_mesh(tp, backend=backend, pp=pp)
    if plan is not None and plan.tp != tp:
        raise ConfigError(f"the plan was made for tp={plan.tp}, not tp={tp}")
    device = torch.device(device)

    def prepare():
        cap = capture_model(model, example_inputs, example_kwargs, seq_range=seq_range)
        check_heads(cap, tp, uneven)
        # a pipeline stage holds a share of the model: the stage checks its share (runtime/pipeline.py)
        result, index, prop = build_plan(cap, tp, batch=batch, seq=_planning_seq(model, seq, seq_range),
                                         profile=profile or _default_profile(device), layout=layout,
                                         plan=plan, uneven=uneven, gather_logits=gather_logits,
                                         memory_limit=memory_limit if pp == 1 else float("inf"),
                                         sequence_parallel=sequence_parallel)
        return cap, result, index, prop

    cap, result, index, prop = _on_every_rank_or_none(mesh, prepare)
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        for note in result.notes:   # once per parallelize, on one rank
            log.warning("autotp plan note: %s", note)
    if rng not in ("torch", "counter"):
        raise ConfigError(f"rng={rng!r}: choose 'torch' (torch's generator in eager calls, counter-based under "
                          "torch.compile) or 'counter' (counter-based in both)")
    rng = RNGTracker(_agreed_seed(mesh, seed), mesh.tp_rank, mesh.dp_rank, device, counter_based=rng == "counter")

    def program(index: GraphIndex, prop: Propagation) -> Any:
        gm = rewrite(index, prop, mesh.tp_rank, mesh.tp_group, device, rng)
        return checkpoint_layers(gm, rng) if activation_checkpointing else gm

    # later captures read a weightless copy: the rank program keeps no reference to the model's
    # own tensors (the whole serial model on every rank), so dropping the model frees them
    twin = shape_twin(model)

    def build(inputs: dict, training: bool, step: Any = None) -> tuple:
        """Another call signature's program under the same parameter layout (``result``); with
        ``step`` (an autotp.generation.StepSpec), a generation step's program instead."""
        def prepare_call():
            was = twin.training
            twin.train(training)
            try:
                if step is None:
                    example = example_like(inputs, seq_bounds(twin, seq_range))
                    if on_meta(twin):   # export only needs shapes; a meta model indexes its buffers with them
                        example = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example.items()}
                    call_cap = capture_model(twin, seq_range=seq_range, example_kwargs=example)
                else:
                    call_cap = capture_step(twin, step)
            finally:
                twin.train(was)
            call_plan, call_index, call_prop = build_plan(
                call_cap, tp, batch=batch, seq=seq or _default_seq(twin),
                profile=profile or _default_profile(device), plan=result, uneven=uneven,
                gather_logits=gather_logits, memory_limit=memory_limit,
                input_placements=step.input_placements if step else None,
                keep_split=step.keep_split(call_cap) if step else frozenset())
            return call_cap, call_plan, call_index, call_prop

        call_cap, call_plan, call_index, call_prop = _on_every_rank_or_none(mesh, prepare_call)
        return call_cap, call_plan, program(call_index, call_prop)

    source = weights(mesh, model) if weights is not None else None
    if mesh.pp > 1:
        from .runtime.outline import layer_paths
        from .runtime.pipeline import PipelineModule, layer_costs

        prof = get_profile(profile or _default_profile(device))
        costs = layer_costs(index, prop, prof, layer_paths(model))
        with source or contextlib.nullcontext():
            return PipelineModule(cap, result, program(index, prop), mesh, model, device, microbatches=microbatches,
                                  schedule=schedule, virtual=virtual, costs=costs, weights=source,
                                  memory_limit=prof.memory if memory_limit is None else memory_limit,
                                  stage_layers=stage_layers)
    with source or contextlib.nullcontext():
        return ParallelModule(cap, result, program(index, prop), mesh, model, device, weights=source, build=build)


def _on_every_rank_or_none(mesh: Any, step: Any) -> Any:
    """Run ``step`` (capture and planning: no collectives) and tell the TP group whether it
    worked, with one small all-reduce, before anyone waits in a collective of the model. A
    rank that failed raises its own error; the others raise at once instead of waiting for it
    until the collective timeout."""
    try:
        value, failure = step(), None
    except Exception as exc:   # re-raised below, after the group has been told
        value, failure = None, exc
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is not None:
        import torch.distributed as dist

        ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if failure is None and ok.item() == 0:
            raise DisagreementError(
                f"another rank of TP group {list(mesh.tp_ranks)} failed to capture or plan the model (its own "
                "error says why); this rank stops too instead of waiting for it in a collective"
            )
    if failure is not None:
        raise failure
    return value


def _agreed_seed(mesh: Any, seed: int | None) -> int:
    """One dropout seed for the whole TP group: ``seed``, or TP rank 0's initial seed."""
    seed = torch.initial_seed() % (1 << 62) if seed is None else int(seed)
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is None:
        return seed
    import torch.distributed as dist

    value = torch.tensor([seed], dtype=torch.int64)
    dist.broadcast(value, src=mesh.tp_ranks[0], group=group)
    return int(value.item())


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
    from transformers import AutoConfig

    from .runtime.checkpoint import CheckpointReader

    config = AutoConfig.from_pretrained(path)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    reader = CheckpointReader(path)    # fails early, before any collective, on a folder without weights
    with torch.device("meta"):
        if model_class is None:
            model = _architecture(config).from_config(config, dtype=dtype)
        else:
            model = model_class(config).to(dtype)
    computed = _compute_buffers(model, set(reader.names()))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def weights(mesh: Any, meta_model: nn.Module) -> _CheckpointWeights:
        return _CheckpointWeights(reader, meta_model, mesh, progress, computed)

    defaults = {name: p.default for name, p in inspect.signature(parallelize).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "device"}   # one source of defaults
    return _parallelize(model, tp, weights, device=device, **{**defaults, **parallelize_kwargs})


def _architecture(config: Any) -> Any:
    """What builds the model a checkpoint was saved from: the class its config names
    (``BertForMaskedLM``, ``T5ForConditionalGeneration``, ...), else ``AutoModelForCausalLM``."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return _FromConfig(cls)
    return transformers.AutoModelForCausalLM


class _FromConfig:
    """``cls`` with the ``from_config(config, dtype=)`` call of the Auto classes."""

    def __init__(self, cls: Any):
        self.cls = cls

    def from_config(self, config: Any, dtype: torch.dtype) -> nn.Module:
        return self.cls._from_config(config, dtype=dtype)


def _compute_buffers(model: nn.Module, saved: set[str]) -> dict[str, torch.Tensor]:
    """The values, on the CPU, of the buffers a checkpoint does not hold (rotary ``inv_freq``,
    BERT's ``position_ids``, GPT-BigCode's causal ``bias``: computed, not saved) that the model's
    own initializer (``_init_weights``) computes, by dotted name (plain tensor attributes such as
    rotary's ``original_inv_freq`` too). The initializer runs twice per module, the missing
    tensors filled with two different values first: a tensor it computes comes out the same both
    times. The model is left as it was, all on the meta device (every later capture sees one
    device); the parallel module takes the values from here, and reports a buffer neither here
    nor in the checkpoint."""
    init = getattr(model, "_init_weights", None)
    values: dict[str, torch.Tensor] = {}
    if init is None:
        return values
    for prefix, module in model.named_modules():
        held = {**{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}, **module._buffers}
        missing = {name: b for name, b in held.items() if b is not None and b.is_meta
                   and f"{prefix}.{name}".lstrip(".") not in saved}
        if not missing:
            continue
        runs = []
        for fill in (0, 1):
            for name, b in missing.items():
                _set_tensor(module, name, torch.full(b.shape, fill, dtype=b.dtype))
            with torch.no_grad():
                try:
                    init(module)
                except Exception:   # an initializer that cannot run on this module: nothing computed
                    pass
            runs.append({name: getattr(module, name) for name in missing})
        for name, b in missing.items():
            first, second = runs[0][name], runs[1][name]
            _set_tensor(module, name, b)
            if (isinstance(first, torch.Tensor) and not first.is_meta and first.shape == b.shape
                    and torch.equal(first, second) and not (first.is_floating_point() and first.isnan().any())):
                values[f"{prefix}.{name}".lstrip(".")] = first.clone()
    return values


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, value)


def _saved_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Parameter name -> checkpoint key, for the keys transformers renames when it loads this
    model class (GPT-NeoX's checkpoints hold ``embed_out.weight`` for ``lm_head.weight``). Only
    plain renames: a transform that merges or splits tensors is not applied (``find`` then names
    the missing tensor)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renames = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]
    except (ImportError, AttributeError, TypeError):   # an older transformers renames nothing
        return {}
    out = {}
    for key in keys:
        name = key
        for rename in renames:   # each source pattern (a regex) becomes the first target
            for source in rename.source_patterns:
                name = re.sub(source, rename.target_patterns[0], name)
        if name != key:
            out[name] = key
    return out


class _CheckpointWeights:
    """``weights(fqn, placement)`` for ParallelModule: this rank's slices, read from a checkpoint,
    with a progress bar on the first rank while it is entered. A tied parameter is found under
    any of its names (GPT-2's checkpoints hold ``transformer.wte.weight``, not ``lm_head.weight``)."""

    def __init__(self, reader: Any, meta_model: nn.Module, mesh: Any, progress: bool,
                 buffers: dict[str, torch.Tensor] | None = None):
        from rich.progress import Progress

        self.reader, self.tp, self.rank = reader, mesh.tp, mesh.tp_rank
        #: values of the buffers the checkpoint does not hold, computed by the model's initializer
        self.buffers = dict(buffers or {})
        self.params = dict(meta_model.named_parameters(remove_duplicate=False))
        self.twins: dict[int, list[str]] = {}
        for name, p in self.params.items():
            self.twins.setdefault(id(p), []).append(name)
        self.saved_as = _saved_names(meta_model, reader.names())
        shown = progress and mesh.tp_rank == 0 and mesh.dp_rank == 0
        self.bar = Progress(transient=True, disable=not shown)
        self.task = self.bar.add_task(f"loading {reader.folder.name} (TP rank {mesh.tp_rank} of {mesh.tp})",
                                      total=len(self.twins))

    def __enter__(self) -> "_CheckpointWeights":
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def __call__(self, fqn: str, placement: Placement) -> torch.Tensor:
        meta = self.params[fqn]
        names = [fqn] + [n for n in self.twins[id(meta)] if n != fqn]
        names += [self.saved_as[n] for n in names if n in self.saved_as]
        local = self.reader.read_local(self.reader.find(names), tuple(meta.shape), placement, self.tp, self.rank,
                                       meta.dtype)
        self.bar.advance(self.task)
        return local
