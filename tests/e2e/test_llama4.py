"""Llama-4's text model, every call equal to serial: its experts split, its attention exact.

Llama-4 runs every token through every expert: the rows are repeated once per expert and scaled
by the router's scores (sigmoid of the top-k logits, zero elsewhere), and each expert's stack is
read whole by ``bmm`` (gate|up ``[experts, hidden, 2*inter]``, down ``[experts, inter, hidden]``),
the outputs summed over the experts and added to a shared expert's. Its attention is chunked with
rotary (as complex products) in some layers and full without rotary, with a temperature on the
queries, in the others. Before, the stacks were not recognised as experts (gate|up split on its
hidden size, down whole on every rank: 0.42 of the expert bytes per rank at tp 8), generate at tp
2 was a PlanError (``bmm`` with inputs [R, S(1)]) and the tokens diverged at tp 4.

Hypothesis draws tp, the experts' layout (the planner's choice at a large workload, or pinned:
whole experts per rank, or every expert's matrices split), the order of the calls (a training call
with labels and backward, an inference call, a left-padded inference call, greedy and sampled
``generate`` with left padding) and the seed. Every call must equal the serial model's: loss,
logits and every gradient within float32's TOLERANCE (the router's sigmoid runs in float32:
BOUND), tokens identical."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE

VOCAB = 64
PAD = VOCAB - 1
#: 4 query heads of 2 kv heads; 4 experts; a chunk of 4 positions shorter than the prompts
STRUCTURE = dict(layers=2, heads=4, kv_heads=2, head_dim=8, vocab=VOCAB, positions=64)
ATTENTION = {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
             "*.o_proj.weight": "row", "*.shared_expert.gate_proj.weight": "column",
             "*.shared_expert.up_proj.weight": "column", "*.shared_expert.down_proj.weight": "row"}
EXPERTS = {"ep": {"*.experts.gate_up_proj": "expert", "*.experts.down_proj": "expert"},
           "etp": {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"},
           "planner": {},
           # the router row-parallel, as the solver takes it at Llama-4-Scout's size (its input, the
           # post-attention norm's output, left split along the hidden size: docs/models.md)
           "etp-row-router": {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row",
                              "*.router.weight": "row"}}
#: the router's scores are a sigmoid computed in float32 whatever the model's dtype
#: (``sigmoid(router_scores.float())``): the parallel model's logits, equal to serial's at float64's
#: rounding, round to float32 apart there, so every call is held to float32's tolerance
BOUND = TOLERANCE[torch.float32]
_MODELS: dict = {}   # per rank process: (tp, experts) -> (config, serial model, parallel model)


def _models(tp: int, experts: str):
    import autotp
    from autotp import zoo
    from autotp.testing import keep_loss_precision

    if (tp, experts) not in _MODELS:
        config = zoo.tiny_config("llama4", **STRUCTURE)
        model = zoo.build("llama4", config, dtype=torch.float64, seed=7)
        keep_loss_precision(model)
        layout = {**ATTENTION, **EXPERTS[experts]} if experts != "planner" else None
        if layout and tp > STRUCTURE["kv_heads"]:   # fewer kv heads than ranks: the planner places k and v
            layout = {k: v for k, v in layout.items() if not k.startswith(("*.k_proj", "*.v_proj"))}
        # the planner's own choice, at a workload where splitting pays
        kw = {} if layout else dict(batch=64, seq=4096, profile="h100-dgx")
        _MODELS[tp, experts] = (config, model, autotp.parallelize(model, tp, layout=layout, **kw))
    return _MODELS[tp, experts]


def prepare(case: dict) -> None:
    """The models built and parallelized in a task of their own (the calls' captures in the next)."""
    _models(case["tp"], case["experts"])


def calls_in_order(case: dict) -> dict:
    from autotp import zoo
    from autotp.testing import equivalence_errors

    config, model, pm = _models(case["tp"], case["experts"])
    gen = torch.Generator().manual_seed(case["seed"])
    errors: dict = {}
    for i, call in enumerate(case["order"]):
        model.train(call == "train")
        pm.train(call == "train")
        ids = torch.randint(2, PAD, (2, case["seq"]), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, :case["pad"]] = 0
        ids[0, :case["pad"]] = PAD
        if call == "train":
            batch = zoo.example_batch("llama4", config, batch=2, seq=case["seq"], seed=case["seed"] + i)
            for name, err in equivalence_errors(model, pm, batch).items():
                errors[f"{i}:train:{name}"] = err
        elif call in ("infer", "padded"):
            kw = {"attention_mask": mask} if call == "padded" else {}
            with torch.no_grad():
                want, got = model(input_ids=ids, **kw).logits, pm(input_ids=ids, **kw).logits
            if call == "padded":   # a padded position's logits are whatever its masked row gives
                want, got = want[mask.bool()], got[mask.bool()]
            errors[f"{i}:{call}:logits"] = ((got - want).norm() / want.norm()).item()
        else:
            sampling = {"do_sample": True, "top_k": 5} if call == "sample" else {"do_sample": False}
            torch.manual_seed(case["seed"])
            want = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD,
                                  eos_token_id=None, **sampling)
            rank = torch.distributed.get_rank()
            torch.manual_seed(case["seed"] + (rank % case["tp"]) * 1000)
            got = pm.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD, eos_token_id=None,
                              **sampling)
            errors[f"{i}:{call}:tokens"] = 0.0 if torch.equal(got, want) else float("inf")
    roles = {n: r for n, r in pm.plan.roles.items() if ".experts." in n}
    stacks = {n: tuple(p.shape) for n, p in pm.named_parameters() if ".experts." in n}
    return {"errors": errors, "roles": roles, "local": {n: p.to_local().numel() if hasattr(p, "to_local")
                                                         else p.numel() for n, p in pm.named_parameters()
                                                         if ".experts." in n},
            "whole": {n: int(torch.Size(s).numel()) for n, s in stacks.items()},
            "router": {n: r for n, r in pm.plan.roles.items() if n.endswith("router.weight")}}


def assert_calls(cluster_of, case: dict) -> list[dict]:
    cluster = cluster_of(case["tp"])
    cluster.run(prepare, case)
    results = cluster.run(calls_in_order, case)
    for r in results:
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= BOUND, (case, worst, sorted(r["errors"].items(), key=lambda kv: -kv[1])[:6])
        if case["tp"] > 1:   # the experts are split, whichever way: no rank holds them all
            assert set(r["roles"].values()) <= {"expert", "expert_column", "expert_row"}, (case, r["roles"])
        if case["tp"] > 1 and "*.router.weight" in EXPERTS[case["experts"]]:
            assert set(r["router"].values()) == {"row"}, (case, r["router"])
    if case["tp"] > 1:
        held = sum(sum(r["local"].values()) for r in results)
        assert held == sum(results[0]["whole"].values()), (case, held)   # each expert byte on one rank
    return results


#: the fast tier: the failures the issue reports (generate at tp 2, tokens at tp 4 after the
#: first), each with the other calls around it, and the sweep's first find (an inference call
#: after a training call whose plan split the down stack, x arriving whole: no strategy for
#: bmm [R, S(1)] until the row split converts x to the stack's split)
FAST = [
    dict(tp=2, experts="etp", order=["train", "generate", "padded"], seq=7, pad=3, seed=1),
    dict(tp=1, experts="etp", order=["train", "infer"], seq=2, pad=0, seed=0),
    dict(tp=2, experts="etp-row-router", order=["train", "padded"], seq=5, pad=2, seed=3),
]
#: the slow tier (50 s alone on two cores, the fast tier's longest case): the tokens at tp 4 after
#: a generate, expert-parallel; the drawn sweep below covers tp 4 and both layouts too
SLOW = [dict(tp=4, experts="ep", order=["generate", "train", "infer"], seq=6, pad=2, seed=2)]


@pytest.mark.parametrize("case", [*FAST, *(pytest.param(c, marks=pytest.mark.slow) for c in SLOW)],
                         ids=[f"tp{c['tp']}-{c['experts']}" for c in FAST + SLOW])
def test_llama4_every_call_equals_serial(cluster_of, case):
    assert_calls(cluster_of, case)


@pytest.mark.slow
@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tp=st.integers(1, 4), experts=st.sampled_from(sorted(EXPERTS)),
       order=st.lists(st.sampled_from(["train", "infer", "padded", "generate", "sample"]), min_size=2, max_size=4),
       seq=st.integers(2, 9), pad=st.integers(0, 1), seed=st.integers(0, 99))
def test_llama4_every_call_equals_serial_many(cluster_of, tp, experts, order, seq, pad, seed):
    assert_calls(cluster_of, dict(tp=tp, experts=experts, order=order, seq=seq, pad=min(pad * (seq - 1), seq - 1),
                                  seed=seed))
