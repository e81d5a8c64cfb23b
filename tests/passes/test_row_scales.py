"""Per-row scales moved to a product's input (autotp/passes/row_scales.py): which graphs have
them, that the moved program computes what the captured one does (outputs and every gradient,
float64), and that the planner takes them where the cost model finds it cheaper.

The routing weights multiply the experts' down product's output rows ``[rows, hidden]``; moved,
they multiply its input rows ``[rows, inter]`` (a rank's ``inter / tp`` under expert-TP).
"""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.capture import capture
from autotp.capture.program import flat_inputs, unflatten_outputs
from autotp.passes.row_scales import moved, row_scales

ETP = {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}


def _tiny(family: str, impl: str, **extra):
    config = zoo.tiny_config(family, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2,
                             output_router_logits=True, **extra)
    config._experts_implementation = impl
    return config, zoo.build(family, config, dtype=torch.float64, seed=3)


def _run(cap, model, inputs):
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    flat = ([tensors[fqn] for fqn in cap.param_names.values()] + [tensors[fqn] for fqn in cap.buffer_names.values()]
            + [cap.constants[name] for name in cap.constant_names.values()] + flat_inputs(cap, inputs))
    return unflatten_outputs(cap, cap.graph_module(*flat))


@pytest.mark.parametrize("family, impl", [("qwen3-moe", "batched_mm"), ("mixtral", "batched_mm"),
                                          ("olmoe", "grouped_mm")])
def test_moved_scales_compute_what_the_capture_does(family, impl):
    config, model = _tiny(family, impl)
    batch = zoo.example_batch(family, config, batch=2, seq=7, seed=4)
    cap = capture(model)
    scales = row_scales(cap)
    assert len(scales) == 1 and scales[0].outer == config.hidden_size
    after = moved(cap, scales)
    nodes = {n.name: n for n in after.graph.nodes}
    product = nodes[scales[0].product]
    # the multiply, under its own name, now feeds the product (through x's column and the bmm on
    # the batched path: unsqueeze -> bmm -> squeeze)
    feeding = {product}
    for _ in range(3):
        feeding |= {a for n in feeding for a in n.all_input_nodes}
    assert nodes[scales[0].mul] in feeding
    assert row_scales(after) == [] and row_scales(cap) == scales   # the given capture is left as it was
    if impl == "grouped_mm":   # torch's grouped kernel takes no float64 on CPU: the moved graph is checked above
        return
    results = []
    for c in (cap, after):
        model.zero_grad()
        out = _run(c, model, batch)
        (out["loss"] + out["aux_loss"]).backward()
        results.append((out["logits"].detach(), out["aux_loss"].detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (logits, aux, grads), (logits2, aux2, grads2) = results
    torch.testing.assert_close(logits2, logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux2, aux, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads2.keys() and any(".mlp.gate." in n for n in grads)   # the router's gradient too
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_bias_between_product_and_scale_is_not_moved():
    # gpt-oss adds its experts' biases after the down product: the weight scales product + bias
    _, model = _tiny("gpt-oss", "batched_mm")
    assert row_scales(capture(model)) == []


@pytest.mark.parametrize("size, layout, moves", [
    ("qwen3-30b-a3b", ETP, True),      # 768 / 8 = 96 columns of the down product's input against 2048
    ("mixtral-8x7b", ETP, False),      # bfloat16 rows scaled by float32 weights: float32 rows, not offered
])
def test_the_plan_moves_the_routing_weights_where_narrower_and_cheaper(size, layout, moves):
    config = zoo.published_config(size, layers=2)
    model = zoo.build(zoo.family_of(size).name, config, device="meta", dtype=torch.bfloat16)
    plan = autotp.plan(model, 8, batch=2, seq=4096, profile="h200", layout=layout, sequence_parallel=True)
    notes = [n for n in plan.notes if n.startswith("per-row scales")]
    assert bool(notes) == moves, plan.notes
    if moves:
        assert "model.layers.{0..1}.mlp.experts" in notes[0] and "768 against 2048" in notes[0]
