"""An f or a g reduces in place exactly where nothing else reads the tensor it overwrites.

Hypothesis draws small rank programs around one g (the producer of its partial, views between,
another reader of the partial) or one f (the readers of its output): the pass
(:mod:`autotp.passes.in_place`) marks the module in place where the rule says, and on a real tp-2
gloo group the program's outputs and gradients equal, bit for bit, those of the same program with
every all-reduce into a new tensor (float64). Forced where the rule refuses, the in-place reduce
is wrong or fails: the refusals are needed.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import fx, nn

from autotp.distributed import comm_modules
from autotp.distributed.mesh import get_mesh
from autotp.passes.in_place import reduce_in_place

aten = torch.ops.aten
N, K, M = 3, 4, 5   # x [N, K] @ w [K, M]

#: g: producers whose result no backward keeps (in place) and ones whose result is saved
G_PRODUCERS = {"mm": True, "add": True, "relu": False, "exp": False}
#: g: another reader of the partial (none; a residual add after the g; the graph's output)
G_READERS = {"none": True, "residual": False, "output": False}
#: g: a cast between the producer and the g, walked through as a view: ``to`` the partial's own
#: dtype (the partial itself: GPT-2's logits' ``.float()``), ``to`` another dtype and ``_to_copy``
#: (a new tensor whose backward saves nothing)
G_CASTS = {"none": None, "to_same": (aten.to.dtype, (torch.float64,), {}),
           "to_float32": (aten.to.dtype, (torch.float32,), {}),
           "copy": (aten._to_copy.default, (), {"dtype": torch.float64})}
#: f: readers of its output whose backward makes a new gradient for it (True) or may pass it on
F_READERS = {"mm": True, "view_mm": True, "mul": True, "bias_add": True,
             "add": False, "relu": False, "output": False}


def _tensor(seed: int, shape, *key) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def g_program(group, producer: str, views: int, reader: str, cast: str = "none") -> fx.GraphModule:
    """loss inputs (x, w, b) -> (g of the partial x @ w [+ b | relu | exp], cast, extra readers)."""
    graph, root = fx.Graph(), nn.Module()
    x, w, b = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("b")
    partial = graph.call_function(aten.mm.default, (x, w))
    if producer == "add":
        partial = graph.call_function(aten.add.Tensor, (partial, b))
    elif producer != "mm":
        partial = graph.call_function(getattr(aten, producer).default, (partial,))
    node = partial
    if G_CASTS[cast] is not None:
        op, args, kwargs = G_CASTS[cast]
        node = graph.call_function(op, (node, *args), kwargs)
    for i in range(views):   # [N, M] -> [N * M] -> [N, M] -> ...
        node = graph.call_function(aten.view.default, (node, [N * M] if i % 2 == 0 else [N, M]))
    root.add_module("g_0", comm_modules.ReduceFromTP(group))
    out = graph.call_module("g_0", (node,))
    if views % 2:
        out = graph.call_function(aten.view.default, (out, [N, M]))
    if reader == "residual":   # reads the partial after the g has summed it
        out = graph.call_function(aten.add.Tensor, (out, partial))
    graph.output((out, partial) if reader == "output" else (out,))
    return fx.GraphModule(root, graph)


def f_program(group, readers: tuple[str, ...]) -> fx.GraphModule:
    """(x [N, K], w [K, M], z [N, K], z3 [2, N, K]) -> the f of x, read by each of ``readers``."""
    graph, root = fx.Graph(), nn.Module()
    x, w, z, z3 = (graph.placeholder(n) for n in ("x", "w", "z", "z3"))
    for node, ndim in ((x, 2), (w, 2), (z, 2), (z3, 3)):
        node.meta["autotp_ndim"] = ndim   # what the rewrite records from the captured graph
    # made before the f, so its backward runs after the f's: it reads the gradient the add hands
    # to both of its operands after the f has reduced it, were that in place
    zz = graph.call_function(aten.mul.Tensor, (z, z))
    root.add_module("f_0", comm_modules.CopyToTP(group))
    f = graph.call_module("f_0", (x,))
    outs = []
    for kind in readers:
        if kind == "mm":
            outs.append(graph.call_function(aten.mm.default, (f, w)))
        elif kind == "view_mm":
            flat = graph.call_function(aten.view.default, (f, [N * K]))
            outs.append(graph.call_function(aten.mm.default, (graph.call_function(aten.view.default, (flat, [N, K])), w)))
        elif kind == "mul":
            outs.append(graph.call_function(aten.mul.Tensor, (f, z)))
        elif kind == "bias_add":   # f's output broadcast over z3's first dim: its gradient is a sum
            outs.append(graph.call_function(aten.add.Tensor, (z3, f)))
            outs[-1].meta["autotp_ndim"] = 3
        elif kind == "add":   # add's backward hands one gradient to both operands
            outs.append(graph.call_function(aten.add.Tensor, (f, zz)))
        elif kind == "relu":
            outs.append(graph.call_function(aten.relu.default, (f,)))
        else:
            outs.append(f)
    for node in outs:
        node.meta.setdefault("autotp_ndim", 2)
    graph.output(tuple(outs))
    return fx.GraphModule(root, graph)


def run_program(kind: str, params: tuple, seed: int, force: bool | None = None) -> dict:
    """In a rank of a tp-2 group: the program's in-place marks, then its outputs and the gradients
    of its inputs, with the pass's marks and with every reduce into a new tensor (``force``: every
    f and g marked in place, or not, whatever the rule says)."""
    mesh = get_mesh(2)
    group, r = mesh.tp_group, mesh.tp_rank
    block = dist.get_rank() // 2
    results = {}
    for variant in ("pass", "copy"):
        gm = (g_program if kind == "g" else f_program)(group, *params)
        gm = reduce_in_place(gm)
        marks = {n: m.in_place for n, m in gm.named_children()}
        if variant == "copy" or force is not None:
            for m in gm.children():
                m.in_place = variant == "pass" and bool(force)
        if kind == "g":   # summands differ per rank; the replicated ones do not
            shapes = {"x": (N, K), "w": (K, M), "b": (N, M)}
            inputs = {k: _tensor(seed, s, k, block, r).requires_grad_() for k, s in shapes.items()}
        else:
            shapes = {"x": (N, K), "w": (K, M), "z": (N, K), "z3": (2, N, K)}
            inputs = {k: _tensor(seed, s, k, block).requires_grad_() for k, s in shapes.items()}
        try:
            outs = gm(*inputs.values())
            loss = sum((o * _tensor(seed, o.shape, "dy", i, block, r)).sum() for i, o in enumerate(outs))
            loss.backward()
        except RuntimeError as e:   # autograd's version check: a saved tensor written in place
            results[variant] = ("raised", str(e).splitlines()[0])
            continue
        results[variant] = ([o.detach().clone() for o in outs], [t.grad for t in inputs.values()])
        results["marks"] = marks
    return results


def _check(results: list, expected: bool, name: str) -> None:
    for res in results:
        assert res["marks"][name] is expected, res["marks"]
        (outs, grads), (want_outs, want_grads) = res["pass"], res["copy"]
        for got, want in zip(outs + grads, want_outs + want_grads):
            assert (got is None and want is None) or torch.equal(got, want)   # None: an unused input


@settings(max_examples=20, deadline=None)
@given(producer=st.sampled_from(sorted(G_PRODUCERS)), views=st.integers(0, 2),
       reader=st.sampled_from(sorted(G_READERS)), cast=st.sampled_from(sorted(G_CASTS)), seed=st.integers(0, 2**31 - 1))
@example(producer="mm", views=1, reader="residual", cast="none", seed=0)
@example(producer="relu", views=0, reader="none", cast="none", seed=0)
@example(producer="mm", views=1, reader="none", cast="to_same", seed=0)
@example(producer="mm", views=0, reader="residual", cast="to_same", seed=0)
@example(producer="exp", views=0, reader="none", cast="to_same", seed=0)
def test_a_g_reduces_in_place_only_a_fresh_unsaved_partial_that_it_alone_reads(cluster, producer, views, reader,
                                                                                   cast, seed):
    results = cluster.run(run_program, "g", (producer, views, reader, cast), seed)
    _check(results, G_PRODUCERS[producer] and G_READERS[reader], "g_0")


@settings(max_examples=20, deadline=None)
@given(readers=st.lists(st.sampled_from(sorted(F_READERS)), min_size=1, max_size=3, unique=True),
       seed=st.integers(0, 2**31 - 1))
@example(readers=["add"], seed=0)
@example(readers=["mm", "view_mm"], seed=0)
def test_an_f_reduces_in_place_only_a_gradient_that_no_other_formula_holds(cluster, readers, seed):
    results = cluster.run(run_program, "f", (tuple(readers),), seed)
    _check(results, all(F_READERS[k] for k in readers), "f_0")


@pytest.mark.parametrize("kind, params", [("g", ("mm", 0, "residual")), ("g", ("mm", 0, "output")),
                                          ("g", ("exp", 0, "none")), ("g", ("mm", 0, "residual", "to_same")),
                                          ("g", ("exp", 1, "none", "to_same")), ("f", (("add",),))])
def test_the_refused_cases_are_wrong_or_fail_when_forced_in_place(cluster, kind, params):
    # the rule's refusals matter: forced in place, a reader of the partial sees the sum, a saved
    # result raises autograd's version check, a gradient the add shared is summed for z too
    for res in cluster.run(run_program, kind, params, 3, True):
        forced, copied = res["pass"], res["copy"]
        if forced[0] == "raised":
            assert "modified by an inplace operation" in forced[1], forced
            continue
        assert not all(a is None or torch.equal(a, b) for a, b in zip(forced[0] + forced[1], copied[0] + copied[1]))


def test_a_vocab_parallel_embeddings_g_and_a_tied_head_reduce_in_place(fake_rank):
    # the lookup's rows held elsewhere are zeroed in place by a mask (autotp.distributed.functional):
    # a fresh tensor that no backward keeps, so its g sums it where it is
    import autotp
    from autotp import zoo
    from autotp.testing.work import CopyCounter

    config = zoo.tiny_config("gpt2", layers=1, vocab=48)
    model = zoo.build("gpt2", config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, 2, layout={"lm_head.weight": "vocab"})
    inputs = zoo.example_batch("gpt2", config, batch=2, seq=6, seed=2)
    pm(**inputs).loss.backward()
    code = pm.graph_module.code
    assert "vocab_parallel_embedding" in code
    reduces = [m for m in pm.graph_module.children()
               if isinstance(m, (comm_modules.CopyToTP, comm_modules.ReduceFromTP))]
    assert reduces and all(m.in_place for m in reduces), [(type(m).__name__, m.in_place) for m in reduces]
    with CopyCounter() as copies:
        pm(**inputs).loss.backward()
    assert not [c for c in copies.copies if c.site == "comm._all_reduce"], copies.copies


#: a layout per family for the checkpointed programs below (each an f and a g per product pair,
#: the embedding vocabulary-parallel), and the g refused: GPT-2's embedding g sits outside the
#: layers (its add and dropout do); Llama's, read first by layer 0's norm, joins layer 0, so it
#: sums an input of that layer, which the rule refuses under checkpointing
CHECKPOINTED = {
    "gpt2": ({"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
              "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}, set()),
    "llama": ({"*_proj.weight": "column", "*embed_tokens.weight": "vocab", "lm_head.weight": "vocab"}, {"g_0"}),
}
#: Llama's vocabulary large enough that its masked lookup (a partial, summed by g_0) is cheaper
#: than reading the table by columns (an all-to-all of the table, no g): at the tiny 96 the
#: cpu-gloo profile reads it by columns, and no g sums a layer's input
VOCAB = {"gpt2": 96, "llama": 4096}


def _reduces(gm) -> dict:
    """f and g module name (its last part: ``submod_1.inner.g_0`` is ``g_0``) -> in place."""
    return {n.rsplit(".", 1)[-1]: m.in_place for n, m in gm.named_modules()
            if isinstance(m, (comm_modules.CopyToTP, comm_modules.ReduceFromTP))}


def checkpointed_against_serial(family: str, b: int, s: int, seed: int) -> dict:
    """A rank of tp 2: the checkpointed program's errors against serial (float64, forward and every
    gradient), its f and g marks beside the unsplit program's, and the copies its all-reduces make
    in a training step."""
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors, keep_loss_precision
    from autotp.testing.work import CopyCounter

    layout, _ = CHECKPOINTED[family]
    config = zoo.tiny_config(family, layers=2, vocab=VOCAB[family])
    model = keep_loss_precision(zoo.build(family, config, dtype=torch.float64, seed=seed))
    inputs = zoo.example_batch(family, config, batch=b, seq=s, seed=seed + 1)
    plain = autotp.parallelize(model, 2, layout=layout)
    pm = autotp.parallelize(model, 2, layout=layout, activation_checkpointing=True)
    errors = equivalence_errors(model, pm, inputs)
    # a saved-tensor hook turns autograd's check of the kept inputs off: a layer input summed in
    # place is then recomputed from silently (the memory-mode tests' 3.5e-2), not an error
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        hooked = equivalence_errors(model, pm, inputs)
    errors.update({f"hooked {k}": v for k, v in hooked.items()})
    plain(**inputs)   # its program is written at the first call
    with CopyCounter() as copies:
        pm.zero_grad(set_to_none=True)
        out = pm(**inputs)
        out.loss.backward()
    reduced = [c.bytes for c in copies.copies if c.site == "comm._all_reduce"]
    return {"errors": errors, "checkpointed": _reduces(pm.graph_module), "plain": _reduces(plain.graph_module),
            "copied": reduced, "partial": b * s * config.hidden_size * 8}


@settings(max_examples=2, deadline=None, derandomize=True)
@given(family=st.sampled_from(sorted(CHECKPOINTED)), b=st.integers(1, 3), s=st.integers(2, 9),
       seed=st.integers(0, 99))
@example(family="llama", b=2, s=6, seed=0)
@example(family="gpt2", b=2, s=6, seed=0)
def test_under_checkpointing_a_g_reduces_in_place_only_a_partial_its_layer_makes(cluster_of, family, b, s, seed):
    # recomputation starts from the layer's inputs as checkpoint kept them: a g that summed one in
    # place (Llama's embedding g, in layer 0) would recompute the layer from tp times the partial
    for res in cluster_of(2).run(checkpointed_against_serial, family, b, s, seed):
        worst = max(res["errors"], key=res["errors"].get)
        assert res["errors"][worst] <= 1e-10, (worst, res["errors"][worst])
        refused = CHECKPOINTED[family][1]
        assert all(res["plain"][name] for name in refused), res["plain"]   # the unsplit rule marks it
        assert res["checkpointed"] == {n: mark and n not in refused for n, mark in res["plain"].items()}, res
        assert sum(res["checkpointed"].values()) >= 4, res["checkpointed"]   # the layers' f and g in place
        # the refused g copies its partial once in forward and once more in the recompute
        assert res["copied"] == [res["partial"]] * 2 * len(refused), res["copied"]
