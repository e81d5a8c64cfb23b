"""A dead rank is an error, not a hang: the surviving ranks raise LostRankError naming it."""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.errors import CommError, ConfigError
from autotp.distributed import faults
from autotp.distributed.mesh import DEFAULT_TIMEOUT, collective_timeout
from autotp.testing import MEGATRON_GPT2
from autotp.distributed.launch import LocalCluster
from tests.helpers import batch, tiny_gpt2

pytestmark = pytest.mark.timeout(300)

#: the survivors of a fault wait this long: short, yet far above a healthy step's skew (the ranks
#: plan a one-layer model with a pinned layout, ~1-2 s apart at most on 2 busy cores)
COLLECTIVE_TIMEOUT = 8.0


def steps_where_a_rank_dies_in_backward(tp: int, heads: int, dying: int, layout: dict) -> None:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=heads), tp=tp, layout=layout)
    pm(**batch(100)).loss.backward()  # one healthy step: every connection is up
    loss = pm(**batch(100, seed=2)).loss
    if dist.get_rank() == dying:  # dies mid-step, between its forward and its backward collectives
        loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
    loss.backward()


def _what_the_ranks_raise(world: int, tp: int, heads: int, dying: int, layout: dict = MEGATRON_GPT2) -> str:
    # The others may report for the collective timeout plus the roll call's slack: a rank still
    # waiting in a collective on a live peer learns of the loss only when it times out.
    with LocalCluster(world, timeout=120, collective_timeout=COLLECTIVE_TIMEOUT,
                      error_grace=COLLECTIVE_TIMEOUT + faults.SLACK_S) as cluster:
        with pytest.raises(CommError) as info:
            cluster.run(steps_where_a_rank_dies_in_backward, tp, heads, dying, layout)
    text = str(info.value)
    assert f"lost rank {dying} (exit code -9, SIGKILL)" in text  # what the launcher saw
    return text


@pytest.mark.slow   # the dp x tp case below loses a TP peer mid-backward too (its rank 2)
def test_ranks_that_lose_a_peer_mid_step_raise_lost_rank_error_naming_it():
    text = _what_the_ranks_raise(3, 3, 3, 2)
    for survivor in (0, 1):                               # what each surviving rank raised
        assert f"rank {survivor} raised LostRankError: lost rank 2: the process has exited" in text
    assert "did not finish" not in text


@pytest.mark.slow   # a fresh 4-rank cluster that loses a rank (22 s); the fast tier keeps the TP fault cases
def test_a_dp_peer_lost_mid_step_is_named_by_every_rank():
    # dp 2 x tp 2: TP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3}. Rank 3 dies: rank 2 loses it
    # in TP's backward, rank 1 in the DP all-reduce, and rank 0, left waiting on the live rank 2
    # in the DP all-reduce, names what rank 2 found instead of blaming rank 2. That order needs a TP
    # collective before backward's first DP all-reduce: lm_head split by vocabulary puts its input's
    # f (an all-reduce in backward) ahead of ln_f's gradients, whose hooks start the DP all-reduces.
    # The planner replicates this tiny vocabulary's lm_head, and then the DP all-reduce comes first
    # and rank 0 waits on rank 1 in TP's instead.
    text = _what_the_ranks_raise(4, 2, 2, 3, {**MEGATRON_GPT2, "lm_head.weight": "vocab"})
    for survivor in (1, 2):
        assert f"rank {survivor} raised LostRankError: lost rank 3: the process has exited" in text
    rank0 = text[text.index("rank 0 raised"):].split("\nrank ")[0]
    assert rank0.startswith("rank 0 raised CommError"), text
    assert "rank 2 raised LostRankError: lost rank 3: the process has exited" in rank0, rank0
    assert "lost rank 2" not in text


def rank0_calls_the_roll_alone(timeout_s: float):
    if dist.get_rank() != 0:
        return None
    saved = faults._namespace
    faults._namespace = lambda: None  # as if the other ranks lived on other hosts
    try:
        return faults.roll_call(dist.group.WORLD, (0, 1, 2, 3), time.monotonic() - timeout_s, timeout_s,
                                since=time.time() - timeout_s)
    finally:
        faults._namespace = saved


def test_a_rank_that_never_answers_the_roll_call_is_named_silent(cluster):
    found = cluster.run(rank0_calls_the_roll_alone, 0.2)[0]
    assert found.silent == (1, 2, 3) and found.lost == (1, 2, 3)
    assert "lost ranks 1, 2, 3: no answer to autotp's roll call" in found.describe(0.2)


class _DictStore:
    def __init__(self, **keys) -> None:
        self.keys = keys

    def check(self, names):
        return all(n in self.keys for n in names)

    def get(self, name):
        return self.keys[name]


def test_a_fault_published_before_the_previous_collective_is_an_earlier_calls():
    # A persistent rank keeps its last fault in the store; a later roll call on a call that rank
    # joined since must not name it (it would blame a healthy rank for an old error).
    import json
    store = _DictStore(**{"autotp/fault/last/1": json.dumps({"rank": 1, "error": "ValueError: x", "at": 100.0})})
    assert faults._published_fault(store, 1, since=None)["error"] == "ValueError: x"
    assert faults._published_fault(store, 1, since=99.5)["rank"] == 1
    assert faults._published_fault(store, 1, since=100.5) is None
    assert faults._published_fault(store, 2, since=None) is None


def test_collective_timeout_defaults_to_300_s_and_reads_autotp_timeout(monkeypatch):
    monkeypatch.delenv("AUTOTP_TIMEOUT", raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT == datetime.timedelta(seconds=300)
    monkeypatch.setenv("AUTOTP_TIMEOUT", "42.5")
    assert collective_timeout() == datetime.timedelta(seconds=42.5)


@pytest.mark.parametrize("text", ["0", "-3", "soon"])
def test_a_bad_autotp_timeout_is_refused_with_the_default_named(monkeypatch, text):
    monkeypatch.setenv("AUTOTP_TIMEOUT", text)
    with pytest.raises(ConfigError, match=rf"AUTOTP_TIMEOUT='{text}' is not a positive number of seconds "
                                          r"\(unset it for the default of 300 s\)"):
        collective_timeout()


# ---- an exception inside a call on some ranks -------------------------------------------------

class _RaiseAtOp(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises ValueError at the ``at``-th ATen op run under it (0-based), once."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.seen = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        if self.seen == self.at + 1:
            raise ValueError(f"injected at op {self.at} ({func})")
        return func(*args, **(kwargs or {}))


def raise_inside_a_call_then_call_again(raising: tuple[int, ...], at: int, check_inputs: bool) -> dict:
    """Ranks in ``raising`` raise at op ``at`` of a call (past its first collectives when ``at`` is
    large), catch it and call again; every rank reports what its calls did."""
    torch.manual_seed(0)
    serial = tiny_gpt2(n_layer=1, n_head=3).double()
    pm = autotp.parallelize(serial, tp=3, layout=MEGATRON_GPT2)
    pm.check_inputs = check_inputs
    inputs = batch(100)
    first = pm(**inputs).loss.item()            # a healthy call
    out: dict = {"first_ok": abs(first - serial(**inputs).loss.item()) < 1e-9}
    try:
        with (_RaiseAtOp(at) if dist.get_rank() in raising else contextlib.nullcontext()):
            pm(**batch(100, seed=2))
        out["second"] = "returned"
    except Exception as e:      # the caught exception the job goes on after
        out["second"] = f"{type(e).__name__}: {e}"
    try:
        third = pm(**batch(100, seed=3)).loss.item()
        out["third"] = abs(third - serial(**batch(100, seed=3)).loss.item())
    except Exception as e:
        out["third"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow   # a fresh cluster left waiting in a collective (20 s a case)
@pytest.mark.parametrize("check_inputs", [True, False])
def test_a_rank_that_raises_inside_a_call_and_calls_again_fails_every_rank_clearly(check_inputs):
    # rank 1 raises at its 40th op (past the call's first all-reduce); ranks 0 and 2 are left
    # waiting in a collective. Without the guard, rank 1's next call pairs with theirs: a gloo
    # abort, or, with check_inputs=False, silently shifted results.
    with LocalCluster(3, timeout=120, collective_timeout=COLLECTIVE_TIMEOUT,
                      error_grace=COLLECTIVE_TIMEOUT + faults.SLACK_S) as cluster:
        results = cluster.run(raise_inside_a_call_then_call_again, (1,), 40, check_inputs)
    assert all(r["first_ok"] for r in results)
    assert results[1]["second"].startswith("ValueError: injected at op 40")
    for survivor in (0, 2):   # their collective times out; the roll call names the rank that raised
        assert results[survivor]["second"].startswith("CommError"), results[survivor]
        assert "rank 1 raised ValueError: injected at op 40" in results[survivor]["second"]
        assert "inside this call and left its collectives unfinished" in results[survivor]["second"]
        assert "can no longer be trusted" in results[survivor]["third"]
    assert results[1]["third"].startswith("CommError: rank 1 raised ValueError: injected at op 40")
    assert "inside a call; ranks [0, 2] then failed in a collective of that call" in results[1]["third"]


def test_ranks_that_all_raise_at_the_same_op_stay_in_step(cluster_of):
    # every rank raises at the same op, past the first collectives: the group stays usable and
    # the next call equals serial
    results = cluster_of(3).run(raise_inside_a_call_then_call_again, (0, 1, 2), 40, True)
    for r in results:
        assert r["first_ok"] and r["second"].startswith("ValueError: injected at op 40")
        assert isinstance(r["third"], float) and r["third"] < 1e-9, r


# ---- an exception inside a backward pass on some ranks ----------------------------------------

def raise_inside_backward_then_call_again(raising: tuple[int, ...], at: int) -> dict:
    """Ranks in ``raising`` raise at op ``at`` of a backward pass, catch it and call again."""
    torch.manual_seed(0)
    serial = tiny_gpt2(n_layer=1, n_head=3).double()
    pm = autotp.parallelize(serial, tp=3, layout=MEGATRON_GPT2)
    inputs = batch(100)
    pm(**inputs).loss.backward()                    # a healthy step
    out: dict = {}
    loss = pm(**batch(100, seed=2)).loss
    try:
        with (_RaiseAtOp(at) if dist.get_rank() in raising else contextlib.nullcontext()):
            loss.backward()
        out["backward"] = "returned"
    except Exception as e:
        out["backward"] = f"{type(e).__name__}: {e}"
    try:
        third = pm(**batch(100, seed=3)).loss
        out["next"] = abs(third.item() - serial(**batch(100, seed=3)).loss.item())
        third.backward()                             # the group works for backward too
    except Exception as e:
        out["next"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow   # a fresh cluster (20 s); the fast tier keeps the forward case and the shared-cluster backward one
def test_a_rank_that_raises_inside_backward_and_calls_again_fails_every_rank_clearly():
    # rank 1 raises at the 30th op of its backward, past its first backward collective; ranks 0
    # and 2 wait in the next one. Unguarded, rank 1's next call would pair its forward
    # collectives with their backward ones.
    with LocalCluster(3, timeout=120, collective_timeout=COLLECTIVE_TIMEOUT,
                      error_grace=COLLECTIVE_TIMEOUT + faults.SLACK_S) as cluster:
        results = cluster.run(raise_inside_backward_then_call_again, (1,), 30)
    assert results[1]["backward"].startswith("ValueError: injected at op 30"), results[1]
    for survivor in (0, 2):   # their backward collective times out; the roll call names rank 1
        assert results[survivor]["backward"].startswith("CommError"), results[survivor]
        assert "rank 1 raised an exception (the pass stopped before its end) inside the backward pass of a call" \
            in results[survivor]["backward"], results[survivor]
        assert "failed in a collective of its backward pass" in results[survivor]["next"], results[survivor]
    assert results[1]["next"].startswith("CommError: rank 1 raised an exception (the pass stopped before its end) "
                                         "inside the backward pass of a call; ranks [0, 2] then failed"), results[1]


def test_ranks_that_all_raise_at_the_same_backward_op_stay_in_step(cluster_of):
    for r in cluster_of(3).run(raise_inside_backward_then_call_again, (0, 1, 2), 30):
        assert r["backward"].startswith("ValueError: injected at op 30")
        assert isinstance(r["next"], float) and r["next"] < 1e-9, r
