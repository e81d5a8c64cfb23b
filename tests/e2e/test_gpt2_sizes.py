"""Every GPT-2 size at every tp from 1 to 8: uneven heads, a 50257-row vocabulary split by
rows, the tied embedding/lm_head, vocab-parallel cross-entropy. Shrunken variants (fewer layers,
smaller head dim, the real head counts and vocabulary) against the serial model."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE, assert_equivalent, keep_loss_precision

HEADS = {"gpt2": 12, "gpt2-medium": 16, "gpt2-large": 20, "gpt2-xl": 25}
MEGATRON_VOCAB = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
                  "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}


def check_size_case(case: dict) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dtype = getattr(torch, case["dtype"])
    torch.manual_seed(case["seed"])
    heads = HEADS[case["size"]]
    config = GPT2Config(n_layer=case["layers"], n_head=heads, n_embd=heads * case["head_dim"], vocab_size=50257,
                        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = keep_loss_precision(GPT2LMHeadModel(config).to(dtype))
    gen = torch.Generator().manual_seed(case["seed"])
    inputs = {k: torch.randint(0, 50257, (2, case["seq"]), generator=gen) for k in ("input_ids", "labels")}
    errors = assert_equivalent(model, case["tp"], inputs, layout=MEGATRON_VOCAB)
    return errors


@pytest.mark.parametrize("tp", range(1, 9))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(size=st.sampled_from(sorted(HEADS)), layers=st.integers(1, 2), head_dim=st.sampled_from([2, 4]),
       seq=st.integers(2, 12), dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 999))
def test_every_gpt2_size_at_every_tp_matches_serial(cluster_of, tp, size, layers, head_dim, seq, dtype, seed):
    case = dict(tp=tp, size=size, layers=layers, head_dim=head_dim, seq=seq, dtype=dtype, seed=seed)
    results = cluster_of(tp).run(check_size_case, case)
    bound = TOLERANCE[getattr(torch, dtype)]
    for errors in results:
        worst = max(errors, key=errors.get)
        assert errors[worst] <= bound, (worst, errors[worst])


def _sharded_logits():
    from tests.helpers import batch, tiny_gpt2

    import autotp
    from autotp.runtime.collectives import local_shard

    model = tiny_gpt2(n_head=3, head_dim=4, vocab=101)
    inputs = batch(101)
    pm = autotp.parallelize(model, tp=2, layout=MEGATRON_VOCAB, gather_logits=False)
    out, ref = pm(**inputs), model(**inputs)
    placement = pm.plan.sharded_outputs["logits"]
    expected = local_shard(ref.logits, placement, 2, pm.mesh.tp_rank)
    gathered = autotp.parallelize(model, tp=2, layout=MEGATRON_VOCAB)
    return ((out.loss - ref.loss).abs().item(), (out.logits - expected).abs().max().item(),
            tuple(out.logits.shape), pm.plan.cost["comm_bytes_per_step"], gathered.plan.cost["comm_bytes_per_step"])


def test_logits_can_stay_vocab_sharded_and_skip_the_gather(cluster):
    for loss_err, logits_err, shape, bytes_sharded, bytes_gathered in cluster.run(_sharded_logits):
        assert loss_err < 1e-12 and logits_err < 1e-12
        assert shape[-1] in (50, 51)            # 101 rows split 51 / 50
        assert bytes_sharded < bytes_gathered   # the b*s*V all-gather is not paid
