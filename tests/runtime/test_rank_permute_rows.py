"""Rows reordered by a permutation run backward as one kernel: no scatter to make the inverse.

transformers' MoE layers sort their (token, expert) rows by expert (``perm``) and put the experts'
output back by ``inv_perm``, made as ``inv_perm[perm] = arange`` (``index_put_``). The rank's
program runs that reorder as ``distributed.functional.permute_rows`` (a gather each way, no
scatter-add). The output's backward gathers by the inverse of ``inv_perm``, which is ``perm``, a
value the graph already holds (``passes/rules/row_reads.inverse_permutations``); the routing
weights' reorder ``w[perm]`` gathers by ``inv_perm``, which the rank's program makes before it
(``passes/rewrite._inverses_first``; the model makes it only after). Counted by a dispatch mode
over the backward of a Mixtral step on torch's ``fake`` backend (collectives return at once), at
tp 1 and on rank 0 of tp 2: no ``arange`` scattered into an inverse, no row copied to its row.
"""
from collections import Counter

import pytest
import torch

import autotp
from autotp import zoo
from tests.helpers import fake_process_group

LAYERS = 2


def _backward_calls(tp: int) -> tuple[Counter, list]:
    """The ATen calls (by short name) of the backward of a Mixtral step on rank 0 of tp ``tp``, and
    the reorders the rank's program runs as ``permute_rows``: whether each is given its inverse."""
    from tests.cost_model.kernel_counts import KernelCounter

    config = zoo.tiny_config("mixtral", layers=LAYERS, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4,
                             top_k=2)
    model = zoo.build("mixtral", config, dtype=torch.float64, seed=1)
    batch = zoo.example_batch("mixtral", config, batch=2, seq=7, seed=2)
    with fake_process_group(tp):
        pm = autotp.parallelize(model, tp, batch=8, seq=7)
        pm(**batch).loss.backward()   # warm: the program built
        pm.zero_grad(set_to_none=True)
        loss = pm(**batch).loss
        with KernelCounter(fills=()) as counted:
            loss.backward()
    reorders = [len(n.args) > 2 and n.args[2] is not None for n in pm.graph_module.graph.nodes
                if n.op == "call_function" and getattr(n.target, "__name__", "") == "permute_rows"]
    return Counter(name for name, _ in counted.calls), reorders


@pytest.mark.parametrize("tp", [1, 2])
def test_a_reorder_back_to_token_order_makes_no_inverse_in_backward(tp):
    calls, reorders = _backward_calls(tp)
    assert calls["scatter_"] == 0 and calls["arange"] == 0, calls
    # a layer's two reorders, the weights' by perm and the output's by inv_perm, each given its
    # inverse (inv_perm made before the first): both gather their gradient back, no index_copy_
    assert calls["index_copy_"] == 0, calls
    assert calls["index_select"] == 2 * LAYERS, calls
    assert reorders == [True] * 2 * LAYERS, reorders
