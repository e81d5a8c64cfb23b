"""Outlining (autotp.runtime.module.outline): a program's repeated layers cut into calls of the modules
that hold their parameters, computing what the program did; programs that cannot be cut so are
refused with the fix. One process: the program is a capture's own graph."""
import pytest
import torch
from torch import fx, nn

from autotp.capture import capture, flat_inputs, unflatten_outputs
from autotp.errors import ConfigError
from autotp.runtime.module.state import put_named
from autotp.runtime.module.outline import LayerCall, layer_paths, outline


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, layers=3, reread=False, revisit=False):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(6, 2)
        self.reread, self.revisit = reread, revisit

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        if self.revisit:   # layer 0 again, after the others: its ops interleave with theirs
            h = self.layers[0](h)
        out = self.head(h)
        if self.reread:    # a layer's parameter read by the parent
            out = out + self.layers[1].lin.bias.sum()
        return out


def outlined(model):
    """The model's capture with its layers outlined into calls of parameter trees that hold the
    model's parameters, as a ParallelModule holds them."""
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    tree = nn.Module()
    for name, p in model.named_parameters():
        put_named(tree, name, p)
    units = {path: tree.get_submodule(path) for path in layer_paths(model)}
    order = list(cap.param_names.values())
    gm, done = outline(cap.graph_module, order, list(units), units)
    return cap, gm, done, order, x


def test_layers_become_calls_of_their_parameter_trees_and_compute_the_same():
    model = Net().double()
    cap, gm, done, order, x = outlined(model)
    assert layer_paths(model) == ["layers.0", "layers.1", "layers.2"]
    calls = [m for m in gm.modules() if isinstance(m, LayerCall)]
    assert len(calls) == 3 and all(set(c.names) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias"}
                                   for c in calls)
    assert done == {n for n in order if n.startswith("layers.")}
    # the program is fed no layer parameter: each layer call reads its tree's
    params = dict(model.named_parameters())
    fed = [None if name in done else params[name] for name in order]
    got = unflatten_outputs(cap, gm(*fed, *flat_inputs(cap, {"x": x})))
    want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-12)
    # no op of a layer is left in the program itself
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "layers" in str(n.meta.get("nn_module_stack"))]


def test_a_parameter_read_outside_its_layer_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"cannot outline layers\.1: its parameter layers\.1\.lin\.bias is read "
                                          r"outside the layer's ops.*per_layer=False"):
        outlined(Net(reread=True).double())


def test_layers_whose_ops_interleave_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"cannot outline layers\.0 and layers\.1: their ops interleave.*per_layer=False"):
        outlined(Net(revisit=True).double())


def test_a_refused_program_is_left_as_it_was():
    model = Net(reread=True).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    before = [(n.name, n.op, str(n.target), str(n.args)) for n in cap.graph.nodes]
    units = {path: model.get_submodule(path) for path in layer_paths(model)}
    with pytest.raises(ConfigError):
        outline(cap.graph_module, list(cap.param_names.values()), list(units), units)
    assert [(n.name, n.op, str(n.target), str(n.args)) for n in cap.graph.nodes] == before
    assert isinstance(cap.graph_module, fx.GraphModule)


def test_a_layer_whose_ops_carry_no_module_path_is_refused_with_the_fix():
    """A program whose ops lost their module paths: a layer's parameters are read, its ops not
    found; refused, rather than fed parameters FSDP2 never gathered."""
    model = Net().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    for n in cap.graph.nodes:
        n.meta.pop("nn_module_stack", None)
    units = {path: model.get_submodule(path) for path in layer_paths(model)}
    with pytest.raises(ConfigError, match=r"cannot outline layers\.0: the program reads its parameters.*per_layer=False"):
        outline(cap.graph_module, list(cap.param_names.values()), list(units), units)


class Copy(nn.Module):
    """An identity over a parameter, as the rewrite's f is in forward (a module with no module path)."""

    def forward(self, x):
        return x * 1.0


def test_a_conversion_of_a_layers_parameter_made_right_before_its_first_op_joins_the_layer():
    """The rewrite's f over a replicated norm weight that a sequence-parallel norm reads carries
    no module path and sits right before the layer's first op (gpt-bigcode's and falcon-new's
    first norm at tp 2): it is the layer's, outlined with it, not a read of the layer's parameter
    outside the layer (refused before: per-layer FSDP could not run these families)."""
    from autotp.capture import layer_of

    model = Net().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    gm, graph = cap.graph_module, cap.graph
    order = list(cap.param_names.values())
    params = dict(zip(order, (n for n in graph.nodes if n.op == "placeholder")))
    layers = layer_paths(model)
    for i, layer in enumerate(layers):
        first = next(n for n in graph.nodes if n.op == "call_function" and layer_of(n, layers) == layer)
        weight = params[f"{layer}.norm.weight"]
        gm.add_module(f"f_{i}", Copy())
        with graph.inserting_before(first):
            f = graph.call_module(f"f_{i}", (weight,))
        weight.replace_all_uses_with(f, delete_user_cb=lambda user, f=f: user is not f)
    gm.recompile()
    tree = nn.Module()
    for name, p in model.named_parameters():
        put_named(tree, name, p)
    units = {path: tree.get_submodule(path) for path in layers}
    gm, done = outline(gm, order, layers, units)
    calls = [m for m in gm.modules() if isinstance(m, LayerCall)]
    assert len(calls) == 3 and all("norm.weight" in c.names for c in calls)
    assert all(any(n.op == "call_module" and n.target.startswith("f_") for n in c.block.graph.nodes) for c in calls)
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("f_")]
    named = dict(model.named_parameters())
    fed = [None if name in done else named[name] for name in order]
    got = unflatten_outputs(cap, gm(*fed, *flat_inputs(cap, {"x": x})))
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=1e-12)


def test_a_family_whose_first_norm_is_sequence_parallel_is_outlined_at_tp_2():
    """gpt-bigcode at tp 2, planned for 64 x 4096 on h100-dgx (the family stack's plan): its
    layers' first norms run sequence-parallel, their weights read through an f made right before
    them; every program of the rank is cut layer by layer (one rank on the fake backend; refused
    before with "its parameter transformer.h.0.ln_1.weight is read outside the layer's ops")."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp
    from autotp import zoo
    from autotp.capture import layer_of

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        config = zoo.tiny_config("gpt-bigcode", layers=2, heads=4, kv_heads=2, head_dim=4, vocab=50, positions=64)
        pm = autotp.parallelize(zoo.build("gpt-bigcode", config, dtype=torch.float64, seed=3), 2,
                                profile="h100-dgx", batch=64, seq=4096)
        layers = list(pm._layers)
        before = set()   # (layer, parameter) read through a node of no layer placed before the layer's first op
        for program in pm._programs:
            nodes = list(program.graph_module.graph.nodes)
            fqn = dict(zip((n for n in nodes if n.op == "placeholder"), program.param_order))
            start = {}
            for i, n in enumerate(nodes):
                if (layer := layer_of(n, layers)) is not None:
                    start.setdefault(layer, i)
            for p, name in fqn.items():
                for layer in layers:
                    if name.startswith(layer + ".") and any(nodes.index(u) < start[layer] for u in p.users):
                        before.add((layer, name))
            outline(program.graph_module, program.param_order, layers, {}, check_only=True)
        assert ("transformer.h.0", "transformer.h.0.ln_1.weight") in before, sorted(before)
    finally:
        dist.destroy_process_group()
