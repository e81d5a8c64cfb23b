"""A fused activation (``autotp/passes/activations.py``) is priced as the kernels it runs: one
``gelu`` forward (reads x, writes y) and one ``gelu_backward`` (reads the output's gradient and x,
writes x's), where GPT-2's written-out tanh-GELU is priced as its 8 ops' kernels, forward and
backward. GPT-2 on the meta device, Megatron's layout at tp 2, profile h200."""
import sympy
import torch

from autotp.capture import capture
from autotp.cost_model import get_profile
from autotp.cost_model.symbolic import evaluate, op_work
from autotp.passes.activations import find_regions
from autotp.planner import build_plan
from autotp.testing.host import MEGATRON
from tests.helpers import tiny_gpt2

aten = torch.ops.aten
TP, LAYERS, BATCH, SEQ, HIDDEN = 2, 2, 8, 64, 32


def _work(nodes, index, prop):
    prof = get_profile("h200")
    works = [op_work(index.infos[n], prop.chosen[n], prof, TP) for n in nodes]
    moved = sum((b for w in works for _, b in w.moved), sympy.Integer(0))
    return sum(w.launches for w in works), evaluate(moved, index.env)


def test_a_fused_gelu_is_priced_as_one_kernel_each_way():
    cap = capture(tiny_gpt2(n_layer=LAYERS, n_head=4, head_dim=HIDDEN // 4, device="meta"))
    plans = {fuse: build_plan(cap, TP, batch=BATCH, seq=SEQ, profile="h200", layout=MEGATRON["gpt2"],
                              fuse_activations=fuse) for fuse in (True, False)}
    _, index, prop = plans[True]
    gelus = [n for n in index.capture.graph.nodes if n.target is aten.gelu.default]
    launches, moved = _work(gelus, index, prop)
    activation = BATCH * SEQ * 4 * HIDDEN // TP * get_profile("h200").dtype_bytes   # c_fc's columns on a rank
    assert len(gelus) == LAYERS
    assert launches == 2 * LAYERS
    assert moved == 5 * activation * LAYERS     # x, y; dy, x, dx
    _, written_index, written_prop = plans[False]
    regions = [region for _, region, _ in find_regions(written_index.capture.graph)]
    written_launches, written_moved = _work([n for r in regions for n in r], written_index, written_prop)
    assert len(regions) == LAYERS and written_launches == 16 * LAYERS and written_moved > 5 * moved
    assert plans[True][0].compute_s < plans[False][0].compute_s
    said = [n for n in plans[True][0].notes if n.startswith("activations fused")]
    assert said and f"{LAYERS} tanh-GELU regions of 8 pointwise ops (transformer.h.0.mlp.act, ...)" in said[0]
    assert not [n for n in plans[False][0].notes if n.startswith("activations fused")]
