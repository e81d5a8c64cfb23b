"""Shared fixtures: one set of local gloo ranks for the whole session (spawning costs seconds)."""
import pytest

from autotp.testing_launch import LocalCluster


@pytest.fixture(scope="session")
def cluster():
    """Four persistent ranks; a task that breaks them makes the cluster restart its workers."""
    with LocalCluster(4) as c:
        yield c


@pytest.fixture(scope="session")
def cluster_of():
    """``cluster_of(world)``: persistent ranks of that world size; the previous one is closed
    when another size is asked for (tests that use it are ordered by world size)."""
    current: dict = {}

    def get(world: int) -> LocalCluster:
        if world not in current:
            for c in current.values():
                c.close()
            current.clear()
            current[world] = LocalCluster(world)
            current[world].start()
        return current[world]

    yield get
    for c in current.values():
        c.close()
