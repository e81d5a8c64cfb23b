"""A model that is not a transformer, at real size: Mamba-130m (two of its layers) planned at
tp=8 on the meta device. Its slow path loops over the sequence, so the capture's sequence dim
comes out fixed to the example's length (Capture.fixed_dims) and the unrolled scan keeps many
tensors live at once (the solver's state cap, autotp/passes/solve.py): the plan must still
come back, its vocabulary split."""
import torch

import autotp
from autotp import zoo
from autotp.capture import EXAMPLE_SEQ
from autotp.capture import cache as capture_cache
from autotp.placements import Shard


def test_mamba_130m_plans_at_tp8_with_its_sequence_fixed():
    model = zoo.build("mamba", zoo.published_config("mamba-130m", layers=2), device="meta", dtype=torch.bfloat16)
    cap = capture_cache.capture(model)
    assert cap.fixed_dims == {"input_ids.1": EXAMPLE_SEQ, "labels.1": EXAMPLE_SEQ}
    plan = autotp.plan(model, tp=8)
    head = plan.params["lm_head.weight"]
    assert isinstance(head, Shard) and plan.shapes["lm_head.weight"][head.dim] == 50280
