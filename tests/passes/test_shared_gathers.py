"""The plan's count of the gathers of one split tensor (``propagate.gather_parts``): one
all-gather serves every conversion that gathers it, whatever order the consumers come in, as
the rewrite makes them (``rewrite.gathered``; tests/e2e/test_sequence_parallel_gathers.py holds
the rank to the plan)."""
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from autotp.cost_model.devices import get_profile
from autotp.cost_model.symbolic import collective_bytes, collective_time
from autotp.passes.propagate import cut_from_whole, gather_parts, read_seconds
from autotp.placements import REPLICATE, Shard

HAVE = Shard(2)   # split by features
PLAIN = Shard(1)  # split by the sequence: cut from the whole by slicing
TAILED = Shard(1, chunks=2, tail=1)   # a tail every rank holds: scattered, not cut

#: every conversion of a split tensor that gathers it: whole (no f, f fused into the gather,
#: f kept apart for a tailed product's runs), or split another way
WANTED = [(REPLICATE, False), (REPLICATE, True), (REPLICATE, "apart"), (PLAIN, False), (TAILED, False)]
GATHERS = ("all_gather", "all_gather_f", "reshard", "all_to_all")


def kinds(wanted: list) -> Counter:
    return Counter(kind for kind, _, _ in gather_parts(HAVE, wanted))


def test_one_conversion_alone_is_listed_as_it_runs_alone():
    assert kinds([(REPLICATE, False)]) == Counter(["all_gather"])
    assert kinds([(REPLICATE, True)]) == Counter(["all_gather_f"])
    assert kinds([(REPLICATE, "apart")]) == Counter(["all_gather", "f"])
    # a reshard alone gathers nothing: one all-to-all moves it, where one can (a tail cannot)
    assert kinds([(PLAIN, False)]) == Counter(["all_to_all"])
    assert kinds([(TAILED, False)]) == Counter(["reshard"])


def test_sharded_compute_reading_it_whole_serves_the_others_from_its_all_gather_f():
    # a replicated consumer reads it through grad_if, a reshard cuts it (rank_slice): no bytes
    # moved, their copies priced; a tailed split is scattered
    assert kinds([(REPLICATE, False), (REPLICATE, True), (PLAIN, False)]) == Counter(
        ["all_gather_f", "grad_if", "rank_slice"])
    assert kinds([(PLAIN, False), (REPLICATE, True), (TAILED, False)]) == Counter(
        ["all_gather_f", "rank_slice", "scatter"])
    assert cut_from_whole(PLAIN) and not cut_from_whole(TAILED)
    assert all(collective_bytes(kind, 1e6, 8) == (0.0, 0.0) for kind in ("grad_if", "rank_slice"))


def test_a_read_of_a_shared_gather_is_priced_by_the_copies_it_makes():
    """Cheaper than the collectives it saves, not free: the whole-sized add of its gradient, and
    for a cut the rank's part copied out and its gradient padded back to the whole size."""
    profile, full, tp = get_profile("h100-dgx"), 64 * 4096 * 4096 * 2, 8
    add = 3 * full / profile.bandwidth("elementwise")
    assert read_seconds("grad_if", full, profile, tp) == pytest.approx(add + profile.launch_s)
    assert read_seconds("grad_if", full, profile, tp, grad=False) == 0.0
    assert read_seconds("rank_slice", full, profile, tp) > read_seconds("grad_if", full, profile, tp)
    assert read_seconds("rank_slice", full, profile, tp) < sum(collective_time("reshard", full, profile, tp))


def test_a_plain_gather_serves_whole_and_split_consumers():
    assert kinds([(REPLICATE, False), (PLAIN, False)]) == Counter(["all_gather", "scatter"])
    assert kinds([(PLAIN, False), (TAILED, False)]) == Counter(["all_gather", "scatter", "scatter"])
    assert kinds([(REPLICATE, "apart"), (REPLICATE, False)]) == Counter(["all_gather", "f"])


@given(st.lists(st.sampled_from(WANTED), min_size=1, unique=True).flatmap(
    lambda wanted: st.tuples(st.just(wanted), st.permutations(wanted))))
def test_any_set_of_gathers_runs_one_all_gather_whatever_their_order(drawn):
    wanted, shuffled = drawn
    parts = gather_parts(HAVE, wanted)
    assert sum(kind in GATHERS for kind, _, _ in parts) == 1
    assert kinds(shuffled) == kinds(wanted)
    assert all(entry in wanted for _, _, entry in parts)   # each listed for a consumer that wanted it
    assert ("all_gather_f" in kinds(wanted)) == ((REPLICATE, True) in wanted)


def test_a_reshard_by_all_to_all_sends_a_tp_th_of_what_a_gather_and_cut_sends():
    """Each rank sends the others (tp-1)/tp of its 1/tp part, each way, where the all-gather (and
    the scatter's backward all-gather) move (tp-1)/tp of the whole: tp times the bytes."""
    full = 64 * 4096 * 4096 * 2
    for tp in (2, 3, 8):
        a2a, gather = collective_bytes("all_to_all", full, tp), collective_bytes("reshard", full, tp)
        assert a2a == pytest.approx(((tp - 1) / tp ** 2 * full,) * 2)
        assert gather == pytest.approx((tp * a2a[0], tp * a2a[1]))
