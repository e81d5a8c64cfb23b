"""A call without a mask is captured as transformers runs it eagerly (autotp.capture.masks):
no mask, causal by the kernel's flag, grouped-query attention at the key/value heads' own count;
any call whose mask depends on its values keeps transformers' exported mask."""
import pytest
import torch

from autotp import zoo
from autotp.capture import capture
from autotp.capture.masks import eager_masks, wants_eager_masks

aten = torch.ops.aten


def _sdpa(cap):
    return [n for n in cap.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


def _masked(node) -> bool:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask is not None


def _causal(node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


def _model(family, heads=4, kv=None, **extra):
    config = zoo.tiny_config(family, heads=heads, kv_heads=kv)
    for key, value in extra.items():
        setattr(config, key, value)
    return zoo.build(family, config)


def test_a_decoder_without_a_mask_attends_causally_at_its_own_kv_heads():
    model = _model("llama", heads=4, kv=2)
    nodes = _sdpa(capture(model))
    assert len(nodes) == 2
    for node in nodes:
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        assert not _masked(node) and _causal(node) and node.kwargs.get("enable_gqa") is True
        assert q.shape[1] == 4 and k.shape[1] == 2   # k and v not repeated to the query heads


def test_an_encoder_without_a_mask_attends_unmasked_and_not_causally():
    nodes = _sdpa(capture(_model("bert")))
    assert nodes and all(not _masked(n) and not _causal(n) for n in nodes)


@pytest.mark.parametrize("extra", ["attention_mask", "position_ids"])
def test_a_call_with_a_mask_or_positions_keeps_transformers_mask(extra):
    model = _model("llama", heads=4, kv=2)
    ids = torch.randint(0, 96, (2, 11))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False,
              extra: torch.ones_like(ids) if extra == "attention_mask" else torch.arange(11).expand(2, 11)}
    nodes = _sdpa(capture(model, example_kwargs=kwargs))
    assert nodes and all(_masked(n) for n in nodes)   # a padding mask, or packed sequences in the positions


def test_a_sliding_window_shorter_than_the_positions_keeps_its_mask():
    # a length above the window needs the window's band: the mask cannot be skipped for every call
    model = _model("mistral", heads=4, kv=2, sliding_window=8)
    nodes = _sdpa(capture(model))
    assert nodes and all(_masked(n) for n in nodes)


def test_transformers_own_decisions_are_back_after_a_capture():
    from transformers import masking_utils as mu

    before = (mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa, mu.find_packed_sequence_indices)
    packed = torch.tensor([[0, 1, 2, 0, 1]])   # two sequences in one row
    with eager_masks({"input_ids": torch.zeros(2, 3, dtype=torch.long), "use_cache": False}):
        assert mu.find_packed_sequence_indices is not before[2]
        # outside an export (another thread's eager call) transformers answers
        assert mu.find_packed_sequence_indices(packed) is not None
        assert mu._ignore_causal_mask_sdpa(None, 5, 5, 0, 0) == before[0](None, 5, 5, 0, 0)
    assert (mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa, mu.find_packed_sequence_indices) == before
    with pytest.raises(RuntimeError), eager_masks({"input_ids": torch.zeros(2, 3, dtype=torch.long)}):
        raise RuntimeError("a failed export")
    assert (mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa, mu.find_packed_sequence_indices) == before


def test_which_calls_run_without_a_mask():
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert wants_eager_masks({"input_ids": ids, "labels": ids, "use_cache": False, "attention_mask": None})
    for name in ("attention_mask", "decoder_attention_mask", "position_ids", "cache_position", "past_key_values"):
        assert not wants_eager_masks({"input_ids": ids, name: ids}), name


@pytest.mark.parametrize("family, kv", [("llama", 2), ("mistral", 2), ("bert", None), ("gpt2", None)])
def test_the_mask_free_capture_computes_what_the_model_does(family, kv):
    """The captured program against the model's own eager call, float64, at a length other than
    the example's: every tensor output equal."""
    from tests.test_capture_expand import run

    model = _model(family, heads=4, kv=kv).double()
    cap = capture(model)
    batch = zoo.example_batch(family, model.config, batch=3, seq=9)
    kwargs = {**batch, "use_cache": False} if "use_cache" in cap.input_keys else batch
    got, want = run(cap, model, kwargs), model(**kwargs)
    compared = 0
    for name in cap.output_names:
        if isinstance(want.get(name), torch.Tensor):
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
            compared += 1
    assert compared >= 2   # the loss and the logits at least
