"""Sibling products (``linear``s of one input) are found from the graph alone and run as one
product of their weights joined (``autotp/passes/products.py``); the plan splits the joined
weight as each rank's run of every sibling's heads (``cat``'s rule, ``autotp/passes/rules/joins.py``).

The captured program of a model, fused, computes what the written one does, forward and every
parameter's gradient (float64); products of other inputs, of one input with a bias and one
without, and a mixture's experts stay as written.
"""
import pytest
import torch
from torch import nn

from autotp import zoo
from autotp.capture.cache import capture
from autotp.passes.products import find_siblings, fuse_products
from autotp.placements import Shard, local_ranges
from autotp.planner import build_plan

aten = torch.ops.aten


class Mixed(nn.Module):
    """Two products of x (a set), one of y (alone), two of z, one with a bias and one without."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6, bias=False), nn.Linear(8, 4, bias=False)
        self.c = nn.Linear(8, 5, bias=False)
        self.d, self.e = nn.Linear(8, 3, bias=True), nn.Linear(8, 3, bias=False)

    def forward(self, x, y, z):
        return (self.a(x) * 2).sum() + self.b(x).sum() + self.c(y).sum() + self.d(z).sum() + self.e(z).sum()


def _sets(cap):
    return [tuple(cap.param_names[p.args[1].name] for p in s.products)
            for s in find_siblings(cap.graph, cap.param_names)]


def test_a_set_is_the_products_of_one_input_alike_in_their_bias():
    model = Mixed().double()
    args = tuple(torch.randn(2, 3, 8, dtype=torch.float64) for _ in range(3))
    cap = capture(model, args)
    assert _sets(cap) == [("a.weight", "b.weight")]


class _CrossBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8, bias=False)
        self.k, self.v = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x, memory):
        return x + self.q(x) * self.k(memory) * self.v(memory)


class CrossAttending(nn.Module):
    """A decoder whose every layer reads one memory by its own k and v products (T5's cross
    attention of the encoder's output), beside two products of the input outside the layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.layers = nn.ModuleList([_CrossBlock() for _ in range(2)])

    def forward(self, x, memory):
        x = self.a(x) + self.b(x)
        for layer in self.layers:
            x = layer(x, memory)
        return x.sum()


def test_products_of_one_input_in_two_layers_are_a_set_per_layer():
    # one product across layers would tie the layers' ops together: per-layer FSDP could not
    # outline them (T5 raised "their ops interleave" with its cross-attention k and v joined over
    # all decoder layers), nor a pipeline stage hold a layer alone
    args = tuple(torch.randn(2, 3, 8, dtype=torch.float64) for _ in range(2))
    cap = capture(CrossAttending().double(), args)
    assert sorted(_sets(cap)) == [("a.weight", "b.weight"), ("layers.0.k.weight", "layers.0.v.weight"),
                                  ("layers.1.k.weight", "layers.1.v.weight")]


class WrittenInPlace(nn.Module):
    """Two products of x, one activated in place (``relu_``), through a view: joined, its output
    would be a piece of a ``split_with_sizes``, which autograd lets no op write (the fuzzer's
    gated block of an in-place activation raised at its first call)."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(5, 2, bias=False), nn.Linear(5, 2, bias=False)

    def forward(self, x):
        return torch.relu_(self.gate(x).view(-1, 2)).view_as(x[..., :2]) * self.up(x)


def test_a_set_whose_output_is_written_in_place_stays_as_written():
    model = WrittenInPlace().double()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    cap = capture(model, (x,))
    assert _sets(cap) == []
    fused, joined = fuse_products(cap)
    assert not joined


def _run(cap, inputs):
    """The captured program's loss and its parameters' gradients, on the model's own tensors."""
    gm = cap.graph_module
    params = {n: p.detach().clone().requires_grad_() for n, p in _MODEL.named_parameters()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    for node in placeholders:
        if node.name in cap.param_names:
            values.append(params[cap.param_names[node.name]])
        elif node.name in cap.buffer_names:
            values.append(dict(_MODEL.named_buffers())[cap.buffer_names[node.name]])
        else:
            values.append(inputs.get(node.name))
    out = gm(*values)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in params.items() if p.grad is not None}


_MODEL = None


def test_llamas_q_k_v_and_gate_up_run_joined_and_compute_the_written_values_and_gradients():
    global _MODEL
    config = zoo.tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=4, vocab=64)
    _MODEL = zoo.build("llama", config, dtype=torch.float64, seed=3)
    batch = zoo.example_batch("llama", config, batch=2, seq=7, seed=4)
    cap = capture(_MODEL, example_kwargs=batch)
    sets = _sets(cap)
    assert sets == [tuple(f"model.layers.{i}.{m}.weight" for m in ms) for i in range(2) for ms in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                               ("mlp.gate_proj", "mlp.up_proj"))]
    fused, what = fuse_products(cap)
    assert [f.nodes for f in what] == [3, 2, 3, 2]
    products = lambda c: sum(n.target is aten.linear.default for n in c.graph.nodes)   # noqa: E731
    assert (products(cap), products(fused)) == (2 * 7 + 1, 2 * 4 + 1)
    assert cap.graph is not fused.graph and fuse_products(cap)[0] is fused   # the capture kept, memoized
    loss, grads = _run(cap, batch)
    loss_f, grads_f = _run(fused, batch)
    torch.testing.assert_close(loss_f, loss, rtol=1e-12, atol=0)
    assert grads.keys() == grads_f.keys() and len(grads) == len(list(_MODEL.parameters()))
    for name in grads:
        torch.testing.assert_close(grads_f[name], grads[name], rtol=1e-10, atol=1e-13)


def test_a_mixtures_experts_are_not_joined():
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=4, vocab=64)
    model = zoo.build("mixtral", config, dtype=torch.float32, seed=1)
    cap = capture(model)
    sets = _sets(cap)
    assert [len(s) for s in sets] == [3] and all("self_attn" in name for name in sets[0]), sets


def test_the_joined_weight_splits_as_each_ranks_run_of_every_siblings_heads():
    # grouped-query attention: 8 query heads beside 2 kv heads of 4; at tp 2 each rank holds a
    # kv head with its 4 query heads, and joins its own shards: its rows of the joined weight
    # are its q rows, then its k rows, then its v rows (Megatron's fused layout)
    config = zoo.tiny_config("llama", layers=1, heads=8, kv_heads=2, head_dim=4, vocab=64)
    model = zoo.build("llama", config, dtype=torch.float32, seed=1, device="meta")
    cap = capture(model)
    layout = {"*q_proj.weight": "column", "*k_proj.weight": "column", "*v_proj.weight": "column"}
    plan, index, prop = build_plan(cap, 2, batch=64, seq=32, profile="h100-dgx", layout=layout, fuse_products=True)
    cat = next(n for n in index.capture.graph.nodes if n.target is aten.cat.default
               and all(a.op == "placeholder" for a in n.args[0]))
    joined = prop.placements[cat]
    assert isinstance(joined, Shard) and joined.sizes == (4, 1, 1), joined
    names = ["q_proj", "k_proj", "v_proj"]
    shards = [plan.params[f"model.layers.0.self_attn.{m}.weight"] for m in names]
    sizes = [32, 8, 8]
    for rank in range(2):
        want, start = [], 0
        for n, s in zip(sizes, shards):
            want += [(a + start, b + start) for a, b in local_ranges(n, s, 2, rank)]
            start += n
        assert list(local_ranges(48, joined, 2, rank)) == want
    assert [tuple(local_ranges(32, shards[0], 2, r)) for r in range(2)] == [((0, 16),), ((16, 32),)]


def test_the_plan_joins_them_where_it_pays_and_keeps_them_apart_where_the_join_costs_more():
    # Llama-3-8B's layer (bf16) at tp 8 on 2 x 4096 tokens: the rank's products are narrow and x's
    # gradient is summed by three full-size adds: joined, the predicted step faster than apart
    model = zoo.build("llama", zoo.published_config("llama-3-8b", layers=1), device="meta", dtype=torch.bfloat16)
    cap = capture(model)
    split, _, _ = build_plan(cap, 8, batch=2, seq=4096, profile="h200", fuse_products=True)
    assert any(n.startswith("sibling products fused: 1 x 3 products of one input (4096+1024+1024 rows: "
                            "model.layers.0.self_attn)") for n in split.notes), split.notes
    assert not any(n.startswith("sibling products kept apart") for n in split.notes), split.notes
    apart = build_plan(cap, 8, batch=2, seq=4096, profile="h200", fuse_products=False)[0]
    assert split.compute_s + split.comm_s < apart.compute_s + apart.comm_s


def test_the_cheaper_of_joined_and_apart_is_kept():
    from types import SimpleNamespace

    from autotp.planner.siblings import fused_cheaper

    config = zoo.tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=4, vocab=64)
    cap = capture(zoo.build("llama", config, dtype=torch.float32, seed=1, device="meta"))

    def attempt(joined_costs):
        def run(c):
            joins = sum(n.target is aten.cat.default and n.args[0][0].op == "placeholder" for n in c.graph.nodes)
            return (SimpleNamespace(params={}), SimpleNamespace(apart=None),
                    SimpleNamespace(total_s=1.0 + joins * joined_costs))
        return run

    (_, index, prop), fused, note = fused_cheaper(cap, 1, None, attempt(+0.1))
    assert (prop.total_s, fused) == (1.0, [])
    assert note.startswith("sibling products kept apart: 4 sets (joined, the predicted step is slower"), note
    assert len(index.apart) == 4    # the sets kept apart, recorded for a rank that rebuilds the plan
    (_, index, prop), fused, note = fused_cheaper(cap, 1, None, attempt(-0.1))
    assert round(prop.total_s, 6) == 0.6 and len(fused) == 4 and note is None and index.apart == frozenset()
    # decided already (another rank's choice): that capture alone is attempted
    (_, index, prop), fused, _ = fused_cheaper(cap, 1, None, attempt(+0.1), only=frozenset())
    assert round(prop.total_s, 6) == 1.4 and len(fused) == 4 and index.apart == frozenset()


def test_a_solver_failure_is_said_and_planned_the_other_way_and_raised_when_none_plans(caplog):
    # a SolverError (the solver's plan does not replay: a bug) on the joined capture was taken for
    # "no plan this way", silently: tp 1 ran every set apart (9535864). Now it is logged as a bug
    # where the other way plans, and raised, before a plain PlanError, where none does
    from types import SimpleNamespace

    from autotp.errors import PlanError, SolverError
    from autotp.planner.siblings import fused_cheaper

    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=2, head_dim=4, vocab=64)
    cap = capture(zoo.build("llama", config, dtype=torch.float32, seed=1, device="meta"))

    def attempt(joined: Exception, apart: Exception | None = None):
        def run(c):
            if any(n.target is aten.cat.default and n.args[0][0].op == "placeholder" for n in c.graph.nodes):
                raise joined
            if apart is not None:
                raise apart
            return SimpleNamespace(params={}), SimpleNamespace(apart=None), SimpleNamespace(total_s=1.0)
        return run

    with caplog.at_level("WARNING", logger="autotp.planner.siblings"):
        (_, index, _), fused, _ = fused_cheaper(cap, 2, None, attempt(SolverError("internal: no replay")))
    assert fused == [] and len(index.apart) == 2
    assert "internal: no replay" in caplog.text and "bug in autotp" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="autotp.planner.siblings"):
        fused_cheaper(cap, 2, None, attempt(PlanError("no plan joined")))
    assert caplog.text == ""   # a plain "no plan this way" is no bug
    with pytest.raises(SolverError, match="internal: no replay"):
        fused_cheaper(cap, 2, None, attempt(SolverError("internal: no replay"), PlanError("no plan apart")))
    with pytest.raises(SolverError, match="internal: apart"):
        fused_cheaper(cap, 2, None, attempt(PlanError("no plan joined"), SolverError("internal: apart")))


def test_the_op_by_op_walk_never_gathers_a_joined_weight():
    # A later program (an inference call, a decode step) replays its plan op by op (propagate
    # without the solver's choices). A joined weight is its weights' shards, as a parameter is:
    # gathered, it would move them each step (priced forward only) and run the product whole. Before,
    # the walk gathered OLMo-2's q|k|v (column-pinned, tp 8) for a product run whole, a plan the
    # solver never takes (so "the solver is no dearer than the walk" failed), and gpt-oss's decode
    # step returned its key cache whole where it takes it split by head (a PlanError in generate)
    from autotp.cost_model.devices import get_profile
    from autotp.passes.propagate import GraphIndex, propagate
    from autotp.testing.host import MEGATRON

    config = zoo.tiny_config("olmo2", layers=1, heads=8, kv_heads=8, head_dim=16, vocab=128, positions=64)
    model = zoo.build("olmo2", config, device="meta", dtype=torch.bfloat16)
    cap, fused = fuse_products(capture(model))
    assert fused
    index = GraphIndex.build(cap, 8, 2, 16, uneven=True)
    column = [k[1:] for k, role in MEGATRON["llama"].items() if role == "column"]   # "*q_proj.weight" -> suffix
    pins = {p: Shard(0) for p, fqn in cap.param_names.items() if fqn.endswith(tuple(column))}
    assert len(pins) == 5, pins
    walk = propagate(index, pins, get_profile("h200"))
    joined = {n.name for n in cap.graph.nodes if n.target is aten.cat.default
              and all(a.op == "placeholder" and a.name in cap.param_names for a in n.args[0])}
    assert len(joined) == 2 and walk.infeasible is None
    assert [c for c in walk.comms if c.tensor in joined] == [], walk.comms
    for name in joined:   # each runs as the rank's shards joined: split along the joined rows
        placed = next(p for n, p in walk.placements.items() if n.name == name)
        assert isinstance(placed, Shard) and placed.dim == 0, placed


def test_a_pin_on_a_joined_weight_means_its_parameter_and_a_set_pinned_unalike_runs_apart():
    # Llama-4's router reads the post-attention norm's output, as its shared expert's gate and up
    # do: a set of three. A layout pinning the router row-parallel (as the solver takes it at
    # Llama-4-Scout's size) and the gate and up column-parallel: the pin's role is read off the
    # product that reads the router's weight (before, off the join, where "row" named nothing: a
    # ConfigError), and a joined weight splits along its rows alone, so that set runs apart (a note
    # says why) while the attention's q, k and v, pinned alike, run joined
    config = zoo.tiny_config("llama4", layers=2, heads=4, kv_heads=2, head_dim=8, vocab=64, positions=64)
    model = zoo.build("llama4", config, device="meta")
    layout = {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
              "*.o_proj.weight": "row", "*.shared_expert.gate_proj.weight": "column",
              "*.shared_expert.up_proj.weight": "column", "*.shared_expert.down_proj.weight": "row",
              "*.router.weight": "row"}
    plan, index, _ = build_plan(capture(model), 2, batch=8, seq=32, layout=layout)
    for layer in range(2):
        ff = f"model.layers.{layer}.feed_forward"
        assert plan.params[f"{ff}.router.weight"] == Shard(1), plan.params[f"{ff}.router.weight"]
        assert plan.params[f"{ff}.shared_expert.gate_proj.weight"].dim == 0
    assert any(n.startswith("sibling products fused: 2 x 3 products of one input") for n in plan.notes), plan.notes
    assert "sibling products kept apart: 2 sets (the layout pins their weights differently)" in plan.notes, plan.notes
    joined = [n for n in index.capture.graph.nodes if n.target is aten.cat.default
              and all(a.op == "placeholder" for a in n.args[0])]
    assert {index.capture.param_names[n.args[0][0].name].rsplit(".", 2)[-2] for n in joined} == {"q_proj"}


def test_at_tp_1_a_joined_capture_is_planned_and_replayed():
    # At tp 1 the join ``cat`` is offered whole alone; the solver once sliced it to the product's
    # blocks there (a slice of a whole join looked local), which the walk refuses for a join (a
    # join is placed where it is made): the plan did not replay, an internal PlanError, which the
    # planner took for "no plan this way" (tp 1 ran every set apart) and, under a memory limit,
    # raised in place of the MemoryLimitError
    import autotp
    from autotp.errors import MemoryLimitError

    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=4, head_dim=8, vocab=64, positions=32)
    model = zoo.build("llama", config, device="meta", dtype=torch.float32)
    fused_cap, fused = fuse_products(capture(model, (), None), frozenset())
    assert fused
    plan, _, _ = build_plan(fused_cap, 1, batch=8, seq=32, fuse_products=False)
    assert all(c.fwd_bytes == c.bwd_bytes == 0 for c in plan.comms), plan.comms   # one rank sends nothing
    whole = autotp.plan(model, 1, batch=8, seq=32)
    try:
        autotp.plan(model, 1, batch=8, seq=32, memory_limit=whole.memory_bytes * 0.8)
    except MemoryLimitError as exc:
        assert "no plan fits the memory limit" in str(exc)
    else:
        raise AssertionError("a limit under tp 1's only plan was met")
