"""Capture cache: same structure hits and gives what a fresh capture gives; any other structure misses."""
import pytest
import torch
from torch import nn

import autotp
from autotp import zoo
from autotp.capture import cache as capture_cache
from autotp.capture import capture
from autotp.capture.structure import Uncacheable
from autotp.testing import keep_loss_precision


@pytest.fixture(autouse=True)
def empty_cache():
    capture_cache.clear()
    yield
    capture_cache.clear()


@pytest.fixture(scope="module")
def base_capture():
    """A fresh capture of the default tiny Llama, made once for the module (export costs seconds)."""
    return capture(_llama())


def preload(cap) -> None:
    """Put ``cap`` in the cache under the default tiny Llama's key, as if it had been captured there."""
    capture_cache._entries[capture_cache.structure_key(_llama())] = cap


def _llama(seed=0, dtype=torch.float64, layers=2, heads=4, kv_heads=2):
    config = zoo.tiny_config("llama", layers=layers, heads=heads, kv_heads=kv_heads)
    return zoo.build("llama", config, dtype=dtype, seed=seed)


def test_models_that_differ_only_in_weights_share_one_capture():
    first = capture_cache.capture(_llama(seed=0))
    second = capture_cache.capture(_llama(seed=1))
    assert capture_cache.stats()["hits"] == 1 and capture_cache.stats()["misses"] == 1
    assert second.graph_module is first.graph_module


def test_a_hit_plans_exactly_as_a_fresh_capture_does(base_capture):
    preload(base_capture)
    model = _llama(seed=5)
    cached = autotp.plan(model, 2, batch=64, seq=4096, profile="h100-dgx")
    assert capture_cache.stats()["hits"] == 1
    with capture_cache.disabled():
        fresh = autotp.plan(model, 2, batch=64, seq=4096, profile="h100-dgx")
    assert capture_cache.stats()["hits"] == 1
    assert cached.to_json() == fresh.to_json()
    assert cached.roles == fresh.roles


def test_cached_graph_is_the_fresh_graph(base_capture):
    cached_cap = base_capture
    fresh = capture(_llama(seed=3))
    assert cached_cap.graph_module.code == fresh.graph_module.code
    assert cached_cap.param_names == fresh.param_names and cached_cap.user_inputs == fresh.user_inputs


@pytest.mark.parametrize("other", [
    lambda: _llama(layers=3),
    lambda: _llama(heads=2, kv_heads=2),
    lambda: _llama(dtype=torch.float32),
    lambda: _llama().train(False),
    lambda: keep_loss_precision(_llama()),
    lambda: zoo.build("mistral", zoo.tiny_config("mistral", heads=4, kv_heads=2), dtype=torch.float64),
], ids=["layers", "heads", "dtype", "eval", "loss-function", "class"])
def test_a_different_structure_misses(other, base_capture):
    preload(base_capture)
    capture_cache.capture(other())
    assert capture_cache.stats() == {"hits": 0, "misses": 1, "entries": 2}


def test_different_example_input_signatures_miss_and_equal_lengths_hit():
    model = _llama()
    ids = torch.zeros(2, 6, dtype=torch.long)
    capture_cache.capture(model, example_kwargs={"input_ids": ids, "labels": ids})
    capture_cache.capture(model, example_kwargs={"input_ids": ids})
    assert capture_cache.stats()["misses"] == 2
    longer = torch.zeros(3, 9, dtype=torch.long)   # batch and seq are dynamic: same graph
    capture_cache.capture(model, example_kwargs={"input_ids": longer, "labels": longer})
    assert capture_cache.stats()["hits"] == 1


def test_which_inputs_share_a_length_is_part_of_the_key():
    # capture gives each distinct length its own symbol: ids and labels of one length are one
    # program, of two lengths (an encoder-decoder's source and target) another
    model = _llama()
    same = capture_cache.structure_key(model, example_kwargs={"input_ids": torch.zeros(2, 6, dtype=torch.long),
                                                              "labels": torch.zeros(2, 6, dtype=torch.long)})
    other = capture_cache.structure_key(model, example_kwargs={"input_ids": torch.zeros(2, 6, dtype=torch.long),
                                                               "labels": torch.zeros(2, 4, dtype=torch.long)})
    swapped = capture_cache.structure_key(model, example_kwargs={"input_ids": torch.zeros(2, 9, dtype=torch.long),
                                                                 "labels": torch.zeros(2, 7, dtype=torch.long)})
    assert same != other and other == swapped


class _Opaque:
    """An attribute the key cannot read: the forward could depend on anything in it."""
    scale = 2.0


class _WithOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.opaque = _Opaque()

    def forward(self, x):
        return self.lin(x) * self.opaque.scale


def test_a_model_with_state_the_key_cannot_read_is_captured_afresh_each_time():
    x = torch.randn(2, 3, 4)
    capture_cache.capture(_WithOpaque(), example_kwargs={"x": x})
    capture_cache.capture(_WithOpaque(), example_kwargs={"x": x})
    assert capture_cache.stats() == {"hits": 0, "misses": 0, "entries": 0}


def test_a_plain_attribute_the_forward_reads_is_part_of_the_key():
    x = torch.randn(2, 3, 4)

    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), scale

        def forward(self, x):
            return self.lin(x) * self.scale

    a = capture_cache.capture(Scaled(2.0), example_kwargs={"x": x})
    b = capture_cache.capture(Scaled(3.0), example_kwargs={"x": x})
    assert capture_cache.stats()["misses"] == 2 and a.graph_module.code != b.graph_module.code


def test_a_cached_capture_that_no_longer_fits_the_model_is_replaced(base_capture):
    model = _llama(heads=2, kv_heads=2)
    # an entry under this model's key whose placeholders name tensors of other shapes
    capture_cache._entries[capture_cache.structure_key(model)] = base_capture
    cap = capture_cache.capture(model)
    assert capture_cache.stats()["misses"] == 1 and cap is not base_capture
    assert capture_cache._entries[capture_cache.structure_key(model)] is cap


def test_a_capture_holding_a_fixed_length_serves_only_examples_of_that_length():
    # Mamba's loop over the sequence: export fixes the length (Capture.fixed_dims), so the key's
    # "n" for the length does not say which lengths the program holds. Before, the second length's
    # example got the first length's capture: a ParallelModule's second inference call at a new
    # length was refused (InputError: the program does not hold its inputs' sizes)
    config = zoo.tiny_config("mamba", layers=1, heads=2, head_dim=8, vocab=61)
    model = zoo.build("mamba", config, dtype=torch.float32, seed=1).eval()
    ids = torch.randint(0, 61, (2, 5))
    five = capture_cache.capture(model, example_kwargs={"input_ids": ids})
    three = capture_cache.capture(model, example_kwargs={"input_ids": ids[:, :3]})
    again = capture_cache.capture(model, example_kwargs={"input_ids": ids[:, 1:4]})
    assert five.fixed_dims == {"input_ids.1": 5} and three.fixed_dims == {"input_ids.1": 3}
    assert again.graph_module is three.graph_module   # the same length still hits
    assert capture_cache.stats()["hits"] == 1 and capture_cache.stats()["misses"] == 2


def test_a_model_with_hooks_is_keyed_by_its_hooks_functions_and_closures():
    # transformers installs an output-capturing hook on a model's layers at its first call; before,
    # such a model was never cached (every later capture of it exported again)
    model = _llama()
    bare = capture_cache.structure_key(model)
    model(input_ids=torch.randint(0, 96, (1, 4)), output_hidden_states=True)
    hooked = capture_cache.structure_key(model)
    assert any(m._forward_hooks for m in model.modules()) and hooked != bare
    other = _llama(seed=1)
    other(input_ids=torch.randint(0, 96, (1, 4)), output_hidden_states=True)
    assert capture_cache.structure_key(other) == hooked          # the same hooks, other weights

    def scaled(factor):
        return lambda module, args, output: output * factor
    model.model.norm.register_forward_hook(scaled(2.0))
    other.model.norm.register_forward_hook(scaled(3.0))          # the closure's value is keyed
    assert capture_cache.structure_key(model) != capture_cache.structure_key(other)

    class Recorder:
        def hook(self, module, args, output):
            return output
    other.model.norm.register_forward_hook(Recorder().hook)      # a bound method: its object unread
    with pytest.raises(Uncacheable):
        capture_cache.structure_key(other)
