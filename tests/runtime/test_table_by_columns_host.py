"""The host work of a table read by columns (``EmbeddingByColumns``: one all-to-all of the table
each way), counted on one rank on torch's ``fake`` backend after a warm-up
(:mod:`autotp.testing.host`). Eager code exchanges through the group's own c10d collective, as
the f/g all-reduces and the gathers do: no functional collective's pytree, dispatch, wrapper tensor
or autograd registration (about 110 Python calls an exchange), and a hidden tp does not divide
works out no layout per step (its blocks were cut run by run from ``local_ranges``: 340 calls of
``autotp/placements.py`` a step at 20 columns on 3 ranks). Before: 317 Python calls for the op's
forward and backward at tp 8 (hidden 32), 777 at tp 3 (hidden 20); a tiny GPT-2's step at tp 3
(hidden 20, vocabulary 67) 3080, 84 of them in the functional collectives; now 73, 77 and 1680."""
from __future__ import annotations

import pytest
import torch

import autotp
from autotp import zoo
from autotp.distributed.functional import EmbeddingByColumns
from autotp.placements import Shard, local_ranges
from autotp.testing.host import MEGATRON, PythonCalls
from tests.helpers import fake_process_group

FUNCTIONAL = "torch/distributed/_functional_collectives.py"


@pytest.mark.parametrize("vocab,hidden,tp", [(64, 32, 8), (67, 20, 3), (67, 20, 8)])
def test_the_table_read_by_columns_costs_its_host_few_python_calls(vocab, hidden, tp):
    with fake_process_group(tp, 0) as group:
        (start, stop), = local_ranges(vocab, Shard(0), tp, 0)
        weight = torch.randn(stop - start, hidden, dtype=torch.float64, requires_grad=True)
        ids = torch.randint(0, vocab, (2, 16))
        module = EmbeddingByColumns(group, Shard(0), Shard(1), vocab)

        def step():
            module(weight, ids).sum().backward()

        step()
        step()   # warm: the splits' layouts worked out
        with PythonCalls() as calls:
            step()
    assert calls.by_file()[FUNCTIONAL] == 0, calls.by_function.most_common(20)
    # the module, reshard_tp and its Function, two all-to-alls (layout, c10d call) and the lookup
    assert calls.total <= 80, calls.by_function.most_common(30)


def test_a_gpt2_ranks_step_reads_its_table_by_columns_without_functional_collectives():
    # 4 heads of 5 on 3 ranks: a hidden of 20, split 7, 7, 6 (and a vocabulary of 67: 23, 22, 22)
    config = zoo.tiny_config("gpt2", layers=2, heads=4, head_dim=5, vocab=67, positions=64)
    model = zoo.build("gpt2", config)
    batch = zoo.example_batch("gpt2", config, batch=1, seq=8, seed=0)
    with fake_process_group(3, 0):
        # planned where the tokens outweigh the table's rows, as gpt2-xl's 8 x 1024 do its 50257
        pm = autotp.parallelize(model, 3, profile="h100-dgx", batch=64, seq=4096, layout=MEGATRON["gpt2"])
        assert pm.plan.comm_counts().get("all_to_all_columns") == 1

        def step():
            pm.zero_grad(set_to_none=True)
            pm(**batch).loss.backward()

        step()
        step()
        with PythonCalls() as calls:
            step()
    files = calls.by_file()
    assert files[FUNCTIONAL] == 0, calls.by_function.most_common(20)
    assert files["autotp/placements.py"] <= 20, calls.by_function.most_common(30)   # 680 before
