"""A rank's step copies no more than serial's, beyond what a collective needs.

One rank of tp 2 on torch's ``fake`` backend (its collectives return at once), Llama, GPT-2
(pinned to Megatron's layout, and as the cost model plans it: attn.c_proj whole after gathering
attention's heads) and OPT (its MLP on ``[b*s, h]``, pinned to Megatron's layout) wide enough that the plan splits them
(8 heads of 64, planned for 256 x 32 on h100-dgx: 8192 tokens, as many as 8 x 1024, at a length
the tiny models' 32 positions take), with sequence parallelism forced and forbidden, at a batch
of one and of two.
:class:`autotp.testing.work.CopyCounter` records every copy and cast of a training step (forward
and backward) and where it was made. The model's own copies (its program's nodes and their
backward formulas: rotary's ``cat``, the labels' pad, a reshape of a transposed tensor) run at
the rank's size, never more bytes than serial's. autotp's own code around them copies only
where a real collective, or a slice the program's views read, needs it:

* ``gather_scatter._all_gather``: an all-gather lands the ranks' blocks one after another along
  dim 0 (NCCL's and gloo's ``all_gather_into_tensor``); a split of another dim with more than
  ``gather_scatter.ROWS_COALESCED`` leading rows before it (the hidden of any [b, s, h]) is moved
  into place, one copy of the gathered tensor; a send that is not contiguous is made so. A split
  of dim 0, or with only dims of size one before it (the sequence of a batch of one), is the
  gathered buffer itself, and an even split after a few rows (the sequence of a batch of two)
  is gathered row by row into the result: no copy. An even split's part held as a permutation
  (attention's output ``[b, heads, s, d]`` held ``[b, s, heads, d]``) is gathered in its
  memory's order and returned so: no send copy, and the program's fold of the heads is a view.
* ``gather_scatter._reduce_scatter``: a reduce-scatter reads each rank's block one after another
  along dim 0; the same splits are staged into that order (one copy of the summand), others
  are that order already or reduce-scattered row by row (the sequence of a batch of two).
* ``exchange._all_to_all``: a reshard's all-to-all (one split to another) sends and receives
  the ranks' blocks one after another along dim 0; the rank's part is staged into that order by
  the split it is sent as and the blocks received are laid out by the split they came as, one
  copy of the rank's part each side (none where that split is of dim 0, or has only dims of size
  one before it), run by run where a split is uneven.
* ``collectives.rank_slice``: a rank's slice of a replicated tensor (a scatter, no collective)
  that is strided (a split of the hidden), laid out for the program's ``view`` nodes, at most
  one per scatter. A slice that is contiguous is a view; a gradient's slice (an all-gather's
  backward) stays a view, strided or not, which the formula it goes to reads so.

An f's and a g's all-reduce make no copy: they reduce in place (``autotp.passes.in_place``; a
functional all-reduce copies its input first, which ``CopyCounter`` records as an ``all_reduce``
copy at ``comm._all_reduce``), in training and inference alike.

And the per-call check of the inputs' index ranges (``inputs.stage_index_bounds``: one number per
bounded input, stacked to be read at once; bytes, not tensors). Never a cast, and never a copy of a tensor laid out as the copy is (a contiguous slice, a
``.contiguous()`` of a contiguous tensor). What a collective writes itself (c10d's ops; the fake
backend copies its input into the output where NCCL's transfer writes it) is no copy here.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import autotp
from autotp import zoo
from autotp.testing.work import CopyCounter

TP = 2
#: the planning workload: the tiny models' 32 positions, a batch that makes 8 x 1024's tokens
PLANNED = dict(batch=256, seq=32)
#: where autotp's code may copy, and why (module docs)
NEEDED = ("gather_scatter._all_gather", "gather_scatter._reduce_scatter", "exchange._all_to_all", "shards.rank_slice",
          "inputs.stage_index_bounds")
#: the modules of the collectives' code, as CopyCounter names a site (``module.function``)
COLLECTIVES = ("collectives.", "comm.", "comm_modules.", "exchange.", "gather_scatter.", "shards.")


def _copies(module, inputs) -> CopyCounter:
    module(**inputs).loss.backward()   # the program is written at the first call
    module.zero_grad(set_to_none=True)
    with CopyCounter() as copies:
        module(**inputs).loss.backward()
    module.zero_grad(set_to_none=True)
    return copies


def _inference_copies(module, inputs) -> CopyCounter:
    module.eval()
    try:
        with torch.no_grad():
            module(**inputs)   # the program of this call is written at the first one
            with CopyCounter() as copies:
                module(**inputs)
    finally:
        module.train()
    return copies


#: OPT's Megatron layout (at this width the cost model keeps its layers whole): its MLP then runs
#: on the rank's tokens' rows of [b*s, h] under sequence parallelism. GPT-2's layers', run pinned
#: and as the cost model plans them (at this width without sequence parallelism it runs
#: attn.c_proj whole, its bias inside the product, autotp/passes/fused_bias.py, after gathering
#: the heads of attention's output, held as [b, s, heads, d]: gathered in that layout, the
#: program folds the heads into the hidden by a view, as serial's does, and the gradient's slice
#: is a view attention's backward reads strided)
LAYOUTS = {"gpt2": {"*c_attn.weight": "column", "*attn.c_proj.weight": "row", "*c_fc.weight": "column",
                    "*mlp.c_proj.weight": "row"},
           "opt": {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
                   "*.out_proj.weight": "row", "*.fc1.weight": "column", "*.fc2.weight": "row"}}


@pytest.mark.parametrize("family,pinned", [("llama", False), ("gpt2", True), ("gpt2", False), ("opt", True)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_ranks_step_copies_only_what_its_collectives_need(fake_rank, family, pinned, sequence_parallel):
    config = zoo.tiny_config(family, layers=2, heads=8, kv_heads=8, head_dim=64, vocab=512)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    # planned at a length the model takes (before: seq=1024 over its 32 positions, a workload it
    # cannot run, with a warning; the plan is the same, token for token)
    pm = autotp.parallelize(model, TP, **PLANNED, profile="h100-dgx", sequence_parallel=sequence_parallel,
                            layout=LAYOUTS[family] if pinned else None)
    assert pm.plan.comm_counts().get("reduce_scatter", 0) >= (1 if sequence_parallel else 0)
    if family == "opt" and sequence_parallel:   # fc2's sums reduce-scattered into the tokens' rows
        assert ("reduce_scatter", "P", "P(tokens 0)") in [(c.kind, c.src, c.dst) for c in pm.plan.comms]
    for batch in (1, 2):
        inputs = zoo.example_batch(family, config, batch=batch, seq=8, seed=2)
        serial, rank = _copies(model, inputs), _copies(pm, inputs)
        ours = rank.autotp_copies()
        assert not [c for c in ours if c.cast or c.duplicate], ours
        assert {c.site for c in ours} <= set(NEEDED), ours
        # a rank's slice is laid out only for the program's views (a scatter's forward, one
        # each); a gradient's (an all-gather's backward) is a view its formula reads strided
        sliced = [c for c in ours if c.site == "shards.rank_slice"]
        assert len(sliced) <= pm.plan.comm_counts().get("scatter", 0), (sliced, pm.plan.comm_counts())
        # the model's own copies, at the rank's size: never more bytes than serial's
        model_ops = lambda copies: Counter({op: b for (site, op), b in copies.by_site().items()   # noqa: E731
                                            if site in ("program", "autograd")})
        assert not model_ops(rank) - model_ops(serial), (model_ops(rank), model_ops(serial))
        # f and g all-reduce in place (autotp.passes.in_place): the functional all-reduce's copy
        # of its input is gone from training and inference alike
        assert pm.plan.comm_counts().get("g", 0) + pm.plan.comm_counts().get("f", 0) > 0
        inference = _inference_copies(pm, inputs).autotp_copies()
        assert not [c for c in ours + inference if c.site == "comm._all_reduce"], ours + inference
        assert not [c for c in inference if c.cast or c.duplicate], inference
        assert {c.site for c in inference} <= set(NEEDED), inference
        if sequence_parallel and family == "opt":
            # the tokens' rows are [b, s/tp, h] flattened: reduce-scattered into and gathered out
            # of as that, staging nothing, at a batch of one (the ranks' blocks in rank order
            # already) or of two (row by row, one collective a batch row in one coalesced call;
            # before, one copy of the whole summand each, forward and the all-gathers' backward)
            assert not [c for c in ours
                        if c.site in ("gather_scatter._reduce_scatter", "gather_scatter._all_gather")], ours
        if batch == 1 and sequence_parallel and family == "gpt2" and pinned:
            # the all-gathers and reduce-scatters split the sequence (a batch of one): no copy; a
            # reshard between the sequence and the hidden (the plan's all-to-alls: the tied
            # embedding's and the head's, split by the hidden) stages its hidden side, one copy of
            # the rank's part forward and one backward
            assert sum(c.bytes for c in ours if c.site.startswith(COLLECTIVES)
                       and c.site != "exchange._all_to_all") == 0, ours
            resharded = [c.bytes for c in ours if c.site == "exchange._all_to_all"]
            part = inputs["input_ids"].numel() // TP * config.hidden_size * 4   # float32
            assert resharded == [part] * 2 * pm.plan.comm_counts().get("all_to_all", 0), resharded


#: Megatron's layout for Llama (the table whole: at this width the cost model splits its columns,
#: whose hidden-split output is gathered after b*s rows, the staged path)
LLAMA_MEGATRON = {"*q_proj.weight": "column", "*k_proj.weight": "column", "*v_proj.weight": "column",
                  "*o_proj.weight": "row", "*gate_proj.weight": "column", "*up_proj.weight": "column",
                  "*down_proj.weight": "row", "*embed_tokens.weight": "replicate"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sequence_parallel_gathers_and_reduce_scatters_of_a_batch_copy_nothing(fake_rank, family):
    # under sequence parallelism at a batch of two, each gather and reduce-scatter along s of
    # [b, s, h] moves its b rows straight between the tensor and the result, one collective a row
    # in one coalesced call: before, each staged the whole activation through a [tp, ...] buffer
    # (one copy per gather and per reduce-scatter, forward and backward)
    config = zoo.tiny_config(family, layers=1, heads=8, kv_heads=8, head_dim=64, vocab=512)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, TP, **PLANNED, profile="h100-dgx", sequence_parallel=True,
                            layout=LLAMA_MEGATRON if family == "llama" else LAYOUTS[family])
    counts = pm.plan.comm_counts()
    assert counts.get("reduce_scatter", 0) >= 1 and counts.get("all_gather_f", 0) >= 1, counts
    inputs = zoo.example_batch(family, config, batch=2, seq=8, seed=2)
    copies = _copies(pm, inputs).autotp_copies()
    staged = [c for c in copies if c.site in ("gather_scatter._all_gather", "gather_scatter._reduce_scatter")]
    assert staged == [], staged
