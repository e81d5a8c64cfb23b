"""The one-process tier: one rank of tp=8 planned, rewritten and run on torch's ``fake``
process-group backend (its collectives return at once and move nothing).

Values are not checked here (the gloo tiers compare with serial); what one rank can show is:
every parameter holds exactly its planned slice, the outputs and every gradient have the shapes
the serial model's have (or the planned slice's), and the collectives the rank issues in a
forward and backward (counted with ``CommDebugMode``) are the plan's own: one per direction
its communication ops move bytes in, plus the per-call input check. No rank processes, so a
family's tp=8 program costs seconds.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.placements import Shard, local_size

TP = 8


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=TP, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _collectives(pm, inputs) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        out = pm(**inputs)
        out.loss.backward()
    return comm.get_total_counts(), out


def _expected(plan) -> int:
    """One collective per direction a communication op moves bytes in, plus the ranks' agreement
    on the call (its inputs, its place in the order of calls) and on its backward pass."""
    return sum((c.fwd_bytes > 0) + (c.bwd_bytes > 0) for c in plan.comms) + 2


def _families():
    # Falcon's new layout, 2 or 3 kv groups of 4 query heads at tp=8, deals each group to its own
    # set of ranks (a per-block shard): every rank holds one group's k and v and its query heads
    return sorted(zoo.FAMILIES)


def _spread():
    """(family, rank, heads): each family on another rank of the eight, every other one with 12
    heads (uneven at tp 8). Chosen, not drawn: hypothesis's first derandomized draw is its
    simplest, rank 0 with 8 heads for every family (offset 0, even heads)."""
    for i, family in enumerate(_families()):
        heads = 12 if i % 2 else 8
        if family == "t5" and heads == 12:
            heads = 16   # T5's 12 uneven heads at tp=8 take the planner ~45 s: the slow test below
        yield family, (3 * i + 5) % TP, heads


@pytest.mark.parametrize("family, rank, heads", [
    # T5 (one capture and a tp 8 solve of both stacks: 33 s of the fast tier on 2 cores) slow
    pytest.param(*case, marks=pytest.mark.slow) if case[0] == "t5" else case for case in _spread()],
    ids=[f"{f}-rank{r}-heads{h}" for f, r, h in _spread()])
def test_one_rank_of_tp8_holds_its_slices_and_issues_the_plans_collectives(fake_world, family, rank, heads):
    _one_rank(fake_world, family, rank, heads)


@pytest.mark.slow
def test_t5_with_uneven_heads_at_tp8(fake_world):
    _one_rank(fake_world, "t5", 5, 12)


@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_a_partial_sum_reduce_scattered_at_a_dropout_or_a_cast_issues_the_plans_collectives(fake_world, family):
    # Phi-3's output projections feed a dropout, OLMo-2's a post-norm's float32 cast, before the
    # residual add: sequence parallelism forced, the reduce-scatter enters there
    _one_rank(fake_world, family, 6, 8, sequence_parallel=True)


def test_one_collective_serves_a_consumer_with_f_and_one_without(fake_world):
    # OLMo-2: the embedding's output is made whole by one collective for q_proj (column-parallel,
    # so an f after it) and k_proj (run whole: no f). With the table split by vocabulary that was a
    # g of its partial sum, which the rank reused while the plan counted (and the solver priced) a
    # second one (42 collectives issued, 43 expected). Since products are priced never cheaper as
    # they deepen, the plan reads the table by columns and all-gathers it (an `all_gather_f` for
    # q_proj, read whole by k_proj: its `grad_if`): still one collective, the issued count equal
    # to the plan's (_one_rank)
    plan = _one_rank(fake_world, "olmo2", 6, 8)
    whole = [c.kind for c in plan.comms if c.tensor == "embedding_default" and c.kind in ("g", "all_gather_f")]
    assert len(whole) == 1, [(c.kind, c.tensor) for c in plan.comms]
    q, k = (plan.params[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qk")
    assert isinstance(q, Shard) and not isinstance(k, Shard), (q, k)   # one consumer with f, one without
    assert whole == ["g"] or "grad_if" in [c.kind for c in plan.comms if c.tensor == "embedding_default"]


def _one_rank(fake_world, family: str, rank: int, heads: int, **plan_kw):
    fake_world(rank)
    # kv heads (where the family has them) fewer than the 8 ranks: 2 or 3
    config = zoo.tiny_config(family, layers=2, heads=heads, kv_heads=heads // 4, head_dim=4, vocab=61)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    inputs = zoo.example_batch(family, config, batch=2, seq=7, seed=2)
    pm = autotp.parallelize(model, TP, batch=64, seq=4096, profile="h100-dgx", **plan_kw)
    assert pm.mesh.tp_rank == rank
    plan = pm.plan
    full = dict(model.named_parameters(remove_duplicate=False))
    local = pm.local_parameters()
    split = 0
    for name, p in local.items():
        placement = plan.params[name]
        want = list(full[name].shape)
        if isinstance(placement, Shard):
            want[placement.dim] = local_size(want[placement.dim], placement, TP, rank)
            split += 1
        assert list(p.shape) == want, (name, placement, tuple(p.shape), want)
    assert split, "the real-size workload splits something"
    count, out = _collectives(pm, inputs)
    serial = model(**inputs)
    assert out.logits.shape == serial.logits.shape and out.loss.shape == serial.loss.shape
    assert all(pm.local_grad(name) is not None and pm.local_grad(name).shape == p.shape
               for name, p in local.items() if p.requires_grad)
    assert count == _expected(plan), (count, _expected(plan), [c.kind for c in plan.comms])
    return plan


def test_a_later_kind_of_call_keeps_sequence_parallelism_forbidden(fake_world):
    """The program of a later kind of call (a training call with an attention mask after one
    without) is planned with the first's choices: forbidden sequence parallelism stays forbidden
    there. Llama at hidden 512, planned for 8 x 1024 on h100-dgx, takes it by cost in the first
    program unless forbidden, and in the later one too (solved under the first's placements; the
    greedy walk that planned later programs before never took it there, so this guarded the rule
    without reproducing a failure)."""
    fake_world(0)
    config = zoo.tiny_config("llama", layers=2, heads=8, kv_heads=8, head_dim=64, vocab=512)
    ids = torch.randint(0, 512, (2, 7))
    for sequence_parallel in (None, False):
        model = zoo.build("llama", config, dtype=torch.float32)
        pm = autotp.parallelize(model, TP, batch=8, seq=1024, profile="h100-dgx",
                                sequence_parallel=sequence_parallel)
        pm(input_ids=ids, labels=ids).loss.backward()
        pm(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss.backward()
        assert len(pm.programs) == 2
        # a shard of (b, s, h) along s, the sequence (a reduce-scatter along h, the residual stream
        # split by its width, is another plan: not sequence parallelism)
        first, later = ([(c.kind, c.src, c.dst) for c in program.plan.comms if "S(1)" in (c.src, c.dst)]
                        for program in pm.programs)
        assert bool(first) == bool(later) == (sequence_parallel is None), (sequence_parallel, first, later)
