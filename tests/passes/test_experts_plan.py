"""Expert parallelism at real size: MoE models planned at tp=8 on the meta device (no ranks, no weights)."""
import pytest

import autotp
from autotp import zoo
from autotp.errors import ConfigError


def _plan(size: str, layers: int, **kw):
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=layers), device="meta")
    return autotp.plan(model, tp=8, **kw), model


def _expert_bytes(plan, rank_share: bool) -> int:
    from autotp.placements import Shard, local_size

    total = 0
    for name, shape in plan.shapes.items():
        if ".experts." not in name:
            continue
        n = 1
        for s in shape:
            n *= s
        p = plan.params[name]
        if rank_share and isinstance(p, Shard):
            n = n // shape[p.dim] * max(local_size(shape[p.dim], p, plan.tp, r) for r in range(plan.tp))
        total += n
    return total


@pytest.mark.parametrize("size", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_experts_split_by_whole_experts_at_tp8(size):
    plan, _ = _plan(size, layers=2)
    experts = {n: r for n, r in plan.roles.items() if ".experts." in n}
    assert experts and set(experts.values()) == {"expert"}, experts
    assert _expert_bytes(plan, True) * 8 == _expert_bytes(plan, False)   # 8 and 128 experts: 1/8 each
    assert "expert" in str(plan)


def test_expert_pin_on_a_matrix_names_the_fix():
    model = zoo.build("mixtral", zoo.tiny_config("mixtral", layers=1), device="meta")
    with pytest.raises(ConfigError, match="role 'expert'"):
        autotp.plan(model, tp=2, layout={"*.q_proj.weight": "expert"})
    with pytest.raises(ConfigError, match="stack of experts"):
        autotp.plan(model, tp=2, layout={"*.experts.down_proj": "row"})
