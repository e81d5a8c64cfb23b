"""One rank of tp 8 runs GPT-2's MLP activation as one kernel forward and one backward.

HF's GPT-2 writes its tanh-GELU as ``mul``/``pow``/``add``/``tanh``: serial runs 8 ATen calls of
it forward and more backward, each a pass over the ``[tokens, 4h]`` activation. The rank's program
runs ``aten.gelu(x, approximate="tanh")`` and autograd's ``gelu_backward`` once a layer
(``autotp/passes/activations.py``), counted by a dispatch mode over a training step on torch's
``fake`` backend (collectives return at once), where serial's step (HF's module as it runs) calls
``tanh`` and ``pow``.
"""
from collections import Counter

import pytest
import torch

import autotp
from autotp.testing.host import MEGATRON, AtenCalls
from tests.helpers import batch, fake_process_group, tiny_gpt2

TP, LAYERS = 8, 2


@pytest.fixture
def fake_rank_of_8():
    with fake_process_group(TP) as group:
        yield group


def _step_calls(module) -> Counter:
    inputs = batch(64, b=1, s=16)
    module(**inputs).loss.backward()   # warm: the program built
    module.zero_grad(set_to_none=True)
    with AtenCalls() as calls:
        module(**inputs).loss.backward()
    return calls.by_op


def test_a_rank_runs_the_mlp_activation_as_one_gelu_each_way(fake_rank_of_8):
    model = tiny_gpt2(n_layer=LAYERS, n_head=TP, head_dim=4, vocab=64, dtype=torch.float32)
    serial = _step_calls(model)
    assert serial["aten.gelu"] == 0 and serial["aten.tanh"] == LAYERS and serial["aten.pow"] >= LAYERS, serial
    rank = _step_calls(autotp.parallelize(model, TP, profile="h200", batch=8, seq=32, layout=MEGATRON["gpt2"]))
    assert (rank["aten.gelu"], rank["aten.gelu_backward"]) == (LAYERS, LAYERS), rank
    assert rank["aten.tanh"] == rank["aten.tanh_backward"] == rank["aten.pow"] == 0, rank
