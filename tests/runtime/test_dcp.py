"""torch.distributed.checkpoint of a ParallelModule and its optimizer, loaded at another tp: the
parameters and AdamW state are the saved ones exactly, the param groups come back, and the next
clipped step equals the saving module's."""
import pytest
import torch

import autotp

LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}
VOCAB = 22


def _step(pm, opt, seed: int) -> None:
    from tests.helpers import batch

    data = batch(VOCAB, b=2, s=5, seed=seed)
    opt.zero_grad()
    pm(**data).loss.backward()
    torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.1)
    opt.step()


MLP_ONLY = {"*.mlp.c_fc.weight": "column", "*.mlp.c_proj.weight": "row"}


def _save_and_reshard(path: str, tp_from: int, tp_to: int, layout_to: dict = LAYOUT) -> dict:
    from autotp.runtime.checkpoint import dcp
    from tests.helpers import tiny_gpt2

    # 5 heads: 3 + 2 at tp 2, 2 + 1 + 1 + 1 at tp 4 (fused q|k|v runs, uneven); vocab 22 uneven
    saving = autotp.parallelize(tiny_gpt2(n_layer=2, n_head=5, head_dim=2, vocab=VOCAB, seed=5), tp=tp_from,
                                layout=LAYOUT)
    saving_opt = torch.optim.AdamW(saving.parameters(), lr=1e-2, weight_decay=0.1)
    for seed in range(2):
        _step(saving, saving_opt, seed)
    dcp.save(saving, path, saving_opt)
    # another model's weights and another optimizer's settings: everything must come from the file
    loading = autotp.parallelize(tiny_gpt2(n_layer=2, n_head=5, head_dim=2, vocab=VOCAB, seed=6), tp=tp_to,
                                 layout=layout_to)
    loading_opt = torch.optim.AdamW(loading.parameters(), lr=0.5, weight_decay=0.0)
    dcp.load(loading, path, loading_opt)

    a, b = dict(saving.named_parameters()), dict(loading.named_parameters())
    params = max((a[n].full_tensor() - b[n].full_tensor()).abs().max().item() for n in a)
    sa, sb = saving_opt.state_dict()["state"], loading_opt.state_dict()["state"]
    state = max((sa[i][k] - sb[i][k]).abs().item() if k == "step" else
                (sa[i][k].full_tensor() - sb[i][k].full_tensor()).abs().max().item() for i in sa for k in sa[i])
    group = {k: loading_opt.param_groups[0][k] for k in ("lr", "weight_decay")}
    _step(saving, saving_opt, 7)
    _step(loading, loading_opt, 7)
    after = max((a[n].full_tensor() - b[n].full_tensor()).abs().max().item() for n in a)
    runs = sum("RunShard" in repr(p.placements) for p in b.values())
    return {"params": params, "state": state, "group": group, "after": after, "runs": runs,
            "same_keys": sorted(sa) == sorted(sb) and len(sa) == len(a)}


@pytest.mark.parametrize("tp_from, tp_to, layout_to", [   # to tp 1 (nothing split: 12 s) in the slow tier
    (2, 4, LAYOUT), pytest.param(4, 1, LAYOUT, marks=pytest.mark.slow), (2, 2, MLP_ONLY)],
                         ids=["tp2-to-tp4", "tp4-to-tp1", "another-plan"])
def test_dcp_checkpoint_of_model_and_adamw_loads_at_another_tp(cluster, tmp_path, tp_from, tp_to, layout_to):
    for r in cluster.run(_save_and_reshard, str(tmp_path / "ckpt"), tp_from, tp_to, layout_to):
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["same_keys"]
        assert r["group"] == {"lr": 1e-2, "weight_decay": 0.1}
        assert r["after"] <= 1e-12
        assert r["runs"] > 0 or tp_to == 1 or layout_to is MLP_ONLY


def _trained(tp: int, steps: int):
    from tests.helpers import tiny_gpt2

    pm = autotp.parallelize(tiny_gpt2(n_layer=2, n_head=5, head_dim=2, vocab=VOCAB, seed=5), tp=tp, layout=LAYOUT)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for seed in range(steps):
        _step(pm, opt, seed)
    return pm, opt


def _full(pm) -> dict:
    return {n: p.full_tensor().clone() for n, p in pm.named_parameters()}


def _async_save_then_train_on(path: str) -> dict:
    from autotp.runtime.checkpoint import dcp

    pm, opt = _trained(2, 1)
    at_save = _full(pm)
    future = dcp.async_save(pm, path, opt)
    _step(pm, opt, 5)                 # training goes on while the checkpoint is written
    future.result()
    import torch.distributed as dist

    dist.barrier()
    fresh, fresh_opt = _trained(2, 0)
    dcp.load(fresh, path, fresh_opt)
    loaded = _full(fresh)
    return {"equal": all(torch.equal(loaded[n], at_save[n]) for n in at_save),
            "moved": any(not torch.equal(_full(pm)[n], at_save[n]) for n in at_save)}


def test_async_save_keeps_the_state_of_its_call_while_training_goes_on(cluster, tmp_path):
    for r in cluster.run(_async_save_then_train_on, str(tmp_path / "ckpt")):
        assert r["equal"] and r["moved"]


def _save_twice_rank_1_killed_in_the_second(path: str, api: str) -> dict:
    import os
    import signal
    import warnings

    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from autotp.runtime import checkpoint
    from autotp.runtime.checkpoint import dcp

    warnings.simplefilter("ignore", FutureWarning)
    save = dcp.save if api == "dcp" else lambda pm, path, opt: checkpoint.save_sharded(pm, path)
    pm, opt = _trained(2, 1)
    save(pm, path, opt)
    first = _full(pm)
    _step(pm, opt, 5)
    if dist.get_rank() == 1:          # writes its files, then dies before the save completes
        write, save_file = FileSystemWriter.write_data, safetensors.torch.save_file

        def write_then_die(self, plan, planner):
            out = write(self, plan, planner)
            out.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        def save_file_and_die(*args, **kwargs):   # the per-rank files of the retired save_sharded
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
        safetensors.torch.save_file = save_file_and_die
    if dist.get_rank() == 0:
        torch.save(first, os.path.join(os.path.dirname(path), "first.pt"))
    try:
        save(pm, path, opt)
    except Exception as exc:          # what the surviving rank itself was told
        with open(os.path.join(os.path.dirname(path), f"rank{dist.get_rank()}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise


def _load(path: str, api: str = "dcp") -> dict:
    import warnings

    from autotp.runtime import checkpoint
    from autotp.runtime.checkpoint import dcp

    warnings.simplefilter("ignore", FutureWarning)
    pm, opt = _trained(2, 0)
    if api == "dcp":
        dcp.load(pm, path, opt)
    else:
        checkpoint.load_sharded(pm, path)
    return _full(pm)


@pytest.mark.slow   # kills a rank of a fresh cluster (18 s)
@pytest.mark.parametrize("api", ["dcp", "save_sharded"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path, api):
    # save_sharded before it was retired: rank 0's new file beside rank 1's old one, loaded as a mix
    import os

    from autotp.errors import CommError
    from autotp.distributed.launch import LocalCluster

    path = str(tmp_path / "ckpt")
    with LocalCluster(2, timeout=120, collective_timeout=15, error_grace=20) as cluster:
        with pytest.raises(CommError, match="lost rank 1"):
            cluster.run(_save_twice_rank_1_killed_in_the_second, path, api)
    assert os.path.isdir(path + ".partial")          # the second save's files, never loaded
    told = (tmp_path / "rank0.txt").read_text()
    assert told.startswith("LostRankError: lost rank 1: the process has exited"), told   # the survivor names it
    first = torch.load(str(tmp_path / "first.pt"))
    with LocalCluster(2) as cluster:
        for loaded in cluster.run(_load, path, api):
            assert all(torch.equal(loaded[n], first[n]) for n in first)   # the first checkpoint, whole


def _rank_0_alone(path: str) -> str:
    import warnings

    import torch.distributed as dist

    from autotp.runtime.checkpoint import save_sharded

    warnings.simplefilter("ignore", FutureWarning)
    pm, _ = _trained(2, 0)
    if dist.get_rank() != 0:
        return "not called"
    try:
        save_sharded(pm, path)
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.slow   # waits out a collective timeout on a fresh cluster (about 30 s)
def test_a_save_on_one_rank_alone_names_the_missing_rank_and_publishes_nothing(tmp_path):
    # before: `if rank == 0: save_sharded(...)` wrote half a checkpoint with no error
    import os

    from autotp.distributed.launch import LocalCluster

    path = str(tmp_path / "ckpt")
    with LocalCluster(2, timeout=120, collective_timeout=10) as cluster:
        told, _ = cluster.run(_rank_0_alone, path)
    assert told.startswith("LostRankError: lost rank 1: no answer to autotp's roll call"), told
    assert "the start of save of" in told
    assert not os.path.exists(path)
