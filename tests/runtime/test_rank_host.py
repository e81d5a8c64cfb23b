"""A rank's host does no work per step that has no purpose in steady state.

A GPU rank with short kernels waits on its host, so the Python, ATen calls and autograd nodes a
rank's step adds to serial's are its cost there (``benchmarks/rank_host.py``). These tests count
them device-independently (:mod:`autotp.testing.host`) on one rank of tp 2 on torch's ``fake``
backend (collectives return at once), after a warm-up: Megatron's layout pinned, with sequence
parallelism forced (so the step runs every kind of collective: all-gathers, reduce-scatters,
scatters, f and g) and forbidden. What may not cost a step anything:

* the layout arithmetic of a split (``autotp.placements``: each rank's ranges, the widest part,
  whether it is even), which depends on the shard, the size and tp alone: worked out once;
* a functional collective's Python in eager code, where c10d's collective does the same into a
  buffer (the all-reduces of f and g are another matter, ``collectives._all_reduce``);
* a generator context manager, an import statement or ``copy.copy`` in what runs per collective
  or per parameter (the mappings, their layouts, the parameters' leaves and hooks), nor a compile
  check per parameter;
* a view of a collective's result made for dynamo's sake, in eager code.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.placements import Shard
from autotp.testing.host import MEGATRON, AtenCalls, PythonCalls

TP = 2


def _rank(family: str, layers: int, sequence_parallel: bool):
    config = zoo.tiny_config(family, layers=layers, heads=4, head_dim=8, vocab=64, positions=64)
    model = zoo.build(family, config)
    batch = zoo.example_batch(family, config, batch=1, seq=8, seed=0)
    pm = autotp.parallelize(model, TP, profile="h200", batch=8, seq=64, layout=MEGATRON[family],
                            sequence_parallel=sequence_parallel)
    return pm, batch


def _training(pm, batch):
    def step():
        pm.zero_grad(set_to_none=True)
        pm(**batch).loss.backward()
    step()
    step()   # warm: the programs built, the leaves made
    return step


def _inference(pm, batch):
    def step():
        with torch.no_grad():
            pm(input_ids=batch["input_ids"])
    pm.eval()
    step()
    step()
    return step


def _python(step) -> PythonCalls:
    with PythonCalls() as calls:
        step()
    return calls


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_steady_step_works_out_no_split_layout(fake_rank, family):
    pm, batch = _rank(family, 2, sequence_parallel=True)
    kinds = {type(m).__name__ for m in pm.graph_module.modules()}
    assert {"GatherIntoTP", "ReduceScatterToTP"} <= kinds or {"GatherFromTP", "ReduceScatterToTP"} <= kinds
    training = _python(_training(pm, batch)).by_file()
    inference = _python(_inference(pm, batch)).by_file()
    assert training["autotp/placements.py"] == inference["autotp/placements.py"] == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_gathers_and_reduce_scatters_call_c10d_not_functional_collectives(fake_rank, family):
    pm, batch = _rank(family, 2, sequence_parallel=True)
    step = _training(pm, batch)
    with AtenCalls() as aten:
        step()
    ops = aten.by_op
    assert ops["c10d._allgather_base_"] > 0 and ops["c10d._reduce_scatter_base_"] > 0
    functional = {op: n for op, n in ops.items() if op.startswith("_c10d_functional.")
                  and "all_reduce" not in op and "wait_tensor" not in op and "wrap_tensor" not in op}
    assert functional == {}
    # every wait is an all-reduce's (f's and g's, collectives._all_reduce)
    assert ops["_c10d_functional.wait_tensor"] <= ops["_c10d_functional.all_reduce"]


#: what autotp's code run per collective or per parameter (the mappings, their layouts, the
#: parameters' leaves and hooks) must not call in a steady step: a generator context manager, an
#: import statement, copy.copy, the layout arithmetic of a split
PER_COLLECTIVE = ("autotp/distributed/", "autotp/runtime/module/leaves.py")
NOT_THERE = ("/contextlib.py", "importlib._bootstrap>", "/copy.py", "autotp/placements.py")


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_context_manager_import_or_copy_per_collective_or_parameter(fake_rank, family, sequence_parallel):
    pm, batch = _rank(family, 2, sequence_parallel)
    calls = _python(_training(pm, batch)).by_caller
    found = {k: n for k, n in calls.items() if k.split(" -> ")[0].startswith(PER_COLLECTIVE)
             and k.split(" -> ")[1].rsplit(":", 1)[0].endswith(NOT_THERE)}
    assert found == {}


def test_the_compile_check_is_made_once_per_call_not_per_parameter(fake_rank):
    pm, batch = _rank("gpt2", 2, sequence_parallel=False)
    calls = _python(_training(pm, batch)).by_caller
    assert not any(k.startswith("autotp/runtime/module/leaves.py:program_tensor -> ") and "is_compiling" in k
                   for k in calls), [k for k in calls if "program_tensor ->" in k]


@pytest.mark.parametrize("mapping", ["gather", "reduce_scatter", "scatter"])
def test_an_eager_mapping_returns_what_it_computed_not_a_view_of_it(fake_rank, mapping):
    # a view of the result is made for dynamo alone (collectives._output): one more ATen call
    # and one more view's bookkeeping per collective in eager code
    from autotp.distributed import collectives as C

    group, shard = dist.group.WORLD, Shard(1)
    x = {"gather": torch.randn(2, 2, 3), "reduce_scatter": torch.randn(2, 4, 3),
         "scatter": torch.randn(2, 4, 3)}[mapping].requires_grad_()
    out = {"gather": lambda: C.gather_from_tp(x, group, shard, 4),
           "reduce_scatter": lambda: C.reduce_scatter_to_tp(x, group, shard, 4),
           "scatter": lambda: C.scatter_to_tp(x, group, shard, 4)}[mapping]()
    assert out.grad_fn is not None and not out._is_view()
    out.sum().backward()
    assert x.grad.shape == x.shape
