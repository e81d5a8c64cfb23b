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
  buffer (the all-reduces of f and g are another matter, ``comm._all_reduce``);
* a generator context manager, an import statement or ``copy.copy`` in what runs per collective
  or per parameter (the mappings, their layouts, the parameters' leaves and hooks), nor a compile
  check per parameter;
* a view of a collective's result made for dynamo's sake, in eager code;
* torch's Python around an eager collective or a parameter (``Function.apply``'s, ``dist``'s
  wrappers, a functional collective's pytree and dispatch, DTensor's ``__init__`` wrappers):
  an f or a g costs at most 18 calls through its module call, a parameter two;
* Python between the program's code and its ops and collectives (``OpOverload.__call__``, a
  submodule's lookup and module call, the compile checks): the program's eager code
  (``autotp/runtime/module/eager_code.py``) calls each op's C++ callable and each collective
  module's ``eager_forward``, a mapping's forward and backward at most 12 calls;
* ``zero_grad``'s walk of the modules (the programs' collective modules among them).

A training step makes no more calls than serial's forward and backward plus two per parameter
and 12 per collective module.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.placements import Shard
from autotp.testing.host import MEGATRON, AtenCalls, PythonCalls
from tests.helpers import fake_process_group

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


def _aten(step) -> AtenCalls:
    with AtenCalls() as calls:
        step()
    return calls


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
    # every wait is an all-reduce's (f's and g's, comm._all_reduce)
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


@pytest.fixture
def fake_rank_of_8():
    """Rank 0 of a tp-8 world on torch's ``fake`` backend, in this process."""
    with fake_process_group(8) as group:
        yield group


def _gpt2_of_8():
    config = zoo.tiny_config("gpt2", layers=2, heads=8, head_dim=8, vocab=64, positions=64)
    model = zoo.build("gpt2", config, seed=0)
    pm = autotp.parallelize(model, 8, profile="h200", batch=8, seq=64, layout=MEGATRON["gpt2"])
    return config, model, pm


def test_a_bias_inside_its_product_is_added_as_serial_adds_it(fake_rank_of_8):
    """GPT-2's Conv1D runs ``addmm(b, x.view(-1, in), W)``, W stored ``[in, out]``; a rank's
    column-parallel c_attn and c_fc run the same call (``autotp/passes/fused_bias.py``), not
    ``linear(x, W.T, b)``, whose transposes (W's, and linear's back, forward and backward) were
    ATen calls serial does not make: 16 a step here. Its view back reads x's sizes at run time: a
    second batch and sequence run on the same program."""
    config, model, pm = _gpt2_of_8()
    batch = zoo.example_batch("gpt2", config, batch=1, seq=8, seed=0)
    serial, rank = (_aten(_training(m, batch)) for m in (model, pm))
    assert rank.by_op["aten.addmm"] == 2 * 2   # c_attn and c_fc of two layers: their bias inside
    assert rank.by_op["aten.t"] <= serial.by_op["aten.t"], (rank.by_op["aten.t"], serial.by_op["aten.t"])
    other = zoo.example_batch("gpt2", config, batch=3, seq=5, seed=1)
    assert pm(**other).logits.shape == (3, 5, config.vocab_size)
    assert len(pm.programs) == 1


@pytest.mark.slow   # dynamo traces the program at two shapes: 15-40 s on 2 loaded cores
def test_a_bias_inside_its_product_compiles_to_one_graph(fake_rank_of_8):
    """Under ``torch.compile(fullgraph=True)`` (a break raises) each call is one graph that holds
    the products with their bias inside and no transpose; the second shape (dynamo's automatic
    dynamic shapes: a recompile) runs the same program."""
    config, model, pm = _gpt2_of_8()
    batches = [zoo.example_batch("gpt2", config, batch=b, seq=s, seed=b) for b, s in ((2, 8), (3, 5))]
    pm(**batches[0]).loss.backward()   # eager first: the call's program is built
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(pm, fullgraph=True, backend=backend)
    for batch in batches:
        compiled(**batch).loss.backward()
    assert graphs
    for gm in graphs:
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.aten.addmm.default) == 2 * 2
        assert torch.ops.aten.t.default not in targets
    assert len(pm.programs) == 1


# ---------------------------------------------------------------- torch's Python per collective and per parameter

def _extra_calls(step, bare) -> tuple[int, set]:
    """The Python calls ``step`` makes beyond ``bare`` (the same step without what is counted),
    and the files they are made in."""
    step(), bare()
    with PythonCalls() as counted:
        step()
    with PythonCalls() as base:
        bare()
    extra = {k: n - base.by_function.get(k, 0) for k, n in counted.by_function.items()}
    extra = {k: n for k, n in extra.items() if n > 0 and k.startswith(("autotp/", "torch/"))}
    return sum(extra.values()), {k.rsplit(":", 1)[0] for k in extra}


#: what a mapping's step may call into beyond autotp's own code: the module call, the one compile
#: check, autograd's calls of the Function's backward. Not pytree, a functional collective's
#: dispatch, dist's wrappers (c10d_logger, the group checks), Function.apply's Python, DTensor
MAPPING_FILES = {*(f"autotp/distributed/{m}.py" for m in ("collectives", "comm", "comm_modules", "exchange",
                                                       "gather_scatter", "shards")),
                 "torch/nn/modules/module.py", "torch/compiler/__init__.py",
                 "torch/_jit_internal.py", "torch/autograd/function.py"}


@pytest.mark.parametrize("mapping", ["f", "g"])
def test_an_f_or_a_g_costs_the_host_a_bounded_number_of_python_calls(fake_rank, mapping):
    """An f or a g, forward and backward, in eager code: at most 18 Python calls, each with a
    purpose: the module's call (``_wrapped_call_impl``, ``_call_impl``, ``forward``: 3), the
    mapping, its one compile check (``is_compiling``, ``is_scripting``) and ``_apply`` (4), the
    Function's forward (1), autograd's call of its backward (``apply``, ``_get_user_fn``,
    ``backward``: 3), the all-reduce, with its own compile check in backward where it runs there (f)
    or the view of dynamo's sake asked in forward (g) (3), the comm guard's ``__init__``,
    ``__enter__`` and ``__exit__`` (3), and the group's collective (1). Before: 141 (f, whose
    strided gradient went through the functional all-reduce's pytree and dispatch) and 39 (g)."""
    from autotp.distributed.comm_modules import CopyToTP, ReduceFromTP

    module = (CopyToTP if mapping == "f" else ReduceFromTP)(fake_rank, in_place=True)
    x = torch.randn(4, 8, requires_grad=True)
    calls, files = _extra_calls(lambda: module(x * 1).sum().backward(), lambda: (x * 1).sum().backward())
    assert files <= MAPPING_FILES, files - MAPPING_FILES
    assert calls <= 18, calls


@pytest.mark.parametrize("mapping", ["all_gather_f", "reduce_scatter", "all_gather"])
def test_an_eager_gather_or_reduce_scatter_calls_its_group_without_torchs_python(fake_rank, mapping):
    """Sequence parallelism's collectives (Megatron-SP's f̄ and ḡ) call their group's own c10d
    method: no ``dist`` wrapper (``c10d_logger``, the tensor and group checks, the coalescing
    state: five Python calls a collective), nor ``Function.apply``'s Python (seven)."""
    from autotp.distributed.comm_modules import GatherFromTP, GatherIntoTP, ReduceScatterToTP

    kind = {"all_gather_f": GatherIntoTP, "reduce_scatter": ReduceScatterToTP, "all_gather": GatherFromTP}[mapping]
    module = kind(fake_rank, Shard(1), 8)
    x = torch.randn(1, 8 if mapping == "reduce_scatter" else 4, 3, requires_grad=True)
    calls, files = _extra_calls(lambda: module(x * 1).sum().backward(), lambda: (x * 1).sum().backward())
    assert files <= MAPPING_FILES, files - MAPPING_FILES


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_parameter_costs_a_training_step_two_python_calls(fake_rank, family):
    """Through its local leaf a DTensor parameter costs the step two Python calls: its leaf looked
    up (``program_tensor``, once for each name the program reads it by) and its gradient handed to ``param.grad`` (the leaf's hook), the
    DTensor made by DTensor's C++ constructor, without ``__init__``'s dynamo and export wrappers
    (seven calls a parameter before) or a spec copy's call."""
    from torch.distributed.tensor import DTensor

    pm, batch = _rank(family, 2, sequence_parallel=False)
    params = sum(1 for p in pm.parameters() if isinstance(p, DTensor) and p.requires_grad)
    calls = _python(_training(pm, batch))
    leaves = {k: n for k, n in calls.by_function.items() if k.startswith("autotp/runtime/module/leaves.py:")}
    program, = (p for p in pm.programs if p.capture.training)
    fed = sum(1 for fqn in program.param_order if fqn not in program.outlined)   # a tied one under each name
    assert leaves == {"autotp/runtime/module/leaves.py:program_tensor": fed,
                      "autotp/runtime/module/leaves.py:hook": params}, (leaves, fed, params)
    # DTensor's Python runs for an output returned split alone (Llama's logits, vocab-split where its
    # q|k|v and gate|up run joined: a DTensor.from_local each, its dynamo wrapper included), never
    # for a parameter
    split = len(program.plan.sharded_outputs)
    api = {k.split(":")[1]: n for k, n in calls.by_function.items() if k.startswith("torch/distributed/tensor/_api.py:")}
    assert api.get("from_local", 0) == split and set(api) <= {"from_local", "forward", "__init__"}, api
    assert all(n == split for n in api.values()), api
    files = calls.by_file()
    assert files["torch/_dynamo/eval_frame.py"] <= 2 * split, files["torch/_dynamo/eval_frame.py"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_ranks_training_step_costs_the_host_its_ops_parameters_and_collectives(fake_rank, family,
                                                                                  sequence_parallel):
    """A rank's training step, its ``zero_grad`` included, makes no more Python calls than serial's
    forward and backward and, on top of them, what its program costs by construction: two per
    parameter (the test above) and at most 12 per collective module called (the eager code's call
    of it, ``EAGER_MAPPING_CALLS``); none per ATen op (the eager code calls each op's C++
    callable, as the model's code calls C functions) and none per module for ``zero_grad``. The
    call's own work (the ranks' agreement on it, the inputs bound and flattened, the program
    chosen) is paid from serial's calls that the program does not make: the model's modules'
    Python, which the rank's one graph replaces. Before: one call per ATen op
    (``OpOverload.__call__``), 20 per collective, and zero_grad's walk of the modules (the
    programs' collective modules among them), every case over the bound (gpt2 with sequence
    parallelism: 1,436 calls against 975; here 585)."""
    from torch.distributed.tensor import DTensor

    from autotp.distributed.comm_modules import _CommModule

    pm, batch = _rank(family, 2, sequence_parallel)
    serial = zoo.build(family, zoo.tiny_config(family, layers=2, heads=4, head_dim=8, vocab=64, positions=64))
    serial_calls = _python(_training(serial, batch)).total - _python(serial.zero_grad).total   # its forward, backward
    rank_calls = _python(_training(pm, batch)).total   # its zero_grad too
    graph = pm.graph_module.graph
    comms = sum(1 for n in graph.nodes if n.op == "call_module"
                and isinstance(pm.graph_module.get_submodule(n.target), _CommModule))
    params = sum(1 for p in pm.parameters() if isinstance(p, DTensor) and p.requires_grad)
    budget = serial_calls + 2 * params + max(EAGER_MAPPING_CALLS.values()) * comms
    assert rank_calls <= budget, (rank_calls, budget, serial_calls, params, comms)


# ---------------------------------------------------------------- the program's eager code

#: the Python calls of a mapping's forward and backward in the eager code, at most: the code's call
#: of the module's ``eager_forward`` and the Function's ``forward`` (2); the collective's helpers
#: (``_all_gather`` and ``_gather_into``, ``_reduce_scatter``, ``_all_reduce``, a scatter's
#: ``rank_slice``: 1 or 2) and its start noted for a failure's roll call (``_started``, 1);
#: autograd's call of the backward (``apply``, ``_get_user_fn``, ``backward``: 3), its one compile
#: check where it communicates or slices (``is_compiling``, ``is_scripting``: 2: compiled
#: autograd may trace a backward whose forward ran eagerly), and the reverse collective's
#: helpers and start (1 to 3). Before: no such path; the module call cost 13 to 24
EAGER_MAPPING_CALLS = {"f": 9, "g": 7, "all_gather": 11, "all_gather_f": 12, "reduce_scatter": 12, "scatter": 11}


@pytest.mark.parametrize("mapping", sorted(EAGER_MAPPING_CALLS))
def test_a_mapping_in_the_eager_code_costs_its_forward_and_backward_at_most_a_dozen_calls(fake_rank, mapping):
    from autotp.distributed.comm_modules import (CopyToTP, GatherFromTP, GatherIntoTP, ReduceFromTP,
                                                 ReduceScatterToTP, ScatterToTP)

    if mapping in ("f", "g"):
        module, shape = (CopyToTP if mapping == "f" else ReduceFromTP)(fake_rank, in_place=True), (4, 8)
    else:
        kind = {"all_gather": GatherFromTP, "all_gather_f": GatherIntoTP, "reduce_scatter": ReduceScatterToTP,
                "scatter": ScatterToTP}[mapping]
        module, shape = kind(fake_rank, Shard(1), 8), (1, 4 if "gather" in mapping else 8, 3)
    x = torch.randn(*shape, requires_grad=True)

    def step():
        y = module.eager_forward(x * 1)
        y.backward(torch.ones_like(y))   # a dense gradient, as a program's are

    calls, files = _extra_calls(step, lambda: (x * 1).backward(torch.ones(shape)))
    assert files <= MAPPING_FILES, files - MAPPING_FILES
    assert calls <= EAGER_MAPPING_CALLS[mapping], calls


#: what the program's code may not call: an op's Python ``OpOverload.__call__`` (the eager code
#: calls its C++ callable) or a submodule's lookup (bound, not read through ``Module.__getattr__``)
NOT_FROM_THE_CODE = ("torch/_ops.py:__call__", "torch/nn/modules/module.py:__getattr__")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_programs_eager_code_calls_ops_and_collectives_without_python_between(fake_rank, family):
    """In a steady training step with sequence parallelism (every kind of collective), the
    program's code (fx's forward, its own frame: ``<...>:forward``) calls no ``OpOverload`` through
    Python and looks no submodule up; a collective module is called through its
    ``eager_forward``, and only the other modules (the table read by columns) through a module
    call. Before: one ``OpOverload.__call__`` per op node and a lookup and a module call per
    collective (gpt2: 456 and 101 a step of 12 layers)."""
    from autotp.distributed.comm_modules import _CommModule

    pm, batch = _rank(family, 2, sequence_parallel=True)
    calls = _python(_training(pm, batch)).by_caller
    from_code = Counter()
    for key, n in calls.items():
        caller, callee = key.split(" -> ")
        if caller.startswith("<") and caller.endswith(":forward"):
            from_code[callee] += n
    assert not {c: from_code[c] for c in NOT_FROM_THE_CODE if from_code[c]}, from_code
    gm = pm.graph_module
    modules = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    comms = sum(isinstance(m, _CommModule) for m in modules)
    assert comms and from_code["autotp/distributed/comm_modules.py:eager_forward"] == comms, (from_code, comms)
    assert from_code["torch/nn/modules/module.py:_wrapped_call_impl"] == len(modules) - comms, from_code


def test_the_eager_code_is_made_again_when_the_graph_is_recompiled(fake_rank):
    """The eager code is the graph module's code as it is now: a graph edited and recompiled
    after a call (a pass, per-layer FSDP2's outline) runs as edited."""
    pm, batch = _rank("gpt2", 1, sequence_parallel=False)
    with torch.no_grad():
        before = pm(**batch).loss
        program = pm.programs[-1]
        first = program.eager
        assert first is not None and program.eager_of is program.graph_module._code
        gm = program.graph_module
        out = next(n for n in gm.graph.nodes if n.op == "output")
        loss, *rest = out.args[0]   # a training call's outputs: the loss first
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (loss, 2.0))
        out.args = ((doubled, *rest),)
        gm.recompile()
        after = pm(**batch).loss
    assert program.eager is not first and program.eager_of is gm._code
    assert torch.equal(after, before * 2)


def test_zero_grad_resets_every_gradient_without_walking_modules_in_python(fake_rank):
    """``pm.zero_grad()`` is one Python call (its own): a loop over the modules' parameter dicts,
    not ``parameters()``'s generators (before: 1,300 calls here, 2,300 a step of gpt2 with 12
    layers under sequence parallelism); every gradient reset as ``nn.Module.zero_grad`` resets it.
    (``set_to_none=False`` zeroes each DTensor gradient through DTensor's Python dispatch, as
    torch's does: those calls are the gradients', not the walk's.)"""
    pm, batch = _rank("gpt2", 2, sequence_parallel=True)
    pm(**batch).loss.backward()
    grads = {n: p.grad for n, p in pm.named_parameters()}
    assert all(g is not None for g in grads.values())
    for set_to_none in (False, True):
        with PythonCalls() as calls:
            pm.zero_grad(set_to_none=set_to_none)
        walk = [k for k in calls.by_function if k.startswith("torch/nn/modules/module.py:")]
        assert not walk and (calls.total == 1 or not set_to_none), calls.by_function.most_common(5)
        for name, p in pm.named_parameters():
            if set_to_none:
                assert p.grad is None, name
            else:
                assert p.grad is grads[name] and not p.grad.to_local().any(), name


@pytest.mark.parametrize("mapping", ["all_gather_f", "reduce_scatter"])
def test_a_sequence_parallel_collective_makes_the_aten_calls_it_needs_and_no_more(fake_rank, mapping):
    """Megatron-SP's f̄ (all-gather forward, reduce-scatter backward) and ḡ (the reverse), eagerly,
    of a batch of one: seven ATen calls, forward and backward together: the two c10d collectives,
    a fresh buffer for each one's result (``new_empty``), one view of each buffer (the gather's
    into the full shape, the reduce-scatter's send as the ranks' blocks), and the forward's input
    detached (it records; the gradient in backward does not). Before: ten (the gradient detached
    too, each buffer viewed ``[tp, *local]`` and again)."""
    from autotp.distributed.comm_modules import GatherIntoTP, ReduceScatterToTP

    module = (GatherIntoTP if mapping == "all_gather_f" else ReduceScatterToTP)(fake_rank, Shard(1), 8)
    x = torch.randn(1, 4 if mapping == "all_gather_f" else 8, 3, requires_grad=True)

    def step():
        y = module.eager_forward(x * 1)
        y.backward(torch.ones_like(y))

    def bare():
        y = x * 1
        y.backward(torch.ones_like(y))

    step(), bare()
    extra = _aten(step).by_op - _aten(bare).by_op
    assert extra["c10d._allgather_base_"] == extra["c10d._reduce_scatter_base_"] == 1, extra
    assert sum(extra.values()) <= 7, extra
