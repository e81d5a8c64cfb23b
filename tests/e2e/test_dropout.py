"""Dropout on: replicated regions draw the same masks on every TP rank, sharded regions their
own, and after training steps every replicated parameter is bitwise identical across the group."""
import pytest
import torch

import autotp

LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}


def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _drifted(pm) -> list[str]:
    """The parameters ``pm`` holds whole whose copies differ across its TP group's ranks."""
    return [name for name, p in pm.local_parameters().items()
            if not isinstance(pm.plan.params[name], autotp.Shard)
            and not all(torch.equal(p.detach(), q) for q in _gather(p.detach(), pm.mesh.tp_group))]


def _train_with_dropout(n_head: int, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import torch.distributed as dist
    from tests.helpers import batch

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)     # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=n_head, n_embd=n_head * 4, vocab_size=64, n_positions=16,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)).double().to(device)
    torch.manual_seed(1000 + dist.get_rank())   # ranks' own generators differ: autotp must not rely on them
    pm = autotp.parallelize(model, tp=2, layout=LAYOUT)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(3):
        data = {k: v.to(device) for k, v in batch(64, b=2, s=9, seed=step).items()}
        opt.zero_grad()
        pm(**data).loss.backward()
        opt.step()
    drifted = _drifted(pm)
    # Each random op, fed the same input on every rank: equal draws where replicated, not where sharded.
    from autotp.distributed.rng import RandomOp

    same = {}
    gen = torch.Generator().manual_seed(5)
    for name, mod in pm.graph_module.named_children():
        if not isinstance(mod, RandomOp):
            continue
        if mod.target is torch.ops.aten.dropout.default:
            out = mod(torch.ones(256, dtype=torch.float64, device=device), 0.5, True)
        else:
            q = torch.randn(1, 1, 8, 4, dtype=torch.float64, generator=gen).to(device)
            out = mod(q, q, q, None, 0.5)
        same[name] = all(torch.equal(out, o) for o in _gather(out, pm.mesh.tp_group))
    return drifted, same


# even heads, and uneven (a rank holds two heads, the other one); even in the slow tier
@pytest.mark.parametrize("n_head", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_replicated_parameters_stay_bitwise_identical_and_masks_follow_the_placement(cluster, n_head):
    for drifted, same in cluster.run(_train_with_dropout, n_head):
        assert drifted == []
        replicated = [n for n in same if "_replicated_" in n]
        sharded = [n for n in same if "_sharded_" in n]
        assert replicated and sharded, sorted(same)
        assert all(same[n] for n in replicated)
        assert not any(same[n] for n in sharded)


def _eval_mode():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from tests.helpers import batch, whole

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=64, n_positions=16,
                                       resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)).double()
    pm = autotp.parallelize(model, tp=2, layout=LAYOUT)
    data = batch(64, b=2, s=9)
    trained = [whole(pm(**data).logits) for _ in range(2)]
    pm.eval()
    model.eval()
    evaluated = [whole(pm(**data).logits) for _ in range(2)]
    return (torch.equal(trained[0], trained[1]), (evaluated[0] - model(**data).logits).abs().max().item(),
            torch.equal(evaluated[0], evaluated[1]))


def test_eval_mode_turns_the_captured_dropout_off(cluster_of):
    for train_runs_equal, eval_err, eval_runs_equal in cluster_of(2).run(_eval_mode):
        assert not train_runs_equal      # training: fresh masks each call
        assert eval_err < 1e-12 and eval_runs_equal   # eval: no dropout, equal to the serial model


def _rows_draws(family: str, seq: int):
    """On each rank: a tiny model with dropout on rows a rank holds alone, trained two steps with
    dropout on; whether each replicated parameter stayed bitwise the same across the group, and
    for each random op on such rows (its placement, its stream) whether the same input drew
    the same mask on every rank. ``mixtral``: a dropout after the experts' activation, on their
    rows (``P(routed 0)``, expert parallelism); ``opt``: its MLP's dropout on the rank's tokens'
    rows (``P(tokens 0)``, sequence parallelism forced on ``[b*s, h]``)."""
    import torch.distributed as dist

    from autotp import zoo
    from autotp.distributed.rng import RandomOp
    from autotp.placements import Routed

    if family == "mixtral":
        model = zoo.build("mixtral", zoo.tiny_config("mixtral", layers=1), dtype=torch.float64, seed=1)
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.act_fn = torch.nn.Sequential(experts.act_fn, torch.nn.Dropout(0.5))
        options = {"layout": {"*.experts.*": "expert"}}
    else:
        config = zoo.tiny_config("opt", layers=2, heads=4, kv_heads=None, head_dim=8, vocab=61)
        config.dropout = 0.5
        model = zoo.build("opt", config, dtype=torch.float64, seed=1)
        options = {"batch": 64, "seq": 4096, "profile": "h100-dgx", "sequence_parallel": True,
                   "layout": {"*.out_proj.weight": "row", "*.fc2.weight": "row"}}
    torch.manual_seed(1000 + dist.get_rank())   # ranks' own generators differ: autotp must not rely on them
    pm = autotp.parallelize(model, 2, **options)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(3, 50, (2, seq), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    drifted = _drifted(pm)
    same = {}
    for node in pm.graph_module.graph.nodes:
        op = pm.graph_module.get_submodule(node.target) if node.op == "call_module" else None
        placement = node.meta.get("autotp_placement")
        if isinstance(op, RandomOp) and isinstance(placement, Routed):
            out = op(torch.ones(256, dtype=torch.float64), 0.5, True)
            same[f"{node.name} {placement}"] = all(torch.equal(out, o) for o in _gather(out, pm.mesh.tp_group))
    return drifted, same


@pytest.mark.parametrize("family, rows", [("mixtral", "P(routed 0)"), ("opt", "P(tokens 0)")])
def test_a_dropout_on_rows_a_rank_holds_alone_draws_the_ranks_own_mask(cluster_of, family, rows):
    # each row is on one rank: a mask from the replicated state (before, on the experts' rows)
    # masks every rank's different rows with one pattern, where the whole tensor draws one per row
    for drifted, same in cluster_of(2).run(_rows_draws, family, 7):
        assert drifted == []
        on_rows = [name for name in same if name.endswith(rows)]
        assert on_rows, sorted(same)
        assert all("_sharded_" in name for name in on_rows), sorted(same)
        assert not any(same[name] for name in on_rows), same
