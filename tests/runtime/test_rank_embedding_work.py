"""One rank of tp 8 looks up GPT-2's embeddings, and scatters their gradients, at 1/8 of serial.

Counted by a dispatch mode over a training step on torch's ``fake`` backend (collectives return at
once, so the rank's program runs at its own size), against the serial model's step: the elements
each ATen call writes, and the gradient rows ``embedding_dense_backward`` reads. GPT-2 ties ``wte``
to the vocabulary-parallel ``lm_head``; before, the rank looked up every token in its rows and
wrote the whole ``[b, s, h]`` (then zeroed the rows it does not hold: ``masked_fill_``), and
scattered every token's gradient row; the positions' table was looked up whole and sliced. Now the
tied table is read by columns (``rules/nn.py``) and the positions' table is split by columns: each
rank writes and scatters its ``h/8`` columns of every token. The adds between (the two
embeddings' sum, the residual adds, the biases added after the row-parallel products, the tied
table's two gradients summed) each run on the rank's share of their tensor.
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autotp
from autotp.testing.host import MEGATRON
from tests.helpers import batch, fake_process_group, tiny_gpt2

TP, HEADS, HEAD_DIM, VOCAB, B, S = 8, 8, 4, 64, 2, 32
H = HEADS * HEAD_DIM


class Written(TorchDispatchMode):
    """Per op: the float elements its calls write, the largest one call writes, and the gradient
    elements ``embedding_dense_backward`` reads."""

    def __init__(self) -> None:
        super().__init__()
        self.elements, self.largest, self.grad_read = Counter(), Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        n = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
        self.elements[name] += n
        self.largest[name] = max(self.largest[name], n)
        if name == "embedding_dense_backward":
            self.grad_read += args[0].numel()
        return out


@pytest.fixture
def fake_rank_of_8():
    with fake_process_group(TP) as group:
        yield group


def _step(module) -> Written:
    inputs = batch(VOCAB, b=B, s=S)
    module(**inputs).loss.backward()   # warm: the program built
    module.zero_grad(set_to_none=True)
    with Written() as counted:
        module(**inputs).loss.backward()
    return counted


def test_a_rank_looks_up_and_scatters_its_eighth_of_gpt2s_embeddings(fake_rank_of_8):
    model = tiny_gpt2(n_layer=2, n_head=HEADS, head_dim=HEAD_DIM, vocab=VOCAB, n_positions=S, dtype=torch.float32)
    serial = _step(model)
    assert serial.elements["embedding"] == B * S * H + S * H, serial.elements   # wte's and wpe's rows
    # planned where tokens outnumber the table's rows (as at gpt2-xl's 8 x 1024 against 50257), the
    # layers Megatron's and the tied table split by vocabulary, the regions between along the sequence
    pm = autotp.parallelize(model, TP, profile="h100-dgx", batch=64, seq=4096, layout=MEGATRON["gpt2"],
                            sequence_parallel=True)
    rank = _step(pm)
    looked_up = rank.elements["embedding"] + rank.elements["masked_fill_"]
    assert looked_up * TP == serial.elements["embedding"], (looked_up, serial.elements["embedding"])
    assert rank.grad_read * TP == serial.grad_read, (rank.grad_read, serial.grad_read)
    # no add on a whole tensor: each writes at most the rank's share of the residual stream [b, s/8, h]
    # or of the tied table's gradient [V/8, h]
    adds = max(rank.largest["add"], rank.largest["add_"])
    assert 0 < adds <= max(B * S * H, VOCAB * H) // TP, (rank.largest, serial.largest["add"])
