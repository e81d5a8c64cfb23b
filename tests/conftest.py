"""Shared fixtures: one set of local gloo ranks for the whole session (spawning costs seconds)."""
import gc
import os
import shutil
import tempfile

import pytest
import torch

from autotp import zoo
from autotp.capture import cache as capture_cache
from autotp.distributed.launch import LocalCluster, close_all, preload
from tests.helpers import fake_process_group

# pytest-xdist's workers share the cores: each computes on its share (torch's default, every
# core per process, makes two workers' thread pools contend for the same cores)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))

#: the fast tier's longest files on 2 cores, longest first (pytest --durations, summed per file:
#: the last fresh clone's two-worker figures where a file's cases were listed, files timed alone
#: otherwise): collected first, so that the two xdist workers (dev.py: one file at a time, in this
#: order) take them at the start and end together on the many short files. A file of one or two
#: long cases belongs here too: left to the end of the collection it would run alone on one worker
LONGEST_FIRST = ("tests/e2e/test_compile.py", "tests/e2e/test_experts.py", "tests/runtime/test_host_syncs.py",
                 "tests/e2e/test_training.py", "tests/passes/test_attention.py", "tests/runtime/test_pipeline.py",
                 "tests/e2e/test_torchrun.py", "tests/e2e/test_families.py", "tests/runtime/test_dcp_safety.py",
                 "tests/e2e/test_calls_after_training.py", "tests/e2e/test_generate.py",
                 "tests/passes/test_recurrent_plan.py", "tests/e2e/test_llama4.py",
                 "tests/passes/test_experts_plan.py", "tests/e2e/test_experts_row_scales.py",
                 "tests/passes/test_families_plan.py",
                 "tests/e2e/test_sequence_parallel_families.py", "tests/runtime/test_dtensor_params.py",
                 "tests/e2e/test_sliding_window.py", "tests/test_capture_cache.py", "tests/passes/test_rules.py",
                 "tests/e2e/test_sequence_parallel_gathers.py", "tests/test_capture_expand.py", "tests/test_plan.py",
                 "tests/passes/test_solve.py", "tests/test_fake_backend.py", "tests/e2e/test_calls.py")


def pytest_configure(config):
    """One folder of captures for the session (autotp/capture/cache.py, AUTOTP_CAPTURE_CACHE): the
    xdist workers and every rank process started from them export each structure once. Made by
    the process that starts the workers (they inherit its environment), removed at its end."""
    if os.environ.get("PYTEST_XDIST_WORKER") or capture_cache.FOLDER_ENV in os.environ:
        return
    config._autotp_captures = tempfile.mkdtemp(prefix="autotp-captures-")
    os.environ[capture_cache.FOLDER_ENV] = config._autotp_captures


def pytest_unconfigure(config):
    folder = getattr(config, "_autotp_captures", None)
    if folder is not None:
        os.environ.pop(capture_cache.FOLDER_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))   # stable: a file keeps its order


#: seconds a task on the shared clusters may take: a rank waits for its peers in every
#: collective, so with another worker's ranks on the same cores a task runs about twice as slow
#: as alone (the pipeline test's one task: 26-28 s alone, 58 s beside the other worker)
TASK_TIMEOUT = 120.0 * WORKERS

# what rank tasks import, imported once in the server the ranks fork from (seconds of CPU per
# rank otherwise: the suite starts tens of ranks)
preload("transformers", *zoo.modeling_modules(), "torch.export", "torch.distributed.tensor",
        "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.fsdp",
        "hypothesis", "pytest")

# the modules imported so far (torch, transformers, autotp, the modeling modules: some 400 thousand
# objects) live as long as the session: out of the collector's reach, a full collection walks only
# what the tests make (0.2-0.4 s each before, a few a minute in a worker). The ranks' fork server
# does the same (autotp/distributed/frozen.py)
gc.freeze()


@pytest.fixture(scope="session")
def cluster():
    """Four persistent ranks; a task that breaks them makes the cluster restart its workers."""
    with LocalCluster(4, timeout=TASK_TIMEOUT) as c:
        yield c


@pytest.fixture
def own_cluster():
    """Four ranks of this test's own, that no earlier test has run tasks on."""
    with LocalCluster(4, timeout=TASK_TIMEOUT) as c:
        yield c


#: rank processes cluster_of keeps alive at once (besides the shared four): clusters of several
#: world sizes stay up across test files, so each is spawned, and warms its caches, once a session
KEEP_RANKS = 10


@pytest.fixture(scope="session")
def cluster_of(cluster):
    """``cluster_of(world)``: persistent ranks of that world size (world 4: the shared ``cluster``).
    Clusters stay up while their ranks number at most KEEP_RANKS in all; beyond that the least
    recently used are closed."""
    current: dict = {}    # world -> cluster, least recently used first

    def get(world: int) -> LocalCluster:
        if world == 4:
            return cluster
        if world in current:
            current[world] = current.pop(world)
            return current[world]
        while current and sum(current) + world > KEEP_RANKS:
            current.pop(next(iter(current))).close()
        current[world] = LocalCluster(world, timeout=TASK_TIMEOUT)
        current[world].start()
        return current[world]

    yield get
    close_all([*current.values(), cluster])   # the ranks of every world leave together


@pytest.fixture
def fake_rank():
    """Rank 0 of a tp-2 world on torch's ``fake`` backend, in this process: collectives return at
    once, so a rank's program runs (and is counted) at its own size."""
    with fake_process_group(2) as group:
        yield group


@pytest.fixture
def fake_world():
    """``fake_world(tp)``: rank 0 of a tp-``tp`` world on torch's ``fake`` backend, in this process,
    started (a world already up destroyed first) when the test calls it; gone after the test.
    (``tests/test_fake_backend.py`` keeps its own, which starts any rank of tp 8.)"""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(tp: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
