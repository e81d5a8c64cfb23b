"""``aten.rms_norm`` of an input split along its normalized dim into whole heads runs split
(``rules/nn.py`` ``rms_norm_rule``, ``distributed.functional.SplitRmsNorm``): each rank's sum of
squares all-reduced forward, ``sum(dy * x)`` backward. On real gloo ranks, float64, tight: the
rank's part of the output and of x's gradient equal the whole op's, heads tp may not divide,
``eps`` given or the op's default."""
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st


@st.composite
def cases(draw):
    tp = draw(st.integers(2, 4))
    return {"tp": tp, "heads": draw(st.integers(tp, 2 * tp + 1)), "head_dim": draw(st.integers(2, 5)),
            "rows": draw(st.integers(1, 3)), "eps": draw(st.sampled_from([1e-6, 0.5, None])),
            "seed": draw(st.integers(0, 1000))}


def split_norm(case: dict) -> dict:
    import sympy
    import torch
    import torch.distributed as dist

    from autotp.passes.rules.contract import LocalContext, OpInfo, TensorMeta
    from autotp.passes.rules.nn import rms_norm_localizer, rms_norm_rule
    from autotp.placements import Shard, local_ranges

    aten = torch.ops.aten
    tp, rank = dist.get_world_size(), dist.get_rank()
    width, rows, eps = case["heads"] * case["head_dim"], case["rows"], case["eps"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(rows, 3, width, dtype=torch.float64, generator=gen) * 3
    dy = torch.randn(rows, 3, width, dtype=torch.float64, generator=gen)
    meta = TensorMeta((sympy.Integer(rows), sympy.Integer(3), sympy.Integer(width)), torch.float64)
    info = OpInfo(aten.rms_norm.default, (meta, [width], None, eps), {}, (meta,), meta, tp)
    shard = Shard(2, unit=case["head_dim"])
    offered = [s for s in rms_norm_rule(info, (shard,)) if s.inputs == (shard,)]
    assert [s.output for s in offered] == [shard] and [k for k, _ in offered[0].internal] == ["all_reduce"] * 2
    module, args, _ = rms_norm_localizer(info, offered[0], ("x", [width], None, eps), {},
                                         LocalContext(tp, rank, dist.group.WORLD))
    ranges = local_ranges(width, shard, tp, rank)
    mine = lambda t: torch.cat([t[..., a:b] for a, b in ranges], -1)  # noqa: E731
    x_local = mine(x).requires_grad_(True)
    y_local = module(x_local)
    y_local.backward(mine(dy))
    whole = x.clone().requires_grad_(True)
    y = aten.rms_norm.default(whole, [width], None, eps)
    y.backward(dy)
    err = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    return {"args": args, "y": err(y_local.detach(), mine(y.detach())), "dx": err(x_local.grad, mine(whole.grad))}


@settings(phases=[Phase.explicit], deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(case={"tp": 4, "heads": 6, "head_dim": 3, "rows": 2, "eps": 1e-6, "seed": 1})
@example(case={"tp": 2, "heads": 3, "head_dim": 4, "rows": 1, "eps": None, "seed": 2})
@given(case=cases())
def test_a_norm_over_split_heads_runs_split_and_equals_the_whole_op(cluster_of, case):
    check(cluster_of, case)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(case=cases())
def test_split_rms_norm_30_cases(cluster_of, case):
    check(cluster_of, case)


def check(cluster_of, case: dict) -> None:
    for rank, r in enumerate(cluster_of(case["tp"]).run(split_norm, case)):
        assert r["args"] == ("x",), r["args"]
        assert r["y"] <= 1e-13 and r["dx"] <= 1e-12, (case, rank, r)
