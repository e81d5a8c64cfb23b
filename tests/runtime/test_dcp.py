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


def _save_and_reshard(path: str, tp_from: int, tp_to: int) -> dict:
    from autotp.runtime import dcp
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
                                 layout=LAYOUT)
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


@pytest.mark.parametrize("tp_from, tp_to", [(2, 4), (4, 1)])
def test_dcp_checkpoint_of_model_and_adamw_loads_at_another_tp(cluster, tmp_path, tp_from, tp_to):
    for r in cluster.run(_save_and_reshard, str(tmp_path / "ckpt"), tp_from, tp_to):
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["same_keys"]
        assert r["group"] == {"lr": 1e-2, "weight_decay": 0.1}
        assert r["after"] <= 1e-12
        assert r["runs"] > 0 or tp_to == 1
