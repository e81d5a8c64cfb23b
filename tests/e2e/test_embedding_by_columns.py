"""GPT-2's tied embedding read by columns on real gloo ranks equals the serial model, float64.

``wte`` is tied to ``lm_head``, which the plan splits by vocabulary. Planned where tokens outnumber
the table's rows, the lookup reads the table by columns (``rules/nn.py``: the rank's vocabulary
rows all-to-all'd into every row's ``h/tp`` columns inside the op,
``distributed/functional.EmbeddingByColumns``), and the table's gradient goes back to the rows'
ranks by the reverse all-to-all, summed there with the head's. Every call must equal serial: a
training call (loss, logits, every gradient, the tied table's included), an inference call with a
backward (logits gathered), an eval-mode left-padded call, and greedy ``generate``; the training
program must hold the lookup by columns. Vocabularies tp does not divide, hidden sizes tp does not
divide (the table's columns 7, 7 and 6 of 20 on three ranks: packed by one strided copy per width,
joined back by one ``cat``), lengths tp does not divide and ones shorter than tp.
"""
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

BY_COLUMNS = "all_to_all_columns"


def by_columns_calls(case: dict) -> dict:
    """On each rank: the errors of every kind of call against serial, and which programs read the
    tied table by columns."""
    import autotp
    from autotp.testing import equivalence_errors, keep_loss_precision
    from autotp.testing.host import MEGATRON
    from tests.helpers import tiny_gpt2

    tp, seq, rows, vocab = case["tp"], case["seq"], case["batch"], case["vocab"]
    model = keep_loss_precision(tiny_gpt2(n_layer=case["layers"], n_head=case["heads"],
                                          head_dim=case.get("head_dim", 4), vocab=vocab, n_positions=32,
                                          seed=case["seed"]))
    # planned where the tokens' rows outweigh the table's (as gpt2-xl's 8 x 1024 against 50257 rows)
    pm = autotp.parallelize(model, tp, profile="h100-dgx", batch=64, seq=4096, layout=MEGATRON["gpt2"],
                            sequence_parallel=case["sequence_parallel"])
    gen = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = torch.randint(0, vocab, (rows, seq), generator=gen)
    errors, columns = {}, {}
    for name, err in equivalence_errors(model, pm, {"input_ids": ids, "labels": labels}).items():
        errors[f"train:{name}"] = err
    columns["train"] = any(c.kind == BY_COLUMNS for c in pm.plan.comms)
    for name, err in equivalence_errors(model, pm, {"input_ids": ids}).items():
        errors[f"infer:{name}"] = err
    model.eval()
    pm.eval()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0   # row 0 left-padded by two
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, 2:]
        got = pm(input_ids=ids, attention_mask=mask).logits
        got = (got.full_tensor() if hasattr(got, "full_tensor") else got)[:, 2:]
    errors["padded:logits"] = ((got - want).norm() / want.norm()).item()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    got = pm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    errors["generate:tokens"] = 0.0 if torch.equal(got, want) else float("inf")
    return {"errors": errors, "columns": columns}


def assert_equal_to_serial(cluster_of, case: dict) -> None:
    from autotp.testing import TOLERANCE

    for rank, r in enumerate(cluster_of(case["tp"]).run(by_columns_calls, case)):
        if case["tp"] > 1:
            assert r["columns"]["train"], (case, rank, "the training program keeps the masked lookup")
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE[torch.float64], (case, rank, worst, r["errors"][worst])


#: tp 3 over a vocabulary of 61 (21, 20, 20 rows) and hidden 12 (4 columns each), a length of 7
FAST = dict(tp=3, heads=3, layers=1, vocab=61, seq=7, batch=2, seed=3, sequence_parallel=None)


def test_tied_embedding_read_by_columns_equals_serial_on_every_call(cluster_of):
    assert_equal_to_serial(cluster_of, FAST)


#: tp 3 over a hidden of 20 (4 heads of 5: 7, 7 and 6 of the table's columns on the three ranks)
#: and a vocabulary of 67 (23, 22, 22 rows)
UNEVEN_HIDDEN = dict(tp=3, heads=4, head_dim=5, layers=1, vocab=67, seq=7, batch=2, seed=5, sequence_parallel=None)


def test_tied_embedding_read_by_columns_equals_serial_where_tp_does_not_divide_the_hidden(cluster_of):
    assert_equal_to_serial(cluster_of, UNEVEN_HIDDEN)


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    # whole heads on every rank, or one more on the first ones; a head of 5 leaves the hidden
    # (heads x 5) undivided by tp wherever the heads are
    return dict(tp=tp, heads=tp * draw(st.integers(1, 2)) + draw(st.integers(0, tp - 1)),
                head_dim=draw(st.sampled_from([4, 5])), layers=draw(st.integers(1, 2)),
                vocab=tp * draw(st.integers(2, 10)) + draw(st.integers(0, tp - 1)),
                seq=draw(st.integers(2, 12)), batch=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
                sequence_parallel=draw(st.sampled_from([None, True])))


@pytest.mark.slow
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_tied_embedding_read_by_columns_equals_serial_drawn(cluster_of, case):
    assert_equal_to_serial(cluster_of, case)
