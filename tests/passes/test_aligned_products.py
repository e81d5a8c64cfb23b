"""Products with an unaligned local output width run padded (autotp.cost_model.alignment): the
weight's shard padded with zero features to an aligned width, the product, the output sliced back.
One process, no ranks: the rewritten graph's shape, and at tp 1 its values against the model's."""
import torch

from autotp.capture import capture
from autotp.cost_model.alignment import Align, aligned
from autotp.passes.rewrite import rewrite
from autotp.placements import local_size
from autotp.planner import build_plan
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, tiny_gpt2
from tests.test_capture_expand import run

aten = torch.ops.aten


def _padded(gm):
    """(the padded weight's node, pad amounts, the product, the slice's width) per padded product."""
    out = []
    for pad in (n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default):
        (product,) = pad.users
        (cut,) = product.users
        assert cut.target is aten.slice.Tensor and cut.args[2] == 0
        out.append((pad.args[0].name, pad.args[1], product.target, cut.args[3]))
    return out


def test_gpt2_head_of_50257_words_runs_padded_on_every_rank_of_tp8():
    """GPT-2's vocabulary split 8 ways (6283 rows on rank 0, 6282 elsewhere) runs at 6288 on every
    rank, the same ops everywhere; unasked, or over a decode step's few rows, it runs as captured."""
    model = tiny_gpt2(n_layer=1, n_head=8, head_dim=8, vocab=50257, device="meta")
    cap = capture(model)
    _, index, prop = build_plan(cap, 8, batch=8, seq=32, layout={**MEGATRON_GPT2, "transformer.wte.weight": "vocab"})
    for rank in (0, 7):
        gm = rewrite(index, prop, rank, None, None, align=Align())
        head = next(n for n in index.capture.graph.nodes if n.name == "p_lm_head_weight")   # the capture planned
        mine = local_size(50257, prop.placements[head], 8, rank)
        assert _padded(gm) == [("p_lm_head_weight", [0, 0, 0, 6288 - mine], aten.linear.default, mine)]
        assert not aligned(mine) and mine == (6283 if rank == 0 else 6282)
    assert _padded(rewrite(index, prop, 0, None, None)) == []
    assert _padded(rewrite(index, prop, 0, None, None, align=Align(8 * 32 + 1))) == []   # fewer rows than asked


def test_a_padded_program_computes_exactly_what_the_model_does():
    """At tp 1 the whole head (53 words) and nothing else runs padded (to 56); loss, logits and
    every gradient are the model's (float64, to 1e-12), and the padded rows reach none of them."""
    model = tiny_gpt2(n_layer=1, n_head=4, head_dim=8, vocab=53)
    cap = capture(model)
    _, index, prop = build_plan(cap, 1, batch=2, seq=8)
    gm = rewrite(index, prop, 0, None, None, align=Align())
    assert _padded(gm) == [("p_lm_head_weight", [0, 0, 0, 3], aten.linear.default, 53)]
    data = batch(53)
    want = run(cap, model, data)
    want["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cap.graph_module = gm
    got = run(cap, model, data)
    got["loss"].backward()
    assert got["logits"].shape == want["logits"].shape
    for name in ("loss", "logits"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        assert p.grad.shape == p.shape
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-12, atol=1e-12, msg=name)
