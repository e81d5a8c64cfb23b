"""The cost model: ring collectives move 2(n-1)/n of the bytes, an op is priced by the kernels
eager PyTorch runs for it on the largest rank (products by a rate their shape reaches, memory-bound
kernels by their bytes at their class's bandwidth, a launch each), floats are priced at the
profile's training dtype, costs are sympy expressions in b and s, and calibrate() measures a
profile on this machine."""
import math

import pytest
import sympy
import torch
from hypothesis import given, strategies as st

from autotp.cost_model import PROFILES, DeviceProfile, calibrate
from autotp.cost_model.devices import fit_alpha_beta
from autotp.cost_model.symbolic import (collective_bytes, collective_time, collective_time_expr, compute_time,
                                        compute_time_expr, evaluate, nbytes)
from autotp.passes.rules import OpInfo, Strategy, TensorMeta
from autotp.placements import PARTIAL, REPLICATE, Shard

aten = torch.ops.aten
b, s = sympy.symbols("b s", integer=True, positive=True)
H100 = PROFILES["h100-dgx"]


def mm_info(k: int, n: int, dtype=torch.float32, tp: int = 8) -> OpInfo:
    x, w = TensorMeta((b * s, sympy.Integer(k)), dtype), TensorMeta((sympy.Integer(k), sympy.Integer(n)), dtype)
    return OpInfo(aten.mm.default, (x, w), {}, (x, w), TensorMeta((b * s, sympy.Integer(n)), dtype), tp)


@given(n=st.integers(2, 64), full=st.floats(1.0, 1e10))
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_bytes(n, full):
    assert collective_bytes("g", full, n) == (pytest.approx(2 * (n - 1) / n * full), 0.0)
    assert collective_bytes("f", full, n) == (0.0, pytest.approx(2 * (n - 1) / n * full))
    assert collective_bytes("all_gather", full, n)[0] == pytest.approx((n - 1) / n * full)
    fw, _ = collective_time("g", full, H100, n)
    assert fw == pytest.approx(2 * (n - 1) * H100.link_latency + 2 * (n - 1) / n * full / H100.link_bw)


def test_collective_expression_is_symbolic_in_the_tensor_size():
    meta_bytes = b * s * 768 * 2
    expr = collective_time_expr("g", meta_bytes, H100, 8)
    assert expr.free_symbols == {b, s}
    assert float(expr.subs({b: 8, s: 1024})) == pytest.approx(sum(collective_time("g", 8 * 1024 * 768 * 2, H100, 8)))


def test_an_uneven_column_split_is_priced_at_its_largest_rank():
    info = mm_info(768, 12 * 64)
    split = compute_time(info, Strategy((REPLICATE, Shard(1, 1, 64)), Shard(1, 1, 64)), {b: 8, s: 1024}, H100, 8)
    # 12 heads over 8 ranks: the slowest holds 2, and its product is a whole product of that width
    largest = compute_time(mm_info(768, 2 * 64), Strategy((REPLICATE, REPLICATE), REPLICATE), {b: 8, s: 1024},
                           H100, 8)
    assert split == pytest.approx(largest)


def test_a_row_split_product_is_priced_as_the_product_a_rank_runs():
    info = mm_info(768, 768)
    row = compute_time(info, Strategy((Shard(1), Shard(0)), PARTIAL), {b: 8, s: 1024}, H100, 4)
    local = compute_time(mm_info(768 // 4, 768), Strategy((REPLICATE, REPLICATE), REPLICATE), {b: 8, s: 1024},
                         H100, 4)
    assert row == pytest.approx(local)


def test_a_smaller_product_runs_further_below_peak():
    env = {b: 8, s: 1024}
    rates = []
    for width in (64, 512, 4096):
        info = mm_info(width, width)
        seconds = compute_time(info, Strategy((REPLICATE, REPLICATE), REPLICATE), env, H100, 1)
        rates.append(3 * 2 * 8 * 1024 * width * width / seconds)
    assert rates[0] < rates[1] < rates[2] <= H100.flops


def test_an_unaligned_product_is_priced_at_the_unaligned_rate():
    env = {b: 8, s: 1024}
    whole = Strategy((REPLICATE, REPLICATE), REPLICATE)
    aligned = compute_time(mm_info(1600, 50256), whole, env, H100, 1)
    unaligned = compute_time(mm_info(1600, 50257), whole, env, H100, 1)
    assert unaligned > 3 * aligned       # cuBLAS's align1 kernels: ~120 of 754 TFLOP/s on an H200


@pytest.mark.parametrize("strategy", [Strategy((PARTIAL, REPLICATE), PARTIAL),    # scaled before the g
                                      Strategy((REPLICATE, REPLICATE), PARTIAL)],  # made Partial from whole
                         ids=["partial-input", "whole-inputs"])
def test_an_op_with_nothing_split_costs_its_whole_size_on_every_rank(strategy):
    # the sum of the ranks' pieces is the whole shape on each: scaling it runs on every element
    x = TensorMeta((b * s, sympy.Integer(768)), torch.float32)
    info = OpInfo(aten.mul.Tensor, (x, x), {}, (x, x), x, 4)
    whole = compute_time(info, Strategy((REPLICATE, REPLICATE), REPLICATE), {b: 8, s: 1024}, H100, 4)
    assert compute_time(info, strategy, {b: 8, s: 1024}, H100, 4) == pytest.approx(whole)


def test_floats_are_priced_at_the_profiles_training_dtype_not_the_traced_one():
    meta = TensorMeta((b, s, sympy.Integer(768)), torch.float32)
    env = {b: 8, s: 1024}
    assert nbytes(meta, env, PROFILES["h100-dgx"].dtype_bytes) == 8 * 1024 * 768 * 2
    assert nbytes(meta, env, PROFILES["cpu-gloo"].dtype_bytes) == 8 * 1024 * 768 * 4
    ids = TensorMeta((b, s), torch.int64)
    assert nbytes(ids, env, 2) == 8 * 1024 * 8        # integers keep their own size


def test_compute_expression_evaluates_to_the_priced_cost():
    info = mm_info(1600, 6400)
    strat = Strategy((REPLICATE, Shard(1)), Shard(1))
    for env in ({b: 8, s: 1024}, {b: 1, s: 1}):
        expr = compute_time_expr(info, strat, H100, 8, env)   # each product at the rate its shape reaches there
        assert expr.free_symbols == {b, s}
        assert evaluate(expr, env) == pytest.approx(compute_time(info, strat, env, H100, 8))


def test_a_small_product_is_memory_bound_on_the_roofline():
    info = mm_info(8, 8)
    t = compute_time(info, Strategy((REPLICATE, REPLICATE), REPLICATE), {b: 1, s: 1}, H100, 1)
    flops_time = 3 * 2 * 8 * 8 / H100.flops
    assert t > flops_time * 10


def test_loss_over_the_logits_is_priced_by_what_its_kernels_move():
    logits = TensorMeta((b * s, sympy.Integer(50257)), torch.float32)
    target = TensorMeta((b * s,), torch.int64)
    info = OpInfo(aten.cross_entropy_loss.default, (logits, target), {}, (logits, target),
                  TensorMeta((), torch.float32), 1)
    t = compute_time(info, Strategy((REPLICATE, REPLICATE), REPLICATE), {b: 8, s: 1024}, H100, 1)
    x = 8 * 1024 * 50257 * 2
    # forward log_softmax (read, write); backward a zero-filled gradient and log_softmax's backward
    # (two reads, a write): six launches
    expected = 5 * x / H100.bandwidth("softmax") + x / H100.bandwidth("elementwise") + 6 * H100.launch_s
    assert t == pytest.approx(expected)


def test_a_float32_upcast_in_a_bf16_model_moves_four_bytes_an_element():
    x16 = TensorMeta((b * s, sympy.Integer(4096)), torch.bfloat16)
    x32 = TensorMeta((b * s, sympy.Integer(4096)), torch.float32)
    info = OpInfo(aten.to.dtype, (x16, torch.float32), {}, (x16,), x32, 1)
    info.train_dtype, info.grad_inputs = torch.bfloat16, (True,)
    t = compute_time(info, Strategy((REPLICATE,), REPLICATE), {b: 8, s: 1024}, H100, 1)
    n = 8 * 1024 * 4096
    assert t == pytest.approx(2 * (2 * n + 4 * n) / H100.bandwidth("cast") + 2 * H100.launch_s)


def test_an_elementwise_op_on_a_broadcast_operand_takes_the_strided_rate():
    x = TensorMeta((b * s, sympy.Integer(4096)), torch.bfloat16)
    w = TensorMeta((sympy.Integer(4096),), torch.bfloat16)
    full = OpInfo(aten.mul.Tensor, (x, x), {}, (x, x), x, 1)
    broadcast = OpInfo(aten.mul.Tensor, (x, w), {}, (x, w), x, 1)
    for info in (full, broadcast):
        info.grad_inputs = (False, False)
    env, whole = {b: 8, s: 1024}, Strategy((REPLICATE, REPLICATE), REPLICATE)
    n = 8 * 1024 * 4096 * 2
    assert compute_time(full, whole, env, H100, 1) == pytest.approx(3 * n / H100.bandwidth("elementwise")
                                                                    + H100.launch_s)
    assert compute_time(broadcast, whole, env, H100, 1) == pytest.approx((2 * n + 4096 * 2) / H100.bandwidth("strided")
                                                                         + H100.launch_s)


def test_a_broadcast_operand_takes_the_broadcast_share_where_a_profile_has_one():
    # a CPU runs a product with a norm's weight or a per-token scale near a contiguous one's rate
    # and an add of a transposed operand at a few percent of it (1 thread: 15.6 and 11.4 GB/s
    # against 14.2 contiguous, 0.8 transposed): calibrate() measures the two apart, and a
    # broadcast operand once took the transposed add's rate (an ETP rank's routing-weight
    # product on CPU priced 117 ms, measured 5: benchmarks/moe_rank.md). A profile without a
    # broadcast share (the GPU ones, where both take the non-vectorized path) prices it at its
    # strided share, as before
    from dataclasses import replace

    x = TensorMeta((b * s, sympy.Integer(4096)), torch.float32)
    scale = TensorMeta((b * s, sympy.Integer(1)), torch.float32)
    broadcast = OpInfo(aten.mul.Tensor, (x, scale), {}, (x, scale), x, 1)
    broadcast.grad_inputs = (False, False)
    cpu = replace(PROFILES["cpu-gloo"], class_bw=(("elementwise", 1.0), ("strided", 0.05), ("broadcast", 0.9)))
    env, whole = {b: 2, s: 256}, Strategy((REPLICATE, REPLICATE), REPLICATE)
    n = 2 * 256 * 4096 * 4
    assert compute_time(broadcast, whole, env, cpu, 1) == pytest.approx((2 * n + n // 4096) / (0.9 * cpu.mem_bw)
                                                                        + cpu.launch_s)
    assert H100.bandwidth("broadcast") == H100.bandwidth("strided")


@given(alpha=st.floats(1e-7, 1e-3), bw=st.floats(1e7, 1e12), n=st.integers(2, 16))
def test_alpha_beta_fit_recovers_a_ring_profile(alpha, bw, n):
    sizes = [1e3, 1e5, 1e7]
    seconds = [DeviceProfile("x", 1, 1, bw, alpha, 1).all_reduce_time(x, n) for x in sizes]
    got_alpha, got_bw = fit_alpha_beta(sizes, seconds, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-3)
    assert got_bw == pytest.approx(bw, rel=1e-3)


def test_calibrate_measures_a_cpu_gloo_profile_on_this_machine():
    prof = calibrate("here", world=2, matmul_sizes=(64, 128), message_bytes=(1 << 10, 1 << 14, 1 << 18), repeats=2)
    for value in (prof.flops, prof.mem_bw, prof.link_bw, prof.link_latency, prof.memory):
        assert math.isfinite(value) and value > 0
    assert prof.dtype_bytes == 4 and prof.name == "here"
    assert 1e6 < prof.flops < 1e14          # a CPU, not a typo of units
    assert math.isfinite(prof.sync_s) and prof.sync_s >= 0   # a read to the host, beyond a launch
    assert math.isfinite(prof.grouped_bw) and prof.grouped_bw >= 0   # a grouped product's weights streamed


def test_a_cpu_calibration_times_compute_by_the_threads_cpu_time():
    # on a machine shared with other jobs the wall clock also holds the time a run waited for a
    # core: at a load average of 16 on 2 cores the serial MoE step measured 2.5x its CPU time
    # (benchmarks/moe_rank.md), so a profile of best-of-3 short runs priced long steps low
    import time

    from autotp.cost_model.measure import _clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _clock("cpu") is time.thread_time
        torch.set_num_threads(2)
        assert _clock("cpu") is time.perf_counter     # other threads' work is not this thread's time
    finally:
        torch.set_num_threads(threads)
    assert _clock("cuda") is time.perf_counter


def _grouped_info(experts: int, rows_per_expert: int, k: int, n: int) -> OpInfo:
    x = TensorMeta((sympy.Integer(experts * rows_per_expert), sympy.Integer(k)), torch.float32)
    w = TensorMeta((sympy.Integer(experts), sympy.Integer(k), sympy.Integer(n)), torch.float32)
    offs = TensorMeta((sympy.Integer(experts),), torch.int32)
    out = TensorMeta((sympy.Integer(experts * rows_per_expert), sympy.Integer(n)), torch.float32)
    info = OpInfo(aten._grouped_mm.default, (x, w, offs), {}, (x, w, offs), out, 1)
    info.grad_inputs = (True, True, False)
    return info


def test_a_grouped_product_streams_its_experts_weights_at_the_measured_rate():
    # a grouped product of many small experts reads each expert's matrix for its few rows, forward
    # and backward: on one CPU thread 128 experts of 32 rows (512 -> 384) measured 3.8x the
    # product model's price of the same grouped work, 8 experts of 128 rows (512 -> 3584) 2x.
    # The stream is priced at grouped_bw beyond the products; 0 (no measurement) prices none.
    from dataclasses import replace

    whole = Strategy((REPLICATE, REPLICATE, REPLICATE), REPLICATE)
    cpu = PROFILES["cpu-gloo"]
    streaming = replace(cpu, grouped_bw=2e9)
    many, few = _grouped_info(128, 32, 512, 384), _grouped_info(8, 512, 512, 384)   # the same FLOPs
    weights = 3 * 512 * 384 * 4   # each expert's [512, 384]: forward, the input's gradient, the weights'
    assert compute_time(many, whole, {}, streaming, 1) == pytest.approx(
        compute_time(many, whole, {}, cpu, 1) + 128 * weights / 2e9)
    assert compute_time(few, whole, {}, streaming, 1) == pytest.approx(
        compute_time(few, whole, {}, cpu, 1) + 8 * weights / 2e9)
    assert compute_time(many, whole, {}, streaming, 1) > 2 * compute_time(few, whole, {}, streaming, 1)
    # an ordinary product streams nothing
    mm = mm_info(512, 384, tp=1)
    mm.grad_inputs = (True, True)
    rep = Strategy((REPLICATE, REPLICATE), REPLICATE)
    assert compute_time(mm, rep, {b: 2, s: 256}, streaming, 1) == compute_time(mm, rep, {b: 2, s: 256}, cpu, 1)


def test_a_size_nothing_fixes_is_priced_at_one_rather_than_failing():
    from autotp.cost_model.symbolic import evaluate

    s, u = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("u9", integer=True, positive=True)
    assert evaluate(4 * s * u, {s: 3}) == 12.0


def test_calibrating_a_gpu_without_a_way_to_time_its_link_is_a_clear_error_before_measuring():
    from autotp.errors import ConfigError

    with pytest.raises(ConfigError, match="link_from="):
        calibrate("x", device="cuda")    # no CUDA here: the check comes before any measurement


def test_an_unaligned_product_the_rewrite_pads_is_priced_at_the_aligned_rate_plus_its_copies():
    from autotp.cost_model.alignment import Align

    env = {b: 8, s: 1024}
    whole = Strategy((REPLICATE, REPLICATE), REPLICATE)
    aligned = compute_time(mm_info(1600, 50264), whole, env, H100, 1)      # 50257 padded to 50264
    unaligned = compute_time(mm_info(1600, 50257), whole, env, H100, 1)
    padded = compute_time(mm_info(1600, 50257), whole, env, H100, 1, align=Align.for_profile(H100))
    assert aligned < padded < 1.2 * aligned and padded < unaligned / 3   # the copies: the weight, the gradient
    # a decode step's few rows: bound by reading the weight, which a pad would copy again
    assert compute_time(mm_info(1600, 50257), whole, {b: 1, s: 1}, H100, 1, align=Align.for_profile(H100)) == \
        compute_time(mm_info(1600, 50257), whole, {b: 1, s: 1}, H100, 1)


def test_a_strided_operand_is_priced_strided_through_the_cached_work():
    # the cached work once rebuilt the op without its strided inputs: an add of a transposed
    # operand was priced as a contiguous one (and, equal in every other key, shared its price)
    x = TensorMeta((b * s, sympy.Integer(4096)), torch.bfloat16)
    infos = [OpInfo(aten.add.Tensor, (x, x), {}, (x, x), x, 1) for _ in range(2)]
    for info, strided in zip(infos, [(False, False), (False, True)]):
        info.grad_inputs, info.strided_inputs = (False, False), strided
    env, whole = {b: 8, s: 1024}, Strategy((REPLICATE, REPLICATE), REPLICATE)
    n = 8 * 1024 * 4096 * 2
    contiguous, strided = (compute_time(info, whole, env, H100, 1) for info in infos)
    assert contiguous == pytest.approx(3 * n / H100.bandwidth("elementwise") + H100.launch_s)
    assert strided == pytest.approx(3 * n / H100.bandwidth("strided") + H100.launch_s)


def test_a_product_whose_f_feeds_the_dealt_runs_alone_is_not_priced_padded():
    # the rewrite pads no f_runs_only product (autotp/passes/rewrite.py); the price once read the
    # flag off the op, where it never is, and priced such a product at the padded kernel's rate
    from autotp.cost_model.kernels import op_work

    x = TensorMeta((b * s, sympy.Integer(1600)), torch.bfloat16)
    w = TensorMeta((sympy.Integer(6283), sympy.Integer(1600)), torch.bfloat16)
    out = TensorMeta((b * s, sympy.Integer(6283)), torch.bfloat16)
    info = OpInfo(aten.linear.default, (x, w), {}, (x, w), out, 1)
    info.grad_inputs = (True, True)
    plain = Strategy((REPLICATE, REPLICATE), REPLICATE)
    apart = Strategy((REPLICATE, REPLICATE), REPLICATE, f_runs_only=True)
    assert all(p.padded is not None for p in op_work(info, plain, 1, 2).products)
    assert all(p.padded is None for p in op_work(info, apart, 1, 2).products)


def test_a_rank_priced_alone_takes_its_own_part_of_uneven_splits_that_rotate_between_layers():
    # 5 heads over 2 ranks: each layer's third head goes to the rank its rotation names (layer 0
    # rank 0, layer 1 rank 1), so each rank's step holds 3 + 2 heads' products, where the per-op
    # bound (every op on its largest rank, what the solver weighs) holds 3 + 3
    from autotp.capture import capture
    from autotp.cost_model.symbolic import busiest_rank, step_breakdown
    from autotp.planner import build_plan
    from tests.helpers import tiny_gpt2

    layout = {"*.c_attn.weight": "column", "*.attn.c_proj.weight": "row", "*.mlp.c_fc.weight": "column",
              "*.mlp.c_proj.weight": "row"}
    h200 = PROFILES["h200"]
    model = tiny_gpt2(n_layer=2, n_head=5, head_dim=64, vocab=1024, device="meta", dtype=torch.bfloat16)
    _, index, prop = build_plan(capture(model), 2, batch=8, seq=1024, profile=h200, layout=layout)
    bound = step_breakdown(index, prop, h200)
    ranks = [step_breakdown(index, prop, h200, r) for r in range(2)]
    for kind in ("products", "attention", "memory"):
        assert all(r[kind] <= bound[kind] * (1 + 1e-9) for r in ranks)
    assert ranks[0]["attention"] == pytest.approx(ranks[1]["attention"])   # 3 + 2 heads each
    assert ranks[0]["attention"] < 0.9 * bound["attention"]                 # against 3 + 3
    busy, step = busiest_rank(index, prop, h200)
    total = lambda b: b["products"] + b["attention"] + b["memory"]   # noqa: E731
    assert total(step) == max(total(r) for r in ranks) and total(step) < total(bound)


def test_an_even_split_prices_every_rank_as_the_bound():
    from autotp.capture import capture
    from autotp.cost_model.symbolic import step_breakdown
    from autotp.planner import build_plan
    from tests.helpers import tiny_gpt2

    h200 = PROFILES["h200"]
    model = tiny_gpt2(n_layer=2, n_head=4, head_dim=64, vocab=1024, device="meta", dtype=torch.bfloat16)
    _, index, prop = build_plan(capture(model), 2, batch=8, seq=1024, profile=h200,
                                layout={"*.c_attn.weight": "column", "*.attn.c_proj.weight": "row"})
    bound = step_breakdown(index, prop, h200)
    for r in range(2):
        assert step_breakdown(index, prop, h200, r)["attention"] == pytest.approx(bound["attention"])
