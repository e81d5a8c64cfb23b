"""The state-space mixers split as Megatron and vLLM split them, on gloo ranks against serial.

Mamba (tiny, float64): Megatron's channel layout pinned (in_proj column, x_proj row, dt_proj
column, out_proj row) at tp 2 and 3 (uneven: 32 channels): the training call at the captured
length equals serial (loss, logits, every gradient; the program is fixed to it: a loop over the
sequence), and greedy ``generate`` gives the serial model's tokens. The cost model keeps the
selective scan itself whole at these lengths (docs/architecture.md, "The hybrids' mixers").

Mamba2 (Bamba, Granite-4.0-H; tiny, float64, mamba_n_groups = tp): the solver's own choice,
in_proj column by head group and out_proj row with the conv, chunked scan and gated norm on each
rank's groups; every call equals serial at float32's rounding (the mixer computes in float32),
training at two lengths, a left-padded call, and greedy ``generate`` carrying the conv and SSM
states (each rank its groups' share between steps: tests/e2e/test_recurrent_states.py). Slow tier: captures of the chunked scan take a minute each on two loaded cores."""
import pytest
import torch

from autotp.testing import TOLERANCE

MAMBA_LAYOUT = {"*in_proj.weight": "column", "*x_proj.weight": "row", "*dt_proj.weight": "column",
                "*out_proj.weight": "row"}


def mamba_channel_calls(layout: dict) -> dict:
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors

    config = zoo.tiny_config("mamba", layers=2, heads=2, head_dim=8, vocab=64)
    model = zoo.build("mamba", config, dtype=torch.float64)
    batch = zoo.example_batch("mamba", config, batch=2, seq=6)
    pm = autotp.parallelize(model, torch.distributed.get_world_size(), example_kwargs=batch, layout=layout)
    local = pm.local_parameters()
    out = {"shapes": {n: tuple(p.shape) for n, p in local.items() if "layers.0.mixer" in n},
           "train": max(equivalence_errors(model, pm, batch).values())}
    model.eval()
    pm.eval()
    ids = batch["input_ids"][:, :3]
    out["generate"] = (pm.generate(ids, max_new_tokens=3, eos_token_id=None).tolist(),
                       model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None,
                                      pad_token_id=0).tolist())
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", [2, 3])
def test_mamba_with_the_channel_layout_pinned_equals_serial(tp, cluster_of):
    results = cluster_of(tp).run(mamba_channel_calls, MAMBA_LAYOUT)
    channels = 32
    for rank, r in enumerate(results):
        assert r["train"] <= TOLERANCE[torch.float64], r["train"]
        got, serial = r["generate"]
        assert got == serial
        mine = channels // tp + (rank < channels % tp)
        shapes = r["shapes"]
        assert shapes["backbone.layers.0.mixer.dt_proj.weight"][0] == mine, shapes
        assert shapes["backbone.layers.0.mixer.x_proj.weight"][1] == mine, shapes
        assert shapes["backbone.layers.0.mixer.out_proj.weight"][1] == mine, shapes


def mamba2_group_calls(family: str) -> dict:
    from tests.e2e.test_hybrids import hybrid_calls

    out = hybrid_calls(family, {"mamba_n_groups": torch.distributed.get_world_size()},
                       ("model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.out_proj.weight"))
    out["in_proj"], out["out_proj"] = (out.pop("model.layers.0.mamba.in_proj.weight"),
                                       out.pop("model.layers.0.mamba.out_proj.weight"))
    return out


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid"])
def test_mamba2_split_by_head_group_equals_serial(family):
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Shard

    # six programs' captures (two training lengths, a padded call, a prompt, a decode step), each
    # of the chunked scan: 4 minutes for Bamba under a load average of 8 on two cores
    with LocalCluster(2, timeout=3000) as cluster:
        results = cluster.run(mamba2_group_calls, family)
    for r in results:
        # per group: z 16, x 16, B 4, C 4, dt 2 elements (units of 2)
        assert isinstance(r["in_proj"], Shard) and r["in_proj"].sizes == (8, 8, 2, 2, 1), r["in_proj"]
        assert r["out_proj"] == Shard(1, 1, 16), r["out_proj"]
        for call in ("train 11", "train 8", "padded"):
            assert r[call] <= TOLERANCE[torch.float32], (call, r[call])
        got, serial = r["generate"]
        assert got == serial
