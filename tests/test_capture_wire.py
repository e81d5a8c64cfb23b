"""A capture written as bytes and read back is the capture: same graph, same values' shapes and
module stacks, same plan (autotp/capture/wire.py; the TP ranks load TP rank 0's capture)."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.capture import cache as capture_cache
from autotp.capture import wire


@pytest.fixture(autouse=True)
def empty_cache():
    capture_cache.clear()
    yield
    capture_cache.clear()


def _node_view(node) -> tuple:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    shapes = tuple((str(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)
    return node.name, node.op, str(node.target), str(node.args), shapes, str(node.meta.get("nn_module_stack"))


@pytest.mark.parametrize("family, extra", [("llama", {"kv_heads": 2}), ("mixtral", {"experts": 4, "top_k": 2})])
def test_a_loaded_capture_is_the_capture_and_plans_the_same(family, extra):
    model = zoo.build(family, zoo.tiny_config(family, **extra), dtype=torch.float64)
    fresh = capture_cache.capture(model)
    loaded = wire.loads(wire.dumps(fresh))
    assert loaded.graph_module is not fresh.graph_module
    assert [_node_view(n) for n in loaded.graph.nodes] == [_node_view(n) for n in fresh.graph.nodes]
    for field in ("param_names", "buffer_names", "user_inputs", "input_keys", "range_constraints", "dim_symbols",
                  "symbol_hints", "input_dims", "fixed_dims", "guards"):
        assert getattr(loaded, field) == getattr(fresh, field), field
    assert loaded.constants.keys() == fresh.constants.keys()
    assert all(torch.equal(loaded.constants[k], fresh.constants[k]) for k in fresh.constants)
    # the values live in a fake mode of their own, with the capturing process's symbols
    val = next(n.meta["val"] for n in loaded.graph.nodes if n.op == "placeholder" and n.name in loaded.user_inputs)
    assert val.fake_mode is not next(n.meta["val"] for n in fresh.graph.nodes
                                     if n.name == loaded.user_inputs[0]).fake_mode
    assert str(val.shape) == str(next(n.meta["val"] for n in fresh.graph.nodes if n.name == loaded.user_inputs[0]).shape)

    expected = autotp.plan(model, tp=2).to_json()     # from the fresh capture (a cache hit)
    capture_cache.clear()
    capture_cache.adopt(loaded, model)
    assert autotp.plan(model, tp=2).to_json() == expected
    assert capture_cache.stats()["misses"] == 0       # planned from the loaded capture


def test_a_capture_torch_cannot_pickle_is_a_wire_error(monkeypatch):
    model = zoo.build("llama", zoo.tiny_config("llama"), dtype=torch.float64)
    cap = capture_cache.capture(model)
    node = next(n for n in cap.graph.nodes if n.op == "call_function")
    monkeypatch.setattr(node, "target", lambda *a: None)    # a callable the pickle cannot name
    with pytest.raises(wire.WireError):
        wire.dumps(cap)
    with pytest.raises(wire.WireError):
        wire.loads(b"not a pickle")


def test_a_folder_of_captures_serves_another_process(monkeypatch, tmp_path):
    # AUTOTP_CAPTURE_CACHE: a capture made here is written; a process whose cache misses reads it
    monkeypatch.setenv(capture_cache.FOLDER_ENV, str(tmp_path))
    model = zoo.build("llama", zoo.tiny_config("llama"), dtype=torch.float64)
    before = capture_cache.folder_stats()
    made = capture_cache.capture(model)
    files = list(tmp_path.glob("*.capture"))
    assert len(files) == 1 and capture_cache.folder_stats()["written"] == before["written"] + 1
    capture_cache.clear()                              # as another process: nothing in memory
    other = zoo.build("llama", zoo.tiny_config("llama"), dtype=torch.float64, seed=1)
    read = capture_cache.capture(other)
    assert capture_cache.folder_stats()["read"] == before["read"] + 1
    assert [_node_view(n) for n in read.graph.nodes] == [_node_view(n) for n in made.graph.nodes]
    # another structure has a file of its own
    capture_cache.capture(zoo.build("llama", zoo.tiny_config("llama", layers=1), dtype=torch.float64))
    assert len(list(tmp_path.glob("*.capture"))) == 2
    # a file that cannot be read is passed over and replaced by a fresh capture's
    files[0].write_bytes(b"torn")
    capture_cache.clear()
    again = capture_cache.capture(model)
    assert [_node_view(n) for n in again.graph.nodes] == [_node_view(n) for n in made.graph.nodes]
    assert files[0].read_bytes() != b"torn" and capture_cache.folder_stats()["read"] == before["read"] + 1
    assert not list(tmp_path.glob("*.part"))


def test_a_torch_without_the_graph_pickler_is_a_wire_error(monkeypatch):
    # the pickler is a private module of torch.fx: where a torch lacks it, every rank captures itself
    import torch.fx

    model = zoo.build("llama", zoo.tiny_config("llama", layers=1), dtype=torch.float64)
    cap = capture_cache.capture(model)
    monkeypatch.delattr(torch.fx, "_graph_pickler")
    monkeypatch.setitem(__import__("sys").modules, "torch.fx._graph_pickler", None)
    with pytest.raises(wire.WireError, match="no graph pickler"):
        wire.dumps(cap)
    with pytest.raises(wire.WireError, match="no graph pickler"):
        wire.loads(b"")
