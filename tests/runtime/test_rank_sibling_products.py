"""A rank of tp 8 runs Llama's q, k, v and its gate, up as one product each (sibling products
fused, ``autotp/passes/products.py``): counted, not timed.

One rank of tp 8 on torch's ``fake`` backend (its collectives return at once), a Llama-like model
(16 query heads and 8 kv heads of 8: each rank one kv head and its two query heads, as
Llama-3-8B's 32 and 8 at tp 8), sequence parallelism forced (the products' input is the all-gathered
``[b, s, h]``), Megatron's layout pinned (at this width the cost model keeps the layers whole), one training step counted op by op in a dispatch mode, with ``fuse_products`` and
without. Per layer, written apart: three and two products forward and two each backward (its
input's gradient and its weight's), and the input's gradient summed from three and two products
by two and one full-size ``add``s; fused: one product each forward and two each backward, no
``add`` of the input's gradient (summed inside the product over the joined rows), the join of
the rank's weight shards (``cat``, one kernel forward; its backward views) and, backward, the
pieces' gradients joined (``split``'s backward, one ``cat``).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autotp
from autotp import zoo
from autotp.testing.host import MEGATRON
from tests.helpers import fake_process_group

TP, LAYERS, BATCH, SEQ = 8, 2, 2, 16


class Calls(TorchDispatchMode):
    """Calls and bytes written per ATen op (views write none)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.written: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and name != "_unsafe_view" and not name.startswith(("_c10d", "c10d", "wait_tensor")):
            self.calls[name] += 1
            self.written[name] += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                      if isinstance(t, torch.Tensor))
        return out


def _step(fuse_products: bool):
    config = zoo.tiny_config("llama", layers=LAYERS, heads=16, kv_heads=8, head_dim=8, vocab=256)
    model = zoo.build("llama", config, dtype=torch.float32, seed=1)
    with fake_process_group(TP):
        pm = autotp.parallelize(model, TP, batch=256, seq=32, profile="h100-dgx", sequence_parallel=True,
                                layout=MEGATRON["llama"], fuse_products=fuse_products)
        inputs = zoo.example_batch("llama", config, batch=BATCH, seq=SEQ, seed=2)
        pm(**inputs).loss.backward()   # the program is written at the first call
        pm.zero_grad(set_to_none=True)
        forward, backward = Calls(), Calls()
        with forward:
            loss = pm(**inputs).loss
        with backward:
            loss.backward()
        return pm.plan, forward, backward, config


def test_a_ranks_sibling_products_run_as_one_product_without_adds_of_their_input_gradient():
    plan_apart, fwd_apart, bwd_apart, config = _step(False)
    plan, fwd, bwd, _ = _step(True)
    assert plan.params["model.layers.0.self_attn.k_proj.weight"] == plan_apart.params[
        "model.layers.0.self_attn.k_proj.weight"]   # split alike: each rank its kv head, its q heads
    assert any(n.startswith("sibling products fused: 2 x 3 products") for n in plan.notes), plan.notes
    # products: forward 7 a layer apart, 4 fused (q|k|v, o, gate|up, down); backward two each
    assert fwd_apart.calls["mm"] - fwd.calls["mm"] == 3 * LAYERS, (fwd_apart.calls, fwd.calls)
    assert bwd_apart.calls["mm"] - bwd.calls["mm"] == 6 * LAYERS, (bwd_apart.calls, bwd.calls)
    # the input's gradient (the gathered [b, s, h]) summed by 2 + 1 full-size adds a layer apart:
    # none fused
    x_grad = BATCH * SEQ * config.hidden_size * 4
    added = lambda c: c.written["add"] + c.written["add_"]   # noqa: E731
    assert added(bwd_apart) - added(bwd) == 3 * LAYERS * x_grad, (bwd_apart.written, bwd.written)
    assert (bwd_apart.calls["add"] + bwd_apart.calls["add_"]) - (bwd.calls["add"] + bwd.calls["add_"]) == 3 * LAYERS
    # the join of the rank's weight shards, once a set forward; the pieces' gradients joined backward
    assert fwd.calls["cat"] - fwd_apart.calls["cat"] == 2 * LAYERS
    assert bwd.calls["cat"] - bwd_apart.calls["cat"] == 2 * LAYERS
    # the rank's joined weights are its own shards': q|k|v of 2 + 1 + 1 heads of 8, gate|up of its columns
    local_q = 2 * 8 * config.hidden_size * 4
    local_qkv = 4 * 8 * config.hidden_size * 4
    assert fwd.written["cat"] - fwd_apart.written["cat"] >= LAYERS * local_qkv > LAYERS * local_q
    # fewer kernels in all, forward and backward
    total = lambda c: sum(c.calls.values())   # noqa: E731
    assert total(fwd) < total(fwd_apart) and total(bwd) < total(bwd_apart), (total(fwd), total(fwd_apart),
                                                                            total(bwd), total(bwd_apart))
