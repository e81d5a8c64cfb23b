"""Pipeline parallelism (the p of Megatron's PTD-P): a rank program cut into stages at its
repeated layers, run by ``torch.distributed.pipelining``'s schedules.

``autotp.parallelize(model, tp=t, pp=p)`` in a world of ``d * p * t`` ranks plans and rewrites the
whole model for tensor parallelism as without a pipeline (every stage's TP group runs the same
plan), then cuts this rank's program into ``p * v`` *chunks* (``v`` virtual stages per rank,
interleaved 1F1B) and keeps the chunks of its own stage:

- **where to cut**, chosen in planning (:func:`autotp.cost_model.pipeline.cut_layers`, by
  :func:`balance`): the model's repeated layers (:func:`runtime.module.outline.layer_paths`)
  go to the chunks in order, contiguous, at least one each, so that the slowest chunk is as fast
  as it can be by the plan's own cost model (each layer's ops and collectives, forward and
  backward; what lies before the first layer, the embedding, counts in the first chunk, what lies
  after the last, the final norm, the head and the loss, in the last).
- **what each chunk computes** (:func:`cut`): every op of the program that depends on both a
  parameter and an input is an *activation*: it runs in the chunk of its layer, or, outside the
  layers, in the latest chunk of what it reads (the first chunk of what reads it when it reads no
  activation: the embedding). What depends on no parameter (masks, positions, rotary tables, sizes)
  and what depends on parameters alone (a transposed or gathered weight) is computed again by each
  chunk that reads it, so that only activations and the model's inputs travel between stages. A
  non-tensor value (a size read off an activation) is computed again from the activation.
- **what travels** from chunk ``c`` to ``c + 1``: every activation made before ``c + 1`` and read
  at or after it, and the model inputs later chunks read (the labels go through to the last
  chunk), in program order. The last chunk returns the loss.

The chunks run as ``torch.distributed.pipelining.PipelineStage`` s over the pipeline group (the
ranks at this rank's (dp, tp) position in every stage), under ``ScheduleGPipe``,
``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (chunk ``c`` on stage ``c mod p``, the looped
placement those schedules use). A step's batch is split along dim 0 into ``microbatches``
equal micro-batches; each micro-batch's loss is divided by their number, so the gradients are
those of the mean over micro-batches, which is the model's own mean loss when every micro-batch
counts the same tokens (no ignored labels). A parameter read by chunks on several stages (a tied
embedding and head) is held by each, and its gradient is summed over them after the pipeline
flushes (Megatron's embedding group); data parallelism then combines every gradient over the dp
group, once per step, in one all-reduce per dtype. Where the loss is a mean over counted tokens,
the micro-batches of every replica are weighted by the whole batch's count (one small
all-reduce over dp) and the gradients summed, so that pp x dp computes the whole batch's mean
loss whichever rows hold the ignored labels (a masked LM's); otherwise the replicas' gradients
are averaged. ``step`` returns each replica's own loss.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn

from ...capture import Capture, bind_inputs, flat_inputs
from ...cost_model.pipeline import in_flight_layers
from ...cost_model.pipeline import balance, layer_costs   # noqa: F401 (this package's names; the cut is planning's)
from ...errors import ConfigError, InputError
from ...plan import Plan
from ...distributed.agreement import check_call, input_signature
from ...distributed.faults import StepGuard
from .chunks import Chunk, cut
from ..module.inputs import check_index_bounds, check_not_empty, index_bounds
from ..module.leaves import LeavesSwitch, LocalLeaves, local_tensor, program_tensor
from ..module.module import agree_on_module, control_group
from ..module.state import RankState, refuse_dtype_change

log = logging.getLogger("autotp")

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


# ---- the loss's token count ------------------------------------------------------------------

#: ops between a mean cross-entropy and the loss output that keep its value (a cast, a copy)
_KEEPS_VALUE = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
                torch.ops.aten.to.dtype, torch.ops.aten.detach.default}


def token_counter(capture: Capture, loss_index: int, constants: dict[str, torch.Tensor],
                  device: torch.device | str = "cpu") -> Callable | None:
    """When the model's loss is a mean cross-entropy over tokens (``ignore_index`` skipped) whose
    targets come from the inputs alone (HF's shift of the labels, a ``view(-1)``): a function of
    the flat tensor inputs giving each row's count of counted tokens, so that micro-batch means
    can be weighted into the batch's mean. None otherwise (the step then takes the mean of the
    micro-batches' means). ``constants``: the lifted constants' values on the run device, by name."""
    node = capture.output_nodes[loss_index]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _KEEPS_VALUE:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is torch.ops.aten.cross_entropy_loss.default):
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    reduction = args[3] if args[3] is not None else node.kwargs.get("reduction", 1)
    ignore = args[4] if args[4] is not None else node.kwargs.get("ignore_index", -100)
    weighted = args[2] if args[2] is not None else node.kwargs.get("weight")
    smoothing = args[5] if args[5] is not None else node.kwargs.get("label_smoothing", 0.0)
    if reduction != 1 or weighted is not None or smoothing:
        return None    # not a plain mean (a sum, class weights, label smoothing)
    target = node.args[1]
    by_name = {n.name: n for n in capture.graph.nodes if n.op == "placeholder"}
    inputs = [by_name[name] for name in capture.user_inputs]
    lifted = {by_name[ph]: name for ph, name in capture.constant_names.items()}   # placeholder -> constant
    ancestors, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        if n.op == "placeholder":
            if n not in inputs and n not in lifted:
                return None        # the targets depend on a parameter or a buffer
        elif n.op != "call_function":
            return None
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
    on_device = lambda a: torch.device(device) if isinstance(a, torch.device) else a   # noqa: E731 (a meta capture's)
    for n in capture.graph.nodes:
        if n in ancestors and n not in env:
            if n.op == "placeholder":
                env[n] = g.placeholder(n.name)
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
            env[n].args = fx.node.map_aggregate(env[n].args, on_device)
            env[n].kwargs = fx.node.map_aggregate(env[n].kwargs, on_device)
    g.output(env[target])
    counted = fx.GraphModule(torch.nn.Module(), g)
    const_values = [constants[lifted[n]] for n in capture.graph.nodes if n in lifted and n in ancestors]
    tensor_keys = [k for k in capture.input_keys if k not in capture.constant_inputs]
    fixed = {k: capture.constant_inputs[k] for k in capture.input_keys if k in capture.constant_inputs}

    def count(tensors: list[torch.Tensor]) -> torch.Tensor:
        by_key = dict(zip(tensor_keys, tensors), **fixed)
        values = [by_key[k] for k in capture.input_keys]
        with torch.no_grad():
            targets = counted(*values, *const_values)
        rows = tensors[0].shape[0]
        return (targets != ignore).reshape(rows, -1).sum(1).to(torch.float64)

    return count


# ---- running the chunks ---------------------------------------------------------------------


def stage_activation_bytes(plan: Any, layers: int, held_layers: float, microbatches: int) -> float:
    """The activations a pipeline stage holds at its fullest, from ``plan``'s (its planning
    batch's, split into ``microbatches``): ``held_layers`` layer-micro-batches in flight, of the
    model's ``layers``. Without activation checkpointing each holds a layer's share of the plan's
    activations. With it (``plan.recomputed``) each holds its layer's input alone (a layer's
    share of ``plan.layer_input_bytes``), and one layer's recomputation is held for one
    micro-batch at a time: the rest of the plan's activations (priced as one layer's share of
    every layer's, and what lies outside the layers, counted on every stage). Before, the
    checkpointed plan's activations were spread over the layers as a plain plan's: a stage
    holding a few layers for many micro-batches was priced the recomputation as many times, one
    holding many layers for few priced less than one recomputation. A plan saved before its
    layers' inputs were recorded (``layer_input_bytes`` 0) is read as a plain one's."""
    per_layer = plan.activation_bytes / max(layers, 1)
    if not (plan.recomputed and plan.layer_input_bytes):
        return per_layer / microbatches * held_layers
    inputs = plan.layer_input_bytes
    return (held_layers * inputs / max(layers, 1) + max(plan.activation_bytes - inputs, 0.0)) / microbatches

class _ChunkModule(nn.Module):
    """One chunk as the module a ``PipelineStage`` runs: reads its parameters (the owner's,
    under their program names) and buffers, then runs the chunk's graph on what it received.
    Holds nothing itself: the owner's module tree is the model's."""

    def __init__(self, chunk: Chunk, owner: "PipelineModule", param_names: list[str], buffer_names: list[str],
                 constants: list[torch.Tensor]):
        super().__init__()
        self.chunk = chunk.graph
        object.__setattr__(self, "_owner", owner)
        self._params, self._buffer_names, self._constants = param_names, buffer_names, constants
        #: under torch < 2.12: the dtype each received value had when it was sent (integers
        #: travel as float64), told by the sender in ``PipelineModule._shapes_of``
        self.received_dtypes: list[Any] | None = None
        #: ... and the dtypes of what this chunk sends, before that
        self.sent_dtypes: list[Any] = []

    def forward(self, *received: Any) -> Any:

        owner, grad = self._owner, torch.is_grad_enabled()
        params = [program_tensor(owner._held[n], grad, owner._leaves) for n in self._params]
        buffers = [owner.get_buffer(n) for n in self._buffer_names]
        raw = received
        if _EVERY_INPUT_NEEDS_A_GRADIENT and self.received_dtypes is not None:
            received = tuple(t.detach().to(d) if isinstance(t, torch.Tensor) and d is not None and t.dtype != d else t
                             for t, d in zip(received, self.received_dtypes))
        out = self.chunk(*params, *buffers, *self._constants, *received)
        outs = list(out) if isinstance(out, tuple) else [out]
        # point-to-point sends take contiguous tensors (a chunk may end on a transposed view)
        outs = [o.contiguous() if isinstance(o, torch.Tensor) else o for o in outs]
        if _EVERY_INPUT_NEEDS_A_GRADIENT:
            outs = self._for_old_stages(outs, raw, grad)
        return tuple(outs) if isinstance(out, tuple) else outs[0]

    def _for_old_stages(self, outs: list, raw: tuple, grad: bool) -> list:
        """What torch < 2.12's stages need (the GPU machine's 2.11): they mark every received
        buffer as requiring grad, which an integer tensor refuses, and refuse a backward that
        leaves a received buffer without a gradient. Integer and boolean outputs travel as
        float64 (exact below 2**53; the receiver converts them back), and every received
        floating buffer is tied to a zero gradient through the first differentiable output."""
        self.sent_dtypes = [o.dtype if isinstance(o, torch.Tensor) else None for o in outs]
        outs = [o.to(torch.float64) if isinstance(o, torch.Tensor) and not (o.is_floating_point() or o.is_complex())
                else o for o in outs]
        tied = [t for t in raw if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if grad and tied:
            tied = [t if t.requires_grad or not t.is_leaf else t.requires_grad_() for t in tied]
            floats = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            i = next((k for k in floats if outs[k].requires_grad), floats[0] if floats else None)
            if i is not None:
                outs[i] = _TieGradients.apply(outs[i], *tied)
        return outs


#: torch < 2.12's stages (see _ChunkModule._for_old_stages)
_EVERY_INPUT_NEEDS_A_GRADIENT = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)


class _TieGradients(torch.autograd.Function):
    """``out`` itself, with every ``tied`` tensor given a zero gradient besides any other it
    gets: what torch < 2.12's stages need for each received buffer."""

    @staticmethod
    def forward(ctx, out, *tied):
        ctx.tied = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.tied))


class PipelineModule(LeavesSwitch, nn.Module):
    """This rank's stage of a pipelined, tensor-parallel model: ``pm.step(**batch)`` runs one
    training step's forward and backward over the pipeline (the schedule's micro-batches) and
    returns the batch's loss on every rank; the gradients are then in this rank's parameters
    (DTensors on the stage's (dp, tp) mesh, under the model's names), ready for an optimizer."""

    def __init__(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, mesh: Any, model: nn.Module,
                 device: torch.device, *, microbatches: int, schedule: str, virtual: int,
                 chunk_layers: list[list[str]], weights: Callable | None = None,
                 memory_limit: float = float("inf")):
        super().__init__()
        # Built as a ParallelModule is (runtime.module.module): the groups and the agreement; then
        # the program cut into the chunks planning chose, the state this stage's chunks read, and
        # the chunks as programs.
        self.mesh, self.device, self.plan, self.capture = mesh, device, plan, capture
        self.microbatches, self.virtual = microbatches, virtual
        self.schedule_name = schedule
        #: a step that raises on some ranks only: the others, left waiting in the schedule's
        #: sends and receives, name the rank and its error when their wait times out, and the
        #: next step refuses to go on out of step (autotp.distributed.faults)
        self._guard = StepGuard(dist.group.WORLD, tuple(range(dist.get_world_size())))
        # the stage's TP ranks agree on the program, the weights they were handed and this
        # module's number (its name in every step's check: steps of two pipelines never pair up)
        number = agree_on_module(capture, plan, graph_module, model, control_group(mesh))
        self.name = f"{type(model).__name__} pipeline #{number}"
        #: each step first checks that every stage and TP rank of this replica was handed inputs
        #: of the same names, shapes and dtypes, in the same mode (one small gloo all-reduce);
        #: ``pm.check_inputs = False`` skips it once the data pipeline is trusted
        self.check_inputs = True
        self._steps = 0
        # -- the cut: the program cut at the chunks' layers (chosen in planning:
        # autotp.cost_model.pipeline.cut_layers), this stage's chunks
        if "loss" not in capture.output_names:
            raise ConfigError("a pipeline step trains on the model's loss, and this capture returns none "
                              f"(outputs {capture.output_names}): pass labels in example_kwargs or call with labels")
        p = mesh.pp
        #: layers per chunk (chunk c runs on stage c mod pp)
        self.chunk_layers = chunk_layers
        chunk_of_layer = {layer: c for c, layers in enumerate(chunk_layers) for layer in layers}
        param_order = [capture.aliases.get(fqn, fqn) for fqn in capture.param_names.values()]
        buffer_order = list(capture.buffer_names.values())
        constant_names = list(capture.constant_names.values())
        fixed = {i: capture.constant_inputs[key] for i, key in enumerate(capture.input_keys)
                 if key in capture.constant_inputs}
        all_chunks = cut(graph_module, (len(param_order), len(buffer_order), len(constant_names)),
                         chunk_of_layer, len(chunk_layers), capture.output_names.index("loss"), fixed, device)
        # parameter FQN -> the stages whose chunks read it (a tied pair on two stages shares its gradient)
        readers: dict[str, set[int]] = {}
        for ch in all_chunks:
            for i in ch.params:
                readers.setdefault(param_order[i], set()).add(ch.index % p)
        mine = [ch for ch in all_chunks if ch.index % p == mesh.pp_rank]
        wanted = {param_order[i] for ch in mine for i in ch.params}
        self._check_memory(wanted, sum(len(chunk_layers[ch.index]) for ch in mine), len(chunk_of_layer), memory_limit)
        # -- the state: the parameters and buffers this stage's chunks read, held as a ParallelModule holds them
        state = RankState(capture, plan, model, mesh, device, weights, wanted)
        self._held = state.put_on(self)
        self._leaves = LocalLeaves()   # the stages' programs read each parameter's local leaf
        state.put_buffers(self, sorted({buffer_order[i] for ch in mine for i in ch.buffers}, key=buffer_order.index))
        constants = state.constants(capture)
        self._shared = self._shared_groups(readers)
        # -- the programs: the chunks as modules, the loss's token count, the inputs' bounds
        self._chunks = mine
        modules = [_ChunkModule(ch, self, [param_order[i] for i in ch.params], [buffer_order[i] for i in ch.buffers],
                                [constants[constant_names[i]] for i in ch.constants])
                   for ch in mine]
        object.__setattr__(self, "_chunk_modules", modules)   # outside the module tree (the owner holds)
        #: each row's count of counted tokens (None: the loss is not a mean over tokens we can find)
        self._counter = token_counter(capture, capture.output_names.index("loss"), constants, device)
        self._bounds = index_bounds(capture)
        self._total = self._replica_total = torch.ones((), dtype=torch.float64)
        if self._counter is None and microbatches > 1 and mesh.tp_rank == 0 and mesh.dp_rank == 0:
            log.warning("autotp pipeline: the model's loss is not a mean cross-entropy whose targets come from the "
                        "inputs, so a step averages the %d micro-batches' losses: the batch's loss only when they "
                        "weigh alike (no ignored labels)", microbatches)
        loss_node = capture.output_nodes[capture.output_names.index("loss")]
        self._loss_dtype = getattr(loss_node.meta.get("val"), "dtype", torch.float32)
        #: a schedule per (input shapes, training): torch's stages fix their shapes on first use
        self._schedules: dict[tuple, Any] = {}
        self.train(capture.training)

    # ---- set-up -------------------------------------------------------------------------------
    def _check_memory(self, wanted: set[str], layers_here: int, layers: int, limit: float) -> None:
        """This stage's share of the plan's memory within ``limit``, on every rank or none: the
        training state of the parameters it holds, and the activations of its layers for the
        micro-batches in flight (GPipe keeps all of them, 1F1B at most pp on the first stage, the
        interleaved schedule about 1 + 1/virtual times as many layers: ``in_flight_layers``),
        :func:`stage_activation_bytes`."""
        import math

        from ...errors import PlanError

        plan, mesh = self.plan, self.mesh
        held = sum(math.prod(plan.local_shape(f, mesh.tp_rank)) for f in wanted) * plan.dtype_bytes
        whole = max(plan.param_bytes_per_rank()) or 1
        state = (plan.memory_bytes - plan.activation_bytes) * held / whole
        if self.schedule_name == "gpipe":
            held_layers = self.microbatches * layers_here
        else:   # the first stage's fullest: 1F1B's pp micro-batches, the interleaved warm-up's longer
            held_layers = in_flight_layers(layers=layers_here * mesh.pp, p=mesh.pp, virtual=self.virtual,
                                           micro_batches=self.microbatches)
        in_flight = held_layers / max(layers_here, 1)
        acts = stage_activation_bytes(plan, layers, held_layers, self.microbatches)
        fits = state + acts <= limit
        flags = torch.tensor([1 if fits else 0], dtype=torch.int64,
                             device=self.device if mesh.backend == "nccl" else "cpu")
        from ...distributed.comm import _comm

        with _comm("all_reduce(min) telling the stages whether each fits in memory", dist.group.WORLD):
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        gib = 2 ** 30
        if not fits:
            raise PlanError(
                f"pipeline stage {mesh.pp_rank} of {mesh.pp} does not fit: {state / gib:.2f} GiB of training state "
                f"(weights, gradients, Adam) for its {layers_here} of {layers} layers and {acts / gib:.2f} GiB of "
                f"activations for {in_flight:g} micro-batches in flight, over the limit of {limit / gib:.2f} GiB per rank; "
                "use more stages (pp), a larger tp, schedule='1f1b' (fewer micro-batches in flight than GPipe), a "
                "smaller planning batch, or pass memory_limit=")
        if flags.item() == 0:
            raise PlanError("another pipeline stage does not fit in memory (its own error says by how much); this rank "
                            "stops too instead of waiting for it")

    def _shared_groups(self, readers: dict[str, set[int]]) -> dict[str, Any]:
        """A group for each parameter read by chunks on several stages: the ranks at this rank's
        (dp, tp) position on those stages (every rank makes every group, in one order)."""
        mesh = self.mesh
        sets = sorted({tuple(sorted(s)) for s in readers.values() if len(s) > 1})
        found = [sets]
        from ...distributed.comm import _comm

        with _comm("broadcast of the parameters the stages share", dist.group.WORLD):   # a lost rank named
            dist.broadcast_object_list(found, src=0)   # one order on every rank, or a clear error
        if found[0] != sets:
            raise ConfigError(f"the pipeline stages disagree on which parameters they share ({sets} here, "
                              f"{found[0]} on rank 0): every rank must parallelize the same model")
        block = mesh.dp * mesh.tp
        position = dist.get_rank() % block
        group_of: dict[tuple[int, ...], Any] = {}
        for stages in sets:
            for j in range(block):
                group = dist.new_group([s * block + j for s in stages])
                if j == position and mesh.pp_rank in stages:
                    group_of[stages] = group
        return {fqn: group_of[tuple(sorted(s))] for fqn, s in readers.items()
                if len(s) > 1 and mesh.pp_rank in s and fqn in self._held}

    def _schedule_for(self, shapes: tuple, first: list[torch.Tensor]) -> Any:
        """The stages and schedule for these input shapes (and mode: an eval schedule runs
        forward only); ``first``: the first micro-batch's inputs (on the first stage)."""
        if shapes not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            chunks, metas = len(self.chunk_layers), self._shapes_of(first)
            stages = [PipelineStage(m, ch.index, chunks, self.device, input_args=metas[ch.index][0],
                                    output_args=metas[ch.index][1], group=self.mesh.pp_group)
                      for m, ch in zip(self._chunk_modules, self._chunks)]
            self._schedules[shapes] = _make_schedule(self.schedule_name, stages, self.microbatches, self._loss)
        return self._schedules[shapes]

    def _shapes_of(self, first: list[torch.Tensor]) -> dict[int, tuple[tuple, tuple]]:
        """Each of this rank's chunks' (inputs, outputs) as meta tensors, found by running the
        first micro-batch through the pipeline once, forward, without gradients: torch's stages
        then take them as given (its own shape inference would run each chunk on zeros or
        uninitialized memory, and numbers that travel, such as sizes, must be real)."""
        mesh, last = self.mesh, len(self.chunk_layers) - 1
        grad = self.training

        def meta(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, device="meta")
            return out.requires_grad_(grad and t.is_floating_point())

        found: dict[int, tuple[tuple, tuple]] = {}
        for ch, module in zip(self._chunks, self._chunk_modules):
            if ch.index == 0:
                args = tuple(first)
            else:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=mesh.pp_ranks[(ch.index - 1) % mesh.pp], group=mesh.pp_group,
                                      device=self.device if mesh.backend == "nccl" else None)
                sent, module.received_dtypes = box[0]
                args = tuple(a.to(self.device) for a in sent)
            with torch.no_grad():
                out = module(*args)
            outs = out if isinstance(out, tuple) else (out,)
            found[ch.index] = (tuple(meta(a) for a in args), tuple(meta(o) for o in outs))
            if ch.index < last:
                dist.send_object_list([(tuple(o.cpu() for o in outs), module.sent_dtypes or None)],
                                      dst=mesh.pp_ranks[(ch.index + 1) % mesh.pp],
                                      group=mesh.pp_group, device=self.device if mesh.backend == "nccl" else None)
        return found

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the batch's loss: its mean weighted by its counted tokens
        (``target``: each row's count) over the batch's, so the shares add up to the batch's mean
        over tokens; without a count, the mean over micro-batches. A micro-batch whose labels are
        all ignored has a mean of 0/0 (nan): its share is 0 (its gradient is zero either way), so
        it does not turn the batch's loss into nan where the serial model's is a number."""
        if self._counter is None:
            return output / self.microbatches
        count = target.sum().to(output.dtype)
        return torch.where(count > 0, output * (count / self._total.to(output.dtype)), torch.zeros_like(output))

    # ---- a step ---------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return any(ch.index == 0 for ch in self._chunks)

    @property
    def is_last(self) -> bool:
        return any(ch.index == len(self.chunk_layers) - 1 for ch in self._chunks)

    def train(self, mode: bool = True) -> "PipelineModule":
        """Training mode runs dropout where the model has it, eval mode skips it (the chunks'
        random ops follow the mode, as the model's would); see :meth:`step`."""
        super().train(mode)
        for module in getattr(self, "_chunk_modules", ()):
            module.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "PipelineModule":

        if refuse_dtype_change(self, fn):   # the stages' programs were captured in the old dtype
            return self
        return super()._apply(fn, recurse)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step's forward and backward, the batch split into micro-batches; returns
        the batch's loss (detached) on every rank. Gradients accumulate into the parameters
        (zero them between steps, as for any module). In eval mode (``pm.eval()``) the step is
        forward only, without dropout: the loss of a validation batch, no gradient."""
        with self._guard:   # an exception on some ranks only never leaves them out of step
            return self._step(args, kwargs)

    def _step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.training and not self.capture.training:
            raise ConfigError("this pipeline was built from a model in eval mode, whose captured program has no "
                              "dropout: training it would silently train without dropout. Call model.train() before "
                              "autotp.parallelize, or pm.eval() to evaluate")
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        flat = flat_inputs(self.capture, kwargs)
        keys = [k for k in self.capture.input_keys if k not in self.capture.constant_inputs]
        tensors = [x for key, x in zip(self.capture.input_keys, flat) if key not in self.capture.constant_inputs]
        if not all(isinstance(x, torch.Tensor) for x in tensors):
            raise InputError(f"a pipeline step takes tensor inputs ({keys}); pass each of them as a tensor")
        # first: torch's sends and receives of unequal shapes abort the process. Every rank of
        # the replica in the same step of the same pipeline, with inputs of one signature
        signature = input_signature(keys, tensors) + (f"training: {self.training}",) if self.check_inputs else ()
        check_call(f"step {self._steps + 1} of {self.name}", signature,
                   getattr(self.mesh, "replica_control_group", None), "pipeline replica")
        self._steps += 1
        batch = tensors[0].shape[0] if tensors else 0
        # every rank is handed the batch: what would fail in one stage's chunk fails on every rank now
        check_not_empty(kwargs)
        check_index_bounds(self._bounds, kwargs)
        if batch % self.microbatches:
            raise InputError(f"a batch of {batch} does not split into {self.microbatches} equal micro-batches; pass a "
                             f"batch that is a multiple of {self.microbatches}, or change microbatches=")
        # the schedule splits a target along the batch: each row's counted tokens (the loss is in the graph)
        if self._counter is not None:
            target = self._counter([x.to(self.device) for x in tensors]).to(self.device)
            self._total = self._replica_total = target.sum()
            if self.mesh.dp > 1 and self.mesh.dp_group is not None:
                # over the dp replicas' tokens: each replica's share of the whole batch's mean,
                # summed (not averaged) by the data-parallel all-reduce (see _reduce_grads)
                from ...distributed.comm import _comm

                self._total = self._total.clone()
                with _comm("the data-parallel all-reduce of the batch's counted tokens", self.mesh.dp_group):
                    dist.all_reduce(self._total, group=self.mesh.dp_group)
        else:
            target = torch.zeros(batch, device=self.device)
        losses: list[torch.Tensor] = []
        inputs = [x.to(self.device) for x in tensors] if self.is_first else []
        first = [x[:batch // self.microbatches] for x in inputs]
        schedule = self._schedule_for((tuple((tuple(x.shape), x.dtype) for x in tensors), self.training), first)
        run = dict(target=target if self.is_last else None, losses=losses if self.is_last else None)
        from ...distributed.comm import _comm, backend_failure

        # a lost neighbour surfaces in a send or receive of torch's schedule: named by a roll call
        with _comm("the pipeline's sends and receives between stages", self.mesh.pp_group, only=backend_failure):
            if self.training:
                schedule.step(*inputs, **run, return_outputs=False)
            else:
                with torch.no_grad():
                    schedule.eval(*inputs, **run, return_outputs=False)
        loss = torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros((), device=self.device)
        if losses and self._counter is not None:   # this replica's own mean (its share of the whole batch's, over dp)
            loss = loss * (self._total / self._replica_total).to(loss.dtype)
        if self.training:
            self._reduce_grads()
        return self._broadcast_loss(loss)

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh
        last = (len(self.chunk_layers) - 1) % mesh.pp
        value = loss.detach().to(device=self.device, dtype=self._loss_dtype).reshape(1)
        dist.broadcast(value, src=mesh.pp_ranks[last], group=mesh.pp_group)
        return value[0]

    def _reduce_grads(self) -> None:
        """Sum each shared parameter's gradient over the stages that hold it, then combine every
        gradient over the dp group (one all-reduce per dtype): a sum where the loss is a mean over
        counted tokens (each replica's micro-batches were weighted by the whole batch's count, so
        the sum is the gradient of the whole batch's mean, however the ignored labels fall), else
        the mean of the replicas' gradients."""
        from ...distributed.comm import _comm

        for fqn, group in self._shared.items():
            grad = self._held[fqn].grad
            if grad is not None:
                with _comm(f"the pipeline's all-reduce of {fqn}'s gradient over the stages that hold it", group):
                    dist.all_reduce(local_tensor(grad), group=group)
        mesh = self.mesh
        if mesh.dp <= 1 or mesh.dp_group is None:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self._held.values():
            if param.grad is not None:
                g = local_tensor(param.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            with _comm("the data-parallel gradient all-reduce", mesh.dp_group):
                dist.all_reduce(flat, group=mesh.dp_group)
            if self._counter is None:
                flat.div_(mesh.dp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise InputError("a pipelined model runs a whole step at a time: call pm.step(**batch) (forward and "
                         "backward over the micro-batches), not pm(**batch)")

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameter shards on this rank, under the names the programs use."""

        return {fqn: local_tensor(p) for fqn, p in self._held.items()}

    def describe(self) -> str:
        """Which layers each chunk runs, and on which stage."""
        lines = [f"pipeline: {self.mesh.pp} stages x {self.virtual} virtual, {self.schedule_name}, "
                 f"{self.microbatches} micro-batches"]
        for c, layers in enumerate(self.chunk_layers):
            span = f"{layers[0]} .. {layers[-1]}" if len(layers) > 1 else layers[0]
            extra = (" + embedding" if c == 0 else "") + (" + head, loss" if c == len(self.chunk_layers) - 1 else "")
            lines.append(f"  chunk {c} on stage {c % self.mesh.pp}: {len(layers)} layers ({span}){extra}")
        return "\n".join(lines)


def _make_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable) -> Any:
    from torch.distributed import pipelining as pl

    if name == "interleaved1f1b":
        return pl.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = pl.ScheduleGPipe if name == "gpipe" else pl.Schedule1F1B
    return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def check_pipeline(pp: int, microbatches: int | None, schedule: str | None, virtual: int) -> tuple[int, str, int]:
    """(micro-batches, schedule, virtual stages) for ``pp`` stages, or a ConfigError naming the fix."""
    for name, value in (("virtual", virtual),):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive int")
    schedule = (schedule or ("interleaved1f1b" if virtual > 1 else "1f1b")).lower().replace("-", "").replace("_", "")
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if virtual > 1 and schedule != "interleaved1f1b":
        raise ConfigError(f"virtual={virtual} stages per rank need schedule='interleaved1f1b' (not {schedule})")
    if schedule == "interleaved1f1b" and virtual < 2:
        raise ConfigError("schedule='interleaved1f1b' runs several chunks per stage: pass virtual >= 2")
    microbatches = pp if microbatches is None else microbatches
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive int")
    if schedule != "gpipe" and microbatches < pp:
        raise ConfigError(f"{schedule} with pp={pp} needs at least {pp} micro-batches (got {microbatches}): a "
                          "stage waits for the others otherwise; pass microbatches >= pp or schedule='gpipe'")
    return microbatches, schedule, virtual


__all__ = ["PipelineModule", "balance", "cut", "layer_costs", "check_pipeline", "token_counter", "SCHEDULES"]
