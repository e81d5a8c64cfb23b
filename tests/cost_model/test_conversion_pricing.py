"""A conversion (f, g, all-gather, reduce-scatter, all-to-all) is priced at the bytes its tensor's
dtype moves: a bf16 model's float32 tensors that cross ranks (OLMo-2's q and k upcast for their
whole-width norms, gathered where the projections are column-parallel) at 4 bytes an element, as
the ATen collectives one rank of the program calls on the fake backend move them, not at the
model's 2."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp import zoo
from autotp.cost_model.symbolic import ring_volume
from autotp.testing.host import MEGATRON
from tests.cost_model.kernel_counts import tensor_bytes
from tests.helpers import fake_process_group

TP = 8


class CollectiveVolumes(TorchDispatchMode):
    """Each float collective a rank calls, as (its dtype, the bytes the rank sends in a ring:
    :func:`~autotp.cost_model.symbolic.ring_volume` of the whole tensor), in call order. Integer
    ones (the per-call agreement) are no conversion of the plan's."""

    #: c10d op -> (the collective priced, the argument holding the tensor, that tensor's share of the whole)
    KINDS = {"allreduce_": ("all_reduce", 0, 1), "_allgather_base_": ("all_gather", 0, 1),
             "_reduce_scatter_base_": ("reduce_scatter", 1, 1), "alltoall_base_": ("all_to_all", 1, TP),
             "all_reduce": ("all_reduce", 0, 1), "all_gather_into_tensor": ("all_gather", 0, TP),
             "reduce_scatter_tensor": ("reduce_scatter", 0, 1), "all_to_all_single": ("all_to_all", 0, TP),
             # the rows of a sequence split at a batch of a few, one collective a row in one call
             "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
             "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1)}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name in self.KINDS:
            kind, arg, share = self.KINDS[name]
            tensors = args[arg] if isinstance(args[arg], (list, tuple)) else [args[arg]]
            if tensors[0].is_floating_point():
                self.calls.append((tensors[0].dtype, float(ring_volume(kind, share * tensor_bytes(tensors), TP))))
        return func(*args, **(kwargs or {}))


def test_a_float32_tensor_crossing_ranks_is_priced_at_the_bytes_it_moves():
    # OLMo-2 upcasts q and k to float32 for their norms over the whole width: with the projections
    # column-parallel (Megatron's layout), each is all-gathered in float32 ([2, 16, 128]: 16 KiB,
    # 14 KiB sent by each rank), where it was priced at 7 KiB
    config = zoo.tiny_config("olmo2", layers=1, heads=TP, kv_heads=TP, head_dim=16, vocab=128, positions=64)
    model = zoo.build("olmo2", config, dtype=torch.bfloat16)
    inputs = zoo.example_batch("olmo2", config, batch=2, seq=16)
    with fake_process_group(TP):
        # the statistics written: their float32 gathers; the products too: q|k|v joined, the plan
        # gathers the bf16 product before its split and upcast instead, and no float32 crosses ranks
        pm = autotp.parallelize(model, TP, profile="h200", batch=2, seq=16, layout=MEGATRON["llama"],
                                fuse_norms=False, fuse_products=False)
        with CollectiveVolumes() as forward:
            loss = pm(**inputs).loss
        with CollectiveVolumes() as backward:
            loss.backward()
    plan = pm.plan
    assert sorted(v for _, v in forward.calls) == sorted(c.fwd_bytes for c in plan.comms if c.fwd_bytes), \
        (forward.calls, plan.comms)
    assert sorted(v for _, v in backward.calls) == sorted(c.bwd_bytes for c in plan.comms if c.bwd_bytes), \
        (backward.calls, plan.comms)
    # what the test is about: the float32 gathers are among them, at 4 bytes an element
    assert [v for dtype, v in forward.calls if dtype == torch.float32] == [2 * 16 * 128 * 4 * (TP - 1) / TP] * 2
