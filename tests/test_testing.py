"""autotp.testing's equivalence measure: relative to the scale of a parameter's group."""
import torch

from autotp.testing import TOLERANCE, relative_error
from autotp.testing.equivalence import _module_grad_norms


def test_a_gradient_zero_in_exact_arithmetic_passes_against_its_modules_scale():
    # A key projection's bias: serial and parallel both give rounding noise around zero.
    weight_grad = torch.randn(8, 8, dtype=torch.float64)
    serial_bias, parallel_bias = torch.full((8,), 3e-17, dtype=torch.float64), torch.full((8,), -2e-17, dtype=torch.float64)
    assert relative_error(parallel_bias, serial_bias) > 1e-1                       # against itself: "wrong"
    assert relative_error(parallel_bias, serial_bias, weight_grad.norm().item()) <= TOLERANCE[torch.float64]


def test_a_wrong_small_gradient_still_fails_against_its_modules_scale():
    weight_grad = torch.randn(8, 8, dtype=torch.float64)
    serial_bias = torch.zeros(8, dtype=torch.float64)
    wrong = torch.full((8,), 0.05, dtype=torch.float64)
    assert relative_error(wrong, serial_bias, weight_grad.norm().item()) > TOLERANCE[torch.float32]


def test_group_norms_are_per_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    norms = _module_grad_norms(model)
    first = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad]).norm().item()
    assert set(norms) == {"0", "1"} and abs(norms["0"] - first) < 1e-12


def test_a_nan_or_inf_on_one_side_only_is_an_infinite_error():
    # a nan error would pass max() and every <= check silently: it must fail them instead
    nan, inf = float("nan"), float("inf")
    one = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert relative_error(torch.tensor([1.0, nan], dtype=torch.float64), one) == inf
    assert relative_error(one, torch.tensor([1.0, nan], dtype=torch.float64)) == inf
    assert relative_error(torch.tensor([inf, 2.0], dtype=torch.float64), one) == inf
    assert relative_error(torch.tensor([-inf]), torch.tensor([inf])) == inf
    assert max([1e-16, relative_error(torch.tensor(nan), torch.tensor(3.0))]) > TOLERANCE[torch.float32]
    # the same nan or inf in the same place on both sides is equal there; the rest is compared
    both = torch.tensor([nan, inf, 2.0], dtype=torch.float64)
    assert relative_error(both, both.clone()) == 0.0
    assert relative_error(both, torch.tensor([nan, inf, 2.5], dtype=torch.float64)) == 0.5 / 2.5


def _olmo2_grads(attention: str, seq: int) -> tuple[torch.nn.Module, dict]:
    from autotp import zoo
    from autotp.testing import keep_loss_precision

    config = zoo.tiny_config("olmo2", layers=1, heads=4, kv_heads=2, head_dim=16, vocab=64)
    config._attn_implementation = attention
    model = keep_loss_precision(zoo.build("olmo2", config, dtype=torch.float64, seed=0))
    model(**zoo.example_batch("olmo2", config, batch=2, seq=seq, seed=0)).loss.backward()
    return model, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_module_whose_whole_gradient_is_rounding_noise_is_measured_against_its_block():
    # OLMo2 at two tokens: the one labelled position attends to itself alone, so q_proj, k_proj
    # and the q/k norms never change the loss; two honest computations (sdpa's backward and the
    # eager one) give different noise there, which the every-call test read as a 35% error
    from autotp.testing.equivalence import gradient_scales

    model, sdpa = _olmo2_grads("sdpa", seq=2)
    _, eager = _olmo2_grads("eager", seq=2)
    attn = "model.layers.0.self_attn"
    assert sdpa[f"{attn}.q_proj.weight"].norm() < 1e-12 * sdpa[f"{attn}.v_proj.weight"].norm()   # the premise
    assert relative_error(eager[f"{attn}.k_norm.weight"], sdpa[f"{attn}.k_norm.weight"]) > 1e-1   # against itself
    scales = gradient_scales(model)
    errors = {n: relative_error(eager[n], sdpa[n], scales[n]) for n in sdpa}
    assert max(errors.values()) <= TOLERANCE[torch.float64], errors
    # a real gradient keeps its module's own scale: a wrong one is caught as before
    assert abs(scales[f"{attn}.v_proj.weight"] / sdpa[f"{attn}.v_proj.weight"].norm().item() - 1) < 1e-12
    wrong = sdpa[f"{attn}.v_proj.weight"] * (1 + 1e-6)
    assert relative_error(wrong, sdpa[f"{attn}.v_proj.weight"], scales[f"{attn}.v_proj.weight"]) > 1e-7


def test_a_small_real_gradient_keeps_its_own_scale():
    # at three tokens q and k matter: their gradients are measured against themselves
    from autotp.testing.equivalence import gradient_scales

    model, grads = _olmo2_grads("sdpa", seq=3)
    name = "model.layers.0.self_attn.k_norm.weight"
    assert abs(gradient_scales(model)[name] / grads[name].norm().item() - 1) < 1e-12


def test_the_bound_is_the_least_precise_dtype_the_model_computes_in():
    """A float64 model that casts values down (Llama's RMSNorm takes its variance in float32) is
    held to float32's bound; one that computes in float64 throughout (GPT-2 with its loss kept in
    the logits' dtype, BERT) to float64's; float32 made from integers (positions) rounds nothing."""
    from autotp import zoo
    from autotp.testing import TOLERANCE, computed_precision, keep_loss_precision, tolerance

    for family, want in (("gpt2", torch.float64), ("bert", torch.float64), ("opt", torch.float64),
                         ("llama", torch.float32)):
        config = zoo.tiny_config(family, layers=1, heads=2, head_dim=4, vocab=37)
        model = zoo.build(family, config, dtype=torch.float64, seed=0)
        if zoo.family(family).task == "causal":
            keep_loss_precision(model)
        batch = zoo.example_batch(family, config, batch=2, seq=5, seed=1)
        assert computed_precision(model, batch) == want, family
        assert tolerance(model, batch) == TOLERANCE[want], family
    gpt2 = zoo.build("gpt2", zoo.tiny_config("gpt2", layers=1, heads=2, head_dim=4, vocab=37), dtype=torch.float64)
    batch = zoo.example_batch("gpt2", zoo.tiny_config("gpt2", layers=1, heads=2, head_dim=4, vocab=37), seq=5)
    assert computed_precision(gpt2, batch) == torch.float32   # transformers' loss upcasts the logits


def test_work_counts_no_bytes_for_an_alias_the_dispatcher_does_not_mark_a_view():
    from autotp.testing.work import WorkCounter

    x, w = torch.randn(2, 3, 4), torch.randn(4, 5)
    with WorkCounter() as work:
        y = x @ w   # matmul folds x to [6, 4], mm, then _unsafe_view back to [2, 3, 5]: an alias of mm's result
    assert y.shape == (2, 3, 5)
    assert "aten._unsafe_view" not in work.by_op and work.moved == 0 and work.flops == 2 * 6 * 4 * 5


def test_work_counts_a_grouped_query_attention_at_the_querys_heads():
    # CUDA's attention kernels take key and value with fewer heads than the query under
    # enable_gqa (transformers' sdpa call); torch 2.11's FLOP formula refused those shapes (the
    # H200 round's dense and MoE ranks failed on it), 2.13's counts the query's heads: so do we
    from autotp.testing.work import WorkCounter

    q = torch.empty(2, 8, 16, 32, device="meta")
    grouped, expanded = {}, {}
    for heads, counts in ((2, grouped), (8, expanded)):
        k = torch.empty(2, heads, 16, 32, device="meta")
        for op, extra in ((torch.ops.aten._scaled_dot_product_flash_attention.default, ()),
                          (torch.ops.aten._scaled_dot_product_efficient_attention.default, (None, False))):
            with WorkCounter() as work:
                op(q, k, k, *extra)
            counts[str(op)] = work.flops
    assert grouped == expanded
    assert set(grouped.values()) == {2 * 2 * 8 * 16 * 16 * (32 + 32)}


def test_work_sites_name_the_program_node_the_backward_formula_and_the_models_own_code():
    from autotp import zoo
    from autotp.testing.work import WorkCounter

    class Step(torch.nn.Module):
        def forward(self, x):
            return (torch.tanh(x) * 3).sum()

    program = torch.fx.symbolic_trace(Step())
    x = torch.randn(4, 4, requires_grad=True)
    with WorkCounter(sites=True) as work:
        program(x).backward()
    sites = {site for _, site in work.moved_by_site}
    assert {"program tanh", "program mul", "backward TanhBackward0", "backward MulBackward0"} <= sites, sites
    assert sum(work.moved_by_site.values()) == work.moved   # every byte has one site
    # a serial model's ops: its own file and function
    config = zoo.tiny_config("gpt2", layers=1, heads=2, head_dim=4, vocab=16)
    model = zoo.build("gpt2", config)
    with WorkCounter(sites=True) as work:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert any(site.startswith("modeling_gpt2.py:") for _, site in work.moved_by_site), work.moved_by_site
    with WorkCounter() as plain:   # off unless asked for
        program(x)
    assert not plain.moved_by_site and plain.moved
