"""Shared fixtures: one set of local gloo ranks for the whole session (spawning costs seconds)."""
import pytest

from autotp.testing_launch import LocalCluster


@pytest.fixture(scope="session")
def cluster():
    """Four persistent ranks; a task that breaks them makes the cluster restart its workers."""
    with LocalCluster(4) as c:
        yield c
