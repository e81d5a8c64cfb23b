"""Cut and expand (autotp.capture.expand): a capture grown from three blocks is the whole export.

For each family the expanded capture is compared with a whole export of the same model: the
same graph node for node (names, ops, arguments, module paths), the same name maps, signature
and shape ranges, the same outputs (and the model's own, float64), and the same plan.
"""
import pytest
import torch
from torch import nn

from autotp.capture import export as capture_mod
from autotp import zoo
from autotp.planner import build_plan
from autotp.capture import capture, flat_inputs, module_path, unflatten_outputs
from autotp.capture.expand import KEEP, find_stacks

LAYERS = KEEP + 2   # two blocks written by the expansion: the recurrence runs copy to copy


def whole(model, **kwargs):
    before = capture_mod.EXPAND
    capture_mod.EXPAND = False
    try:
        return capture(model, **kwargs)
    finally:
        capture_mod.EXPAND = before


def nodes(cap):
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), module_path(n)) for n in cap.graph.nodes]


def run(cap, model, inputs):
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    params = [tensors[fqn] for fqn in cap.param_names.values()]
    buffers = [tensors[fqn] for fqn in cap.buffer_names.values()]
    constants = [cap.constants[name] for name in cap.constant_names.values()]
    flat = flat_inputs(cap, inputs)
    return unflatten_outputs(cap, cap.graph_module(*params, *buffers, *constants, *flat))


def assert_same_capture(fast, full):
    assert nodes(fast) == nodes(full)
    for field in ("param_names", "buffer_names", "constant_names", "user_inputs", "input_keys",
                  "constant_inputs", "range_constraints", "dim_symbols", "input_dims", "aliases", "training"):
        assert getattr(fast, field) == getattr(full, field), field
    assert fast.out_spec == full.out_spec
    shapes = {n.name: n.meta["val"].shape for n in full.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert {n.name: n.meta["val"].shape for n in fast.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)} == shapes


CASES = {   # family -> the stacks cut
    "gpt2": ("transformer.h",),
    "llama": ("model.layers",),   # rotary tables shared by every block, GQA, layer_idx per block
    "bert": ("bert.encoder.layer",),
    "t5": ("encoder.block", "decoder.block"),   # block 0 alone holds the relative attention bias
}


_captured: dict = {}


def captured(family):
    """(model, config, expanded capture, whole capture) of a tiny float64 model, once per module."""
    if family not in _captured:
        fam = zoo.FAMILIES[family]
        config = zoo.tiny_config(family, layers=LAYERS, heads=4, kv_heads=2 if fam.kv_heads else None)
        model = zoo.build(family, config, dtype=torch.float64)
        model.eval()
        seq_range = (3, 32) if family == "t5" else None   # T5 needs 3 tokens: no narrowing pass
        fast = capture(model, seq_range=seq_range)
        _captured[family] = (model, config, fast, whole(model, seq_range=seq_range))
    return _captured[family]


def _fast(families, slow=()):
    """The families as parameters, those in ``slow`` marked for the slow tier."""
    return [pytest.param(f, marks=pytest.mark.slow) if f in slow else f for f in families]


#: BERT's stack is cut as GPT-2's is (a plain list of alike blocks): the fast tier leaves its
#: captures (about 20 s on 2 cores) to the slow tier
SLOW_FAMILIES = ("bert",)


# T5's two stacks (12 s of whole and cut exports) in the slow tier: the fast tier's T5 family test
# (tests/e2e/test_families.py) runs its expanded capture against the serial model
@pytest.mark.parametrize("family", _fast(sorted(CASES), ("t5", *SLOW_FAMILIES)))
def test_expanded_capture_is_the_whole_export(family):
    model, config, fast, full = captured(family)
    assert fast.expanded == CASES[family]
    assert full.expanded == ()
    assert_same_capture(fast, full)
    # the model is whole again
    assert all(len(model.get_submodule(path)) == LAYERS for path in CASES[family])

    batch = zoo.example_batch(family, config, batch=2, seq=7)
    got, want = run(fast, model, batch), run(full, model, batch)
    with torch.no_grad():
        ref = model(**batch)
    for key in ("loss", "logits"):
        assert torch.equal(got[key], want[key])
        torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", _fast(sorted(CASES), ("t5", *SLOW_FAMILIES)))   # T5's solve takes 10 s
def test_expanded_capture_plans_as_the_whole_export(family):
    _, _, fast, full = captured(family)
    fast_plan, _, _ = build_plan(fast, 2, batch=8, seq=32, profile="h100-dgx")
    full_plan, _, _ = build_plan(full, 2, batch=8, seq=32, profile="h100-dgx")
    assert fast_plan.to_json() == full_plan.to_json()


def test_a_new_signature_is_expanded_too():
    """Another call (eval, no labels: no loss in the graph) of a model captured before."""
    config = zoo.tiny_config("gpt2", layers=LAYERS)
    model = zoo.build("gpt2", config, dtype=torch.float64).eval()
    ids = {"input_ids": torch.randint(0, config.vocab_size, (2, 11))}
    fast = capture(model, example_kwargs=ids)
    assert fast.expanded == ("transformer.h",)
    full = whole(model, example_kwargs=ids)
    assert_same_capture(fast, full)
    torch.testing.assert_close(run(fast, model, ids)["logits"], model(**ids).logits, rtol=1e-9, atol=1e-9)


@pytest.fixture
def keeps(monkeypatch):
    """The number of blocks each expanded capture was cut to, in order."""
    from autotp.capture import expand as capture_expand

    seen = []
    real = capture_expand.expand

    def spy(ep, model, stacks, keep=capture_expand.KEEP, **kwargs):
        out = real(ep, model, stacks, keep, **kwargs)
        seen.append(keep)
        return out

    monkeypatch.setattr(capture_expand, "expand", spy)
    return seen


# T5 (12 s) and Llama (GPT-2's one-block cut, with rotary tables and GQA) in the slow tier
@pytest.mark.parametrize("family", _fast(sorted(CASES), ("t5", "llama", *SLOW_FAMILIES)))
def test_a_later_signature_cuts_to_one_block(family, keeps):
    """Once a model's first capture checked three blocks and learned how its blocks are called,
    another call of it is cut to one block where block 0 is alike the rest (not T5's), and is
    still the whole export, node for node."""
    fam = zoo.FAMILIES[family]
    config = zoo.tiny_config(family, layers=LAYERS, heads=4, kv_heads=2 if fam.kv_heads else None)
    model = zoo.build(family, config, dtype=torch.float64).eval()
    seq_range = (3, 32) if family == "t5" else None
    first = capture(model, seq_range=seq_range)
    batch = zoo.example_batch(family, config, batch=2, seq=7)
    if family != "t5":   # T5 reads its decoder's inputs off the labels
        batch.pop("labels")   # another call: no labels, no loss
    fast = capture(model, example_kwargs=batch, seq_range=seq_range)
    assert first.expanded == fast.expanded == CASES[family]
    assert keeps == [KEEP, KEEP if family == "t5" else 1]
    assert_same_capture(fast, whole(model, example_kwargs=batch, seq_range=seq_range))
    got = run(fast, model, batch)
    with torch.no_grad():
        want = model(**batch)
    torch.testing.assert_close(got["logits"], want.logits, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_every_family_cut_to_one_block_is_its_whole_export(family, keeps):
    """Every zoo family: first captured in train mode with labels, then called in eval mode
    without them. Where the first capture expanded and block 0 is alike the rest, the second is
    cut to one block; whatever the cut, it is the whole export node for node and equals the model."""
    fam = zoo.FAMILIES[family]
    config = zoo.tiny_config(family, layers=LAYERS, heads=4, kv_heads=2 if fam.kv_heads else None)
    model = zoo.build(family, config, dtype=torch.float64).train()
    seq_range = (3, 32) if family == "t5" else None
    first = capture(model, seq_range=seq_range)
    model.eval()
    batch = zoo.example_batch(family, config, batch=2, seq=7)
    if family != "t5":
        batch.pop("labels", None)
    fast = capture(model, example_kwargs=batch, seq_range=seq_range)
    if first.expanded and all(s.uniform for s in find_stacks(model)):
        assert keeps[-1] == 1
    assert_same_capture(fast, whole(model, example_kwargs=batch, seq_range=seq_range))
    with torch.no_grad():
        want = model(**batch)
    torch.testing.assert_close(run(fast, model, batch)["logits"], want.logits, rtol=1e-9, atol=1e-9)


def test_a_train_mode_model_is_cut_to_one_block_in_eval(keeps):
    """The first capture in train mode (dropout in every block), the next in eval mode: the
    block's ops differ, its call does not (both pass a mask: a call without one gives every
    block no mask, a constant, which a later call's mask tensor does not fit), and one block
    is enough."""
    config = zoo.tiny_config("gpt2", layers=LAYERS)
    config.resid_pdrop = config.attn_pdrop = config.embd_pdrop = 0.1
    model = zoo.build("gpt2", config, dtype=torch.float64).train()
    ids = {"input_ids": torch.randint(0, config.vocab_size, (2, 9)),
           "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])}
    capture(model, example_kwargs=ids)
    model.eval()
    fast = capture(model, example_kwargs=ids)
    assert keeps == [KEEP, 1]
    assert_same_capture(fast, whole(model, example_kwargs=ids))
    torch.testing.assert_close(run(fast, model, ids)["logits"], model(**ids).logits, rtol=1e-9, atol=1e-9)


@pytest.mark.slow   # 25 s of the fast tier (two whole exports); an edge of the expansion
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_a_call_that_returns_every_block_is_captured_whole(flag, keeps):
    """A model set to return each block's hidden state (or attention weights): HuggingFace
    hooks every module the forward runs, once; a cut export would hook the kept blocks alone.
    The capture is the whole export, and every block is hooked."""
    config = zoo.tiny_config("gpt2", layers=LAYERS)
    config._attn_implementation = "eager"   # sdpa returns no attention weights
    model = zoo.build("gpt2", config, dtype=torch.float64).eval()
    capture(model)
    setattr(model.config, flag, True)
    ids = {"input_ids": torch.randint(0, config.vocab_size, (2, 6))}
    cap = capture(model, example_kwargs=ids)
    assert keeps == [KEEP] and cap.expanded == ()   # the first capture alone was cut
    # the cut exports took off the hooks the forward put on the kept blocks alone
    assert all(m._forward_hooks for m in model.transformer.h)
    assert_same_capture(cap, whole(model, example_kwargs=ids))
    got, want = run(cap, model, ids), model(**ids)
    key = flag.removeprefix("output_")
    assert len(got[key]) == len(want[key]) == LAYERS + (key == "hidden_states")
    for g, w in zip(got[key], want[key]):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_training_mode_dropout_is_expanded():
    """Train mode: every block's dropout ops are in the graph, each block's its own."""
    config = zoo.tiny_config("gpt2", layers=LAYERS)
    config.resid_pdrop = config.attn_pdrop = config.embd_pdrop = 0.1
    model = zoo.build("gpt2", config, device="meta").train()
    fast = capture(model)
    assert fast.expanded == ("transformer.h",) and fast.training
    full = whole(model)
    assert_same_capture(fast, full)
    dropouts = [module_path(n) for n in fast.graph.nodes if n.target is torch.ops.aten.dropout.default]
    assert sum(p.startswith(f"transformer.h.{LAYERS - 1}.") for p in dropouts) == 2


class Block(nn.Module):
    def __init__(self, width: int, index: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.index = index   # counts with the block: allowed to differ

    def forward(self, x, bias=None):
        if bias is not None:
            x = x + bias
        return x + torch.tanh(self.lin(x))


class EvalConstant(Block):
    """Adds its index in eval mode only, as a tensor made in forward: a lifted constant per block."""

    def forward(self, x, bias=None):
        if not self.training:
            x = x + torch.tensor(float(self.index), dtype=x.dtype)
        return super().forward(x, bias)


class Shrinking(Block):
    """Drops the last position: each block's output is shorter than its input."""

    def forward(self, x, bias=None):
        return super().forward(x, bias)[:, :-1]


class Toy(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = 8, odd_scale: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, i) for i in range(layers))
        self.odd_scale = odd_scale

    def forward(self, x, bias=None, collect=False):
        outs = []
        for i, block in enumerate(self.blocks):
            x = block(x, bias)
            outs.append(x)
            if self.odd_scale and i % 2:   # the parent treats blocks 1 and 2 differently
                x = x * 2
        return torch.stack(outs).sum(-1) if collect else x.sum(-1)


def _toy_capture(model):
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    return capture(model, example_kwargs={"x": x}), x


def test_a_plain_stack_is_expanded():
    model = Toy().double()
    cap, x = _toy_capture(model)
    assert cap.expanded == ("blocks",)
    assert_same_capture(cap, whole(model, example_kwargs={"x": x}))
    torch.testing.assert_close(run(cap, model, {"x": x}), model(x), rtol=1e-12, atol=1e-12)


def test_blocks_the_parent_treats_differently_are_captured_whole(keeps):
    model = Toy(odd_scale=True).double()
    cap, x = _toy_capture(model)
    assert cap.expanded == ()   # block 2's segment does not repeat block 1's (no x * 2 after it)
    assert_same_capture(cap, whole(model, example_kwargs={"x": x}))
    assert len(model.blocks) == LAYERS
    # cut to two blocks, block 1 would repeat block 0 (the x * 2 after block 1 is not in its
    # segment): a model the three-block check refused is never cut to two
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    again = capture(model, example_kwargs={"x": x}, dynamic=False)
    assert again.expanded == () and keeps == []
    torch.testing.assert_close(run(again, model, {"x": x}), model(x), rtol=1e-12, atol=1e-12)


def test_a_plain_stack_is_cut_to_one_block_the_second_time(keeps):
    model = Toy().double()
    _toy_capture(model)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    assert keeps == [KEEP, 1] and cap.expanded == ("blocks",)
    assert_same_capture(cap, whole(model, example_kwargs={"x": x}, dynamic=False))
    torch.testing.assert_close(run(cap, model, {"x": x}), model(x), rtol=1e-12, atol=1e-12)


def test_a_block_argument_the_first_call_did_not_pass_cuts_to_two(keeps):
    """The first capture passed each block None for ``bias``; a call that passes a tensor there
    is not the template's call: cut to two blocks instead, where block 1 shows the bias shared."""
    model = Toy().double()
    _toy_capture(model)
    x, bias = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x, "bias": bias}, dynamic=False)
    assert keeps == [KEEP, 2] and cap.expanded == ("blocks",)
    assert_same_capture(cap, whole(model, example_kwargs={"x": x, "bias": bias}, dynamic=False))
    torch.testing.assert_close(run(cap, model, {"x": x, "bias": bias}), model(x, bias), rtol=1e-12, atol=1e-12)


def test_a_call_that_reads_every_block_is_not_cut_to_one(keeps):
    """``collect=True`` returns every block's output: block 0's result is read after the stack
    once more than the template's capture read it, so one block cannot stand for the rest."""
    model = Toy().double()
    _toy_capture(model)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x, "collect": True})
    assert 1 not in keeps and cap.expanded == ()
    assert_same_capture(cap, whole(model, example_kwargs={"x": x, "collect": True}))
    torch.testing.assert_close(run(cap, model, {"x": x, "collect": True}), model(x, collect=True),
                               rtol=1e-12, atol=1e-12)


def test_a_constant_made_in_each_block_is_not_read_off_block_0(keeps):
    """Trained first, then called in eval mode, where each block adds a tensor of its own index
    made in forward (a lifted constant per block): one block cannot show the constants differ,
    so it is not cut to one, and the capture is the whole export."""
    model = Toy().double().train()
    model.blocks = nn.ModuleList(EvalConstant(8, i) for i in range(LAYERS)).double()
    _toy_capture(model)
    model.eval()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    assert keeps == [KEEP] and cap.expanded == ()
    assert_same_capture(cap, whole(model, example_kwargs={"x": x}, dynamic=False))
    torch.testing.assert_close(run(cap, model, {"x": x}), model(x), rtol=1e-12, atol=1e-12)


def test_blocks_that_change_the_shape_are_not_copied():
    """Each block drops a position: block 2's values have other shapes than block 1's, so the
    copies (which take one block's shapes) cannot stand for the rest; captured whole."""
    model = Toy().double()
    model.blocks = nn.ModuleList(Shrinking(8, i) for i in range(LAYERS)).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    cap = capture(model, example_kwargs={"x": x}, dynamic=False)
    assert cap.expanded == ()
    assert_same_capture(cap, whole(model, example_kwargs={"x": x}, dynamic=False))
    torch.testing.assert_close(run(cap, model, {"x": x}), model(x), rtol=1e-12, atol=1e-12)


def test_stacks_that_are_not_alike_are_not_cut():
    model = Toy()
    model.blocks[3].lin = nn.Linear(8, 8, bias=False)     # another parameter set
    assert find_stacks(model) == []
    model = Toy()
    model.blocks[3].index = 7                              # does not count with the block
    assert find_stacks(model) == []
    model = Toy()
    model.blocks[4].lin.weight = model.blocks[3].lin.weight   # tied across blocks
    assert find_stacks(model) == []
    model = Toy()
    model.blocks[2].register_forward_hook(lambda *a: None)
    assert find_stacks(model) == []
    assert [s.path for s in find_stacks(Toy())] == ["blocks"]
    assert find_stacks(Toy(layers=KEEP)) == []             # nothing to gain


def test_the_config_is_cut_and_restored():
    config = zoo.tiny_config("llama", layers=LAYERS)
    model = zoo.build("llama", config, device="meta")
    config.layer_types = ["full_attention"] * LAYERS
    from autotp.capture.expand import cut
    stacks = find_stacks(model)
    with cut(model, stacks):
        assert len(model.model.layers) == KEEP and model.config.num_hidden_layers == KEEP
        assert model.config.layer_types == ["full_attention"] * KEEP
    assert len(model.model.layers) == LAYERS and model.config.num_hidden_layers == LAYERS
    assert model.config.layer_types == ["full_attention"] * LAYERS
    config.layer_types = ["full_attention"] * (LAYERS - 1) + ["sliding_attention"]
    with pytest.raises(Exception, match="differs between layers"):
        with cut(model, stacks):
            pass
    assert len(model.model.layers) == LAYERS


def check_parallel(family: str, checkpointing: bool) -> tuple:
    """On each rank: a 5-layer model parallelized from an expanded capture against serial."""
    import autotp
    from autotp.testing import equivalence_errors, keep_loss_precision, tolerance

    config = zoo.tiny_config(family, layers=LAYERS, heads=4, kv_heads=2 if zoo.FAMILIES[family].kv_heads else None,
                             vocab=53)
    model = keep_loss_precision(zoo.build(family, config, dtype=torch.float64, seed=1))
    pm = autotp.parallelize(model, 2, batch=64, seq=4096, profile="h100-dgx",
                            activation_checkpointing=checkpointing)
    batch = zoo.example_batch(family, config, batch=2, seq=6, seed=2)
    errors = equivalence_errors(model, pm, batch)
    # the bound of the least precise dtype the model computes in: Llama's RMSNorm variance is float32
    return pm.capture.expanded, max(errors.values()), tolerance(model, batch)


@pytest.mark.slow   # gloo ranks; the fast tier checks the graphs are the whole export's, node for node
@pytest.mark.parametrize("family, checkpointing", [("gpt2", True), ("llama", False)])
def test_a_parallel_model_from_an_expanded_capture_matches_serial(cluster_of, family, checkpointing):
    for expanded, worst, bound in cluster_of(2).run(check_parallel, family, checkpointing):
        assert expanded == CASES[family]
        assert worst <= bound


# ---- stacks whose blocks repeat with a period (sliding-window | full attention) ---------------------

def periodic_model(family: str, layers: int):
    """A tiny float64 model whose layers alternate sliding-window and full attention: gpt-oss
    (period 2; its experts on the batched path, which computes float64 on CPU), Gemma 2
    (period 2), Gemma 3 (five sliding to one full: period 6) or ModernBERT (a global layer
    every three; block 0 without its attention norm)."""
    import transformers

    if family == "modernbert":
        config = zoo.tiny_config("modernbert", layers=layers, positions=8)   # local windows narrower than 8
        return zoo.build("modernbert", config, dtype=torch.float64).eval(), config
    if family == "gpt-oss":
        config = zoo.tiny_config("gpt-oss", layers=layers, heads=4, kv_heads=2)
        config._experts_implementation = "batched_mm"
        return zoo.build("gpt-oss", config, dtype=torch.float64).eval(), config
    config_cls, model_cls = {"gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                             "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}[family]
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(torch.float64).eval(), config


def assert_periodic_expansion(family: str, layers: int, period: int, kept: int, plan: bool = True) -> None:
    model, config = periodic_model(family, layers)
    (stack,) = find_stacks(model)
    assert (stack.period, stack.kept()) == (period, kept)
    fast = capture(model)
    full = whole(model)
    assert fast.expanded == ("model.layers",) and full.expanded == ()
    assert_same_capture(fast, full)
    assert len(model.model.layers) == layers and len(model.config.layer_types) == layers   # whole again
    batch = zoo.example_batch(family if family in ("gpt-oss", "modernbert") else "llama", config, batch=2, seq=7)
    got, want = run(fast, model, batch), run(full, model, batch)
    with torch.no_grad():
        ref = model(**batch)
    for key in ("loss", "logits"):
        assert torch.equal(got[key], want[key])   # the same graph: the same values, exactly
        torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-9)
    if not plan:
        return
    fast_plan, _, _ = build_plan(fast, 2, batch=8, seq=32, profile="h100-dgx")
    full_plan, _, _ = build_plan(full, 2, batch=8, seq=32, profile="h100-dgx")
    assert fast_plan.to_json() == full_plan.to_json()


def test_alternating_blocks_are_expanded_a_period_at_a_time():
    """gpt-oss, 8 layers alternating sliding-window and full attention (period 2): cut to a
    head of two blocks (so the rest is whole periods) and two periods, blocks 2-3 checked
    against 4-5, and 6-7 written as a copy of 4-5: the whole export and its outputs (the plans,
    2 s more, in the slow tier's cases below)."""
    assert_periodic_expansion("gpt-oss", 8, period=2, kept=6, plan=False)


@pytest.mark.slow   # 7-14 s each: two exports and two plans
@pytest.mark.parametrize("family, layers, period, kept", [
    ("gpt-oss", 9, 2, 5),     # a head of block 0 alone, two periods copied
    ("gemma2", 8, 2, 6),
    ("gemma3", 20, 6, 14),    # five sliding layers to one full: a head of two, two periods of six
    ("modernbert", 10, 3, 7),
])
def test_periodic_stacks_are_their_whole_export(family, layers, period, kept):
    assert_periodic_expansion(family, layers, period, kept)


@pytest.mark.slow   # 8 s: three exports
def test_a_periodic_stack_stays_at_its_first_cut_the_second_time(keeps):
    """A later call of a periodic stack is cut as the first (head and two periods), not to one or
    two blocks, and is still the whole export and the model's values."""
    model, config = periodic_model("gpt-oss", 8)
    capture(model)
    batch = zoo.example_batch("gpt-oss", config, batch=2, seq=5)
    batch.pop("labels")   # another call: no loss
    fast = capture(model, example_kwargs=batch)
    assert keeps == [KEEP, KEEP] and fast.expanded == ("model.layers",)
    assert_same_capture(fast, whole(model, example_kwargs=batch))
    with torch.no_grad():
        want = model(**batch)
    torch.testing.assert_close(run(fast, model, batch)["logits"], want.logits, rtol=1e-9, atol=1e-9)


class Windowed(Block):
    """A block that reads a window (or None) fixed at construction, as a sliding-window attention does."""

    def __init__(self, width: int, index: int, window: int | None):
        super().__init__(width, index)
        self.window = window

    def forward(self, x, bias=None):
        x = super().forward(x, bias)
        return x if self.window is None else x - x.roll(self.window, dims=1)


def windowed(pattern: list) -> nn.Module:
    model = Toy(layers=len(pattern))
    model.blocks = nn.ModuleList(Windowed(8, i, w) for i, w in enumerate(pattern))
    return model


def test_the_period_is_the_smallest_the_blocks_repeat_with():
    assert [(s.period, s.kept()) for s in find_stacks(windowed([None, 2] * 4))] == [(2, 6)]
    assert [(s.period, s.kept()) for s in find_stacks(windowed([None, 2] * 4 + [None]))] == [(2, 5)]
    assert [(s.period, s.kept()) for s in find_stacks(windowed([1, 1, 2] * 5))] == [(3, 9)]
    assert [(s.period, s.uniform) for s in find_stacks(windowed([3] + [1, 2] * 4))] == [(2, False)]   # block 0 differs
    assert find_stacks(windowed([None, 2] * 4))[0].kept(KEEP) == 6
    assert find_stacks(windowed([None, 2] * 2 + [None])) == []           # no more blocks than a cut keeps
    assert find_stacks(windowed([None, 2, 2, None, 2, None, 2, None])) == []   # the period breaks at block 2
    assert find_stacks(windowed([5, 2, 7, 1, 3, 8, 6, 4])) == []          # every block its own
    assert find_stacks(windowed(([1] * 8 + [2]) * 4 + [1])) == []       # a period of 9: past MAX_PERIOD


def test_a_per_layer_list_that_breaks_the_period_is_refused():
    """gpt-oss's model reads ``config.layer_types[i]`` in its forward: a list that does not
    repeat with its blocks' period cannot be cut (the copies would take the wrong mask)."""
    from autotp.capture.expand import NotExpandable, cut

    config = zoo.tiny_config("gpt-oss", layers=8, heads=4, kv_heads=2)
    model = zoo.build("gpt-oss", config, device="meta")
    (stack,) = find_stacks(model)
    types = list(config.layer_types)
    assert stack.period == 2 and types[:2] == ["sliding_attention", "full_attention"]
    with cut(model, [stack]):
        assert len(model.model.layers) == 6 and model.config.num_hidden_layers == 6
        assert model.config.layer_types == types[:6]
    config.layer_types = types[:6] + types[7:5:-1]   # the last two swapped
    with pytest.raises(NotExpandable, match="every 2 layers"):
        with cut(model, [stack]):
            pass
    assert len(model.model.layers) == 8 and model.config.layer_types == types[:6] + types[7:5:-1]
    with pytest.raises(NotExpandable, match="cut to three periods only"):
        stack.kept(1)
