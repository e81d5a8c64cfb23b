"""One rank of tp 8 runs Llama's RMSNorm statistic as one ``aten.rms_norm`` call a norm.

HF's ``LlamaRMSNorm`` writes its statistic as ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``: five
ATen calls forward, each a kernel on CUDA. The rank's program calls ``aten.rms_norm`` once a norm
instead (``autotp/passes/norms.py``), counted by a function mode over a training step on torch's
``fake`` backend (collectives return at once): on CUDA one ``_fused_rms_norm`` kernel forward and
one ``_fused_rms_norm_backward``. On CPU ``aten.rms_norm`` runs its composite, the written ops in
the same order, so the kernels a dispatch mode counts there are serial's, no more and no fewer.
The first layer's input norm reads the token embedding and stays as written.
"""
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

import autotp
from autotp import zoo
from autotp.testing.host import MEGATRON, AtenCalls
from tests.helpers import fake_process_group

TP, LAYERS = 8, 2
aten = torch.ops.aten
STATISTIC = ("aten.pow", "aten.mean", "aten.rsqrt")


class OpCalls(TorchFunctionMode):
    """The ATen ops a program calls (before dispatch: a composite op counted as itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverload):
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_rank_of_8():
    with fake_process_group(TP) as group:
        yield group


def _step(module, inputs, mode) -> Counter:
    module(**inputs).loss.backward()   # warm: the program built
    module.zero_grad(set_to_none=True)
    with mode as calls:
        module(**inputs).loss.backward()
    return calls.by_op


def test_a_rank_runs_each_rmsnorm_statistic_as_one_rms_norm(fake_rank_of_8):
    config = zoo.tiny_config("llama", layers=LAYERS, heads=TP, kv_heads=TP, head_dim=4, vocab=64)
    model = zoo.build("llama", config, dtype=torch.float32)
    inputs = zoo.example_batch("llama", config, batch=1, seq=16)
    serial = _step(model, inputs, AtenCalls())
    plan = dict(profile="h200", batch=8, seq=32, layout=MEGATRON["llama"])
    written = autotp.parallelize(model, TP, fuse_norms=False, **plan)
    fused = autotp.parallelize(model, TP, **plan)
    before, after = _step(written, inputs, OpCalls()), _step(fused, inputs, OpCalls())
    norms = 2 * LAYERS + 1
    # before: five calls a norm, every one; after: one rms_norm a norm but the embedding's, written
    assert before["aten.rms_norm"] == 0 and before["aten.rsqrt"] == norms, before
    assert (after["aten.rms_norm"], after["aten.rsqrt"]) == (norms - 1, 1), after
    for op in ("aten.pow", "aten.mean"):
        assert before[op] - after[op] == norms - 1, (op, before[op], after[op])
    # on CPU aten.rms_norm is the written ops: the kernels dispatched are serial's
    kernels = _step(fused, inputs, AtenCalls())
    assert [kernels[op] for op in STATISTIC] == [serial[op] for op in STATISTIC], (kernels, serial)
