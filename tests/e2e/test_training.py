"""Training: a DP x TP world (dp 2 x tp 2 on 4 gloo ranks) takes AdamW steps that equal the
serial model's steps on the whole batch."""
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import autotp
from autotp.testing import keep_loss_precision

LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}


def adamw_steps(case: dict) -> dict:
    from autotp.distributed.shards import local_shard
    from autotp.testing import relative_error
    from tests.helpers import batch, tiny_gpt2

    model = keep_loss_precision(tiny_gpt2(n_layer=case["layers"], n_head=case["heads"], head_dim=4,
                                          vocab=case["vocab"], seed=case["seed"]))
    pm = autotp.parallelize(model, tp=2, layout=LAYOUT if case["megatron"] else None)
    dp_rank, dp = pm.mesh.dp_rank, pm.mesh.dp
    serial_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallel_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    b = case["batch"]
    for step in range(case["steps"]):
        data = batch(case["vocab"], b=b * dp, s=case["seq"], seed=100 + step)     # the whole batch
        mine = {k: v[dp_rank * b:(dp_rank + 1) * b] for k, v in data.items()}   # this DP rank's slice
        serial_opt.zero_grad()
        model(**data).loss.backward()
        serial_opt.step()
        parallel_opt.zero_grad()
        pm(**mine).loss.backward()
        parallel_opt.step()
    errors = {}
    for name, param in model.named_parameters():
        held = pm.plan.aliases.get(name, name)
        placement = pm.plan.params[held]
        expected = local_shard(param.detach(), placement, 2, pm.mesh.tp_rank) \
            if isinstance(placement, autotp.Shard) else param.detach()
        errors[held] = relative_error(pm.local_parameter(held), expected)
    return errors


_DP_TP_STEPS = dict(layers=st.integers(1, 2), heads=st.sampled_from([2, 3, 4]), vocab=st.integers(20, 64),
                   batch=st.integers(1, 2), seq=st.integers(3, 10), steps=st.integers(1, 3),
                   megatron=st.booleans(), seed=st.integers(0, 999))


def _dp_tp_steps(cluster, case: dict) -> None:
    for errors in cluster.run(adamw_steps, case):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-8, (worst, errors[worst])


#: every drawn case here: ranks are slow to start (no deadline), the cluster fixture is shared
#: across draws on purpose, and the draws are the same on every run
_DRAWS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)

#: the fast tier's cases (4-rank steps are its dearest), named: hypothesis's first derandomized
#: draws never took the Megatron layout nor a batch of 2; the slow tier draws 20
FAST_DP_TP = [dict(layers=1, heads=3, vocab=37, batch=2, seq=5, steps=2, megatron=True, seed=1),
              dict(layers=2, heads=4, vocab=24, batch=1, seq=10, steps=1, megatron=False, seed=2),
              dict(layers=1, heads=2, vocab=61, batch=2, seq=3, steps=3, megatron=False, seed=3)]


@pytest.mark.parametrize("case", [*FAST_DP_TP[:2], pytest.param(FAST_DP_TP[2], marks=pytest.mark.slow)],
                         ids=["megatron", "planned-2-layers", "planned-3-steps"])   # 3 steps: 12 s, slow
def test_adamw_steps_on_dp2_x_tp2_equal_serial_steps_on_the_whole_batch(cluster, case):
    _dp_tp_steps(cluster, case)


@pytest.mark.slow
@settings(max_examples=20, **_DRAWS)
@given(**_DP_TP_STEPS)
def test_adamw_steps_on_dp2_x_tp2_equal_serial_steps_20_draws(cluster, **case):
    _dp_tp_steps(cluster, case)


def fsdp_adamw_steps(case: dict) -> dict:
    """The dp dimension through FSDP2 (autotp.runtime.fsdp.fully_shard): each step two
    micro-batches, the first without gradient sync; AdamW on the sharded parameters."""
    from autotp.runtime.module import fsdp
    from autotp.testing import relative_error
    from tests.helpers import batch, tiny_gpt2

    from torch.distributed.fsdp import FSDPModule

    from autotp.runtime.module.outline import LayerCall

    model = keep_loss_precision(tiny_gpt2(n_layer=case["layers"], n_head=case["heads"], head_dim=4,
                                          vocab=case["vocab"], seed=case["seed"]))
    pm = autotp.parallelize(model, tp=2, layout=LAYOUT, activation_checkpointing=case["checkpointing"])
    # what a rank holds under tp alone (each parameter once): the share FSDP2 shards further over dp
    tp_held = sum(p._local_tensor.numel() for p in pm.parameters())
    pm = fsdp.fully_shard(pm, per_layer=case["per_layer"], replicate=case.get("replicate", 1))
    units = sorted(name for name, m in pm.named_modules() if isinstance(m, FSDPModule))
    dp_rank, dp = pm.mesh.dp_rank, pm.mesh.dp
    serial_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallel_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    b = case["batch"]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(case["steps"]):
            data = batch(case["vocab"], b=2 * b * dp, s=case["seq"], seed=100 + step)   # two micro-batches per DP rank
            serial_opt.zero_grad()
            model(**data).loss.backward()
            serial_opt.step()
            parallel_opt.zero_grad()
            for micro in range(2):
                at = (micro * dp + dp_rank) * b
                pm.set_requires_gradient_sync(micro == 1)
                (pm(**{k: v[at:at + b] for k, v in data.items()}).loss / 2).backward()
            parallel_opt.step()
    # FSDP2 (torch >= 2.13) warns on every call of a module returning views: the outputs are not
    views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    serial = dict(model.named_parameters())
    errors = {name: relative_error(p.full_tensor(), serial[name].detach()) for name, p in pm.named_parameters()}
    state = sum(t._local_tensor.numel() for s in parallel_opt.state.values() for k, t in s.items() if k != "step")
    whole = 2 * sum(p.numel() for p in model.parameters())       # AdamW's exp_avg and exp_avg_sq
    placements = {str(p.placements) for p in pm.parameters()}
    prompt = batch(case["vocab"], b=2, s=4, seed=7)["input_ids"]
    model.eval(), pm.eval()
    same_tokens = torch.equal(pm.generate(prompt, max_new_tokens=3),      # parameters gathered for it
                              model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0))
    calls = [sum(isinstance(m, LayerCall) for m in p.graph_module.modules()) for p in pm.programs]
    return {"errors": errors, "state_share": state / whole, "tp_share": 2 * tp_held / whole, "dp": dp,
            "placements": placements, "same_tokens": same_tokens,
            "units": units, "layer_calls": calls, "views": views}


_FSDP_CASES = dict(layers=st.integers(1, 3), heads=st.sampled_from([2, 3, 4]), vocab=st.integers(20, 64),
                   batch=st.integers(1, 2), seq=st.integers(3, 8), steps=st.integers(1, 2),
                   seed=st.integers(0, 999), per_layer=st.booleans(), checkpointing=st.booleans(),
                   replicate=st.sampled_from([1, 2]))


def _fsdp_case(cluster, case: dict) -> None:
    for r in cluster.run(fsdp_adamw_steps, case):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= 1e-8, (worst, r["errors"][worst])
        # split over tp 2 and the dp shards: about half of tp's share, or tp's share where the 2 dp
        # ranks are replicas (a tiny model's replicated norms and biases keep tp's share above a half)
        if case["replicate"] == 1:
            assert r["state_share"] < 0.6 * r["tp_share"], r
        else:
            assert r["state_share"] == r["tp_share"], r
        assert any("Shard(dim=0)" in p or "_StridedShard" in p for p in r["placements"])
        assert r["same_tokens"]
        assert not r["views"], r["views"][:1]
        layer_units = [f"transformer.h.{i}" for i in range(case["layers"])] if case["per_layer"] else []
        assert r["units"] == sorted([""] + layer_units)
        # every program (the training call, eval, the generation steps) runs each layer through its unit
        assert len(r["layer_calls"]) >= 3 and set(r["layer_calls"]) == {len(layer_units)}


# The fast tier runs one example alone (4-rank runs are its dearest: HSDP, per layer, recomputed
# layers); FSDP over both dp ranks runs fast in tests/runtime/test_tailed_layouts.py, and the slow
# twin here draws 10.
@settings(max_examples=1, phases=[Phase.explicit], **_DRAWS)
@given(**_FSDP_CASES)
@example(layers=2, heads=2, vocab=30, batch=1, seq=6, steps=2, seed=2, per_layer=True, checkpointing=True,
         replicate=2)
def test_fsdp2_over_dp2_x_tp2_with_accumulation_equals_serial_steps(cluster, **case):
    """Per layer (each block an FSDP unit whose forward runs the block's ops) or the whole
    module as one unit, with or without activation checkpointing (a layer recomputed in its
    backward, FSDP2 gathering its parameters again for it), FSDP over both dp ranks or HSDP
    (``replicate=2``: two replicas of one shard each): AdamW steps with accumulation equal
    serial steps; generation works."""
    _fsdp_case(cluster, case)


@pytest.mark.slow
@settings(max_examples=10, **_DRAWS)
@given(**_FSDP_CASES)
def test_fsdp2_over_dp2_x_tp2_with_accumulation_10_draws(cluster, **case):
    _fsdp_case(cluster, case)


@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_at_tp2_equals_serial_steps(cluster_of):
    """8 ranks: tp 2 x dp 4, the dp ranks two replicas of two shards each (HSDP): AdamW steps
    equal serial steps; optimizer state split over tp 2 and 2 shards: a quarter per rank."""
    case = dict(layers=2, heads=2, vocab=32, batch=1, seq=5, steps=2, seed=4, per_layer=True,
                checkpointing=False, replicate=2)
    for r in cluster_of(8).run(fsdp_adamw_steps, case):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= 1e-8, (worst, r["errors"][worst])
        assert 0.2 < r["state_share"] < 0.35
        assert r["same_tokens"]
        assert not r["views"], r["views"][:1]


def fsdp_bf16_reduced_in_float32() -> dict:
    """bfloat16 parameters, FSDP2 reducing gradients in float32 (mp_policy): the gradients equal
    the float64 serial model's within bfloat16's rounding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autotp.runtime.module import fsdp
    from tests.helpers import batch, tiny_gpt2

    model = tiny_gpt2(n_layer=2, n_head=4, head_dim=8, vocab=48, seed=3)
    reference = keep_loss_precision(tiny_gpt2(n_layer=2, n_head=4, head_dim=8, vocab=48, seed=3))
    pm = fsdp.fully_shard(autotp.parallelize(model.to(torch.bfloat16), tp=2, layout=LAYOUT),
                          mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    data = batch(48, b=4, s=8, seed=11)
    dp_rank = pm.mesh.dp_rank
    pm(**{k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in data.items()}).loss.backward()
    reference(**data).loss.backward()
    want = dict(reference.named_parameters())
    errors = {}
    for name, p in pm.named_parameters():
        got, ref = p.grad.full_tensor().double(), want[name].grad
        errors[name] = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    return {"errors": errors, "dtypes": {str(p.grad.dtype) for p in pm.parameters()}}


def test_fsdp2_with_float32_reduction_of_bfloat16_gradients_matches_float64(cluster):
    for r in cluster.run(fsdp_bf16_reduced_in_float32):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= 3e-2, (worst, r["errors"][worst])   # bfloat16 has 8 bits of mantissa
        assert r["dtypes"] == {"torch.bfloat16"}


def fsdp_refusals() -> list[str]:
    from autotp.runtime.module import fsdp
    from tests.helpers import tiny_gpt2

    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=20), tp=2, layout=LAYOUT)
    said = []
    for call in (lambda: fsdp.fully_shard(pm, mesh=None), lambda: fsdp.fully_shard(pm, replicate=3),
                 lambda: fsdp.fully_shard(fsdp.fully_shard(pm))):
        try:
            call()
            said.append("accepted")
        except autotp.ConfigError as e:
            said.append(str(e))
    return said


def test_fully_shard_refuses_a_mesh_argument_a_bad_replica_count_and_a_second_call(cluster):
    for said in cluster.run(fsdp_refusals):
        assert "do not pass mesh=" in said[0]
        assert "replicate=3 does not divide the 2 data-parallel ranks" in said[1] and "{1, 2}" in said[1]
        assert "already sharded with FSDP2" in said[2]
