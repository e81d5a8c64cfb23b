"""Capture: one export of GPT-2 (real or meta) serves any batch and sequence length."""

import sympy
import torch

from autotp.capture import capture, shape_of
from tests.helpers import tiny_gpt2


def _ops(cap):
    # contiguous() depends on strides, which differ between meta and real tensors after SDPA.
    return [str(n.target) for n in cap.graph.nodes
            if n.op == "call_function" and n.target is not torch.ops.aten.contiguous.default]


def test_meta_and_real_models_capture_the_same_graph():
    real = capture(tiny_gpt2(dtype=torch.float32))
    meta = capture(tiny_gpt2(dtype=torch.float32, device="meta"))
    assert _ops(real) == _ops(meta)


def test_batch_and_sequence_dims_are_symbolic_up_to_n_positions():
    cap = capture(tiny_gpt2(n_positions=24))
    ids = next(n for n in cap.graph.nodes if n.name == "input_ids")
    b, s = shape_of(ids)
    assert isinstance(b, sympy.Symbol) and isinstance(s, sympy.Symbol) and b != s
    assert cap.range_constraints["input_ids.1"] == (2, 24)
    assert set(cap.dim_symbols.values()) == {"batch", "seq"}


def test_capture_splits_biased_products_so_a_row_bias_can_follow_the_all_reduce():
    cap = capture(tiny_gpt2())
    targets = {n.target for n in cap.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default not in targets
    assert torch.ops.aten.matmul.default in targets   # Conv1D's view, product, view back: one matmul
    assert torch.ops.aten._assert_tensor_metadata.default not in targets


def test_capture_adds_a_linear_bias_to_a_product_of_batch_and_sequence():
    # Sequence parallelism reduce-scatters the row-parallel product along s, and all-gathers
    # along s into a column-parallel one: the product and its bias add see (b, s, h), not the
    # flattened (b*s, h) Conv1D computes on (its view, addmm and view back: one matmul of 3-D x).
    cap = capture(tiny_gpt2(n_layer=1))
    bias = next(n for n in cap.graph.nodes if n.name == "p_transformer_h_0_attn_c_proj_bias")
    (add,) = bias.users
    product = add.args[0]
    assert product.target is torch.ops.aten.matmul.default and len(shape_of(product.args[0])) == 3
    b, s, h = shape_of(add)
    assert isinstance(s, sympy.Symbol) and h == 32


def test_tied_embedding_and_lm_head_are_one_parameter():
    cap = capture(tiny_gpt2())
    assert cap.aliases == {"transformer.wte.weight": "lm_head.weight"}


def test_synthesized_inputs_include_labels_and_disable_the_cache():
    cap = capture(tiny_gpt2())
    assert cap.input_keys == ["input_ids", "labels", "use_cache"]
    assert cap.constant_inputs == {"use_cache": False}


# ---- bounds from the model, families that need them -------------------------------------------
import pytest  # noqa: E402

from autotp import zoo  # noqa: E402
from autotp.passes.attention import attention_head_counts, check_heads  # noqa: E402
from autotp.errors import CaptureError, ConfigError, PlanError  # noqa: E402


@pytest.fixture
def exports(monkeypatch) -> list:
    """The dynamic shapes of every torch.export call, with no length narrowed yet in this process."""
    import collections

    import autotp.capture.export as capture_module

    monkeypatch.setattr(capture_module, "_NARROWED", collections.OrderedDict())
    monkeypatch.setattr(capture_module, "_UNNAMED_KINDS", {})
    seen: list = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export",
                        lambda *a, **k: seen.append(k["dynamic_shapes"]) or real_export(*a, **k))
    return seen


def test_a_minimum_length_the_model_needs_is_honoured(exports):
    # T5's decoder (its causal relative-position buckets) needs 3 target tokens or more: export
    # says so, capture narrows the target's dim to it; the source's own dim keeps taking 2.
    config = zoo.tiny_config("t5", layers=1, heads=2, head_dim=4, vocab=40)
    cap = capture(zoo.build("t5", config, device="meta"))
    assert cap.range_constraints["labels.1"][0] == 3 and cap.range_constraints["input_ids.1"][0] == 2
    first = len(exports)
    assert first >= 2                              # asked for 2 tokens, refused, narrowed to 3
    # another model of the same class and config starts from the narrowed dims: one export
    again = capture(zoo.build("t5", config, device="meta"))
    assert len(exports) == first + 1 and again.range_constraints == cap.range_constraints


@pytest.mark.slow   # two more T5 exports (20 s on 2 cores)
def test_a_narrowed_length_is_not_taken_for_another_config(exports):
    capture(zoo.build("t5", zoo.tiny_config("t5", layers=1, heads=2, head_dim=4, vocab=40), device="meta"))
    first = len(exports)
    # a different config is not taken for it: it is refused and narrowed on its own
    other = zoo.tiny_config("t5", layers=1, heads=2, head_dim=4, vocab=48)
    assert capture(zoo.build("t5", other, device="meta")).range_constraints["labels.1"][0] == 3
    assert len(exports) == 2 * first


class _PerPosition(torch.nn.Module):
    """A forward that loops over the sequence (Mamba's slow path, a chunked scan's chunks): export
    traces one step per position, so the program holds the example's length only."""

    def __init__(self):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(vocab_size=16)
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids):
        h = self.emb(input_ids)                                               # (b, s, 4)
        return torch.stack([h[:, i] * (i + 1) for i in range(h.shape[1])], 1).sum()


def _wrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under a wrapper whose class is made per call (as a generation step's is), its
    config on the child only."""
    wrapper = type("Step", (torch.nn.Module,), {"forward": lambda self, input_ids: self.inner(input_ids)})()
    wrapper.inner = model
    return wrapper


class _ChunkedScan(torch.nn.Module):
    """Gated DeltaNet's torch path (Qwen3-Next, Qwen3.5) in small: the sequence padded to the
    chunk, ``(chunk - s % chunk) % chunk``, reshaped into chunks and scanned chunk by chunk."""

    def __init__(self, chunk: int = 16, positions: int = 40):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(vocab_size=16, max_position_embeddings=positions)
        self.chunk = chunk
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids):
        h = self.emb(input_ids)                                                     # (b, s, 4)
        s = h.shape[1]
        pad = (self.chunk - s % self.chunk) % self.chunk
        chunks = torch.nn.functional.pad(h, (0, 0, 0, pad)).reshape(h.shape[0], -1, self.chunk, 4)   # (b, n, c, 4)
        state, out = torch.zeros_like(chunks[:, 0, 0]), torch.zeros_like(chunks)
        for i in range(chunks.shape[1]):                                            # a loop over the chunks
            out[:, i] = chunks[:, i] + state[:, None]
            state = state + chunks[:, i].sum(1)
        return out.reshape(h.shape[0], -1, 4)[:, :s].sum()


def test_a_chunked_scan_is_dynamic_in_the_length_over_its_chunk_count(exports):
    # named dims are refused with "seq = 11": torch's solver cannot prove the padding's guards
    # ((s + (16 - s % 16) % 16) // 16 == 1) over the range and forces the example's length. The
    # trace itself keeps the length symbolic: traced with unnamed dims the program serves every
    # length of one chunk count, checked by its guards (the old capture held 11 only); another
    # chunk count is another program
    from autotp.capture import fits_call

    def fits(cap, n):
        return fits_call(cap, {"input_ids": torch.zeros(2, n, dtype=torch.long)})

    ids = torch.randint(0, 16, (2, 40))
    cap = capture(_ChunkedScan(), example_kwargs={"input_ids": ids[:, :11]})
    assert cap.fixed_dims == {} and len(exports) == 2
    # every padded length of one chunk; an unpadded one (16: no pad, no slice) is another program
    assert [n for n in range(2, 41) if fits(cap, n)] == list(range(2, 16))
    longer = capture(_ChunkedScan(), example_kwargs={"input_ids": ids[:, :20]})
    assert longer.fixed_dims == {} and len(exports) == 3   # the unnamed dims of the first, at once
    assert [n for n in range(2, 41) if fits(longer, n)] == list(range(17, 32))


def test_another_config_of_a_class_that_took_unnamed_dims_starts_there(exports):
    # a config's first export (another chunk, another table) starts from the unnamed dims its class
    # needed: one export, not a refused symbolic trace first, and the program a fresh capture makes
    import autotp.capture.export as capture_module

    ids = torch.randint(0, 16, (2, 11))
    capture(_ChunkedScan(), example_kwargs={"input_ids": ids})
    assert len(exports) == 2                                           # named (refused), unnamed
    other = capture(_ChunkedScan(chunk=12, positions=36), example_kwargs={"input_ids": ids})
    assert len(exports) == 3
    capture_module._UNNAMED_KINDS.clear()
    capture_module._NARROWED.clear()
    fresh = capture(_ChunkedScan(chunk=12, positions=36), example_kwargs={"input_ids": ids})
    assert len(exports) == 5                                           # fresh: refused, then unnamed
    assert other.graph.python_code("self").src == fresh.graph.python_code("self").src
    assert other.guards == fresh.guards and other.range_constraints == fresh.range_constraints


def test_unnamed_dims_refused_for_another_config_fall_back_to_those_asked(exports, monkeypatch):
    # a class's unnamed dims are only a first try: refused for another config, its export goes on as
    # asked (and the class is no longer started unnamed)
    from torch.export.dynamic_shapes import _DimHint

    import autotp.capture.export as capture_module

    ids = torch.randint(0, 16, (2, 11))
    capture(_ChunkedScan(), example_kwargs={"input_ids": ids})
    counted = torch.export.export   # the fixture's counting export
    refused = []

    def refusing_once(*args, **kwargs):
        if not refused and any(isinstance(d, _DimHint) for spec in kwargs["dynamic_shapes"].values()
                               if isinstance(spec, dict) for d in spec.values()):
            refused.append(1)
            exports.append(kwargs["dynamic_shapes"])
            raise RuntimeError("unnamed dims refused")
        return counted(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", refusing_once)
    cap = capture(_ChunkedScan(chunk=12, positions=36), example_kwargs={"input_ids": ids})
    assert refused and len(exports) == 5 and cap.fixed_dims == {}   # unnamed (refused), named (refused), unnamed
    assert capture_module._UNNAMED_KINDS   # learned again from this config's own export


def test_a_forced_pin_is_taken_where_unnamed_dims_are_refused_too(exports, monkeypatch):
    # the fallback: an export with unnamed dims that fails after the forced pin falls back to the
    # pin torch suggested, and the program holds the example's length
    from torch.export.dynamic_shapes import _DimHint

    counted = torch.export.export   # the fixture's counting export

    def refusing(*args, **kwargs):
        if any(isinstance(d, _DimHint) for spec in kwargs["dynamic_shapes"].values() if isinstance(spec, dict)
               for d in spec.values()):
            exports.append(kwargs["dynamic_shapes"])
            raise RuntimeError("unnamed dims refused")
        return counted(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", refusing)
    cap = capture(_ChunkedScan(), example_kwargs={"input_ids": torch.randint(0, 16, (2, 11))})
    assert cap.fixed_dims == {"input_ids.1": 11} and len(exports) == 3   # named, unnamed (refused), pinned


@pytest.mark.parametrize("wrap", [False, True], ids=["model", "wrapper made per call"])
def test_a_length_export_fixed_is_fixed_at_once_at_another_length(exports, wrap):
    # refused a range ("seq = 11"), the first capture exports twice; an equal model at another
    # length goes straight to its own length: the refused symbolic trace is paid once per structure
    make = (lambda: _wrapped(_PerPosition())) if wrap else _PerPosition
    ids = torch.randint(0, 16, (2, 11))
    assert capture(make(), example_kwargs={"input_ids": ids}).fixed_dims == {"input_ids.1": 11}
    assert len(exports) == 2
    again = capture(make(), example_kwargs={"input_ids": ids[:, :7]})
    assert again.fixed_dims == {"input_ids.1": 7} and len(exports) == 3


def test_dims_an_equal_model_needed_that_do_not_hold_are_dropped_for_those_asked(exports, monkeypatch):
    import autotp.capture.export as capture_module

    ids = torch.randint(0, 16, (2, 11))
    capture(_PerPosition(), example_kwargs={"input_ids": ids})
    # the memo's dims made to fail (a range without the example's length): capture exports as asked
    narrow = torch.export.Dim("seq", min=2, max=3)
    monkeypatch.setattr(capture_module, "_replayed", lambda asked, *_: {"input_ids": {0: asked["input_ids"][0],
                                                                                      1: narrow}})
    assert capture(_PerPosition(), example_kwargs={"input_ids": ids[:, :7]}).fixed_dims == {"input_ids.1": 7}
    assert len(exports) == 2 + 3   # the memo's (refused), as asked (refused: "seq = 7"), fixed


@pytest.mark.parametrize("layers, cache", [(2, False), (5, True)])
def test_a_whole_export_keeps_fake_tensors_dispatch_cache_only_over_a_stack_of_blocks(monkeypatch, layers, cache):
    # the cache answers each repeated block's ops from the first's entries; with a block or two
    # its symbolic entries cost more to rebuild than they save (a chunked scan's: twice the capture)
    import autotp.capture.export as capture_module

    monkeypatch.setattr(capture_module, "EXPAND", False)   # every model exported whole
    seen = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: seen.append(
        torch._dynamo.config.fake_tensor_cache_enabled) or real_export(*a, **k))
    capture(tiny_gpt2(n_layer=layers))
    assert seen == [cache]


def test_a_model_with_buffers_indexed_by_its_inputs_captures_on_the_meta_device():
    config = zoo.tiny_config("bert", layers=1, heads=2, head_dim=4, vocab=40)
    meta = capture(zoo.build("bert", config, device="meta"))
    real = capture(zoo.build("bert", config))
    assert _ops(meta) == _ops(real)


def _dtensor_test_transformer():
    common = pytest.importorskip("torch.testing._internal.distributed._tensor.common_dtensor")
    args = common.ModelArgs(n_layers=1, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0)
    return common.Transformer(args)


def test_a_model_without_config_gets_its_length_bound_from_export_and_heads_from_the_graph():
    model = _dtensor_test_transformer()
    cap = capture(model, example_inputs=(torch.randint(0, 64, (2, 7)),))
    assert cap.range_constraints["tokens.1"][1] == 16     # its position table holds 16 rows
    assert set(attention_head_counts(cap).values()) == {4}
    with pytest.raises(PlanError, match="tp=8 exceeds the 4 attention heads"):
        check_heads(cap, 8, uneven=True)
    with pytest.raises(PlanError, match=r"choose tp in \[1, 2, 4\]"):
        check_heads(cap, 3, uneven=False)
    check_heads(cap, 3, uneven=True)


def test_seq_range_bounds_the_captured_program():
    cap = capture(tiny_gpt2(n_positions=24), seq_range=(4, 12))
    assert cap.range_constraints["input_ids.1"] == (4, 12)
    with pytest.raises(ConfigError, match="seq_range"):
        capture(tiny_gpt2(), seq_range=(1, 12))


def test_the_example_length_is_not_a_static_size_of_the_model():
    # head_dim 8 and a length-8 example would let export tie the sequence to the head dim
    cap = capture(tiny_gpt2(head_dim=8))
    ids = next(n for n in cap.graph.nodes if n.name == "input_ids")
    assert ids.meta["val"].shape[1] not in (8, 32)


def test_a_capture_error_keeps_torchs_suggested_fix(monkeypatch):
    import collections

    import autotp.capture.export as capture_module

    monkeypatch.setattr(capture_module, "EXPORT_REFINEMENTS", 0)   # no retry: the first violation surfaces
    monkeypatch.setattr(capture_module, "_NARROWED", collections.OrderedDict())   # nor a narrowing known before
    monkeypatch.setattr(capture_module, "_UNNAMED_KINDS", {})
    config = zoo.tiny_config("t5", layers=1, heads=2, head_dim=4, vocab=40)
    with pytest.raises(CaptureError, match=r"(?s)torch suggests:.*seq1 = Dim\('seq1', min=3"):
        capture(zoo.build("t5", config, device="meta"))


class _ListIndex(torch.nn.Module):
    """Falcon's ``qkv[..., [-2]]``: a Python list as an index, lifted as a constant."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        y = x @ self.w
        return y[..., [-2]] + y[..., [True, False, True, False, True, False]].sum(-1, keepdim=True)


def test_a_list_index_captured_on_meta_keeps_its_values():
    from autotp.capture import capture

    with torch.device("meta"):
        model = _ListIndex()
    cap = capture(model, (torch.randn(2, 3, 4, device="meta"),))
    values = sorted(v.tolist() for v in cap.constants.values())
    assert values == [[-2], [True, False, True, False, True, False]], cap.constants


def test_a_constraint_torch_cannot_prove_is_retried_with_unnamed_dims_of_the_same_range():
    # torch 2.11 fails GQA's repeat_kv reshape under named Dims ("Constraints violated (seq)"
    # with no suggested fix); Dim.DYNAMIC of the same range keeps the dim symbolic
    from autotp.capture.export import _unnamed_dims

    seq = torch.export.Dim("seq", min=2, max=32)
    batch = torch.export.Dim("batch", min=1, max=64)
    shapes = {"input_ids": {0: batch, 1: seq}, "labels": {0: batch, 1: seq}, "use_cache": None}
    relaxed = _unnamed_dims(shapes)
    assert relaxed["use_cache"] is None
    for key in ("input_ids", "labels"):
        assert {d: (dim.min, dim.max) for d, dim in relaxed[key].items()} == {0: (1, 64), 1: (2, 32)}
        assert all(not isinstance(dim, type(seq)) for dim in relaxed[key].values())
    assert _unnamed_dims(relaxed) == relaxed   # nothing left to relax: the retry loop stops


def test_shape_symbols_that_are_not_input_dims_are_priced_at_the_workload_or_their_example():
    from autotp.passes.propagate import _hinted_symbols

    s, b = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    hints = {"s5": "s0", "s6": "2*s0 + s1", "u0": 7, "s0": 11}
    out = _hinted_symbols(hints, {s: 1024, b: 8})
    named = {str(k): v for k, v in out.items()}
    assert named == {"s5": 1024, "s6": 2056, "u0": 7}     # s0 itself keeps the workload's value


class _LayerDrop(torch.nn.Module):
    """LayerDrop as transformers < 5.2x writes it: a Python branch on a 0-d random draw."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                if torch.rand([]) < self.p:
                    continue
            x = x + layer(x)
        return x.sum()


def test_layerdrop_at_zero_is_captured_with_every_layer_and_above_zero_is_refused():
    x = torch.randn(2, 4)
    cap = capture(_LayerDrop(0.0).train(), example_inputs=(x,), dynamic=False)
    assert sum(n.target is torch.ops.aten.linear.default for n in cap.graph.nodes) == 2
    with pytest.raises(CaptureError, match=r"torch.rand\(\[\]\) < 0.3.*config.layerdrop = 0"):
        capture(_LayerDrop(0.3).train(), example_inputs=(x,), dynamic=False)
    assert torch.rand([]).shape == ()    # the draw is a tensor again outside capture


def test_a_unit_draw_answers_only_what_every_draw_answers_alike():
    from autotp.capture.draws import RandomBranchError, _UnitDraw

    u = _UnitDraw("here")
    assert (u < 0, u < 0.0, u <= -1, u > -0.5, u >= 0, u < 1, u <= 1.5, u > 1, u >= 1) == \
        (False, False, False, True, True, True, True, False, False)
    assert (0 > u) is False and (1 > u) is True    # reflected comparisons
    for ask in (lambda: u < 0.5, lambda: u >= 0.1, lambda: u < torch.tensor(0.0), lambda: bool(u), lambda: float(u)):
        with pytest.raises(RandomBranchError):
            ask()


def test_a_shape_twin_holds_no_weights_keeps_ties_and_leaves_the_model_alone():
    from autotp.capture import shape_twin

    model = tiny_gpt2(n_layer=2, vocab=50)
    twin = shape_twin(model)
    assert twin is not model and all(t.is_meta for t in [*twin.parameters(), *twin.buffers()])
    assert twin.lm_head.weight is twin.transformer.wte.weight              # still one tensor
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert [(n, p.shape, p.requires_grad) for n, p in twin.named_parameters()] == \
           [(n, p.shape, p.requires_grad) for n, p in model.named_parameters()]
    twin.eval()
    assert model.training                                                  # its own module tree
    twin.train()
    ids = torch.randint(0, 50, (2, 5))
    whole = capture(model, example_kwargs={"input_ids": ids})
    light = capture(twin, example_kwargs={"input_ids": ids.to("meta")})
    assert _ops(light) == _ops(whole)
    meta = tiny_gpt2(n_layer=1, vocab=50).to("meta")
    assert shape_twin(meta) is meta                                        # nothing to drop


def test_example_inputs_keep_which_lengths_are_equal_and_each_length_gets_its_own_dim():
    from autotp.capture.inputs import _dynamic_shapes, example_like

    call = {"input_ids": torch.ones(3, 6, dtype=torch.long), "attention_mask": torch.ones(3, 6, dtype=torch.long),
            "decoder_input_ids": torch.ones(3, 4, dtype=torch.long), "use_cache": False}
    example = example_like(call, (2, 64))
    assert example["input_ids"].shape == example["attention_mask"].shape == (2, 11)
    assert example["decoder_input_ids"].shape == (2, 13) and example["use_cache"] is False
    shapes = _dynamic_shapes(example, (2, 64))
    assert shapes["input_ids"][1] is shapes["attention_mask"][1]
    assert shapes["decoder_input_ids"][1] is not shapes["input_ids"][1]
    assert shapes["decoder_input_ids"][0] is shapes["input_ids"][0]           # one batch
    one = example_like({"input_ids": torch.ones(1, 5, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long)},
                       (2, 64))
    assert one["input_ids"].shape == one["labels"].shape == (2, 11)


class _Uncopyable(torch.nn.Module):
    """A module holding something deepcopy refuses (a lock, as a logger handler or a client holds)."""

    def __init__(self):
        super().__init__()
        import threading

        self.lin = torch.nn.Linear(4, 4)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.lin(x)


def test_a_model_deepcopy_refuses_is_its_own_twin_with_a_warning(caplog):
    import logging

    from autotp.capture import shape_twin

    model = _Uncopyable()
    with caplog.at_level(logging.WARNING, logger="autotp"):
        assert shape_twin(model) is model                     # later captures read the model itself
    assert "cannot be copied without its weights" in caplog.text and "stays referenced" in caplog.text
    assert not model.lin.weight.is_meta


def test_a_chunked_scan_captures_at_a_dynamic_length_guarded_by_its_residue_class():
    """Granite-4.0-H's Mamba2 mixer (chunks of 4): its causal LM takes use_cache through **kwargs
    (the program must not return a cache object), and its scan pads the sequence to the chunk, so
    export suggests ``seq = 4*_seq - 1``. The capture is dynamic in the length with the guards
    export traced under: lengths of the example's class (11, 13: not a multiple of 4, over 4)
    hold, a multiple of 4 and a single chunk do not (other programs)."""
    from autotp.capture import guards_hold

    config = zoo.tiny_config("granitemoehybrid", layers=1, heads=2, head_dim=8, vocab=64)
    cap = capture(zoo.build("granitemoehybrid", config, device="meta"))
    assert "cache" not in cap.output_names and "past_key_values" not in cap.output_names
    assert cap.fixed_dims == {} and cap.guards
    holds = {n: guards_hold(cap, {"input_ids": torch.zeros(2, n, dtype=torch.long),
                                  "labels": torch.zeros(2, n, dtype=torch.long)}) for n in (3, 4, 5, 8, 11, 13)}
    assert holds == {3: False, 4: False, 5: True, 8: False, 11: True, 13: True}
