"""The ranks agree on what decides the program a rank runs and the values it computes with:
which parameters train, grad mode and autocast, the tensor attributes the forward reads, the
optimizer steps taken and the replicas they leave, generate's arguments. A rank that differs
makes every rank of its TP group raise DisagreementError (never a process abort, a hang or a
silently wrong number); a module whose ranks disagreed on its state refuses calls until they agree."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

import autotp
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, call_while_another_runs, outcome, tiny_gpt2

pytestmark = pytest.mark.timeout(300)


def _last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _gpt2():
    return autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)


def _step(pm, seed: int = 1, s: int = 7) -> float:
    loss = pm(**batch(100, seed=seed, s=s)).loss
    loss.backward()
    return loss.item()


# ---- at parallelize: what each rank was handed ------------------------------------------------

def parallelize_with_a_parameter_frozen_on_the_last_rank() -> str:
    model = tiny_gpt2(n_layer=1)
    if _last_rank():
        model.transformer.h[0].ln_1.weight.requires_grad_(False)
    return outcome(lambda: autotp.parallelize(model, tp=4, layout=MEGATRON_GPT2))


def test_a_parameter_frozen_on_one_rank_before_parallelize_fails_every_rank(cluster):
    # before: a gloo SIGABRT in the first backward (requires_grad was not in the fingerprint)
    for text in cluster.run(parallelize_with_a_parameter_frozen_on_the_last_rank):
        assert text.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group disagree before"), text
        assert "the parameters' requires_grad differ" in text
        assert "ranks 0, 1, 2: 'transformer.h.0.ln_1.weight: trainable'; rank 3: 'transformer.h.0.ln_1.weight: " \
               "frozen'" in text, text


class ShiftedMlp(nn.Module):
    """up, relu, down, plus ``shift``: a plain tensor attribute (neither parameter nor buffer)."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.shift = torch.full((8,), shift)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + self.shift   # (b, s, 8)


def parallelize_with_another_tensor_attribute_on_the_last_rank() -> str:
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5))
    model = ShiftedMlp(2.0 if _last_rank() else 1.0)
    return outcome(lambda: autotp.parallelize(model, tp=4, example_kwargs={"x": x},
                                               layout={"up.weight": "column", "down.weight": "row"}))


def test_a_tensor_attribute_that_differs_across_ranks_fails_every_rank(cluster):
    # before: undetected (neither parameter nor buffer: outside the weight digest), outputs wrong
    for text in cluster.run(parallelize_with_another_tensor_attribute_on_the_last_rank):
        assert text.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group disagree before"), text
        assert "the tensor attributes the model's forward reads differ" in text
        assert "rank 3: 'shift: " in text, text


# ---- at each call: the state the call runs in -------------------------------------------------

def call_in_another_state_on_the_last_rank(state: str) -> list[str]:
    pm = _gpt2()
    _step(pm)
    if state == "frozen":
        if _last_rank():
            pm.get_parameter("transformer.h.0.ln_1.weight").requires_grad_(False)
        return [outcome(_step, pm, 2)]
    if state == "autocast":
        def call():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_last_rank()):
                return _step(pm, 2)
        return [outcome(call)]
    if state == "no_grad":
        def call():
            with torch.set_grad_enabled(not _last_rank()):
                return pm(**batch(100, seed=2)).logits
        return [outcome(call)]
    if state == "shapes":   # check_inputs=False still compares the shapes
        pm.check_inputs = False
        out = [outcome(lambda: pm(**batch(100, s=9 if _last_rank() else 7)))]
        return out + [outcome(_step, pm, 3)]   # refused on every rank, not counted: the module goes on
    raise AssertionError(state)


@pytest.mark.parametrize("state, expected", [
    # before: a raw gloo timeout naming a live rank as lost
    ("frozen", "ranks 0, 1, 2: 'frozen: (none)'; rank 3: 'frozen: transformer.h.0.ln_1.weight'. freeze or unfreeze"),
    # before: a gloo SIGABRT (rank 3's products in bfloat16)
    ("autocast", "ranks 0, 1, 2: 'autocast: off'; rank 3: 'autocast: cpu bfloat16'. enter torch.autocast"),
    ("no_grad", "ranks 0, 1, 2: 'grad mode: enabled'; rank 3: 'grad mode: disabled'. enable or disable gradients"),
])
def test_a_call_in_another_state_on_one_rank_fails_every_rank_naming_it(cluster, state, expected):
    for (text,) in cluster.run(call_in_another_state_on_the_last_rank, state):
        assert text.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group would run this call in "
                               "different states"), text
        assert expected in text, text


def test_inputs_of_other_shapes_fail_every_rank_with_check_inputs_false(cluster):
    # before: a gloo SIGABRT (check_inputs=False compared nothing of the inputs)
    for refused, then in cluster.run(call_in_another_state_on_the_last_rank, "shapes"):
        assert refused.startswith("DisagreementError: the inputs of this call differ"), refused
        assert "ranks 0, 1, 2: 'input_ids: (2, 7)'; rank 3: 'input_ids: (2, 9)'" in refused, refused
        assert then == "returned", then


def call_two_modules_from_two_threads() -> tuple[str, float]:
    a, b = _gpt2(), _gpt2()
    return call_while_another_runs(a, lambda: a(**batch(100)).loss.item(), lambda: b(**batch(100)))


def test_two_modules_called_from_two_threads_at_once_are_refused(cluster):
    # before: a gloo SIGABRT (only one module from two threads was guarded)
    for second, loss in cluster.run(call_two_modules_from_two_threads):
        assert second.startswith("ConfigError: GPT2LMHeadModel #"), second
        assert "is running a call in another thread, on the process group this GPT2LMHeadModel #" in second
        assert loss == loss   # the first call went on


# ---- optimizer steps and the replicas they leave ----------------------------------------------

def step_the_optimizer_on_the_first_rank_only() -> list[str]:
    pm = _gpt2()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    _step(pm)
    if dist.get_rank() == 0:
        opt.step()
    opt.zero_grad()
    out = [outcome(_step, pm, 2)]         # refused: the ranks took other numbers of steps
    out.append(outcome(_step, pm, 3))     # caught and used on: still refused
    out.append(outcome(pm.check_replicas))
    return out


def test_an_optimizer_step_on_one_rank_only_is_refused_at_the_next_call_and_after(cluster):
    # before: every later call ran a half-updated model and nothing noticed
    for first, again, check in cluster.run(step_the_optimizer_on_the_first_rank_only):
        assert first.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group would run this call in "
                                "different states"), first
        assert "rank 0: 'optimizer steps: 1'; ranks 1, 2, 3: 'optimizer steps: 0'" in first, first
        assert "every rank must step its optimizer over this module's parameters as often" in first
        assert again.startswith("DisagreementError: GPT2LMHeadModel #") and "refuses calls: its ranks took other " \
               "numbers of optimizer steps" in again, again
        assert check.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group disagree on what they "
                                "replicate"), check
        assert "the replicated parameters and buffers differ" in check
        assert "- what each rank did since the ranks last agreed on them: rank 0: '1 optimizer step, 0 " \
               "load_state_dict calls'; ranks 1, 2, 3: '0 optimizer steps, 0 load_state_dict calls'" in check, check


def catch_a_replica_disagreement_and_call_again() -> list[str]:
    pm = _gpt2()
    _step(pm)
    if _last_rank():
        with torch.no_grad():
            pm.local_parameter("transformer.h.0.ln_1.weight").add_(1.0)
    out = [outcome(pm.check_replicas)]
    out.append(outcome(_step, pm, 2))     # the error was caught: the module refuses
    if _last_rank():                        # the replicas made equal again: re-agreed
        with torch.no_grad():
            pm.local_parameter("transformer.h.0.ln_1.weight").sub_(1.0)
    out.append(outcome(pm.check_replicas))
    out.append(outcome(_step, pm, 2))
    return out


def test_a_caught_disagreement_on_the_replicas_leaves_the_module_refusing_until_they_agree(cluster):
    # before: the module took calls after the error, computing with other replicas per rank
    for check, refused, recheck, then in cluster.run(catch_a_replica_disagreement_and_call_again):
        assert check.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group disagree"), check
        assert "'transformer.h.0.ln_1.weight: " in check
        assert refused.startswith("DisagreementError: GPT2LMHeadModel #"), refused
        assert "refuses calls: the replicated parameters differ across its ranks" in refused
        assert recheck == "returned" and then == "returned", (recheck, then)


def drift_with_another_learning_rate_on_the_last_rank() -> list[str]:
    pm = _gpt2()
    pm.check_replicas_every = 1
    opt = torch.optim.SGD(pm.parameters(), lr=0.2 if _last_rank() else 0.1)
    out = []
    for seed in (1, 2, 3):
        out.append(outcome(_step, pm, seed))
        opt.step()
        opt.zero_grad()
    return out


def test_replicas_that_drift_apart_are_caught_at_the_next_call_with_check_replicas_every(cluster):
    # the same steps on every rank, another learning rate on one: only the replicas' hashes see it
    for first, second, third in cluster.run(drift_with_another_learning_rate_on_the_last_rank):
        assert first == "returned", first
        assert second.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group would run this call in "
                                 "different states"), second
        assert "'replicated transformer." in second and "the replicated parameters drifted apart" in second
        assert third.startswith("DisagreementError: GPT2LMHeadModel #") and "refuses calls" in third, third


def skip_a_training_step_on_the_last_rank(values: bool, lengths_vary: bool) -> str:
    pm = _gpt2()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    if values:
        pm.check_inputs = "values"

    def steps():
        for step in range(4):
            if _last_rank() and step == 1:
                continue   # a whole step (forward, backward, optimizer) skipped on one rank
            _step(pm, step, s=5 + step if lengths_vary else 7)
            opt.step()
            opt.zero_grad()

    return outcome(steps)


@pytest.mark.parametrize("values, lengths_vary", [(True, False), (False, True)],
                         ids=["check_inputs-values", "lengths-vary"])
def test_a_training_step_skipped_on_one_rank_is_caught_at_the_next_call(cluster, values, lengths_vary):
    # before: later steps paired with the other ranks' batches, then a live rank was named lost
    for text in cluster.run(skip_a_training_step_on_the_last_rank, values, lengths_vary):
        assert text.startswith("DisagreementError: the inputs of this call differ"), text
        assert ("input_ids values: " if values else "'input_ids: (2, 6) int64'; rank 3: 'input_ids: (2, 7) int64'") \
            in text, text


# ---- generate ---------------------------------------------------------------------------------

def generate_with_other_lengths_on_the_last_rank() -> str:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1).eval(), tp=4, layout=MEGATRON_GPT2)
    ids = batch(100)["input_ids"]
    return outcome(lambda: pm.generate(ids, max_new_tokens=5 if _last_rank() else 3, eos_token_id=None))


def test_generate_with_max_new_tokens_differing_across_ranks_fails_every_rank(cluster):
    # before: rank 3 waited in its fourth step until the collective timeout
    for text in cluster.run(generate_with_other_lengths_on_the_last_rank):
        assert text.startswith("DisagreementError: ranks [0, 1, 2, 3] of the TP group would run this call in "
                               "different states"), text
        assert "'generate: max_new_tokens=3, " in text and "'generate: max_new_tokens=5, " in text
        assert "pass generate the same arguments on every rank" in text


# ---- the hash ---------------------------------------------------------------------------------

def test_value_digest_sees_four_values_permuted_so_that_sums_and_weighted_sums_agree():
    from autotp.distributed.agreement import value_digest

    # bits a, b, c, d with a - b == d - c: swapping a<->b and c<->d keeps the sum, the sum of
    # squares and the position-weighted sum of the bits (the old digest's three numbers)
    a, b, c = (torch.tensor(v, dtype=torch.float32).view(torch.int32).item() for v in (1.0, 2.0, 3.0))
    d = c + a - b
    bits = torch.tensor([a, b, c, d], dtype=torch.int32)
    swapped = bits[[1, 0, 3, 2]]
    weights = torch.arange(1, 5, dtype=torch.int64)
    for f in (lambda t: t.sum(), lambda t: (t * t).sum(), lambda t: (t * weights).sum()):
        assert f(bits.long()) == f(swapped.long())
    assert value_digest(bits.view(torch.float32)) != value_digest(swapped.view(torch.float32))
