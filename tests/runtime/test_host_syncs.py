"""A rank's steady-state step never stops its host for the device.

On a GPU, reading a tensor's values on the host (``.item()``, ``.tolist()``, ``int(t)``,
``bool(t)``: ``aten._local_scalar_dense``), running an op whose output's size depends on the
values (``nonzero``, ``masked_select``, ``unique``: the host reads the size back), or copying a
tensor to the host without ``non_blocking`` waits for everything queued before it: the host
stops queueing kernels and the device runs dry.
On CPU nothing waits, so :class:`HostReads` counts the operations that would: reads of values and
blocking copies to the host of a tensor that would live on the device, which is what the call
was given (inputs, parameters, buffers) or computed from it, or made on the device by the
program (a factory op given the device). A copy queued with ``non_blocking=True`` to the host
makes a host tensor (the deferred index check stages the bounds that way), and so do tensors
made on the host from Python values (the agreement's digests, which travel over the gloo control
group and never touch the device).

One rank of tp 2 on torch's ``fake`` backend (its collectives return at once) with
``deferred_checks`` on, as under NCCL: a training step (forward, backward) and an inference call
(eval, no_grad) after a warm-up of each: no read at all, but two. One the model's own op makes,
which is not autotp's to remove: transformers' experts fallback (``grouped_mm_fallback``, what a
float32 model runs where ``_grouped_mm`` does not take the dtype under capture) reads its
per-expert offsets once per product. And one per expert layer where a rank computes its own
experts' rows alone (``distributed.experts``): the bounds of its rows among the rows sorted by
expert (``expert_bounds``), which the layer's products, the gather in front of them and a pick by
the sorted ids (gpt-oss's biases) share, the reorder back to token order a permutation that keeps
the rows (``routed_permute``); on the batched path the rows its experts' ids pick
(``picked_rows``) instead. How many rows are its own sizes every tensor of the layer after it (a
data-dependent size, as in any dropless expert parallelism without a fixed capacity). Where the
tokens arrive split along the sequence and the rank sends its tokens' rows to their experts' ranks
by an all-to-all, still one: everything the host must know of the layer read at once
(``dispatch_sizes``: its experts' rows' bounds, the split sizes, as Megatron's and torchtitan's
dispatchers read theirs, and so how many (token, expert) rows are of its own tokens).
(The serial HuggingFace models read more: GPT-2's forward checks its last and first tokens for
padding with ``in``, a read per call, which the captured program does not hold.)

With ``host_reads=False`` the plan takes no layout that reads (the experts run expert-TP or
replicated) and a step of every zoo family reads nothing at all; a model whose own program
reads (the float32 grouped fallback) is refused with a PlanError naming the op and the fix, so
those families run here with transformers' ``batched_mm`` experts, and the grouped path in
bfloat16, what a GPU runs.
"""
from __future__ import annotations

import pytest
import torch

import autotp
from autotp import zoo
from autotp.capture import EXAMPLE_SEQ
from autotp.testing.host import HostReads, device_tensors

TP = 2
#: the model's own op that reads values on the host (transformers' experts on CPU in float32)
MODEL_READS = "_grouped_mm_fallback"   # and its backward, _grouped_mm_fallback_bwd
#: autotp's reads of an expert layer where a rank computes its own experts' rows alone
#: (autotp.distributed.experts): where its rows start and end among the rows sorted by expert
#: (expert_bounds), which of the rows picked by expert id are its own (picked_rows, the batched
#: path) and, for a reorder by an index not known a permutation, where its rows land
#: (routed_reorder); their count sizes the compact rows after them. One per expert layer; under
#: the all-to-all dispatch (tokens split along the sequence), its bounds and split sizes read at
#: once instead (dispatch_sizes)
ROWS_READS = ("expert_bounds", "picked_rows", "routed_reorder", "dispatch_sizes", "local_dispatch_sizes")


def layers_of_experts(model) -> int:
    return sum(1 for name, _ in model.named_modules() if name.rpartition(".")[2] == "experts")


def _reads(module, inputs, train: bool) -> list[tuple[str, tuple[str, ...]]]:
    """Host reads in one steady-state call of ``module``: a training step, or an inference call."""
    module.train(train)
    infer = {k: v for k, v in inputs.items() if k != "labels" or zoo.family(_reads.family).task == "seq2seq"}

    def step():
        if train:
            module(**inputs).loss.backward()
        else:
            with torch.no_grad():
                module(**infer)

    step()   # warm-up: the first call of a kind captures its program
    with HostReads(device_tensors(module, inputs)) as mode:
        step()
    if hasattr(module, "flush_checks"):
        module.flush_checks()   # the staged index check is read (after the window counted)
    return mode.reads


#: the fast tier's families: a plain stack, grouped-query attention with a gated MLP and dropouts
#: taking the reduce-scatter (Phi-3), Llama's attention, norms and rotary beside experts (Mixtral),
#: experts with biases picked by the sorted ids (gpt-oss); every other family in the slow tier
#: (about 200 s for them all on two cores; Llama itself, 8-12 s, adds nothing Mixtral's and
#: Phi-3's layers do not run; the hybrid with experts, granitemoehybrid, 30-55 s alone, stays fast
#: in the stricter test without host reads below)
FAST = ("gpt2", "phi3", "mixtral", "gpt-oss")


def _families():
    return [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in sorted(zoo._all_families())]


@pytest.mark.parametrize("family", _families())
def test_a_steady_state_step_reads_nothing_back_from_the_device(fake_rank, family):
    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=61)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    inputs = zoo.example_batch(family, config, batch=2, seq=EXAMPLE_SEQ, seed=2)
    pm = autotp.parallelize(model, TP, batch=64, seq=4096, profile="h100-dgx")
    pm.deferred_checks = True   # as under NCCL (the fake backend's collectives, like NCCL's, do not stop the host)
    _reads.family = family
    for train in (True, False):
        reads = _reads(pm, inputs, train)
        autotps = [(what, stack) for what, stack in reads if not any(f.startswith(MODEL_READS) for f in stack)]
        # a rank's own experts' rows: one read per expert layer (their count), shared by the
        # layer's products, its gather, a pick by the sorted ids, the reorder back; where the
        # tokens arrive split along the sequence and go to their experts' ranks by an all-to-all,
        # that one read holds the split sizes too
        rows = [what for what, stack in autotps if set(ROWS_READS) & set(stack)]
        assert len(rows) <= layers_of_experts(model), ("training" if train else "inference", rows)
        assert [what for what, stack in autotps if not set(ROWS_READS) & set(stack)] == [], \
            ("training" if train else "inference", autotps)
        if not layers_of_experts(model):
            assert reads == []


def test_a_dispatching_layer_reads_the_host_once(fake_rank, monkeypatch):
    """The tokens split along the sequence, each (token, expert) row sent to its expert's rank by
    an all-to-all, its output row sent back by the reverse one or summed by a g: a training step
    reads the host once per expert layer, everything the host must know of the layer in one
    ``tolist`` (``dispatch_sizes``: the bounds of the rank's experts' rows, the rows it sends to
    and receives from each rank, and so how many rows of its tokens it holds), which the reorder
    of its tokens' rows, both products, the dispatch, the combine and their backwards share
    (before: three, the bounds, the split sizes and the reorder's ``nonzero``). An inference
    call reads what its own program reads either way. The dispatch is forced (``expert_dispatch=True``):
    since the routing's kernels are priced on both sort paths this tiny layer gathers its tokens
    whole by cost. Without the reverse all-to-all the rank then takes its tokens' rows back from the
    experts' output rows made whole, by the inverse of its own sort (once a PlanError in the
    rewrite, "index_tensor_2 gathers whole rows by a rank's own positions (sorted, ...)")."""
    import autotp.passes.rules.experts as rules
    import autotp.passes.rules.routed as routed

    config = zoo.tiny_config("mixtral", layers=2, heads=4, kv_heads=2, head_dim=4, vocab=61, experts=4, top_k=2)
    inputs = zoo.example_batch("mixtral", config, batch=2, seq=EXAMPLE_SEQ, seed=2)
    _reads.family = "mixtral"
    counts = {}
    for combine in (True, False):
        if not combine:
            monkeypatch.setattr(rules, "combine_back", lambda info, inputs: [])
            # nor the rows sent back after the product (the reverse all-to-all as a conversion)
            monkeypatch.setattr(routed, "_sent_back", lambda info, placements, rule: [])
        model = zoo.build("mixtral", config, dtype=torch.float32, seed=1)
        pm = autotp.parallelize(model, TP, layout={"*.experts.*": "expert"}, batch=64, seq=4096,
                                profile="h100-dgx", sequence_parallel=True, expert_dispatch=True)
        pm.deferred_checks = True
        kinds = [type(m).__name__ for m in pm.graph_module.modules()]
        assert kinds.count("DispatchRows") == 2 and kinds.count("CombineRows") == (2 if combine else 0), kinds
        for train in (True, False):
            reads = [(what, stack) for what, stack in _reads(pm, inputs, train)
                     if not any(f.startswith(MODEL_READS) for f in stack)]
            assert all(set(ROWS_READS) & set(stack) for _, stack in reads), reads
            if train:   # the bounds (2), the rows sent to each rank and received from each (2 x tp)
                # (local_dispatch_sizes where the rank routed its own rows: rules/local_routing.py)
                assert [what for what, stack in reads if {"dispatch_sizes", "local_dispatch_sizes"} & set(stack)] == \
                    [f"Tensor.tolist of ({2 + 2 * TP},)"] * layers_of_experts(model), reads
            counts[combine, train] = len(reads)
    assert counts[True, True] == counts[False, True] == layers_of_experts(model), counts
    assert counts[True, False] == counts[False, False], counts   # inference: its own program's reads


def test_the_counter_sees_what_a_blocking_check_reads(fake_rank):
    """Without deferred_checks the index bounds are read at once (a read on a GPU): counted; and
    so is the serial GPT-2's own padding check."""
    config = zoo.tiny_config("gpt2", layers=1, heads=4, head_dim=4, vocab=61)
    model = zoo.build("gpt2", config, dtype=torch.float32, seed=1)
    inputs = zoo.example_batch("gpt2", config, batch=2, seq=EXAMPLE_SEQ, seed=2)
    pm = autotp.parallelize(model, TP, batch=64, seq=4096, profile="h100-dgx")
    pm.deferred_checks = False
    _reads.family = "gpt2"
    assert [what for what, _ in _reads(pm, inputs, train=True)] == ["Tensor.tolist of (4,)"]
    assert [what for what, _ in _reads(model, inputs, train=True)] == ["aten._local_scalar_dense.default of ()"]


#: the fast tier's families without host reads: experts on the batched path beside Llama-like
#: attention, an embedding and norms (Mixtral); the hybrid with experts (granitemoehybrid, 30-55 s
#: alone) and GPT-2's plain stack, which reads nothing in the test above already and whose layers
#: hold no layout that reads, in the slow tier here
FAST_NO_READS = ("mixtral",)


def _no_read_families():
    return [f if f in FAST_NO_READS else pytest.param(f, marks=pytest.mark.slow) for f in sorted(zoo._all_families())]


def _no_reads_module(family: str, dtype: torch.dtype = torch.float32, experts: str = "batched_mm"):
    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=61)
    config._experts_implementation = experts   # read by MoE families alone
    model = zoo.build(family, config, dtype=dtype, seed=1)
    inputs = zoo.example_batch(family, config, batch=2, seq=EXAMPLE_SEQ, seed=2)
    pm = autotp.parallelize(model, TP, batch=64, seq=4096, profile="h100-dgx", host_reads=False)
    pm.deferred_checks = True
    _reads.family = family
    return pm, inputs


@pytest.mark.parametrize("family", _no_read_families())
def test_without_host_reads_a_step_reads_nothing_at_all(fake_rank, family):
    """``host_reads=False``: every zoo family's steady-state step and inference call read nothing,
    the model's own ops included; no rank runs its own experts' rows alone (Llama-4's experts,
    every token through every expert, may still be split whole per rank: nothing is counted)."""
    pm, inputs = _no_reads_module(family)
    assert not [n for n in pm.graph_module.graph.nodes if getattr(n.target, "__name__", "") in ROWS_READS]
    for train in (True, False):
        assert _reads(pm, inputs, train) == [], ("training" if train else "inference")


@pytest.mark.parametrize("family", ["mixtral", pytest.param("gpt-oss", marks=pytest.mark.slow)])
def test_without_host_reads_the_grouped_experts_in_bfloat16_read_nothing(fake_rank, family):
    """The grouped path as a GPU runs it (``_grouped_mm`` in bfloat16, no fallback): no read."""
    pm, inputs = _no_reads_module(family, torch.bfloat16, experts="grouped_mm")
    assert not any(n.target.__name__.startswith("grouped_mm_fallback") for n in pm.graph_module.graph.nodes
                   if n.op == "call_function" and hasattr(n.target, "__name__"))
    for train in (True, False):
        assert _reads(pm, inputs, train) == [], ("training" if train else "inference")


def test_without_host_reads_a_read_no_layout_avoids_is_an_error():
    """Whole experts pinned per rank, or the model's own op that reads (transformers' float32
    grouped fallback): a PlanError naming it and the fix, before any rank runs."""
    from autotp.errors import PlanError

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=4, vocab=61)
    config._experts_implementation = "batched_mm"
    model = zoo.build("mixtral", config, device="meta")
    with pytest.raises(PlanError, match=r"pins model\.layers\.0\.mlp\.experts\.\w+ to whole experts per rank"
                                        r".*'expert_column'/'expert_row'"):
        autotp.plan(model, tp=2, layout={"*.experts.*": "expert"}, host_reads=False)
    assert "expert" in autotp.plan(model, tp=2, layout={"*.experts.*": "expert"}).roles.values()
    config._experts_implementation = "grouped_mm"
    model = zoo.build("mixtral", config, device="meta")
    with pytest.raises(PlanError, match=r"grouped_mm_fallback.default in model\.layers\.0\.mlp\.experts.*bfloat16"):
        autotp.plan(model, tp=2, host_reads=False)
