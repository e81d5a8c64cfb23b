"""Nothing silently wrong: calls that pair up wrongly across ranks, ranks that received other
weights or other data, a parallel module sharing state with its source, and collectives a dead
rank leaves unanswered are each a clear error on every rank (never an abort, never wrong numbers)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autotp
from autotp.errors import ConfigError, DisagreementError
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, call_while_another_runs, outcome, tiny_gpt2

pytestmark = pytest.mark.timeout(300)


def _last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


# ---- 1. every call is matched or refused ------------------------------------------------------

def _two_modules(widths_differ: bool = False):
    a = autotp.parallelize(tiny_gpt2(n_layer=1, seed=0), tp=4, layout=MEGATRON_GPT2)
    b = autotp.parallelize(tiny_gpt2(n_layer=1, seed=1, head_dim=16 if widths_differ else 8), tp=4,
                           layout=MEGATRON_GPT2)
    return a, b


def call_two_modules_in_another_order_on_the_last_rank(widths_differ: bool) -> str:
    a, b = _two_modules(widths_differ)
    first, second = (b, a) if _last_rank() else (a, b)

    def calls():
        first(**batch(100))
        second(**batch(100))

    return outcome(calls)


@pytest.mark.parametrize("widths_differ", [False, True], ids=["same-widths", "other-widths"])
def test_modules_called_in_another_order_on_one_rank_fail_every_rank_naming_the_call_order(cluster, widths_differ):
    # before: same widths gave logits wrong by ~100% with no error; other widths a gloo SIGABRT
    results = cluster.run(call_two_modules_in_another_order_on_the_last_rank, widths_differ)
    for text in results:
        assert text.startswith("DisagreementError"), results
        # the modules' numbers count every module the persistent ranks made: b's is a's plus one
        found = re.search(r"ranks 0, 1, 2: 'call 1 of GPT2LMHeadModel #(\d+)'; rank 3: 'call 1 of GPT2LMHeadModel "
                          r"#(\d+)'", text)
        assert found and int(found[2]) == int(found[1]) + 1, text
        assert "call their parallel modules, or run their backward passes, in a different order" in text


def skip_a_call_on_the_last_rank_then_call_another_module() -> str:
    a, b = _two_modules()

    def calls():
        a(**batch(100))
        if not _last_rank():   # user code that raised before this call on one rank, caught
            a(**batch(100, seed=2))
        b(**batch(100))

    return outcome(calls)


def test_a_call_skipped_on_one_rank_fails_every_rank_at_the_next_call(cluster):
    results = cluster.run(skip_a_call_on_the_last_rank_then_call_another_module)
    for text in results:
        assert text.startswith("DisagreementError"), results
        found = re.search(r"ranks 0, 1, 2: 'call 2 of GPT2LMHeadModel #(\d+)'; rank 3: 'call 1 of GPT2LMHeadModel "
                          r"#(\d+)'", text)
        assert found and int(found[2]) == int(found[1]) + 1, text


def skip_a_call_of_one_module_on_the_last_rank() -> str:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    pm.check_inputs = "values"

    def calls():
        for step in range(3):
            if _last_rank() and step == 1:
                continue
            pm(**batch(100, seed=step))

    return outcome(calls)


def test_a_call_skipped_on_one_rank_is_caught_by_the_value_check(cluster):
    # the same module, the same shapes: only the batches' values tell the ranks' calls apart
    results = cluster.run(skip_a_call_of_one_module_on_the_last_rank)
    for text in results:
        assert text.startswith("DisagreementError"), results
        assert "the inputs of this call differ" in text and "input_ids values" in text


def skip_one_backward_on_the_last_rank() -> str:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    pm(**batch(100)).loss.backward()

    def steps():
        loss = pm(**batch(100, seed=2)).loss
        if not _last_rank():
            loss.backward()
        pm(**batch(100, seed=3)).loss.backward()

    return outcome(steps)


def test_a_backward_skipped_on_one_rank_fails_every_rank_naming_it(cluster):
    # before: a gloo SIGABRT (rank 3's next forward paired with the others' backward)
    results = cluster.run(skip_one_backward_on_the_last_rank)
    for text in results:
        assert text.startswith("DisagreementError"), results
        assert "ranks 0, 1, 2: 'the backward pass of call 2 of GPT2LMHeadModel #" in text, text
        assert "rank 3: 'call 3 of GPT2LMHeadModel #" in text


def call_one_module_from_two_threads() -> tuple[str, float]:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    return call_while_another_runs(pm, lambda: pm(**batch(100)).loss.item(), lambda: pm(**batch(100)))


def test_one_module_called_from_two_threads_at_once_is_refused(cluster):
    for second, loss in cluster.run(call_one_module_from_two_threads):
        assert second.startswith("ConfigError: this GPT2LMHeadModel #"), second
        assert "is already running a call in another thread" in second
        assert loss == loss   # the first call went on


# ---- 2. agreement covers the data that decides results ---------------------------------------

def parallelize_a_model_built_with_another_seed_on_the_last_rank() -> None:
    autotp.parallelize(tiny_gpt2(n_layer=1, seed=7 if _last_rank() else 0), tp=4, layout=MEGATRON_GPT2)


def test_ranks_whose_models_hold_other_weights_fail_naming_the_first_parameter(cluster):
    # before: wrong by ~100% with no error (the agreement fingerprinted structure, not weights)
    with pytest.raises(DisagreementError) as info:
        cluster.run(parallelize_a_model_built_with_another_seed_on_the_last_rank)
    text = str(info.value)
    assert "the model's parameters and buffers differ" in text
    assert "'transformer.wte.weight: " in text
    assert "ranks that failed: [0, 1, 2, 3]" in text


class ScaledMlp(nn.Module):
    """up, relu, down, times an integer constant ``k`` and a buffer ``scale``."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.k = k

    def forward(self, x):
        h = torch.relu(self.up(x))    # (b, s, 16)
        return self.down(h) * self.scale * self.k


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5))


def _scaled(k: int = 3):
    return autotp.parallelize(ScaledMlp(k), tp=4, example_kwargs={"x": _x()},
                              layout={"up.weight": "column", "down.weight": "row"})


def parallelize_with_another_integer_constant_on_the_last_rank() -> None:
    _scaled(4 if _last_rank() else 3)


def test_an_integer_constant_that_differs_across_ranks_fails_every_rank(cluster):
    # before: undetected (the fingerprint wrote every int as "int"), wrong by ~100%
    with pytest.raises(DisagreementError) as info:
        cluster.run(parallelize_with_another_integer_constant_on_the_last_rank)
    text = str(info.value)
    assert "the captured graphs differ" in text and "'3')" in text and "'4')" in text
    assert "ranks that failed: [0, 1, 2, 3]" in text


def call_with_other_ids_of_the_same_shape_on_the_last_rank() -> str:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    pm(**batch(100, seed=5 if _last_rank() else 1))   # unchecked by default: shapes agree
    pm.check_inputs = "values"
    return outcome(lambda: pm(**batch(100, seed=5 if _last_rank() else 1)))


def test_inputs_of_other_values_fail_every_rank_with_check_inputs_values(cluster):
    for text in cluster.run(call_with_other_ids_of_the_same_shape_on_the_last_rank):
        assert text.startswith("DisagreementError: the inputs of this call differ"), text
        assert "'input_ids values: " in text


def test_value_digest_is_exact_and_sees_every_element_and_its_place():
    from autotp.distributed.agreement import value_digest

    x = torch.randn(3 * (1 << 20) + 7, generator=torch.Generator().manual_seed(0))   # several chunks
    assert value_digest(x) == value_digest(x.clone())
    nudged = x.clone()
    nudged[2 * (1 << 20) + 3] = torch.nextafter(nudged[2 * (1 << 20) + 3], torch.tensor(1.0))
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]
    assert len({value_digest(t) for t in (x, nudged, swapped, x.double(), x[:-1])}) == 5
    for t in (torch.ones(3, dtype=torch.bool), torch.ones(5, dtype=torch.bfloat16), torch.ones(2, dtype=torch.complex64),
              torch.arange(6).view(2, 3).t()):   # every dtype width, a non-contiguous view
        assert value_digest(t) == value_digest(t.clone())


def test_check_inputs_takes_true_false_or_values():
    from autotp.runtime.module.module import _check_inputs_mode

    assert [_check_inputs_mode(v) for v in (True, False, "values")] == [True, False, "values"]
    with pytest.raises(ConfigError, match=r"check_inputs='all' is not valid: use True \(names, shapes and dtypes"):
        _check_inputs_mode("all")


# ---- 3. the parallel module owns its state ----------------------------------------------------

def change_the_source_after_parallelize() -> dict:
    model = ScaledMlp()
    pm = autotp.parallelize(model, tp=4, example_kwargs={"x": _x()},
                            layout={"up.weight": "column", "down.weight": "row"})
    want = model(_x()).detach()
    model.scale.mul_(3)                         # the user's model changes
    out = {"output": (pm(x=_x()) - want).abs().max().item()}
    state = pm.state_dict()
    state["scale"] = torch.full((8,), 5.0)
    pm.load_state_dict(state)
    out["source scale"] = model.scale.tolist()  # the user's model, untouched by pm's load
    out["pm scale"] = pm.get_buffer("scale").tolist()
    out["float64"] = outcome(pm.double)
    out["float"] = outcome(pm.float)           # float32 already: nothing changes
    return out


def test_the_parallel_module_owns_its_buffers_and_refuses_a_dtype_change(cluster):
    # before: source.scale.mul_(3) changed pm's output (wrong by 200%), pm.load_state_dict wrote
    # into the source model, pm.double() silently kept float32 programs
    for r in cluster.run(change_the_source_after_parallelize):
        assert r["output"] < 1e-6, r
        assert r["source scale"] == pytest.approx([3 * v for v in torch.linspace(0.5, 1.5, 8).tolist()])
        assert r["pm scale"] == [5.0] * 8
        assert r["float64"].startswith("ConfigError: pm.double() / pm.to(dtype) after parallelize"), r
        assert r["float"] == "returned"


# ---- 5. every collective autotp issues goes through the fault handling ------------------------

def fail_planning_on_the_last_rank() -> str:
    layout = dict(MEGATRON_GPT2)
    if _last_rank():
        layout["*.mlp.c_fc.weight"] = "sideways"
    return outcome(lambda: autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=layout))


def test_one_ranks_bad_argument_fails_every_rank_with_its_message(cluster):
    results = cluster.run(fail_planning_on_the_last_rank)
    assert results[3].startswith("ConfigError: layout for *.mlp.c_fc.weight: unknown role 'sideways'")
    for text in results[:3]:   # the same message, said to come from rank 3
        assert text.startswith("ConfigError: rank 3 failed to capture or plan the model: layout for "
                               "*.mlp.c_fc.weight: unknown role 'sideways'"), text


def die_on_rank_1_in(where: str, path: str = "") -> None:
    """Rank 1 is killed at ``where``; the others go on into the collective it never joins."""
    import os
    import signal

    import autotp.api
    from autotp.capture import cache as capture_cache
    from autotp.runtime.checkpoint import dcp

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    dying = dist.get_rank() == 1
    # a capture is made on rank 0 and sent (autotp/distributed/captures.py): every rank first asks
    # its capture cache whether it holds the program, then joins the exchange
    if where == "capture" and dying:           # inside parallelize, before its first collective
        capture_cache.lookup = die
    if where == "seed" and dying:              # in the dropout seed's broadcast
        autotp.api._agreed_seed = die
    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=2), tp=2, layout=MEGATRON_GPT2)
    pm(**batch(100))
    if where == "new call" and dying:          # capturing the program of a new call signature
        capture_cache.lookup = die
    if where == "barrier" and dying:           # in a checkpoint's first exchange (autotp.runtime.checkpoint.dcp_safety)
        dcp.safety.agree_to_start = die
    if where == "new call":
        pm.eval()
        pm(**batch(100))
    if where == "barrier":
        dcp.save(pm, path)


@pytest.mark.slow   # a fresh cluster that loses a rank, per case (~15 s each)
@pytest.mark.parametrize("where", ["capture", "seed", "new call", "barrier"])
def test_a_rank_lost_in_any_collective_of_autotp_is_named_by_the_survivor(where, tmp_path):
    from autotp.errors import CommError
    from autotp.distributed import faults
    from autotp.distributed.launch import LocalCluster
    from tests.runtime.test_faults import COLLECTIVE_TIMEOUT

    # before: a raw gloo "Connection closed by peer", or a timeout that names no rank
    with LocalCluster(2, timeout=120, collective_timeout=COLLECTIVE_TIMEOUT,
                      error_grace=COLLECTIVE_TIMEOUT + faults.SLACK_S) as cluster:
        with pytest.raises(CommError) as info:
            cluster.run(die_on_rank_1_in, where, str(tmp_path / "ckpt"))
    text = str(info.value)
    assert "lost rank 1 (exit code -9, SIGKILL)" in text   # what the launcher saw
    assert "rank 0 raised LostRankError: lost rank 1: the process has exited" in text, text


def load_then_change_a_replicated_parameter_on_the_last_rank(path: str) -> list[str]:
    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    dcp.save(pm, path)
    out = [outcome(dcp.load, pm, path)]        # every rank loaded the same replicated values
    if _last_rank():                            # as a load that gave one rank other values would
        with torch.no_grad():
            pm.local_parameter("transformer.h.0.ln_1.weight").add_(1.0)
    out.append(outcome(pm.check_replicas))
    return out


def test_replicated_parameters_that_differ_after_a_load_fail_every_rank(cluster, tmp_path):
    for loaded, checked in cluster.run(load_then_change_a_replicated_parameter_on_the_last_rank,
                                       str(tmp_path / "ckpt")):
        assert loaded == "returned", loaded
        assert checked.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group disagree on what they "
                                  "replicate"), checked
        assert "the replicated parameters and buffers differ" in checked and "'transformer.h.0.ln_1.weight: " in checked
