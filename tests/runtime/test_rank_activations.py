"""One rank of tp 8 runs GPT-2's MLP activation as one kernel forward and one backward.

HF's GPT-2 writes its tanh-GELU as ``mul``/``pow``/``add``/``tanh``: serial runs 8 ATen calls of
it forward and more backward, each a pass over the ``[tokens, 4h]`` activation. The rank's program
runs ``aten.gelu(x, approximate="tanh")`` and autograd's ``gelu_backward`` once a layer
(``autotp/passes/activations.py``), counted by a dispatch mode over a training step on torch's
``fake`` backend (collectives return at once); ``fuse_activations=False`` runs the chain as written.
"""
import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.testing.host import MEGATRON, AtenCalls
from tests.helpers import batch, tiny_gpt2

TP, LAYERS = 8, 2


@pytest.fixture
def fake_rank_of_8():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    yield
    dist.destroy_process_group()


def _step_calls(fuse: bool) -> AtenCalls:
    model = tiny_gpt2(n_layer=LAYERS, n_head=TP, head_dim=4, vocab=64, dtype=torch.float32)
    pm = autotp.parallelize(model, TP, profile="h200", batch=8, seq=32, layout=MEGATRON["gpt2"],
                            fuse_activations=fuse)
    inputs = batch(64, b=1, s=16)
    pm(**inputs).loss.backward()   # warm: the program built
    pm.zero_grad(set_to_none=True)
    with AtenCalls() as calls:
        pm(**inputs).loss.backward()
    return calls


def test_a_rank_runs_the_mlp_activation_as_one_gelu_each_way(fake_rank_of_8):
    fused = _step_calls(True).by_op
    assert (fused["aten.gelu"], fused["aten.gelu_backward"]) == (LAYERS, LAYERS), fused
    assert fused["aten.tanh"] == fused["aten.tanh_backward"] == fused["aten.pow"] == 0, fused
    written = _step_calls(False).by_op
    assert written["aten.gelu"] == 0 and written["aten.tanh"] == LAYERS and written["aten.pow"] >= LAYERS, written
