"""``sequence_parallel=True`` forces sequence parallelism in every program ``parallelize`` builds,
not only the first: each later call (an inference call, a left-padded one, a generation prefill)
is planned forced under the first plan's placements, and a program with no sequence to split (a
one-token decode step) is planned by cost with a note in its plan, logged once.

One rank of tp 2 on torch's ``fake`` backend (``fake_rank``): parallelize plans and rewrites every
program as a real rank does, so each program's plan (``pm.programs``) is read; no value is
checked here (tests/e2e/test_sequence_parallel_families.py runs them against serial)."""
import logging

import pytest
import torch

from autotp import zoo
from autotp.errors import PlanError
from tests.helpers import fake_process_group

#: a planning workload at which the cost model, free to choose, splits no later program along the
#: sequence (before, they were all planned so: "True" held for the first program alone)
WORKLOAD = dict(batch=2, seq=16, profile="h100-dgx")
#: row-parallel products pinned: at this workload the products would otherwise run whole
ROWS = {"*.c_attn.weight": "column", "*.c_fc.weight": "column", "*.c_proj.weight": "row"}
UNSPLIT = "sequence_parallel=True does not apply to the program of a generation decode step"


def along_s(plan) -> int:
    return sum(c.kind == "reduce_scatter" and c.dst == "S(1)" for c in plan.comms)


def _gpt2():
    config = zoo.tiny_config("gpt2", layers=1, heads=4, head_dim=8, vocab=61)
    return zoo.build("gpt2", config, dtype=torch.float32, seed=1)


def test_every_later_program_with_a_sequence_is_forced(fake_rank, caplog):
    # before, the later programs were planned by cost: at this workload the inference and the
    # padded call's programs all-reduced their partial sums whole (no reduce-scatter along s)
    import autotp

    pm = autotp.parallelize(_gpt2(), 2, layout=ROWS, sequence_parallel=True, **WORKLOAD)
    assert along_s(pm.plan) == 2   # the layer's two regions
    pm.eval()
    ids = torch.randint(3, 61, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autotp"):
        pm(input_ids=ids)
        pm(input_ids=ids, attention_mask=mask)
        pm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    # every program's plan: pm.programs (the first is parallelize's), the generation steps by kind
    later = {(p.step or "call") + ("+mask" if "attention_mask" in p.capture.input_keys else ""): p.plan
             for p in pm.programs[1:]}
    assert sorted(later) == ["call", "call+mask", "decode+mask", "prefill+mask"], sorted(later)
    for kind in ("call", "call+mask", "prefill+mask"):   # each as the first: every region along s
        assert along_s(later[kind]) == 2, (kind, later[kind].comms)
        assert any("sequence parallelism in 2 regions, forced" in n for n in later[kind].notes), later[kind].notes
    # one token a row: nothing to split, so by cost, said in its plan and in the log
    decode = later["decode+mask"]
    assert along_s(decode) == 0 and any(UNSPLIT in n and "by cost" in n for n in decode.notes), decode.notes
    # a one-token prompt: its prefill's capture holds the length static, and its first decode step
    # (one position before it) is a program of its own; each says why, the decode step's note
    # logged once for every decode program
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autotp"):
        pm.generate(ids[:, :1], attention_mask=mask[:, -1:], max_new_tokens=3, do_sample=False, pad_token_id=0)
    steps = pm.programs[5:]
    (prefill,) = [p.plan for p in steps if p.step == "prefill"]
    decodes = [p.plan for p in steps if p.step == "decode"]
    assert along_s(prefill) == 0 and any("prefill step: its capture holds every length static" in n
                                         for n in prefill.notes), prefill.notes
    assert decodes and all(any(UNSPLIT in n for n in plan.notes) for plan in decodes), [p.notes for p in decodes]
    said = [r.getMessage() for r in caplog.records if "sequence_parallel=True does not apply" in r.getMessage()]
    assert len(said) == 2 and sum(UNSPLIT in line for line in said) == 1, said


def test_a_saved_plan_the_force_cannot_take_is_a_plan_error(fake_rank):
    # a saved plan that keeps every product whole: forced under its placements, a program has no
    # partial sum to reduce-scatter along the sequence (before, the force went unmet, unsaid)
    import autotp

    import dataclasses

    from autotp.errors import ConfigError

    model = _gpt2()
    whole = autotp.plan(model, 2, layout={"*.weight": "replicate"}, **WORKLOAD)
    # the plan records it was made by cost: forcing it at parallelize contradicts the plan
    with pytest.raises(ConfigError, match="the plan was made with sequence_parallel=None"):
        autotp.parallelize(model, 2, plan=whole, sequence_parallel=True, **WORKLOAD)
    # a plan saved before its arguments were recorded (file version 1) is built with those given
    old = dataclasses.replace(whole, arguments=None)
    with pytest.raises(PlanError, match="under the plan's parameter placements no row-parallel product"):
        autotp.parallelize(model, 2, plan=old, sequence_parallel=True, **WORKLOAD)


def test_falcons_forced_prefill_step_keeps_its_row_parallel_products():
    # planning only (the meta device). Under the first plan's placements the op-by-op walk, cheaper
    # by the cost model, reached Falcon's row-pinned products at tp 3 with x whole and gathered
    # their weights through the transpose (the solver never does), so the forced prefill step held
    # no partial sum to reduce-scatter: a PlanError on generate. Forced, the walk is not taken
    # where it splits fewer regions than the solver's plan
    from autotp.capture import capture
    from autotp.generation import StepSpec, capture_step
    from autotp.planner import build_plan
    from autotp.planner.sequence import sequence_regions

    config = zoo.tiny_config("falcon", layers=2, heads=4, kv_heads=2, head_dim=8, vocab=61)
    model = zoo.build("falcon", config, device="meta", dtype=torch.float64)
    workload = dict(batch=64, seq=4096, profile="h100-dgx", align=None, sequence_parallel=True)
    first, *_ = build_plan(capture(model), 3, **workload, layout={"*.self_attention.dense.weight": "row",
                                                                  "*.mlp.dense_4h_to_h.weight": "row"})
    ids = torch.ones(2, 7, dtype=torch.long, device="meta")
    spec = StepSpec({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    cap = capture_step(model.eval(), spec)
    step, index, prop = build_plan(cap, 3, plan=first, gather_logits=True, keep_split=spec.keep_split(cap),
                                   **workload)
    # each layer's row-parallel sum reduce-scattered (the embeddings, read by columns, may make a region
    # of their own, entered by an all-to-all: rules/nn.py)
    scattered = [c.tensor for c in step.comms if c.kind == "reduce_scatter" and c.dst == "S(1)"]
    assert len(scattered) == 2 and sequence_regions(index, prop) >= 2, \
        [(c.kind, c.tensor, c.src, c.dst) for c in step.comms]
    gathered = [c.tensor for c in step.comms if c.kind == "all_gather" and c.src == "S(0)"]
    assert not gathered, gathered   # no pinned weight gathered


def _mamba(seq: int):
    # transformers' Mamba without its kernels loops over the sequence: export fixes the length
    config = zoo.tiny_config("mamba", layers=1, heads=2, head_dim=8, vocab=61)
    model = zoo.build("mamba", config, dtype=torch.float32, seed=1)
    return model, zoo.example_batch("mamba", config, batch=2, seq=seq)


@pytest.fixture
def fake_world_of_4():
    with fake_process_group(4) as group:
        yield group


def test_a_length_export_fixed_is_split_forced_and_a_later_one_under_tp_planned_by_cost(fake_world_of_4, caplog):
    # before, a program holding its length as a number (no dynamic sequence dim) was planned by
    # cost under sequence_parallel=True, with no note and no error: Mamba's residual adds
    # all-reduced whole. Its 6 tokens split 2, 2, 1, 1 over tp 4; a later call of 3 tokens has no
    # split with a token on every rank, so it is planned by cost, its plan saying why
    import autotp

    model, batch = _mamba(6)
    pm = autotp.parallelize(model, 4, example_kwargs=batch, layout={"*.out_proj.weight": "row"},
                            sequence_parallel=True, **WORKLOAD)
    # the vocab-parallel lookup's partial sum and the layer's row-parallel one, each met by a cast
    assert along_s(pm.plan) == 2 and any("sequence parallelism in 2 regions, forced" in n for n in pm.plan.notes)
    assert pm.capture.static_lengths == {6}
    out = pm(**batch)
    out.loss.backward()   # the rank's program runs, forward and backward, on its 2 of the 6 tokens
    pm.eval()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autotp"):
        pm(input_ids=batch["input_ids"])             # 6 tokens: forced
        pm(input_ids=batch["input_ids"][:, :3])      # 3 tokens at tp 4: by cost, said
    inference, short = (p.plan for p in pm.programs[1:])
    assert along_s(inference) == 2, inference.comms
    assert along_s(short) == 0
    said = "its capture holds the sequence at 3 tokens (torch.export fixed the length), fewer than tp=4"
    assert any(said in n for n in short.notes), short.notes
    assert any(said in r.getMessage() for r in caplog.records)   # rank 0 says it


def test_a_first_capture_whose_fixed_length_is_under_tp_is_a_plan_error():
    # planning only. The first program is the user's to capture longer: forced there, a length
    # shorter than tp is a PlanError naming it and the fix (before: planned by cost, unsaid)
    import autotp

    model, batch = _mamba(3)
    with pytest.raises(PlanError, match=r"holds its sequence at 3 tokens \(torch.export fixed the length.*fewer "
                                        r"than tp=4.*Capture with a sequence of at least tp=4 tokens"):
        autotp.plan(model, 4, example_kwargs=batch, layout={"*.out_proj.weight": "row"}, sequence_parallel=True,
                    **WORKLOAD)
