"""Local ranks: results come back in rank order, errors keep their type, nothing hangs.

Also the mesh: TP groups of neighbouring ranks, DP groups across them, and get_mesh's errors.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from autotp.errors import CommError, ConfigError
from autotp.distributed import mesh as mesh_module
from autotp.distributed.collectives import reduce_from_tp
from autotp.distributed.mesh import get_mesh, init_from_env
from autotp.distributed.launch import LocalCluster, launch

# A failure test that hangs fails here instead of stalling the suite.
pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- tasks run in the ranks

def rank_info(tag: str) -> tuple:
    return dist.get_rank(), dist.get_world_size(), tag, torch.get_num_threads(), os.environ["RANK"]


def raise_config_error() -> None:
    raise ConfigError(f"tp=3 does not fit (rank {dist.get_rank()})")


def all_reduce_ones() -> torch.Tensor:
    return reduce_from_tp(torch.ones(2), dist.group.WORLD)


def rank1_exits_mid_collective() -> torch.Tensor:
    if dist.get_rank() == 1:
        os._exit(7)
    return all_reduce_ones()


def last_rank_killed_mid_collective() -> torch.Tensor:
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return all_reduce_ones()


def rank0_raises_while_others_wait() -> torch.Tensor:
    if dist.get_rank() == 0:
        raise ValueError("rank 0 gave up")
    return all_reduce_ones()


def mesh_layout(tp: int) -> tuple:
    mesh = get_mesh(tp)
    assert get_mesh(tp) is mesh  # cached: no new groups on the next call
    tp_sum = reduce_from_tp(torch.tensor([float(dist.get_rank())]), mesh.tp_group)
    return mesh.tp_ranks, mesh.dp_ranks, mesh.tp_rank, mesh.dp_rank, mesh.dp, tp_sum.item()


def get_mesh_message(tp) -> str:
    try:
        get_mesh(tp)
    except ConfigError as e:
        return str(e)
    return "no error"


def backend_from_env() -> str | None:
    return init_from_env()


def rank1_never_joins_the_all_reduce() -> None:
    if dist.get_rank() == 1:
        return None
    return all_reduce_ones()


def start_state(name: str) -> tuple:
    import gc
    import sys

    # the server's imports frozen out of the collector's reach (autotp/distributed/frozen.py)
    frozen = gc.get_freeze_count() > 50_000
    return os.environ.get(name), "transformers" in sys.modules, torch.get_num_threads(), frozen


# ---------------------------------------------------------------- launch

def test_launch_returns_per_rank_results_in_rank_order():
    assert launch(rank_info, 2, "hi") == [(0, 2, "hi", 1, "0"), (1, 2, "hi", 1, "1")]


def test_ranks_get_the_callers_environment_of_now_and_start_from_the_preloaded_server(monkeypatch):
    launch(rank_info, 1, "the fork server is running from here on")
    monkeypatch.setenv("AUTOTP_TEST_LATE_VARIABLE", "set after the server started")
    # conftest preloads transformers: a rank has it without importing it, and the collector does not
    # walk it (frozen); one thread per rank
    assert launch(start_state, 2, "AUTOTP_TEST_LATE_VARIABLE") == [("set after the server started", True, 1, True)] * 2
    monkeypatch.setenv("AUTOTP_START_METHOD", "spawn")   # a fresh interpreter: nothing preloaded
    assert launch(start_state, 1, "AUTOTP_TEST_LATE_VARIABLE") == [("set after the server started", False, 1, False)]
    monkeypatch.setenv("AUTOTP_START_METHOD", "fork")
    with pytest.raises(ConfigError, match="AUTOTP_START_METHOD='fork': choose forkserver or spawn"):
        launch(rank_info, 1, "x")


def test_a_task_that_does_not_finish_in_time_reports_where_each_stuck_rank_waits():
    with LocalCluster(2, timeout=6.0, collective_timeout=60.0) as cluster:
        with pytest.raises(CommError) as caught:
            cluster.run(rank1_never_joins_the_all_reduce)
    message = str(caught.value)
    assert "ranks [0] did not finish rank1_never_joins_the_all_reduce within 6 s" in message, message
    assert "rank 0 was here (most recent call first):" in message, message
    assert "in all_reduce_ones" in message and "in rank1_never_joins_the_all_reduce" in message, message


def test_launch_reraises_an_autotp_error_with_its_type_rank_and_traceback():
    with pytest.raises(ConfigError, match=r"tp=3 does not fit \(rank 0\)") as info:
        launch(raise_config_error, 2)
    assert "raised on rank 0 of 2" in str(info.value)
    assert "Traceback" in str(info.value) and "raise_config_error" in str(info.value)


def test_launch_reports_a_rank_that_exits_mid_collective_instead_of_hanging():
    with pytest.raises(CommError, match=r"lost rank 1 \(exit code 7\)"):
        launch(rank1_exits_mid_collective, 2, timeout=20)


def test_launch_refuses_a_function_the_ranks_cannot_import():
    with pytest.raises(ConfigError, match="module-level function"):
        launch(lambda: None, 2)


# ---------------------------------------------------------------- LocalCluster after failures

@pytest.fixture(scope="module")
def small_cluster():
    with LocalCluster(2, timeout=20, error_grace=1.0) as c:
        yield c


def test_cluster_restarts_after_a_rank_is_killed_mid_collective(small_cluster):
    with pytest.raises(CommError, match=r"lost rank 1 \(exit code -9, SIGKILL\)") as info:
        small_cluster.run(last_rank_killed_mid_collective)
    assert "fresh ones on next use" in str(info.value)
    assert small_cluster.run(rank_info, "again")[1][:3] == (1, 2, "again")


def test_cluster_restarts_when_one_rank_raises_and_the_others_wait_in_a_collective(small_cluster):
    with pytest.raises(CommError, match="rank 0 raised ValueError: rank 0 gave up") as info:
        small_cluster.run(rank0_raises_while_others_wait)
    assert "ranks [1] did not finish" in str(info.value)
    assert [t.tolist() for t in small_cluster.run(all_reduce_ones)] == [[2.0, 2.0]] * 2


def test_cluster_stays_usable_when_every_rank_raises(cluster):
    with pytest.raises(ConfigError, match="ranks that failed: \\[0, 1, 2, 3\\]"):
        cluster.run(raise_config_error)
    assert [r[0] for r in cluster.run(rank_info, "next")] == [0, 1, 2, 3]


# ---------------------------------------------------------------- mesh

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_groups_are_neighbours_and_dp_groups_are_strided(cluster, tp):
    for rank, (tp_ranks, dp_ranks, tp_rank, dp_rank, dp, tp_sum) in enumerate(cluster.run(mesh_layout, tp)):
        first = rank - rank % tp
        assert tp_ranks == tuple(range(first, first + tp)) and tp_rank == rank % tp
        assert dp_ranks == tuple(range(rank % tp, 4, tp)) and dp_rank == rank // tp and dp == 4 // tp
        assert tp_sum == sum(tp_ranks)  # the group really is those ranks


def test_get_mesh_lists_the_divisors_when_tp_does_not_divide_the_world(cluster):
    assert cluster.run(get_mesh_message, 3) == ["world size 4 is not divisible by tp=3; choose tp in {1, 2, 4}"] * 4


@pytest.mark.parametrize("tp", [0, -2, True, 2.0, "2"])
def test_get_mesh_rejects_a_tp_that_is_not_a_positive_integer(tp):
    with pytest.raises(ConfigError, match="tp must be a positive integer") as info:
        get_mesh(tp)
    assert repr(tp) in str(info.value)


def test_get_mesh_without_a_process_group_says_how_to_start_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="needs an initialized torch.distributed process group") as info:
        get_mesh(2)
    assert "torchrun" in str(info.value) and "LocalCluster" in str(info.value)
    assert init_from_env() is None


def test_init_from_env_keeps_an_initialized_world(cluster):
    assert cluster.run(backend_from_env) == ["gloo"] * 4


def test_default_timeout_is_documented():
    assert mesh_module.DEFAULT_TIMEOUT.total_seconds() == 300
    assert "300 s" in mesh_module.__doc__
