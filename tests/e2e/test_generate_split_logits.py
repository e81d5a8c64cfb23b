"""pm.generate on a module whose head is split by vocabulary, token for token the serial model's
``generate``, whatever ``gather_logits`` says for plain calls.

``gather_logits=False`` keeps a plain call's logits split (a DTensor); a generation step picks its
token from the whole row (argmax, or HuggingFace's processors and one draw), so its program
gathers them. Before, the steps kept them split too and generate read each rank's slice of the
vocabulary as the whole row: a wrong token from the first new one, and the ranks apart
(GPT-2 vocab 61 at tp 2 from the one-token prompt [59]: serial 59, rank 0 17, rank 1 28).

The head is pinned vocab-parallel (the planner may replicate a tiny one), the vocabulary split
evenly or not, and the prompts are one token (a program of its own: export specializes a length
of 1) and longer, greedy and sampled (each rank's generator seeded apart: the group takes its
first rank's draw)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autotp
from autotp import zoo

VOCAB_PARAMS = {"gpt2": ("transformer.wte.weight",), "llama": ("model.embed_tokens.weight", "lm_head.weight")}
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}


def generate_both(case: dict) -> dict:
    family, tp = case["family"], case["tp"]
    config = zoo.tiny_config(family, layers=1, heads=4, kv_heads=2, head_dim=4, vocab=case["vocab"], positions=32)
    model = zoo.build(family, config, dtype=torch.float64, seed=case["seed"]).eval()
    pm = autotp.parallelize(model, tp, layout={name: "vocab" for name in VOCAB_PARAMS[family]},
                            gather_logits=case["gather"], align_products=case["align"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)   # prompts alike on every rank
    rank = torch.distributed.get_rank()
    out: dict = {"tokens": []}
    for length in case["lengths"]:
        ids = torch.randint(1, case["vocab"], (case["batch"], length), generator=gen)
        for sampling in case["sampling"]:
            torch.manual_seed(case["seed"])
            want = model.generate(ids, max_new_tokens=case["new"], pad_token_id=0, eos_token_id=None,
                                  **(sampling or {"do_sample": False}))
            torch.manual_seed(case["seed"] + 1000 * (rank % tp))
            got = pm.generate(ids, max_new_tokens=case["new"], pad_token_id=0, eos_token_id=None,
                              **(sampling or {"do_sample": False}))
            out["tokens"].append((length, sampling, want.tolist(), got.tolist()))
    # every generation step's program returns its logits whole; the plain call parallelize
    # captured keeps them as gather_logits says
    out["steps split"] = sorted({p.step for p in pm.programs if p.step and "logits" in p.plan.sharded_outputs})
    out["call split"] = "logits" in pm.programs[0].plan.sharded_outputs
    return out


def assert_generation(cluster_of, case: dict) -> None:
    for r in cluster_of(case["tp"]).run(generate_both, case):
        for length, sampling, want, got in r["tokens"]:
            assert got == want, (case, length, sampling, want, got)
        assert r["steps split"] == [], (case, r["steps split"])
        if case["gather"] is not None:   # None: split where the call returns a loss
            assert r["call split"] == (not case["gather"]), (case, r["call split"])


#: logits kept split: GPT-2's tied head at tp 2 on an uneven vocabulary (the reported case; a
#: longer prompt too), the untied Llama-like head (grouped-query attention, 2 kv heads for 4) at tp 3
FAST = [dict(tp=2, family="gpt2", vocab=61, gather=False, align=False, batch=1, lengths=[1, 3], new=4,
             sampling=[None, SAMPLED], seed=0),
        dict(tp=3, family="llama", vocab=96, gather=False, align=False, batch=2, lengths=[1], new=4,
             sampling=[None, SAMPLED], seed=3)]


@pytest.mark.parametrize("case", FAST, ids=[f"tp{c['tp']}-{c['family']}" for c in FAST])
def test_generation_with_logits_kept_split_equals_serial(cluster_of, case):
    assert_generation(cluster_of, case)


def _cases(tp: int):
    return st.fixed_dictionaries({
        "tp": st.just(tp), "family": st.sampled_from(sorted(VOCAB_PARAMS)),
        "vocab": st.sampled_from([53, 61, 83, 96]), "gather": st.sampled_from([None, True, False]),
        "align": st.booleans(), "batch": st.integers(1, 3),
        "lengths": st.lists(st.integers(1, 5), min_size=1, max_size=2, unique=True), "new": st.integers(1, 5),
        "sampling": st.lists(st.sampled_from([None, SAMPLED]), min_size=1, max_size=2, unique_by=repr),
        "seed": st.integers(0, 999)})


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3, 4])
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_generation_with_a_vocab_split_head_equals_serial_many(cluster_of, tp, data):
    assert_generation(cluster_of, data.draw(_cases(tp)))


def test_a_step_program_returning_its_logits_split_is_refused():
    """generate's guard: a step's outputs are plain local tensors, so a plan keeping its logits
    split would have each rank pick a token from its own slice of the vocabulary."""
    from types import SimpleNamespace

    from autotp.errors import PlanError
    from autotp.generation import _check_step
    from autotp.placements import Shard

    program = SimpleNamespace(step="decode", plan=SimpleNamespace(sharded_outputs={"logits": Shard(1)}))
    with pytest.raises(PlanError, match="returns its logits split"):
        _check_step(program)
    _check_step(SimpleNamespace(step="prefill", plan=SimpleNamespace(sharded_outputs={})))
