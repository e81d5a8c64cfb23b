"""Capture: one export of GPT-2 (real or meta) serves any batch and sequence length."""
import operator

import sympy
import torch

from autotp.capture import capture, shape_of
from tests.helpers import tiny_gpt2


def _ops(cap):
    # contiguous() depends on strides, which differ between meta and real tensors after SDPA.
    return [str(n.target) for n in cap.graph.nodes
            if n.op == "call_function" and n.target is not torch.ops.aten.contiguous.default]


def test_meta_and_real_models_capture_the_same_graph():
    real = capture(tiny_gpt2(dtype=torch.float32))
    meta = capture(tiny_gpt2(dtype=torch.float32, device="meta"))
    assert _ops(real) == _ops(meta)


def test_batch_and_sequence_dims_are_symbolic_up_to_n_positions():
    cap = capture(tiny_gpt2(n_positions=24))
    ids = next(n for n in cap.graph.nodes if n.name == "input_ids")
    b, s = shape_of(ids)
    assert isinstance(b, sympy.Symbol) and isinstance(s, sympy.Symbol) and b != s
    assert cap.range_constraints["input_ids.1"] == (2, 24)
    assert set(cap.dim_symbols.values()) == {"batch", "seq"}


def test_capture_splits_biased_products_so_a_row_bias_can_follow_the_all_reduce():
    cap = capture(tiny_gpt2())
    targets = {n.target for n in cap.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default not in targets
    assert torch.ops.aten.mm.default in targets
    assert torch.ops.aten._assert_tensor_metadata.default not in targets


def test_capture_adds_a_linear_bias_after_the_view_back_to_batch_and_sequence():
    # Sequence parallelism reduce-scatters the row-parallel product along s: the bias add must
    # see (b, s, h), not the flattened (b*s, h) the product is computed on.
    cap = capture(tiny_gpt2(n_layer=1))
    bias = next(n for n in cap.graph.nodes if n.name == "p_transformer_h_0_attn_c_proj_bias")
    (add,) = bias.users
    view = add.args[0]
    assert view.target is torch.ops.aten.view.default and view.args[0].target is torch.ops.aten.mm.default
    b, s, h = shape_of(add)
    assert isinstance(s, sympy.Symbol) and h == 32


def test_tied_embedding_and_lm_head_are_one_parameter():
    cap = capture(tiny_gpt2())
    assert cap.aliases == {"transformer.wte.weight": "lm_head.weight"}


def test_synthesized_inputs_include_labels_and_disable_the_cache():
    cap = capture(tiny_gpt2())
    assert cap.input_keys == ["input_ids", "labels", "use_cache"]
    assert cap.constant_inputs == {"use_cache": False}
