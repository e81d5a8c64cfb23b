"""A model that is not a transformer, at real size: Mamba-130m (two of its layers) planned at
tp=8 on the meta device. Its slow path loops over the sequence, so the capture's sequence dim
comes out fixed to the example's length (Capture.fixed_dims) and the unrolled scan keeps many
tensors live at once (the solver's state cap, autotp/passes/solve.py): the plan must still
come back, its 50280-word output layer split."""
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
    # by vocabulary rows or by hidden columns, whichever the cost model prices cheaper: at the
    # fixed sequence's 8 x 11 tokens (under the ridge, so not padded), 6285 words a rank is an
    # unaligned product (h100-dgx: 209 us forward and backward, against 40 us for 96 aligned
    # hidden columns, whose logits then take a g)
    assert isinstance(head, Shard) and plan.shapes["lm_head.weight"][head.dim] in (50280, 768), head
    if plan.shapes["lm_head.weight"][head.dim] == 768:
        assert [c.kind for c in plan.comms if c.consumer.startswith("to_dtype") and c.src == "P"] == ["g"]
