"""A fused multi-query projection's tailed layout (each rank: its query heads' rows, then k and v
whole) through the PyTorch stack: clip_grad_norm_ counts the whole k and v rows once (the serial
norm on every rank), torch.distributed.checkpoint saves them once and loads them at another tp,
FSDP2 over dp x tp with clipped AdamW steps equals serial steps, and from_pretrained reads each
rank's query rows and the whole k and v rows from a save_pretrained folder."""
import logging

import torch

import autotp

LAYOUT = {"*.attn.c_attn.*": "column", "*.attn.c_proj.weight": "row", "*.mlp.c_fc.*": "column",
          "*.mlp.c_proj.weight": "row"}
FUSED = "transformer.h.0.attn.c_attn.weight"


def _bigcode(seed: int, heads: int = 6):
    from autotp import zoo
    from autotp.testing import keep_loss_precision

    config = zoo.tiny_config("gpt-bigcode", layers=2, heads=heads, kv_heads=1, head_dim=4, vocab=37)
    return config, keep_loss_precision(zoo.build("gpt-bigcode", config, dtype=torch.float64, seed=seed))


def _batch(config, seed: int, batch: int = 2):
    from autotp import zoo

    return zoo.example_batch("gpt-bigcode", config, batch=batch, seq=5, seed=seed)


def _clip_and_checkpoint(path: str, heads: int) -> dict:
    from autotp.runtime.checkpoint import dcp

    logging.getLogger("autotp").setLevel(logging.ERROR)
    config, model = _bigcode(0, heads)
    pm = autotp.parallelize(model, 2, layout=LAYOUT)
    data = _batch(config, 3)
    model(**data).loss.backward()
    pm(**data).loss.backward()
    serial = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e-3).full_tensor().item()
    ref = dict(model.named_parameters())
    grads = max((p.grad.full_tensor() - ref[n].grad).abs().max().item() for n, p in pm.named_parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.step()
    dcp.save(pm, path, opt)
    loaded = {}
    for tp in (2, 1):   # the same layout, and whole (tp=1 beside dp=2)
        _, other = _bigcode(1, heads)
        loading = autotp.parallelize(other, tp, layout=LAYOUT)
        loading_opt = torch.optim.AdamW(loading.parameters(), lr=0.5)
        dcp.load(loading, path, loading_opt)
        a, b = dict(pm.named_parameters()), dict(loading.named_parameters())
        sa, sb = opt.state_dict()["state"], loading_opt.state_dict()["state"]
        loaded[tp] = max([((a[n].full_tensor() - b[n].full_tensor()).abs().max().item(), n) for n in a] +
                         [((sa[i][k].full_tensor() - sb[i][k].full_tensor()).abs().max().item(), f"{i}.{k}")
                          for i in sa for k in sa[i] if k != "step"])
    fused = dict(pm.named_parameters())[FUSED]
    try:   # a sum over ranks would count the whole k and v rows once per rank
        fused.sum()
        refused = "summed"
    except autotp.ConfigError as exc:
        refused = str(exc)
    return {"placement": pm.plan.params[FUSED], "norm": (serial, got), "grads": grads, "loaded": loaded,
            "refused": refused}


def test_clip_grad_norm_and_dcp_count_the_whole_kv_rows_once(cluster_of, tmp_path):
    for heads in (5,):   # 3 + 2 query heads: the ranks' widths differ, and so would the tail's rounding
        for r in cluster_of(2).run(_clip_and_checkpoint, str(tmp_path / f"ckpt{heads}"), heads):
            assert r["placement"].tail == 2, r["placement"]
            serial, got = r["norm"]
            assert abs(got - serial) <= 1e-12 * serial, (heads, got, serial)
            assert r["grads"] <= 1e-12 * serial
            assert {tp: err for tp, (err, _) in r["loaded"].items()} == {2: 0.0, 1: 0.0}, r["loaded"]
            assert "would sum a tensor whose layout keeps a tail" in r["refused"], r


def _fsdp_clipped_adamw(steps: int) -> dict:
    from autotp.runtime.module import fsdp
    from autotp.testing import relative_error

    logging.getLogger("autotp").setLevel(logging.ERROR)
    config, model = _bigcode(2)
    pm = fsdp.fully_shard(autotp.parallelize(model, tp=2, layout=LAYOUT))
    serial_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallel_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    dp_rank, dp = pm.mesh.dp_rank, pm.mesh.dp
    norms = []
    for step in range(steps):
        data = _batch(config, 10 + step, batch=2 * dp)
        serial_opt.zero_grad()
        model(**data).loss.backward()
        serial = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
        serial_opt.step()
        parallel_opt.zero_grad()
        pm(**{k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in data.items()}).loss.backward()
        got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05).full_tensor().item()
        parallel_opt.step()
        norms.append((serial, got))
    ref = dict(model.named_parameters())
    errors = {n: relative_error(p.full_tensor(), ref[n].detach()) for n, p in pm.named_parameters()}
    return {"placement": pm.plan.params[FUSED], "norms": norms, "errors": errors}


def test_fsdp2_with_clipped_adamw_over_a_tailed_layout_equals_serial_steps(cluster):
    for r in cluster.run(_fsdp_clipped_adamw, 2):
        assert r["placement"].tail == 2
        for serial, got in r["norms"]:
            assert abs(got - serial) <= 1e-10 * serial, r["norms"]
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= 1e-9, (worst, r["errors"][worst])


def _loaded(path: str) -> dict:
    from autotp.testing import equivalence_errors, keep_loss_precision
    from transformers import GPTBigCodeForCausalLM

    logging.getLogger("autotp").setLevel(logging.ERROR)
    from tests.test_checkpoint import _precise_from_config

    pm = autotp.from_pretrained(path, tp=2, layout=LAYOUT, progress=False, model_class=_precise_from_config)
    serial = keep_loss_precision(GPTBigCodeForCausalLM.from_pretrained(path, dtype=torch.float64))
    errors = equivalence_errors(serial, pm, _batch(serial.config, 4))
    local = pm.local_parameter(FUSED)
    return {"placement": pm.plan.params[FUSED], "rows": local.shape[0], "worst": max(errors.values())}


def test_from_pretrained_reads_each_ranks_query_rows_and_the_whole_kv_rows(cluster_of, tmp_path):
    _, model = _bigcode(7, heads=5)
    model.save_pretrained(tmp_path)
    rows = []
    for r in cluster_of(2).run(_loaded, str(tmp_path)):
        assert r["placement"].tail == 2 and r["worst"] <= 1e-9, r
        rows.append(r["rows"])
    assert sorted(rows) == [(2 + 2) * 4, (3 + 2) * 4]   # 3 + 2 query heads of 4 features, then k and v
