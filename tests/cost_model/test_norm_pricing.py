"""A fused RMSNorm statistic (``autotp/passes/norms.py``) is priced as the kernels CUDA runs for
``aten.rms_norm``: one ``_fused_rms_norm`` forward (reads x, writes y) and one
``_fused_rms_norm_backward`` (reads the output's gradient and x, writes x's), at the rate a norm
kernel attains (``cost_model/norms.norm_work``), where Llama's written statistic is priced as its five ops'
kernels, forward and backward. Llama on the meta device, Megatron's layout at tp 2, profile h200."""
import torch

from autotp import zoo
from autotp.capture import capture
from autotp.cost_model import get_profile
from autotp.cost_model.symbolic import evaluate, op_work
from autotp.passes.norms import find_norms
from autotp.planner import build_plan
from autotp.testing.host import MEGATRON

aten = torch.ops.aten
TP, LAYERS, BATCH, SEQ, HIDDEN = 2, 2, 8, 64, 32


def _work(nodes, index, prop):
    prof = get_profile("h200")
    works = [op_work(index.infos[n], prop.chosen[n], prof, TP) for n in nodes]
    moved = [(cls, evaluate(b, index.env)) for w in works for cls, b in w.moved]
    return sum(w.launches for w in works), moved


def test_a_fused_rmsnorm_is_priced_as_one_norm_kernel_each_way():
    config = zoo.tiny_config("llama", layers=LAYERS, heads=4, kv_heads=4, head_dim=HIDDEN // 4, vocab=64)
    cap = capture(zoo.build("llama", config, device="meta"))
    plans = {fuse: build_plan(cap, TP, batch=BATCH, seq=SEQ, profile="h200", layout=MEGATRON["llama"],
                              fuse_norms=fuse) for fuse in (True, False)}
    _, index, prop = plans[True]
    norms = [n for n in index.capture.graph.nodes if n.target is aten.rms_norm.default]
    launches, moved = _work(norms, index, prop)
    x = BATCH * SEQ * HIDDEN * 4   # the float32 activation HF upcasts to, whole
    assert len(norms) == 2 * LAYERS   # every norm but the one of the token embedding
    assert launches == 2 * len(norms)
    for forward, backward in zip(moved[::2], moved[1::2]):   # x, y; dy, x, dx (a rank's part of x)
        local = forward[1] / 2
        assert forward == ("norm", 2 * local) and backward == ("norm", 3 * local) and local in (x, x / TP)
    _, written_index, written_prop = plans[False]
    regions = [norm.nodes for norm in find_norms(written_index.capture.graph)]
    written_launches, written_moved = _work([n for r in regions for n in r], written_index, written_prop)
    assert len(regions) == len(norms) and written_launches >= 5 * len(norms)
    assert sum(b for _, b in written_moved) > sum(b for _, b in moved)
    assert plans[True][0].compute_s < plans[False][0].compute_s
    said = [n for n in plans[True][0].notes if n.startswith("norms fused")]
    first = "model.layers.0.post_attention_layernorm"
    assert said and f"{len(norms)} RMSNorm statistics of 5 ops ({first}, ...)" in said[0]
    assert not [n for n in plans[False][0].notes if n.startswith("norms fused")]
