"""Generate keeps a split mixer's recurrent states split, as it keeps keys and values by head.

A state-space or linear-attention mixer split by head (Mamba2 by head group: Bamba with
``mamba_n_groups`` = tp; Qwen3-Next's Gated DeltaNet with its projections pinned, its
recurrence by head) or by channel (Mamba with Megatron's layout pinned) hands its conv and
SSM states from the prompt's program to the first decode step and from each decode step to the
next. transformers writes them with ``copy_``: into a ``zeros`` buffer in the prefill, into the
state handed in for a decode step. Before ``copy_`` had a rule, each ran replicated: the split
state was all-gathered into a whole buffer on every rank, and every decode step took it whole.
Here each rank's cached states are 1/tp of the serial model's bytes, a decode step gathers no
state (Bamba's SSM state, read merged with the batch for one product, was gathered), and greedy ``generate``
(Bamba's row 0 left-padded) gives the serial model's tokens at tp 2 (float64 models; the mixers
compute in float32). Slow tier: each family captures three programs (a call, a prompt, a decode
step), tens of seconds each on two loaded cores."""
import pytest
import torch

MAMBA_LAYOUT = {"*in_proj.weight": "column", "*x_proj.weight": "row", "*dt_proj.weight": "column",
                "*out_proj.weight": "row"}
#: Gated DeltaNet by head: its in-projections column, its out-projection row (the tiny model's
#: plan, priced forward only, otherwise keeps the recurrence whole)
DELTANET_LAYOUT = {"*linear_attn.in_proj_qkvz.weight": "column", "*linear_attn.in_proj_ba.weight": "column",
                   "*linear_attn.out_proj.weight": "row"}


def state_calls(family: str) -> dict:
    """Greedy generate on a tiny ``family`` at this world's tp against serial, and each cached
    state's bytes on this rank and in the serial model's cache after the prompt."""
    import autotp
    from autotp import zoo
    from autotp.generation import CachedStep

    tp = torch.distributed.get_world_size()
    if family == "mamba":
        config = zoo.tiny_config("mamba", layers=2, heads=2, head_dim=8, vocab=64)
        model = zoo.build("mamba", config, dtype=torch.float64)
        batch = zoo.example_batch("mamba", config, batch=2, seq=6)
        pm = autotp.parallelize(model, tp, example_kwargs=batch, layout=MAMBA_LAYOUT)
        prompt, mask = batch["input_ids"][:, :3], None
    else:   # Mamba2 split by head group; Gated DeltaNet as the cost model splits it
        extra = {"mamba_n_groups": tp} if family == "bamba" else {}
        config = zoo.tiny_config(family, layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64, **extra)
        if hasattr(config, "_experts_implementation"):
            config._experts_implementation = "batched_mm"   # torch's grouped product takes no float64 on CPU
        model = zoo.build(family, config, dtype=torch.float64)
        pm = autotp.parallelize(model, tp, batch=64, seq=4096, profile="h100-dgx",
                                layout=DELTANET_LAYOUT if family == "qwen3-next" else None)
        prompt = zoo.example_batch(family, config, batch=2, seq=5, seed=3)["input_ids"]
        mask = torch.ones_like(prompt)
        mask[0, :2] = 0
    model.eval()
    pm.eval()
    got = pm.generate(prompt, attention_mask=mask, max_new_tokens=3, eos_token_id=None).tolist()
    serial = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None,
                            pad_token_id=0).tolist()
    with torch.no_grad():
        whole = CachedStep(model)(input_ids=prompt, **({"attention_mask": mask} if mask is not None else {}))
    states = {n: (v.numel() * v.element_size(), whole[n].numel() * whole[n].element_size())
              for n, v in pm.kv_cache.items() if n.startswith(("conv_", "ssm_"))}
    # the decode step's all-gathers of a tensor shaped as a state (past the batch dim): a state
    # gathered inside the step, by its layer and kind
    shapes = {tuple(v.shape[1:]): n.split("_")[0] for n, v in whole.items() if n in states}
    gathered = set()
    for program in (p for p in pm._programs if p.step == "decode"):
        nodes = {n.name: n for n in program.capture.graph.nodes}
        for c in program.plan.comms:
            val = nodes[c.tensor].meta.get("val")
            if c.kind.startswith("all_gather") and isinstance(val, torch.Tensor) and tuple(val.shape[1:]) in shapes:
                gathered.add(shapes[tuple(val.shape[1:])])
    return {"generate": (got, serial), "states": states, "gathered in decode": sorted(gathered)}


#: the states each family's plan splits: Qwen3-Next's Gated DeltaNet conv by q's, k's and v's heads
#: (it reads q | k | v joined: blocks of one shard; it ran whole, its conv state with it, before)
SPLIT = {"bamba": ("conv", "ssm"), "mamba": ("conv", "ssm"), "qwen3-next": ("conv", "ssm")}


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("family", list(SPLIT))
def test_generate_keeps_each_ranks_share_of_the_recurrent_states(family):
    from autotp.distributed.launch import LocalCluster

    tp = 2
    # three captures of a chunked scan or an unrolled recurrence: minutes on two loaded cores,
    # past the shared cluster's task timeout
    with LocalCluster(tp, timeout=2400) as cluster:
        results = cluster.run(state_calls, family)
    for r in results:
        got, serial = r["generate"]
        assert got == serial
        assert r["states"], "the model's mixers hand states between steps"
        for name, (held, whole) in r["states"].items():
            assert held * (tp if name.split("_")[0] in SPLIT[family] else 1) == whole, (name, held, whole)
        # Bamba's decode reads its SSM state as view(batch * heads, ...) for one bmm, a merge of
        # the batch with the split heads: each rank's rows of it (P(tokens 0)), not gathered (it was)
        assert r["gathered in decode"] == [], r["gathered in decode"]
