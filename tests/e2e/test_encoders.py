"""Encoder and encoder–decoder families under Megatron's layout, against serial in float64:
BERT's masked-LM head (transform + decoder tied to the word embeddings) with token-type
embeddings, and T5's encoder–decoder (self and cross attention, relative position bias, the
tied shared embedding and untied head). The layout is pinned by role; the rest is the planner's."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.testing import TOLERANCE, equivalence_errors

LAYOUTS = {
    "bert": {"*.query.weight": "column", "*.key.weight": "column", "*.value.weight": "column",
             "*.attention.output.dense.weight": "row", "*.intermediate.dense.weight": "column",
             "*.output.dense.weight": "row", "*.word_embeddings.weight": "vocab",
             "cls.predictions.decoder.weight": "vocab"},
    "t5": {"*.q.weight": "column", "*.k.weight": "column", "*.v.weight": "column", "*.o.weight": "row",
           "*.wi.weight": "column", "*.wo.weight": "row", "lm_head.weight": "vocab", "shared.weight": "vocab"},
}


def encoder_matches_serial(family: str, tp: int) -> tuple[dict, dict]:
    config = zoo.tiny_config(family, layers=2, heads=4, head_dim=8, vocab=67)
    model = zoo.build(family, config, dtype=torch.float64)
    pm = autotp.parallelize(model, tp, layout=LAYOUTS[family])
    inputs = zoo.example_batch(family, config, seq=7)
    if family == "bert":
        inputs["token_type_ids"] = (torch.arange(7) >= 4).long().repeat(2, 1)
    return equivalence_errors(model, pm, inputs), pm.plan.roles


# the slow tier's: the fast tier runs BERT split by the planner (test_families, tp 4) and T5
# under this layout at tp 2 (the lengths test below); T5 at tp 2 x dp 2 is also the slow family stack's
@pytest.mark.parametrize("family, tp", [pytest.param("bert", 2, marks=pytest.mark.slow),
                                        pytest.param("bert", 4, marks=pytest.mark.slow),
                                        pytest.param("t5", 2, marks=pytest.mark.slow),
                                        pytest.param("t5", 4, marks=pytest.mark.slow)])
def test_encoder_families_under_megatrons_layout_match_serial(cluster, family, tp):
    for errors, roles in cluster.run(encoder_matches_serial, family, tp):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE[torch.float64], (worst, errors[worst])
        splits = [name for name, role in roles.items() if role in ("column", "row", "vocab")]
        assert "vocab" in roles.values() and len(splits) >= 12   # the output head and every layer split


def t5_lengths_match_serial(cases: list) -> tuple[list, int]:
    config = zoo.tiny_config("t5", layers=2, heads=4, head_dim=8, vocab=67)
    model = zoo.build("t5", config, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, layout=LAYOUTS["t5"])
    gen = torch.Generator().manual_seed(4)
    worst = []
    for train, source, target, decoder in cases:
        model.train(train)
        pm.train(train)
        inputs = {"input_ids": torch.randint(0, 67, (2, source), generator=gen),
                  decoder: torch.randint(0, 67, (2, target), generator=gen)}
        worst.append(max(equivalence_errors(model, pm, inputs).values()))
    return worst, len(pm.programs)


@pytest.mark.slow   # 20 s on two cores; the fast tier runs T5 against serial (tests/e2e/test_families.py,
# tests/e2e/test_sequence_parallel_gathers.py)
def test_an_encoder_decoder_takes_source_and_target_of_different_lengths(cluster_of):
    # Translation and summarization feed a source and a target of their own lengths. The first
    # program is captured with labels of another length than the ids (one symbol each), so it
    # serves equal and unequal lengths alike; a call with decoder ids is captured the same way.
    cases = [(True, 9, 5, "labels"), (True, 4, 10, "labels"), (True, 6, 6, "labels"),
             (False, 7, 3, "decoder_input_ids"), (False, 5, 5, "decoder_input_ids")]
    for worst, programs in cluster_of(2).run(t5_lengths_match_serial, cases):
        assert max(worst) <= TOLERANCE[torch.float64], worst
        assert programs == 2
