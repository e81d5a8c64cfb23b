"""Sequence parallelism on the batch and the sequence merged, behind an RMS norm: a model that
flattens ``[b, s, h]`` to ``[b*s, h]`` and RMS-normalizes the rows (``torch.nn.RMSNorm``, one
``aten.rms_norm`` in the graph, or Llama's spelled out: a mean of squares and ``rsqrt``)
before its MLP. The norm keeps the rank's tokens' rows (``P(tokens 0)``) and fc1 reads them
all-gathered with its f fused in; before, ``aten.rms_norm`` took no rows, so they were
all-gathered whole in front of it and the norm ran on every token of every rank.

The same model without fc2's bias adds fc2's partial sum to a residual that layer 0 holds whole:
sliced to the rows (``R -> P(tokens 0)``), where before forced sequence parallelism was a
PlanError; and run sequence-first (``[s, b, h] -> [s*b, h]``), its rows read as a partition."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.modeling_outputs import CausalLMOutput   # imported here: not first inside an export trace

from autotp.testing import TOLERANCE

#: Megatron's MLP: fc1 column-parallel, fc2 row-parallel (at these widths the cost model would keep it whole)
PINS = {"*.fc1.weight": "column", "*.fc2.weight": "row"}
ROWS = "P(tokens 0)"
VOCAB = 37


class SpelledRMSNorm(nn.Module):
    """Llama's RMSNorm spelled out: mean of squares, rsqrt, weight (its float32 upcast left out:
    it would round a float64 model's rows to float32)."""

    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, h))

    def forward(self, x):                                           # (rows, h)
        variance = x.pow(2).mean(-1, keepdim=True)                  # (rows, 1)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


class FlatBlock(nn.Module):
    """OPT's MLP block with an RMS norm: ``[b, s, h] -> [b*s, h]``, normalized, fc1, fc2, the
    residual added on the rows, viewed back."""

    def __init__(self, h: int, inner: int, norm: str, fc2_bias: bool = True):
        super().__init__()
        self.norm = nn.RMSNorm(h, eps=1e-6) if norm == "rms_norm" else SpelledRMSNorm(h)
        self.fc1, self.fc2 = nn.Linear(h, inner), nn.Linear(inner, h, bias=fc2_bias)

    def forward(self, x):                                           # (b, s, h)
        rows = x.reshape(-1, x.shape[-1])                           # (b*s, h)
        y = self.fc2(F.gelu(self.fc1(self.norm(rows))))             # (b*s, h)
        return (rows + y).view(x.shape)                             # (b, s, h)


class FlatLM(nn.Module):
    """``sequence_first``: the residual stream runs as ``[s, b, h]`` (Megatron's layout), so each
    block's rows are ``[s*b, h]``: a position's ``b`` tokens side by side, not a sequence's run."""

    def __init__(self, norm: str, layers: int = 2, h: int = 16, inner: int = 24, fc2_bias: bool = True,
                 sequence_first: bool = False):
        super().__init__()
        self.sequence_first = sequence_first
        self.embed = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList(FlatBlock(h, inner, norm, fc2_bias) for _ in range(layers))
        self.head = nn.Linear(h, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)                                   # (b, s, h)
        if self.sequence_first:
            x = x.transpose(0, 1).contiguous()                      # (s, b, h)
        for block in self.blocks:
            x = block(x)
        if self.sequence_first:
            x = x.transpose(0, 1)                                   # (b, s, h)
        logits = self.head(x)                                       # (b, s, vocab)
        return CausalLMOutput(loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits=logits)


def flat_lm(norm: str, seed: int, layers: int = 2, dtype: torch.dtype = torch.float64,
            fc2_bias: bool = True, sequence_first: bool = False) -> FlatLM:
    torch.manual_seed(seed)
    return FlatLM(norm, layers, fc2_bias=fc2_bias, sequence_first=sequence_first).to(dtype)


def test_an_rms_norm_keeps_the_tokens_rows():
    """Planned on the meta device: layer 1's rows (its input split along s, flattened) are
    normalized where they are and all-gathered into fc1 with its f, never gathered whole
    before the norm."""
    from autotp.capture import capture
    from autotp.planner import build_plan

    model = flat_lm("rms_norm", 0)
    ids = torch.randint(0, VOCAB, (2, 8))
    cap = capture(model, (), {"input_ids": ids, "labels": ids})
    plan, _, _ = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True, layout=PINS,
                            align=None)
    comms = [(c.kind, str(c.src), str(c.dst)) for c in plan.comms]
    assert comms.count(("reduce_scatter", "P", ROWS)) == 2, comms      # each layer's fc2 sum into the rows
    assert ("all_gather_f", ROWS, "R") in comms, comms                 # layer 1's normalized rows into fc1
    assert ("all_gather", ROWS, "R") not in comms, comms               # not whole before the norm
    assert ("g", "P", "R") not in comms, comms


def merged_norm_case(case: dict) -> dict:
    """On each rank: the flattening RMS-norm model, sequence parallelism forced, its errors
    against serial (loss, logits, every gradient) at each length, and the plan's collectives."""
    import autotp
    from autotp.testing import equivalence_errors

    model = flat_lm(case["norm"], case["seed"], case["layers"], fc2_bias=case.get("fc2_bias", True),
                    sequence_first=case.get("sequence_first", False))
    ids = torch.randint(0, VOCAB, (2, 8))
    pm = autotp.parallelize(model, case["tp"], example_kwargs={"input_ids": ids, "labels": ids}, batch=64, seq=4096,
                            profile="h100-dgx", sequence_parallel=True, layout=PINS)
    errors = {}
    for seq in case["lengths"]:
        gen = torch.Generator().manual_seed(case["seed"] + seq)
        ids = torch.randint(0, VOCAB, (case["batch"], seq), generator=gen)
        for name, err in equivalence_errors(model, pm, {"input_ids": ids, "labels": ids}).items():
            errors[f"s={seq} {name}"] = err
    return {"errors": errors, "comms": [(c.kind, str(c.src), str(c.dst)) for c in pm.plan.comms]}


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([2, 3]))
    lengths = draw(st.lists(st.integers(tp + 1, 11).filter(lambda s: s % tp), min_size=1, max_size=2, unique=True))
    return {"tp": tp, "norm": draw(st.sampled_from(["rms_norm", "spelled"])), "layers": 2,
            "fc2_bias": draw(st.booleans()),
            "batch": draw(st.integers(1, 3)), "lengths": lengths + [tp - 1], "seed": draw(st.integers(0, 2**16))}


def _check(cluster_of, case: dict) -> None:
    for rank, r in enumerate(cluster_of(case["tp"]).run(merged_norm_case, case)):
        assert ("all_gather_f", ROWS, "R") in r["comms"], (case, r["comms"])
        assert not case.get("scatter") or ("scatter", "R", ROWS) in r["comms"], (case, r["comms"])
        assert r["comms"].count(("reduce_scatter", "P", ROWS)) >= case.get("into_rows", 1), (case, r["comms"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE[torch.float64], (case, rank, worst, r["errors"][worst])


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_an_rms_norm_on_merged_rows_equals_serial(cluster_of, case):
    _check(cluster_of, case)


def test_an_rms_norm_on_two_sequences_merged_equals_serial_at_tp_2(cluster_of):
    # a batch of two: a rank's rows are two runs of [b*s, h], not one block
    _check(cluster_of, {"tp": 2, "norm": "rms_norm", "layers": 2, "batch": 2, "lengths": [7, 1], "seed": 5})


def test_a_whole_residual_is_sliced_to_the_tokens_rows():
    """fc2 with no bias: its partial sum meets the residual add itself, and in layer 0 the
    residual ``[b*s, h]`` is whole on every rank (the embedding's output, flattened). The add on
    the rank's tokens' rows takes the residual sliced to them (``R -> P(tokens 0)``: free
    forward, its gradient all-gathered along s); before, no conversion made rows of a whole
    tensor, and forced sequence parallelism was a PlanError."""
    from autotp.capture import capture
    from autotp.planner import build_plan

    model = flat_lm("rms_norm", 0, fc2_bias=False)
    ids = torch.randint(0, VOCAB, (2, 8))
    cap = capture(model, (), {"input_ids": ids, "labels": ids})
    plan, _, _ = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True, layout=PINS,
                            align=None)
    comms = [(c.kind, str(c.src), str(c.dst)) for c in plan.comms]
    assert ("scatter", "R", ROWS) in comms, comms                      # layer 0's residual, sliced
    assert ("reduce_scatter", "P", ROWS) in comms, comms               # fc2's sum into the rows


def test_a_whole_residual_sliced_to_the_tokens_rows_equals_serial(cluster_of):
    for tp, batch in ((2, 2), (3, 1)):
        _check(cluster_of, {"tp": tp, "norm": "rms_norm", "layers": 2, "batch": batch, "lengths": [7, tp - 1],
                            "seed": 9, "fc2_bias": False, "scatter": True})


def test_a_sequence_first_flatten_equals_serial(cluster_of):
    """A residual stream ``[s, b, h]`` flattened to ``[s*b, h]`` (Megatron's layout): the rows'
    count factors as a sequence times a batch as ``[b*s]``'s does, and the rows are read so, each
    rank holding ``b`` runs of ``s/tp`` flat rows. Those are not its tokens of a sequence split
    but a partition of the rows all the same: every op of the region works row by row and every
    conversion into or out of it (the reduce-scatter, the slice of a whole residual, the
    gathers) reads the rows the same way, so the result is serial's. The view back to ``[s, b,
    h]`` cannot keep them (its dim 1 is the batch: ``token_sequence`` declines), so they are
    all-gathered there. Layer 0 (fc2 without a bias) takes its whole residual sliced to the
    rows, which before was a PlanError."""
    for tp, batch in ((2, 2), (3, 3)):
        case = {"tp": tp, "norm": "rms_norm", "layers": 2, "batch": batch, "lengths": [7, tp - 1], "seed": 3,
                "fc2_bias": False, "sequence_first": True}
        for rank, r in enumerate(cluster_of(tp).run(merged_norm_case, case)):
            assert ("scatter", "R", ROWS) in r["comms"] and ("reduce_scatter", "P", ROWS) in r["comms"], r["comms"]
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] <= TOLERANCE[torch.float64], (case, rank, worst, r["errors"][worst])


def test_a_partial_sum_added_to_the_tokens_rows_is_reduce_scattered_into_them():
    """fc2 with no bias, four layers: from layer 1 on the residual is the rank's tokens' rows
    themselves, and fc2's partial sum meets them at the add. It is reduce-scattered into the
    rows there (``[P(tokens 0), P(tokens 0)] -> P(tokens 0)``: rules/pointwise.partial_into_rows)
    in every layer but the last, whose sum goes on whole to the head (an all-reduce, the same
    bytes as the reduce-scatter and the gather it saves). Before, the rows reached the add as a
    Partial (rows scattered into zeros), the sum of two partial sums passed on, and every layer
    after the first all-reduced its MLP whole, forced or not."""
    from autotp.capture import capture
    from autotp.planner import build_plan

    model = flat_lm("rms_norm", 0, layers=4, fc2_bias=False)
    ids = torch.randint(0, VOCAB, (2, 8))
    cap = capture(model, (), {"input_ids": ids, "labels": ids})
    for forced in (True, None):
        plan, _, _ = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=forced,
                                layout=PINS, align=None)
        comms = [(c.kind, str(c.src), str(c.dst)) for c in plan.comms]
        assert comms.count(("reduce_scatter", "P", ROWS)) == 3, (forced, comms)
        assert comms.count(("g", "P", "R")) == 1, (forced, comms)


def test_a_partial_sum_added_to_the_tokens_rows_equals_serial(cluster_of):
    for tp, batch in ((2, 2), (3, 1)):
        _check(cluster_of, {"tp": tp, "norm": "rms_norm", "layers": 4, "batch": batch, "lengths": [8, tp - 1],
                            "seed": 13, "fc2_bias": False, "scatter": True, "into_rows": 3})
