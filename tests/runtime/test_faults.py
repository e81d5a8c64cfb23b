"""A dead rank is an error, not a hang: the surviving ranks raise LostRankError naming it."""
from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch.distributed as dist

import autotp
from autotp.errors import CommError, ConfigError
from autotp.runtime import faults
from autotp.runtime.mesh import DEFAULT_TIMEOUT, collective_timeout
from autotp.testing import MEGATRON_GPT2
from autotp.testing_launch import LocalCluster
from tests.helpers import batch, tiny_gpt2

pytestmark = pytest.mark.timeout(300)

COLLECTIVE_TIMEOUT = 20.0


def train_steps_where_the_last_rank_dies_in_backward() -> None:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=3), tp=3, layout=MEGATRON_GPT2)
    pm(**batch(100)).loss.backward()  # one healthy step: every connection is up
    loss = pm(**batch(100, seed=2)).loss
    if dist.get_rank() == 2:  # dies mid-step, between its forward and its backward collectives
        loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
    loss.backward()


def test_ranks_that_lose_a_peer_mid_step_raise_lost_rank_error_naming_it():
    # The others may report for the collective timeout plus the roll call's slack: a rank still
    # waiting in a collective on a live peer learns of the loss only when it times out.
    with LocalCluster(3, timeout=120, collective_timeout=COLLECTIVE_TIMEOUT,
                      error_grace=COLLECTIVE_TIMEOUT + faults.SLACK_S) as cluster:
        with pytest.raises(CommError) as info:
            cluster.run(train_steps_where_the_last_rank_dies_in_backward)
    text = str(info.value)
    assert "lost rank 2 (exit code -9, SIGKILL)" in text  # what the launcher saw
    for survivor in (0, 1):                               # what each surviving rank raised
        assert f"rank {survivor} raised LostRankError: lost rank 2: the process has exited" in text
    assert "did not finish" not in text


def rank0_calls_the_roll_alone(timeout_s: float):
    if dist.get_rank() != 0:
        return None
    saved = faults._namespace
    faults._namespace = lambda: None  # as if the other ranks lived on other hosts
    try:
        return faults.roll_call(dist.group.WORLD, (0, 1, 2, 3), time.monotonic() - timeout_s, timeout_s)
    finally:
        faults._namespace = saved


def test_a_rank_that_never_answers_the_roll_call_is_named_silent(cluster):
    found = cluster.run(rank0_calls_the_roll_alone, 0.2)[0]
    assert found.silent == (1, 2, 3) and found.lost == (1, 2, 3)
    assert "lost ranks 1, 2, 3: no answer to autotp's roll call" in found.describe(0.2)


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
