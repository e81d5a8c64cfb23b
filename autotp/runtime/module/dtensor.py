"""autotp's parameter layouts as DTensor placements.

A ParallelModule's parameters are DTensors on the ``(dp, tp)`` DeviceMesh: ``Replicate()`` over
dp, and over tp the placement that says exactly which elements this rank holds.

- ``Replicate`` stays ``Replicate()``.
- A shard whose per-rank ranges are those of ``torch.chunk`` (an even split, or an uneven one
  that happens to deal like ``torch.chunk``) is torch's own ``Shard(dim)``.
- Any other shard (an uneven split that gives the first ``n % tp`` ranks one atom more; fused
  q|k|v, where a rank holds a run of each of q, k and v; runs rotated between layers) is a
  :class:`RunShard`: torch's ``Shard(dim)`` subclassed with autotp's ``Shard(dim, chunks, unit,
  rotate)``, whose gather puts every run back where it came from.

Torch's sharding propagation builds a pointwise op's candidate placements from a few placement
families (``Shard(d)`` for any ``d``), so it never proposes a RunShard: an in-place update of a
RunShard tensor (an optimizer step, gradient clipping) would fail. :func:`install` teaches it
one more candidate: where every tensor of a pointwise strategy is sharded on the RunShard's dim,
the RunShard itself (the tensors of a pointwise op have that dim's size in common, so they split
alike). It also lets a spec holding a RunShard pass torch's shard-order check (which compares
with ``Shard(dim)`` by equality), and refuses a redistribution from a RunShard to anything but
``Replicate()`` or itself rather than relabel the data. A RunShard with a tail (a fused
multi-query k and v, held whole by every rank) would be summed once per rank by a norm: DTensor
handlers for ``linalg_vector_norm`` and ``_foreach_norm`` (what ``clip_grad_norm_`` calls) give
the norm each rank's owned elements only (:func:`owned_part`). These are wrappers around private
torch functions, installed once; a torch without them raises ``ConfigError`` on first use.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor.placement_types import Shard as TorchShard

from ...distributed.mesh import device_mesh_of
from ...errors import ConfigError
from ...placements import Partial, Placement, Shard, layout, local_ranges, local_size, owned_ranges


class RunShard(TorchShard):
    """autotp's ``Shard(dim, chunks, unit, rotate)`` over one mesh dim: rank ``r`` holds the
    ranges ``autotp.placements.local_ranges(size, shard, tp, r)`` of ``dim``, laid side by side."""

    def __init__(self, shard: Shard):
        super().__init__(shard.dim)
        self.shard = shard

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunShard) and other.shard == self.shard

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("RunShard", self.shard))

    def __repr__(self) -> str:
        return f"RunShard({self.shard!r})"

    def __reduce_ex__(self, protocol: int) -> tuple:
        # torch's Shard pickles (and copies) its dim alone; a copy without autotp's layout would
        # be a RunShard that knows no ranges (dynamo copies placements into its guards)
        return RunShard, (self.shard,)

    def __copy__(self) -> "RunShard":
        return RunShard(self.shard)

    def __deepcopy__(self, memo: dict) -> "RunShard":
        return RunShard(self.shard)

    __str__ = __repr__

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        """An expression that rebuilds this placement, and the names it uses: torch registers its
        placements as opaque values, so a graph that makes a DTensor (a compiled call's logits split
        unevenly, ``DTensor.from_local``) writes each placement into its code as such."""
        fields = ", ".join(f"{f.name}={getattr(self.shard, f.name)!r}" for f in dataclasses.fields(self.shard))
        return f"autotp_RunShard(autotp_Shard({fields}))", {"autotp_RunShard": RunShard, "autotp_Shard": Shard}

    # ---- the ranges ----------------------------------------------------------------------
    def ranges(self, size: int, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        return local_ranges(size, self.shard, tp, rank)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """(size, offset) of this rank's part: its size, and the start of its first range. A rank
        holding several runs (fused q|k|v) has no one offset: torch asks for it to size new
        tensors (the size is right); torch.distributed.checkpoint, which writes one chunk per rank
        at that offset, would find the chunks overlap and refuse the plan."""
        ranges = self.ranges(int(curr_local_size), num_chunks, int(rank))
        if not ranges:
            return 0, 0
        return sum(b - a for a, b in ranges), ranges[0][0]

    # ---- moving data ---------------------------------------------------------------------
    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        n = tensor.shape[self.dim]
        most = max(local_size(n, self.shard, num_chunks, r) for r in range(num_chunks))
        pieces, pads = [], []
        for r in range(num_chunks):
            piece = self._select(tensor, n, num_chunks, r)
            pad = most - piece.shape[self.dim]
            if with_padding and pad:
                piece = torch.nn.functional.pad(piece, [0, 0] * (tensor.dim() - 1 - self.dim) + [0, pad])
            pieces.append(piece.contiguous() if contiguous else piece)
            pads.append(pad if with_padding else 0)
        return pieces, pads

    def _select(self, tensor: torch.Tensor, n: int, tp: int, rank: int) -> torch.Tensor:
        return _take(tensor, self.dim, self.ranges(n, tp, rank))

    def _select_split_tensor(self, tensor: torch.Tensor, num_chunks: int, index: int, *, with_padding: bool = True,
                             contiguous: bool = True, clone: bool = True) -> torch.Tensor:
        pieces, _ = self._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=contiguous)
        return pieces[index].clone() if clone else pieces[index]

    def _replicate_to_shard(self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int, shard_index: int) -> torch.Tensor:
        n = local_tensor.shape[self.dim]
        return self._select(local_tensor, n, mesh.size(mesh_dim=mesh_dim), int(shard_index)).clone()

    def _to_replicate_tensor(self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int,
                             current_logical_shape: Sequence[int]) -> torch.Tensor:
        """All-gather the runs (padded to the longest rank's) and put each where it belongs."""
        import torch.distributed._functional_collectives as funcol

        import torch.distributed as dist

        from ...distributed.gather_scatter import _gloo_on_device, all_gather_single

        tp, n, dim = mesh.size(mesh_dim=mesh_dim), int(current_logical_shape[self.dim]), self.dim
        most = max(local_size(n, self.shard, tp, r) for r in range(tp))
        pad = most - local_tensor.shape[dim]
        if pad:
            local_tensor = torch.nn.functional.pad(local_tensor, [0, 0] * (local_tensor.dim() - 1 - dim) + [0, pad])
        if _gloo_on_device(local_tensor, mesh.get_group(mesh_dim)):
            send = local_tensor.contiguous()
            blocks = send.new_empty((tp * send.shape[0],) + tuple(send.shape[1:]))
            dist.all_gather_into_tensor(blocks, send, group=mesh.get_group(mesh_dim))
            gathered = torch.cat(list(blocks.view((tp,) + tuple(send.shape)).unbind(0)), dim=dim)
        else:
            gathered = all_gather_single(local_tensor.contiguous(), dim, (mesh, mesh_dim))
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
        placed = []   # (start in the full dim, the run)
        for r in range(tp):
            block, offset, owned = gathered.narrow(dim, r * most, most), 0, set(owned_ranges(n, self.shard, tp, r))
            for a, b in self.ranges(n, tp, r):
                if (a, b) in owned:   # a tail every rank holds is taken from rank 0
                    placed.append((a, block.narrow(dim, offset, b - a)))
                offset += b - a
        placed.sort(key=lambda item: item[0])
        return torch.cat([run for _, run in placed], dim=dim)


def parameter(full: torch.Tensor, placement: Placement, tp: int, mesh: Any, device: torch.device,
              local: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of the parameter ``full`` under ``placement``, a copy on ``device``
    (``local``: the part itself, read from a checkpoint), as a DTensor on ``mesh``'s (dp, tp)
    DeviceMesh where it has one: replicated over dp, over tp the placement that describes
    ``placement`` exactly (as :func:`torch_placement`; the shard's layout computed once, for both)."""
    from torch.distributed.tensor import DTensor

    rank = mesh.tp_rank if mesh is not None else 0
    size = ranges = None
    if isinstance(placement, Shard):
        size = full.shape[placement.dim]
        ranges = layout(size, placement, tp)   # every rank's: for the slice and for the DTensor placement
    over_tp = torch_placement(placement, size, tp, ranges)
    if local is None:   # a copy: the model's own tensor is never a parameter's storage
        local = (full if ranges is None else _take(full, placement.dim, ranges[rank])).detach().to(device, copy=True)
    else:
        local = local.to(device)
    device_mesh = device_mesh_of(mesh, device)
    if device_mesh is None:
        return local
    install()
    shape = tuple(full.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [TorchReplicate(), over_tp], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def torch_placement(placement: Placement, size: int | None, tp: int, ranges: Any = None):
    """The DTensor placement over the tp mesh dim that describes ``placement`` exactly for a
    dim of ``size`` elements (the sharded dim's size; unused for Replicate); ``ranges``: the
    shard's :func:`~autotp.placements.layout`, where the caller has computed it."""
    if isinstance(placement, Shard):
        if ranges is None:
            ranges = layout(size, placement, tp)
        return TorchShard(placement.dim) if ranges == _chunk_layout(size, tp) else RunShard(placement)
    if isinstance(placement, Partial):
        raise ConfigError("a parameter cannot be Partial (a summand on each rank); this is a planner bug")
    return TorchReplicate()


def _take(tensor: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The ``[start, stop)`` ``ranges`` of ``tensor``'s ``dim``, side by side."""
    if not ranges:
        return tensor.narrow(dim, 0, 0)
    return torch.cat([tensor.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _chunk_layout(size: int, tp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """torch.chunk's per-rank ranges: ceil(size / tp) each, the last ranks short or empty."""
    step = -(-size // tp)
    out = []
    for r in range(tp):
        a, b = min(r * step, size), min((r + 1) * step, size)
        out.append(((a, b),) if b > a else ())
    return tuple(out)


# ---- norms count a tail once ------------------------------------------------------------------
_NORMS = (torch.ops.aten.linalg_vector_norm.default, torch.ops.aten._foreach_norm.Scalar)


def _dispatch_handlers() -> dict:
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        raise ConfigError(f"this torch ({torch.__version__}) lacks DTensor's custom op handlers, which autotp "
                          "uses so that norms count a layout's whole tail once; use the torch version autotp is "
                          "tested with")
    return handlers


def owned_part(t: Any) -> Any:
    """A DTensor whose tp placement is a RunShard with a tail (k and v kept whole on every rank)
    as a DTensor over the elements this rank owns (its runs; the tail on rank 0 only), placed as
    torch's plain ``Shard``: a reduction over it (a norm) sums every element once. Other tensors
    are returned as they are."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    tailed = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, RunShard) and p.shard.holds_whole]
    if not tailed:
        return t
    (mesh_dim, run), = tailed
    dim, n = run.dim, t.shape[run.dim]
    tp, rank = t.device_mesh.size(mesh_dim), t.device_mesh.get_local_rank(mesh_dim)
    # the rank's tp-local positions it owns, then the part of them this tensor holds: FSDP2 cuts
    # the tp-local tensor again on the same dim over dp (torch.chunk's ceil-sized pieces)
    owned, keep, at = set(owned_ranges(n, run.shard, tp, rank)), [], 0
    for a, b in run.ranges(n, tp, rank):
        if (a, b) in owned:
            keep.append((at, at + b - a))
        at += b - a
    start, held = 0, t._local_tensor.shape[dim]
    for i, p in enumerate(t.placements):
        if i != mesh_dim and _splits(p, dim):
            if i > mesh_dim:
                raise ConfigError(f"cannot reduce a tensor split on dim {dim} by {run!r} and then by {p!r}")
            start = t.device_mesh.get_local_rank(i) * -(-at // t.device_mesh.size(i))
    pieces = [t._local_tensor.narrow(dim, max(a, start) - start, min(b, start + held) - max(a, start))
              for a, b in keep if min(b, start + held) > max(a, start)]
    local = torch.cat(pieces, dim=dim) if pieces else t._local_tensor.narrow(dim, 0, 0)
    placements = [TorchShard(dim) if i == mesh_dim or _splits(p, dim) else p for i, p in enumerate(t.placements)]
    return DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _splits(p: Any, dim: int) -> bool:
    """Whether placement ``p`` splits tensor dim ``dim`` (torch's Shard, or FSDP2's _StridedShard,
    which is not a Shard subclass)."""
    return getattr(p, "dim", None) == dim and not (p.is_replicate() or p.is_partial())


def _norm_of_owned(handlers: dict, op: Any, previous: Any):
    """A DTensor handler for ``op`` (a norm): reductions over a tailed layout's dim take each
    rank's owned elements; everything else goes to DTensor's own handling (the handler steps
    aside for that call: torch's own handler for ``op`` where it has one, ``previous``)."""
    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        dims = args[2] if len(args) > 2 else kwargs.get("dim")
        if op_call is torch.ops.aten.linalg_vector_norm.default and dims is not None:
            reduced = {d % args[0].dim() for d in ([dims] if isinstance(dims, int) else dims)}
            tailed = [p.dim for p in getattr(args[0], "placements", ())
                      if isinstance(p, RunShard) and p.shard.holds_whole]
            if not any(d in reduced for d in tailed):
                return _default(handlers, op, handler, previous, op_call, args, kwargs)   # the tail stays
        first = [owned_part(t) for t in args[0]] if isinstance(args[0], (list, tuple)) else owned_part(args[0])
        return _default(handlers, op, handler, previous, op_call, (first,) + tuple(args[1:]), kwargs)

    return handler


def _default(handlers: dict, op: Any, handler: Any, previous: Any, op_call: Any, args: tuple, kwargs: dict) -> Any:
    if previous is None:
        handlers.pop(op, None)
    else:
        handlers[op] = previous
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op] = handler


class _TailSumRefused:
    """Wraps DTensor's sharding propagation (the dispatcher's slow path, where a decision is made
    before torch caches it): an op that would sum a tailed RunShard over ranks (its output
    Partial on that mesh dim: a ``sum``, a ``mean``, a matmul over the dim) is a ConfigError
    naming it, instead of a result that counts the tail once per rank. Norms never get here with
    a tail (their handlers hand over the owned elements)."""

    def __init__(self, propagate: Any, on_op_info: bool = False):
        self.propagate, self.on_op_info = propagate, on_op_info

    def __call__(self, *args: Any) -> Any:
        result = self.propagate(*args)
        op_info = args[0] if self.on_op_info else args[3]   # propagate(op_info) / slow path(op, a, kw, op_info)
        self.check(op_info, op_info.output_sharding if self.on_op_info else result)
        return result

    @staticmethod
    def check(op_info: Any, result: Any) -> None:
        schema = getattr(op_info, "schema", None)
        tailed = set() if schema is None else {
            i for spec in schema.args_spec for i, p in enumerate(spec.placements)
            if isinstance(p, RunShard) and p.shard.holds_whole}
        if tailed and hasattr(result, "output_spec"):
            outs = result.output_spec if isinstance(result.output_spec, (list, tuple)) else [result.output_spec]
            for spec in outs:
                if spec is not None and any(spec.placements[i].is_partial() for i in tailed):
                    raise ConfigError(
                        f"{schema.op} would sum a tensor whose layout keeps a tail (k and v whole on every rank) "
                        "over the ranks, counting the tail once per rank: call full_tensor() first, or reduce "
                        "with torch.linalg.vector_norm / clip_grad_norm_, which count it once")


# ---- teaching torch's sharding propagation about RunShard ------------------------------------
_INSTALLED = False


def _follow_runs_in_pointwise_strategies() -> None:
    """torch < 2.12 builds a pointwise op's strategy in ``common_pointwise_strategy`` from the
    followed argument's placements, re-making each shard as ``Shard(dim)``: an in-place update of
    a RunShard tensor (``param.mul_`` in AdamW) would then redistribute from the RunShard to
    ``Shard(dim)``. Put the RunShard back wherever a spec shards that dim (shifted by
    broadcasting for arguments of fewer dims); the tensors of a pointwise op share the dim's
    size, so they split alike."""
    from dataclasses import replace

    try:
        from torch.distributed.tensor._ops import _pointwise_ops
        from torch.distributed.tensor._ops.utils import generate_redistribute_costs
        from torch.distributed.tensor._op_schema import OpStrategy
    except ImportError:
        return
    common = getattr(_pointwise_ops, "common_pointwise_strategy", None)
    if common is None:
        return

    def follow_runs(op, args_schema, followed_strategy, followed_strategy_index, *args, **kwargs):
        out = common(op, args_schema, followed_strategy, followed_strategy_index, *args, **kwargs)
        tensors = [a for a in args_schema if isinstance(a, OpStrategy)]
        ndim = len(torch.broadcast_shapes(*[a.shape for a in tensors]))
        for followed, spec in zip(followed_strategy.strategies, out.strategies):
            source = followed.output_spec
            runs = {i: (p, ndim - len(source.shape) + p.dim) for i, p in enumerate(source.placements)
                    if isinstance(p, RunShard)}
            if not runs:
                continue

            def put_back(target, target_ndim):
                placements = list(target.placements)
                for i, (run, out_dim) in runs.items():
                    d = target_ndim - ndim + out_dim
                    if d >= 0 and type(placements[i]) is TorchShard and placements[i].dim == d:
                        placements[i] = run if d == run.dim else RunShard(replace(run.shard, dim=d))
                target.placements = tuple(placements)

            put_back(spec.output_spec, ndim)
            for target in spec.input_specs:
                put_back(target, len(target.shape))
            spec.redistribute_cost = [generate_redistribute_costs(a, t) for a, t in zip(tensors, spec.input_specs)]
        return out

    _pointwise_ops.common_pointwise_strategy = follow_runs


def _local_strides_from_local_shapes() -> None:
    """Two fixes of torch < 2.12's ``new_empty_strided`` on DTensors. It gives ``new_empty_strided`` on a DTensor the global strides divided by the
    mesh size, which is right for even shards only: autograd's layout contract (a DTensor
    gradient whose strides differ from its parameter's is copied into ``new_empty_strided``)
    then wrote an uneven shard's gradient into a local tensor of overlapping strides (GPT-2's
    fused c_attn with 6 heads at tp 4: relative error 0.6). Derive the local strides from the
    local shape in the global strides' order, as torch 2.12 does."""
    import inspect

    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor._op_schema import OpSchema
    except ImportError:
        return
    local_stride = getattr(_sharding_prop, "compute_local_stride", None)
    adjust = getattr(_sharding_prop.ShardingPropagator, "_adjust_shape_and_stride_args", None)
    if local_stride is None or adjust is None or "mesh" not in inspect.signature(local_stride).parameters:
        return   # this torch derives them from the local shape already

    def dense(global_stride, local_shape) -> tuple[int, ...]:
        order = sorted(range(len(global_stride)), key=lambda d: global_stride[d], reverse=True)
        out, step = [0] * len(global_stride), 1
        for d in reversed(order):
            out[d] = step
            step *= local_shape[d]
        return tuple(out)

    def adjust_dense(self, out_tensor_meta, schema, spec):
        out = adjust(self, out_tensor_meta, schema, spec)
        index = self.op_to_shape_and_stride_idx[schema.op]
        if isinstance(index, tuple):
            shape_idx, stride_idx = index
            args = list(out.args_schema)
            args[stride_idx] = dense(out_tensor_meta.stride, args[shape_idx])
            out = OpSchema(out.op, tuple(args), out.kwargs_schema)
        return out

    _sharding_prop.ShardingPropagator._adjust_shape_and_stride_args = adjust_dense

    # ... and its new_empty_strided replicates an uneven shard (torch's own Shard(1) of 128
    # columns over 3 ranks): the gradient copied through it came back whole, all-gathered
    # (GPT-2's c_fc at tp 3). A sharded input of the same shape is followed, as 2.12 does.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSpec

    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.new_empty_strided.default
    strategy = propagator.op_strategy_funcs.get(op)
    if strategy is None:
        return

    def follow_shards(op_schema):
        out = strategy(op_schema)
        source = op_schema.args_schema[0]
        if tuple(source.shape) == tuple(op_schema.args_schema[1]):
            for candidate in source.strategies:
                spec = candidate.output_spec
                if spec.is_sharded() and not any(o.output_spec == spec for o in out.strategies):
                    out.strategies.append(OpSpec(output_specs=spec, input_specs=(spec,),
                                                 redistribute_cost=[[-0.1] * len(source.strategies)]))
        return out

    propagator.op_strategy_funcs[op] = follow_shards


def install() -> None:
    """Wrap the torch internals described in the module docstring (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from torch.distributed.tensor import _api, _dispatch, _dtensor_spec, _redistribute
        from torch.distributed.tensor._ops import single_dim_strategy as sds

        fill = sds._fill_single_dim_strategy_placeholders
        placeholder = sds._ShardingPlaceholder
        verify = _dtensor_spec.DTensorSpec._verify_shard_order
        redistribute = _redistribute.redistribute_local_tensor
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"this torch ({torch.__version__}) lacks the DTensor internals autotp extends for its parameter "
            f"placements ({exc}); use the torch version autotp is tested with") from None

    def fill_with_runs(unique_input_placements, strategies):
        out = fill(unique_input_placements, strategies)
        for run in [p for p in unique_input_placements if isinstance(p, RunShard)]:
            for strategy in strategies:
                dims = {p.dim for p in strategy if isinstance(p, placeholder)}
                if dims == {run.dim}:
                    out.append([run if isinstance(p, placeholder) else p for p in strategy])
        return out

    def verify_unless_runs(self, shard_order):
        if any(isinstance(p, RunShard) for p in self.placements):
            return None   # a RunShard is a shard of its dim; torch's check compares with Shard(dim)
        return verify(self, shard_order)

    def redistribute_checked(local_tensor, current_spec, target_spec, *args, **kwargs):
        for i, (a, b) in enumerate(zip(current_spec.placements, target_spec.placements)):
            for src, dst in ((a, b), (b, a)):
                if isinstance(src, RunShard) and dst != src and not dst.is_replicate():
                    raise ConfigError(
                        f"cannot redistribute between {src!r} and {dst!r} on mesh dim {i}: autotp's run "
                        "layouts convert only to Replicate(); call full_tensor() first")
        return redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)

    _follow_runs_in_pointwise_strategies()
    _local_strides_from_local_shapes()
    handlers = _dispatch_handlers()
    for op in _NORMS:
        handlers[op] = _norm_of_owned(handlers, op, handlers.get(op))
    dispatcher = _api.DTensor._op_dispatcher
    if hasattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path"):   # torch >= 2.12: C++ entry point
        dispatcher._propagate_op_sharding_dispatch_slow_path = _TailSumRefused(
            dispatcher._propagate_op_sharding_dispatch_slow_path)
    else:   # older: the Python dispatcher asks the propagator, which records the decision on op_info
        propagator = dispatcher.sharding_propagator
        propagator.propagate = _TailSumRefused(propagator.propagate, on_op_info=True)
    sds._fill_single_dim_strategy_placeholders = fill_with_runs
    _dtensor_spec.DTensorSpec._verify_shard_order = verify_unless_runs
    for module in (_redistribute, _dispatch, _api):   # the latter two import it by name
        if getattr(module, "redistribute_local_tensor", None) is redistribute:
            module.redistribute_local_tensor = redistribute_checked
    _INSTALLED = True
