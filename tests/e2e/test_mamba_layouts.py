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
states (each rank its groups' share between steps: tests/e2e/test_recurrent_states.py). Mamba2 of one
group (the tiny configs' and every published one's): in_proj by head with B's and C's rows whole on
every rank, every call equal to serial (Bamba at tp 2 and 4, Granite-4.0-H and Falcon-H1 at tp 2; at
tp 3 with 6 heads, split by head beside a state of 6 and unsplit beside one of 4), and its whole
rows counted once by clip_grad_norm_ and DCP. Mamba2 of 2 groups at tp 4: every group of B and C
whole, each rank repeating its own head's. Mamba2 of 4 groups of 2 heads at tp 3: split by group
unevenly, every call equal to serial. Slow tier: captures of the chunked scan
take a minute each on two loaded cores."""
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


def _mixer_calls(family: str, overrides: dict) -> dict:
    """The hybrids' every-call check of ``family`` with ``overrides`` on its tiny config, and the
    placements of layer 0's Mamba2 in_proj and out_proj."""
    from tests.e2e.test_hybrids import hybrid_calls

    names = ("model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.out_proj.weight")
    out = hybrid_calls(family, overrides, names)
    out["in_proj"], out["out_proj"] = out.pop(names[0]), out.pop(names[1])
    return out


def mamba2_group_calls(family: str) -> dict:
    return _mixer_calls(family, {"mamba_n_groups": torch.distributed.get_world_size()})


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


def mamba2_one_group_calls(family: str) -> dict:
    tp = torch.distributed.get_world_size()
    # one group (the tiny config's, as published): 4 heads of 8, so tp 4 deals one head a rank
    heads = {} if tp <= 2 else {"num_attention_heads": tp, "num_key_value_heads": tp}
    return _mixer_calls(family, heads)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("family, tp", [("bamba", 2), ("bamba", 4), ("granitemoehybrid", 2), ("falcon-h1", 2)])
def test_mamba2_of_one_group_split_by_head_equals_serial(family, tp):
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Shard

    # Megatron's and vLLM's layout for ngroups=1: each rank its heads' z, x, dt, B and C whole
    with LocalCluster(tp, timeout=3000) as cluster:
        results = cluster.run(mamba2_one_group_calls, family)
    for r in results:
        assert r["in_proj"] == Shard(0, 5, 1, sizes=(8, 8, 1, 1, 1), whole=(2, 3)), r["in_proj"]
        # at tp 4 (one head of 4 a rank, hidden 16) the cost model gathers the scan's output for a
        # whole out_proj: the split it weighs, not a layout this test holds
        assert tp > 2 or (isinstance(r["out_proj"], Shard) and r["out_proj"].dim == 1), r["out_proj"]
        for call in ("train 11", "train 8", "padded"):
            assert r[call] <= TOLERANCE[torch.float32], (call, r[call])
        got, serial = r["generate"]
        assert got == serial


def mamba2_fewer_groups_calls(family: str, groups: int) -> dict:
    tp = torch.distributed.get_world_size()
    # ``groups`` groups of B and C, fewer than the ranks and more than one (vLLM's case where
    # several ranks hold one group's B and C): tp attention heads, the tiny config's 4 Mamba heads
    return _mixer_calls(family, {"mamba_n_groups": groups, "num_attention_heads": tp, "num_key_value_heads": tp})


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mamba2_of_fewer_groups_than_ranks_split_by_head_equals_serial():
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Shard

    # 2 groups at tp 4: each rank its head's z, x and dt, B's and C's two groups whole (the
    # one-group layout with a group count tp cannot deal: vLLM would hold only its own group)
    with LocalCluster(4, timeout=3000) as cluster:
        results = cluster.run(mamba2_fewer_groups_calls, "bamba", 2)
    for r in results:
        # per head: z 8, x 8, dt 1; B's and C's 2 groups of 4 whole on every rank (2 per head)
        assert r["in_proj"] == Shard(0, 5, 1, sizes=(8, 8, 2, 2, 1), whole=(2, 3)), r["in_proj"]
        for call in ("train 11", "train 8", "padded"):
            assert r[call] <= TOLERANCE[torch.float32], (call, r[call])
        got, serial = r["generate"]
        assert got == serial


def mamba2_one_group_at_tp3_calls(family: str, d_state: int) -> dict:
    # hidden 24: 3 attention heads of 8, 6 Mamba heads of 8, one group of B and C of a ``d_state``-wide state
    return _mixer_calls(family, {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3,
                                 "mamba_n_heads": 6, "mamba_d_state": d_state})


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("d_state", [6, 4])
def test_mamba2_of_one_group_at_tp3_equals_serial(d_state):
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Replicate, Shard

    # a state of 6 and 6 heads: 6 groups of one head, 2 a rank, B and C whole on every rank; a
    # state of 4: B's and C's 4 rows and 6 heads share 2 groups only, fewer than 3 ranks, and
    # the in-projection stays whole (the mixer unsplit), every call still equal to serial
    with LocalCluster(3, timeout=3000) as cluster:
        results = cluster.run(mamba2_one_group_at_tp3_calls, "bamba", d_state)
    for r in results:
        if d_state == 6:
            assert r["in_proj"] == Shard(0, 5, 1, sizes=(8, 8, 1, 1, 1), whole=(2, 3)), r["in_proj"]
        else:
            assert r["in_proj"] == Replicate(), r["in_proj"]
        for call in ("train 11", "train 8", "padded"):
            assert r[call] <= TOLERANCE[torch.float32], (call, r[call])
        got, serial = r["generate"]
        assert got == serial


def mamba2_groups_dealt_unevenly_calls(family: str) -> dict:
    # hidden 24: 3 attention heads of 8; 8 Mamba heads of 6 in 4 groups of 2: 4 groups at tp 3
    return _mixer_calls(family, {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3,
                                 "mamba_n_heads": 8, "mamba_d_head": 6, "mamba_n_groups": 4})


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mamba2_of_groups_tp_does_not_divide_equals_serial():
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Shard

    # 4 groups of 2 heads at tp 3: by group, 2, 1 and 1 groups a rank (4, 2 and 2 heads, not a
    # plain split's 3, 3 and 2); the decode step reads the state split so for its bmm (rows of
    # the heads' runs in units of a group: tests/passes/test_step_plan.py), every call equal to serial
    with LocalCluster(3, timeout=3000) as cluster:
        results = cluster.run(mamba2_groups_dealt_unevenly_calls, "bamba")
    for r in results:
        assert isinstance(r["in_proj"], Shard) and r["in_proj"].unit == 2 and not r["in_proj"].whole, r["in_proj"]
        for call in ("train 11", "train 8", "padded"):
            assert r[call] <= TOLERANCE[torch.float32], (call, r[call])
        got, serial = r["generate"]
        assert got == serial


def mamba2_one_group_clip_and_checkpoint(path: str) -> dict:
    import logging

    import autotp
    from autotp import zoo
    from autotp.runtime.checkpoint import dcp

    logging.getLogger("autotp").setLevel(logging.ERROR)
    config = zoo.tiny_config("bamba", layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64)

    def made(seed: int):
        model = zoo.build("bamba", config, dtype=torch.float64, seed=seed)
        return model, autotp.parallelize(model, 2, batch=64, seq=4096, profile="h100-dgx")

    model, pm = made(0)
    data = zoo.example_batch("bamba", config, batch=2, seq=11, seed=3)
    model(**data).loss.backward()
    pm(**data).loss.backward()
    ref = dict(model.named_parameters())
    grads = max((p.grad.full_tensor() - ref[n].grad).abs().max().item() / ref[n].grad.abs().max().item()
                for n, p in pm.named_parameters() if ".mamba." in n)
    serial = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e-3).full_tensor().item()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.step()
    dcp.save(pm, path, opt)
    _, loading = made(1)
    loading_opt = torch.optim.AdamW(loading.parameters(), lr=0.5)
    dcp.load(loading, path, loading_opt)
    a, b = dict(pm.named_parameters()), dict(loading.named_parameters())
    loaded = max((a[n].full_tensor() - b[n].full_tensor()).abs().max().item() for n in a)
    in_proj = "model.layers.0.mamba.in_proj.weight"
    return {"placement": pm.plan.params[in_proj], "grads": grads, "norms": (got, serial), "loaded": loaded,
            "local": tuple(pm.local_parameters()[in_proj].shape)}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mamba2_of_one_group_clips_and_checkpoints_its_whole_b_and_c_rows_once(tmp_path):
    from autotp.distributed.launch import LocalCluster
    from autotp.placements import Shard

    # B's and C's rows of in_proj (and channels of the conv) are held whole on every rank: the
    # gradient norm counts them once, DCP saves them once and loads them back
    with LocalCluster(2, timeout=3000) as cluster:
        results = cluster.run(mamba2_one_group_clip_and_checkpoint, str(tmp_path / "ckpt"))
    for r in results:
        assert r["placement"] == Shard(0, 5, 1, sizes=(8, 8, 1, 1, 1), whole=(2, 3)), r["placement"]
        assert r["local"] == (16 + 16 + 4 + 4 + 2, 8 * 2), r["local"]   # of [76, hidden 16]
        assert r["grads"] <= TOLERANCE[torch.float32], r["grads"]
        got, serial = r["norms"]
        assert abs(got - serial) <= TOLERANCE[torch.float32] * serial, (got, serial)
        assert r["loaded"] == 0.0, r["loaded"]
