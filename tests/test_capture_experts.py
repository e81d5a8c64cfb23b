"""Capturing mixtures of experts: every experts implementation transformers ships, and the weightless
twin captured as on the device its programs run on. One process, no ranks."""
import logging

import pytest
import torch

from autotp import zoo
from autotp.capture import capture, shape_twin
from autotp.errors import CaptureError


def _tiny(impl: str):
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=32, experts=3, top_k=2)
    config._experts_implementation = impl
    return zoo.build("mixtral", config)


def _targets(cap) -> set[str]:
    return {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}


def test_an_int_histc_from_the_meta_twin_runs_on_cpu():
    """transformers' grouped experts count tokens per expert with histc of ints off the CPU and of
    floats on it; the meta twin's program holds the int form, which the rank program must run on CPU."""
    from autotp.passes.rules import localizer
    from autotp.distributed.experts import histc

    twin = shape_twin(_tiny("grouped_mm"))
    cap = capture(twin, example_kwargs={"input_ids": torch.ones(2, 5, dtype=torch.long, device="meta")})
    assert any(n.target is torch.ops.aten.histc.default for n in cap.graph.nodes)
    assert localizer(torch.ops.aten.histc.default)(None, None, (), {}, None)[0] is histc
    ids = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)
    assert histc(ids, 3, 0, 2).tolist() == [1, 1, 3]
    assert histc(ids, 3, 0, 2).dtype == torch.int32


def test_eager_experts_are_captured_as_grouped_and_said_once(caplog):
    model = _tiny("eager")
    with caplog.at_level(logging.WARNING):
        cap = capture(model)
        capture(model)
    assert any("grouped_mm" in t for t in _targets(cap))
    said = [r for r in caplog.records if "experts_implementation='eager'" in r.getMessage()]
    assert len(said) <= 1
    assert model.config._experts_implementation == "eager"   # the model itself is left as it was


def test_batched_experts_capture_as_they_are():
    cap = capture(_tiny("batched_mm"))
    assert "aten.bmm.default" in _targets(cap)


def test_an_uncapturable_experts_implementation_names_itself():
    model = _tiny("grouped_mm")
    model.config._experts_implementation_internal = "sonicmoe"   # a GPU kernel library's, absent here
    with pytest.raises(CaptureError, match="experts_implementation='sonicmoe'"):
        capture(model)
