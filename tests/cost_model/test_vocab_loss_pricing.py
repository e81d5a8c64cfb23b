"""The vocab-parallel loss is priced as the kernels a rank runs for it: every ATen call its forward
and backward dispatch on one rank of the fake backend (collectives return at once) is a launch
of the price, and the bytes each call touches sum to the price's bytes, for half, single and
double logits, every reduction, one or two ranges of the vocabulary held."""
import pytest
import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.cost_model.kernels import op_work
from autotp.distributed.functional import VocabParallelCrossEntropy
from autotp.passes.rules import OpInfo, Strategy, TensorMeta
from autotp.placements import REPLICATE, Shard, local_ranges
from tests.cost_model.kernel_counts import KernelCounter, tensor_bytes
from tests.helpers import fake_process_group

aten = torch.ops.aten
TP = 8
#: ops that fill a tensor without reading one
FILLS = ("zeros_like", "ones_like", "scalar_tensor", "full_like", "empty_like")


@pytest.fixture(scope="module")
def fake_world():
    with fake_process_group(TP) as group:
        yield group


def _priced(rows: int, vocab: int, shard: Shard, dtype, reduction: int):
    logits = TensorMeta((sympy.Integer(rows), sympy.Integer(vocab)), dtype)
    target = TensorMeta((sympy.Integer(rows),), torch.int64)
    out = TensorMeta(() if reduction else (sympy.Integer(rows),), dtype)
    info = OpInfo(aten.cross_entropy_loss.default, (logits, target, None, reduction), {}, (logits, target), out, TP)
    info.train_dtype, info.grad_inputs = dtype, (True, False)
    return op_work(info, Strategy((shard, REPLICATE), REPLICATE), TP, dtype.itemsize if dtype != torch.bfloat16
                   else 2, torch.float32 if dtype == torch.bfloat16 else dtype, rank=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("chunks", [1, 2])
def test_priced_kernels_and_bytes_are_what_the_rank_runs(fake_world, dtype, reduction, chunks):
    rows, vocab = 24, 203            # 8 ranks do not divide the vocabulary
    shard = Shard(1, chunks=chunks) if chunks > 1 else Shard(1)
    vocab = vocab if chunks == 1 else 2 * 101
    ranges = local_ranges(vocab, shard, TP, 0)
    cols = sum(stop - start for start, stop in ranges)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[::5] = -100
    loss = VocabParallelCrossEntropy(fake_world, ranges, -100, reduction)
    with KernelCounter(FILLS) as forward:
        out = loss(logits, target)
    upstream = torch.randn(out.shape, generator=g, dtype=out.dtype)
    with KernelCounter(FILLS) as backward:
        torch.autograd.grad(out, logits, upstream)
    work = _priced(rows, vocab, shard, dtype, reduction)
    calls = forward.calls + backward.calls
    assert work.launches == len(calls), calls
    assert sum(b for _, b in work.moved) == sum(b for _, b in calls), calls


class CollectiveBytes(TorchDispatchMode):
    """The bytes of each tensor a c10d collective is called on, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append((func.overloadpacket.__name__, tensor_bytes(args[0])))
        return func(*args, **(kwargs or {}))


def test_the_loss_collectives_are_priced_at_the_bytes_they_move(fake_world):
    """A bf16 model's vocabulary-parallel loss sums float32 numbers (it upcasts half-precision
    logits): its two all-reduces (the row max; the sums of exps and the targets' logits) are priced
    at 4 bytes an element, as the ATen all-reduces on the fake backend move them, not at the
    model's 2."""
    import autotp
    from autotp import zoo
    from autotp.cost_model.symbolic import ring_volume

    batch, seq, vocab = 4, 128, 32000
    config = zoo.tiny_config("llama", layers=1, heads=8, kv_heads=8, head_dim=16, vocab=vocab, positions=seq)
    model = zoo.build("llama", config, device="meta", dtype=torch.bfloat16)
    plan = autotp.plan(model, TP, batch=batch, seq=seq, profile="h200", gather_logits=False,
                       layout={"lm_head.weight": "vocab"})
    priced = [c.fwd_bytes for c in plan.comms if c.kind == "all_reduce" and "cross_entropy" in c.consumer]
    rows, shard = batch * seq, Shard(1)
    ranges = local_ranges(vocab, shard, TP, 0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, sum(b - a for a, b in ranges), generator=g).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    with CollectiveBytes() as moved:
        VocabParallelCrossEntropy(fake_world, ranges, -100, 1)(logits, target)
    assert [name for name, _ in moved.calls] == ["allreduce_", "allreduce_"], moved.calls
    assert priced == [float(ring_volume("all_reduce", b, TP)) for _, b in moved.calls], (priced, moved.calls)
