"""The optimizer step priced per parameter byte held on a rank: a large replicated table costs
step time, not only memory, so real-size vocabularies split while tiny ones stay whole."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.cost_model.devices import PROFILES
from autotp.placements import REPLICATE, Shard

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_update_time_reads_and_writes_the_whole_training_state_once(name):
    profile = PROFILES[name]
    numel = 10 ** 9
    assert profile.update_time(numel) == pytest.approx(2 * profile.state_bytes_per_param * numel / profile.mem_bw)
    assert profile.update_time(numel / 8) == pytest.approx(profile.update_time(numel) / 8)


def _llama_8b_plan(batch: int, seq: int) -> autotp.Plan:
    model = zoo.build("llama", zoo.published_config("llama-3-8b", layers=2), device="meta", dtype=torch.bfloat16)
    return autotp.plan(model, tp=8, batch=batch, seq=seq)


def test_a_large_untied_embedding_splits_and_the_optimizer_step_is_priced_on_what_a_rank_holds():
    # 128256 x 4096 replicated: ~4.4 ms of AdamW traffic per step saved by a split at tp=8
    plan = _llama_8b_plan(64, 4096)
    assert plan.params[EMBED] != REPLICATE and plan.params[HEAD] != REPLICATE
    held = max(plan.param_bytes_per_rank()) / plan.dtype_bytes
    assert plan.cost["optimizer_s"] == pytest.approx(PROFILES["h100-dgx"].update_time(held), rel=1e-3)
    assert 0 < plan.cost["optimizer_s"] < plan.cost["compute_s"]


def test_a_tiny_model_at_a_small_workload_keeps_its_tables_replicated():
    model = zoo.build("llama", zoo.tiny_config("llama"), device="meta")
    plan = autotp.plan(model, tp=4, batch=2, seq=16)
    assert plan.params[EMBED] == REPLICATE and plan.params[HEAD] == REPLICATE


#: published models whose capture works on the meta device today (BERT-large does not yet)
TABLES = {"llama-3-8b": (EMBED, HEAD), "mistral-7b": (EMBED, HEAD), "qwen2-7b": (EMBED, HEAD),
          "gpt-neox-20b": ("gpt_neox.embed_in.weight", HEAD), "gpt-j-6b": ("transformer.wte.weight", HEAD),
          "falcon-7b": (HEAD,), "opt-6.7b": (HEAD,)}    # Falcon and OPT tie the head to the embedding


# the fast tier: an untied pair (Llama), a tied one (Falcon), NeoX's own names; the rest slow
@pytest.mark.parametrize("name", [n if n in ("llama-3-8b", "falcon-7b", "gpt-neox-20b")
                                  else pytest.param(n, marks=pytest.mark.slow) for n in sorted(TABLES)])
def test_real_size_vocabulary_tables_are_split_at_tp8(name):
    """At real size no rank holds a whole vocabulary table: the output head splits its vocabulary
    rows (column-parallel over V, the loss vocab-parallel); an untied input embedding splits too,
    by hidden columns (an all-gather of b*s*h, cheaper than the all-reduce a vocab split needs)."""
    family = zoo.published_sizes()[name]
    model = zoo.build(family, zoo.published_config(name, layers=2), device="meta", dtype=torch.bfloat16)
    plan = autotp.plan(model, tp=8)
    assert plan.params[HEAD] == Shard(0)
    for table in TABLES[name]:
        assert isinstance(plan.params[table], Shard), (table, plan.params[table])
