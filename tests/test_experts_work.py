"""A rank runs its own experts' rows and nothing else: its work counted, on torch's ``fake`` backend.

One MoE layer, every other parameter pinned replicated, so each rank routes every token as the
serial model does (the fake collectives move nothing: after the layer's g a rank holds only its
share, which no later router reads). Each rank of tp=2 runs a training step under
:class:`~autotp.testing.work.WorkCounter`; over the ranks, the work on the (token, expert) rows
(the expert products' FLOPs, the activation's bytes, forward and backward) adds up to the
serial model's exactly: each row is computed once, by the rank holding its expert, and no rank
passes over another's rows (expert parallelism once ran the activation, the batched product and
the rest on every row of every rank, zero where not its own).
"""
import pytest
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.testing.work import WorkCounter

TP = 2
#: ops that run on the (token, expert) rows alone in Mixtral (its MLP is all experts; attention
#: has no silu, bmm or grouped product)
ROW_OPS = ("aten.silu", "aten.silu_backward", "aten.bmm", "aten._grouped_mm", "transformers.grouped_mm_fallback",
           "transformers.grouped_mm_fallback_backward")


def _work(impl: str, rank: int | None) -> dict[str, int]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=16, vocab=48, experts=4, top_k=2,
                             intermediate_size=128, positions=64)
    config._experts_implementation = impl
    model = zoo.build("mixtral", config, seed=0)
    batch = zoo.example_batch("mixtral", config, batch=2, seq=16, seed=1)
    if rank is not None:
        dist.init_process_group("fake", rank=rank, world_size=TP, store=FakeStore())
        # a planning workload large enough that the rows stay routed up to the combine
        model = autotp.parallelize(model, TP, layout={"*.experts.*": "expert", "*": "replicate"}, batch=64, seq=32)
    try:
        with WorkCounter() as work:
            model(**batch).loss.backward()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # serial Mixtral runs torch's grouped kernel on CPU, the rank program transformers' fallback op
    # (its own capture); a product's FLOPs are the same either way
    products = sum(work.by_op[op] for op in ROW_OPS if op not in ("aten.silu", "aten.silu_backward"))
    return {"products": products, "silu": work.by_op["aten.silu"], "silu_backward": work.by_op["aten.silu_backward"],
            "gathered": work.by_op["aten.index"]}


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_ranks_share_the_rows_of_experts_exactly(impl):
    serial = _work(impl, None)
    ranks = [_work(impl, r) for r in range(TP)]
    gathered = serial.pop("gathered"), [r.pop("gathered") for r in ranks]
    assert all(v > 0 for v in serial.values()), serial
    for kind, whole in serial.items():
        assert sum(r[kind] for r in ranks) == whole, (kind, [r[kind] for r in ranks], whole)
    # the rows gathered for the experts (transformers' hidden_states[perm // top_k] on the grouped
    # path, the routing weights picked on both): the ranks together gather no more than serial
    # (each rank once gathered every row and kept its own)
    assert sum(gathered[1]) <= gathered[0], gathered
