"""A rank's program runs nothing it does not use: nodes nothing reads, with no effect, are erased
(``rewrite.remove_dead``); collectives, writes, draws, checks and reads to the host stay."""
import operator
from collections import Counter

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp import zoo
from autotp.distributed import experts as E
from autotp.passes.rewrite import remove_dead

aten = torch.ops.aten


class _Module(nn.Module):   # a call_module node: a collective's place in a rank's program
    def forward(self, x):
        return x


def test_dead_pure_nodes_go_to_a_fixpoint_and_effects_stay():
    root = nn.Module()
    root.add_module("g_0", _Module())
    graph = fx.Graph()
    x = graph.placeholder("x")
    ids = graph.placeholder("ids")
    # a dead chain: each op's input is read only by the next, the last by nothing
    owners = graph.call_function(E.token_owners, (x, [2], 4, 2))
    picked = graph.call_function(E.take_rows, (owners, ids, 0))
    graph.call_function(aten.add.Tensor, (picked, 1))
    size = graph.call_function(aten.sym_size.int, (x, 0))
    graph.call_function(operator.floordiv, (size, 2))
    # no reader, but each has an effect or a check: kept
    kept = [graph.call_module("g_0", (x,)),                                   # a collective
            graph.call_function(aten.copy_.default, (x, x)),                  # a write in place
            graph.call_function(aten.native_dropout.default, (x, 0.5, True)),  # a draw
            graph.call_function(aten.dropout.default, (x, 0.5, True)),
            graph.call_function(aten._assert_async.msg, (x, "checked")),      # a check
            graph.call_function(aten.nonzero.default, (x,)),                  # a read to the host
            graph.call_function(aten._local_scalar_dense.default, (x,)),
            graph.call_function(E.match_rows, (x, ids, ids, 0, 4)),           # a helper that checks on the host
            graph.call_function(E.routed_reorder, (x, ids, ids, 4))]
    graph.output(x)
    gm = fx.GraphModule(root, graph)
    assert remove_dead(gm.graph) == 5
    left = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert left == kept


class _Calls(TorchDispatchMode):
    """Each ATen call, by op; ``int64 gathers``: the index_selects of integer rows (row maps, holders)."""

    def __init__(self):
        super().__init__()
        self.calls, self.int64_gathers = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        if func is aten.index_select.default and args[0].dtype == torch.int64:
            self.int64_gathers += 1
        return func(*args, **(kwargs or {}))


def test_a_reorder_made_whole_by_a_g_gathers_no_holders(fake_rank):
    # expert-TP Mixtral, the tokens split along the sequence: each rank reorders its own tokens'
    # rows by the whole sort (routed_reorder) and a g sums them whole. The reorder's localizer
    # makes the reordered rows' holders (take_rows of the tokens' holders) for a dispatch that
    # would read them; the g does not. Before, that int64 gather ran on every step, unread: 2
    # integer gathers a layer, now 1 (the reorder's own positions); 741 ATen calls -> 739
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=3, top_k=2,
                             output_router_logits=True)
    config._experts_implementation = "eager"
    model = zoo.build("mixtral", config, dtype=torch.float64, seed=4)
    pm = autotp.parallelize(model, 2, layout={"*.experts.gate_up_proj": "expert_column",
                                              "*.experts.down_proj": "expert_row"},
                            batch=64, seq=4096, sequence_parallel=True, profile="h100-dgx")
    graph = pm.graph_module.graph
    assert any(n.target is E.routed_reorder for n in graph.nodes)   # the path this test is about
    assert ("g", "P", "R") in {(c.kind, c.src, c.dst) for c in pm.plan.comms if ".mlp" in c.module}
    unread = [n.name for n in graph.nodes if n.op == "call_function" and not n.users]
    assert unread == []
    batch = zoo.example_batch("mixtral", config, batch=2, seq=7, seed=5)
    pm(**batch).loss.backward()   # the row maps' caches filled
    with _Calls() as step:
        pm(**batch).loss.backward()
    assert step.int64_gathers == 1, step.int64_gathers
