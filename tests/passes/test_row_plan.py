"""Row-parallel with a free weight: x converted to a fresh split of its features (a whole x sliced
on each rank), offered by the matrix rule where it can pay (autotp/passes/rules/matrix.py), so the
solver reaches what a 'row' pin reaches (models planned on the meta device: no ranks, no weights).
"""
import functools
from dataclasses import replace

import sympy
import torch

import autotp
from autotp import zoo
from autotp.passes.rules.contract import OpInfo, TensorMeta
from autotp.passes.rules.registry import strategies
from autotp.cost_model.devices import PROFILES
from autotp.placements import PARTIAL, REPLICATE, Shard

KV_ROW = {"*.k_proj.weight": "row", "*.v_proj.weight": "row"}


def _total(plan) -> float:
    return plan.compute_s + plan.comm_s


def test_no_pinned_row_split_beats_the_solvers_choice():
    # Qwen2-7B's attention (28 heads, 4 kv heads of 128) at tp 8: with fewer kv heads than ranks, k and v
    # row-parallel (x sliced on each rank, k and v made whole by a g each) save 7/8 of their products for
    # two small all-reduces and an all-gather of x's gradient. Row with a free weight was offered only as
    # x arrived split, so pinning k/v 'row' came out cheaper than the solver's choice (7.716 ms against
    # 7.794 ms/step: layer 1's k/v replicate, its x whole).
    config = zoo.tiny_config("qwen2", heads=28, kv_heads=4, head_dim=128, positions=1024, vocab=1000)
    model = zoo.build("qwen2", config, device="meta")
    plan = autotp.plan(model, tp=8, seq=1024)
    pinned = autotp.plan(model, tp=8, seq=1024, layout=KV_ROW)
    assert _total(plan) <= _total(pinned) * (1 + 1e-12), (_total(plan), _total(pinned))
    for proj in ("k_proj", "v_proj"):
        assert plan.roles[f"model.layers.0.self_attn.{proj}.weight"] == "row"
    # layer 1's x arrives split along the sequence (its residual stream runs sequence-parallel
    # since a split by features reaches it by one all-to-all, issue 44): k and v row-parallel,
    # or their weights whole, run on the rank's tokens (1/8 of the product as well; the weights'
    # gradients summed by an f) and k/v gathered along the sequence into attention
    attention = "model.layers.1.self_attn"
    for proj in ("k_proj", "v_proj"):
        role = plan.roles[f"{attention}.{proj}.weight"]
        assert role in ("row", "replicate"), (proj, role)
        if role == "replicate":
            weight = f"p_{attention.replace('.', '_')}_{proj}_weight"
            assert [c.kind for c in plan.comms if c.tensor == weight] == ["f"], proj
            gathered = [(c.kind, c.src) for c in plan.comms if c.module == attention]
            assert ("all_gather_f", "S(2)") in gathered, gathered
    # layer 1's x reaches k and v split along its features: sliced on each rank from a whole x (one
    # scatter for both, its gradient all-gathered), or already split (this plan's residual stream runs
    # split along the hidden dim: the down projection's 7176 / 8 = 897 rows a rank are unaligned, so
    # the MLP is column-parallel both ways and its 897-wide activation all-gathered)
    sliced = [c for c in plan.comms if c.kind == "scatter" and c.module.startswith("model.layers.1.self_attn.")
              and c.module.endswith(("k_proj", "v_proj"))]
    assert [(c.src, c.dst) for c in sliced] in ([], [("R", "S(2)")]), sliced


def _linear(n_out: int, n_in: int, input_hints: dict | None = None, tp: int = 4) -> OpInfo:
    x = TensorMeta((sympy.Integer(2), sympy.Integer(3), sympy.Integer(n_in)), torch.float32)
    w = TensorMeta((sympy.Integer(n_out), sympy.Integer(n_in)), torch.float32)
    y = TensorMeta((sympy.Integer(2), sympy.Integer(3), sympy.Integer(n_out)), torch.float32)
    return OpInfo(torch.ops.aten.linear.default, (x, w), {}, (x, w), y, tp, input_hints=dict(input_hints or {}))


def _rows(info: OpInfo) -> list:
    return [s.inputs for s in strategies(info, (REPLICATE, None)) if s.output == PARTIAL]


def test_a_free_weight_is_offered_row_where_it_can_pay():
    # fewer outputs than inputs (k and v of few heads, a down projection): x's features split in plain runs
    assert _rows(_linear(16, 32)) == [(Shard(2), Shard(1))]
    # as many, x made of 4 heads of 8 (the output projection after attention computed whole): whole heads
    assert _rows(_linear(32, 32, {(0, 2): (1, 8, 0, 0, False)})) == [(Shard(2, unit=8), Shard(1, unit=8))]
    # as many with no heads, or more outputs (an up projection): row moves more than column, not offered
    assert _rows(_linear(32, 32)) == []
    assert _rows(_linear(64, 32)) == []


TIGHT = {torch.float32: 0.85, torch.float64: 0.9}


@functools.lru_cache(maxsize=None)
def _tight_plans(dtype: torch.dtype = torch.float32) -> tuple:
    """Tiny Qwen2 at tp 4 with q/k/v pinned whole: the fastest plan, and one within TIGHT[dtype] of its
    memory (the fastest already runs a region sequence-parallel; below these no plan fits, with the
    activations priced as autograd keeps them: float32 82%, float64 89%)."""
    h100 = PROFILES["h100-dgx"]
    profile = replace(h100, name="h100-flops/100", flops=h100.flops / 100)
    config = zoo.tiny_config("qwen2", layers=2, heads=6, kv_heads=2, head_dim=4, vocab=48)
    model = zoo.build("qwen2", config, device="meta", dtype=dtype)
    whole = {"*.q_proj.*": "replicate", "*.k_proj.*": "replicate", "*.v_proj.*": "replicate"}
    fastest = autotp.plan(model, 4, batch=64, seq=4096, profile=profile, layout=whole, gather_logits=False)
    return fastest, autotp.plan(model, 4, batch=64, seq=4096, profile=profile, layout=whole, gather_logits=False,
                                memory_limit=TIGHT[dtype] * fastest.memory_bytes)


def test_a_memory_tight_plan_splits_the_output_projection_after_a_whole_attention_by_head():
    # q/k/v pinned whole (attention computed whole on every rank): o_proj's x arrives whole. Row-parallel
    # keeps 1/4 of x for backward where column keeps it all, for the same collectives; offered only as x
    # arrived split, no plan fitted 70% of the fastest plan's memory then (MemoryLimitError). The split follows
    # x's heads: 6 heads dealt to 4 ranks unevenly, the extra head rotated by layer. (An H100 whose FLOP
    # rate is scaled down with the width, hidden 24 against Qwen2-7B's 3584: tests/e2e/test_row_parallel.py.)
    fastest, tight = _tight_plans()
    assert tight.memory_bytes <= TIGHT[torch.float32] * fastest.memory_bytes
    for layer in (0, 1):
        assert tight.params[f"model.layers.{layer}.self_attn.o_proj.weight"] == Shard(1, unit=4, rotate=layer)


def test_an_output_split_along_the_sequence_is_gathered_not_returned_split():
    # The tight plan runs sequence parallelism: the logits leave the last norm split along the
    # sequence. Returned split, their DTensor stated the capture's example length as the whole one
    # (11 tokens for a 7-token call); an output is kept split on a static dim only (the vocabulary).
    # (In float64, as tests/e2e/test_row_parallel.py runs it: its plan keeps the logits split.)
    _, tight = _tight_plans(torch.float64)
    assert any(c.kind == "reduce_scatter" for c in tight.comms), "the case needs sequence parallelism"
    assert all(p.dim == 2 for p in tight.sharded_outputs.values()), tight.sharded_outputs
