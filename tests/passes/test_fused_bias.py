"""The planner marks a bias add ``fused`` exactly where the rewrite adds the bias inside its
product (``autotp/passes/fused_bias.py``), and prices it without its forward kernel.

GPT-2 in Megatron's layout: c_attn and c_fc are column-parallel (the bias split like the product's
columns, nothing between), c_proj row-parallel (its bias added once after the g, to the sum); serial
(tp 1) adds every bias inside its product, as HF's Conv1D does with ``addmm``.
"""
from dataclasses import replace

import pytest
import torch

from autotp import zoo
from autotp.capture import cache as capture_cache
from autotp.cost_model import get_profile
from autotp.cost_model.symbolic import op_work
from autotp.planner import build_plan
from autotp.testing.host import MEGATRON

aten = torch.ops.aten
LAYERS = 2


def _plan(tp: int, sequence_parallel: bool):
    config = zoo.tiny_config("gpt2", layers=LAYERS, heads=5, head_dim=8, vocab=64, positions=64)
    cap = capture_cache.capture(zoo.build("gpt2", config, device="meta"))   # one export for every case
    return build_plan(cap, tp, batch=8, seq=64, profile="h200", layout=MEGATRON["gpt2"] if tp > 1 else None,
                      sequence_parallel=sequence_parallel if tp > 1 else None)


def _module(node) -> str:
    return next(reversed(node.meta["nn_module_stack"].values()))[0]


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, False), (2, True), (3, True)])
def test_bias_adds_are_fused_where_they_take_their_product_as_made(tp, sequence_parallel):
    _, index, prop = _plan(tp, sequence_parallel)
    fused = {}
    for node in index.bias_adds:
        strat = prop.chosen[node]
        product = node.args[0]
        fused[_module(node)] = strat.fused
        # fused exactly where the product's placement reaches the add unconverted
        assert strat.fused == (prop.placements[product] == strat.inputs[0]), (node.name, strat)
    modules = {f"transformer.h.{i}.{m}" for i in range(LAYERS) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                         "mlp.c_proj")}
    assert set(fused) == modules
    want = {m: tp == 1 or m.endswith(("c_attn", "c_fc")) for m in modules}
    assert fused == want


def test_a_fused_bias_add_is_priced_without_its_forward_kernel():
    _, index, prop = _plan(2, True)
    prof = get_profile("h200")
    node = next(n for n in index.bias_adds if prop.chosen[n].fused)
    strat = prop.chosen[node]
    fused, apart = (op_work(index.infos[node], s, prof, 2) for s in (strat, replace(strat, fused=False)))
    assert fused.launches == apart.launches - 1
    assert fused.moved == apart.moved[1:]   # the forward kernel's bytes gone; backward's the same


def test_an_f_into_a_bias_inside_its_product_reduces_in_place(fake_rank):
    """A replicated bias entering sharded compute gets an f (its gradient all-reduced backward);
    read as the bias of a product (``addmm``'s first operand, ``linear``'s third), its gradient is the output's summed
    over the tokens, a new tensor: the f reduces in place (``in_place.BIASED``), as it did into the
    ``add``. GPT-2 at a width whose unpinned plan with sequence parallelism runs its MLP on the
    rank's tokens, weights and biases whole (``tests/runtime/test_rank_copies.py``'s model)."""
    import autotp
    from autotp.distributed.comm_modules import CopyToTP

    config = zoo.tiny_config("gpt2", layers=2, heads=8, head_dim=64, vocab=512)
    pm = autotp.parallelize(zoo.build("gpt2", config, seed=1), 2, batch=256, seq=32, profile="h100-dgx",
                            sequence_parallel=True)
    gm = next(m for m in pm.modules() if type(m).__name__ == "ParallelGraph")
    biased = lambda u, n: (u.target is aten.linear.default and len(u.args) == 3 and u.args[2] is n   # noqa: E731
                           or u.target is aten.addmm.default and u.args[0] is n)
    into_bias = [n for n in gm.graph.nodes if n.op == "call_module" and type(gm.get_submodule(n.target)) is CopyToTP
                 and any(biased(u, n) for u in n.users)]
    assert into_bias
    assert all(gm.get_submodule(n.target).in_place for n in into_bias), into_bias
