"""A sequence-parallel program all-gathers a tensor once, whatever its consumers want of it.

Under sequence parallelism one tensor may be wanted whole by several consumers: by sharded
compute (a column-parallel product: the all-gather with its f fused in, ``all_gather_f``, whose
backward reduce-scatters the gradient's summands), by replicated compute or a returned output
(no f), and split another way (a reshard). The rewrite memoized conversions per (tensor,
placement, f), so each of those made its own all-gather: OLMo-2 at tp 2 gathered its embedding
(split by features) into q/k/v and again for the residual's reshard along s; T5 gathered the
encoder's output along s into the cross-attention's k/v and again for the returned encoder
state. Now one ``all_gather_f`` serves them all: a replicated consumer reads it through
``grad_if`` (rank 0 alone passes its whole gradient into the reduce-scatter), a reshard cuts
the rank's part with ``rank_slice`` (its gradient zero-padded: a summand).

One rank of tp 2 on the fake backend counts the gathers of its program and the collectives a
training step runs; two gloo ranks hold the result to serial (float64), forward and backward.
"""
import collections

import pytest
import torch

import autotp
from autotp import zoo
from autotp.distributed import collectives as C
from autotp.distributed import comm as comm_module
from autotp.distributed import comm_modules, gather_scatter
from autotp.distributed.functional import grad_if, rank_slice

TP = 2
PLANNING = dict(batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True)


def _model(family: str, dtype: torch.dtype, layers: int = 2):
    fam = zoo.family(family)
    config = zoo.tiny_config(family, layers=layers, heads=4, kv_heads=2 if fam.kv_heads else None, head_dim=8,
                             vocab=61)
    if family in zoo.EXPERT_FAMILIES:
        config._experts_implementation = "batched_mm"
    return zoo.build(family, config, dtype=dtype, seed=1), config


def gathers_by_source(gm) -> dict:
    """(input node, gathered dim) -> the all-gathers of the rank's program reading it."""
    modules = dict(gm.named_modules())
    found = collections.defaultdict(list)
    for node in gm.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, (comm_modules.GatherFromTP, comm_modules.GatherIntoTP)):
            found[node.args[0].name, module.shard.dim].append(node.name)
    return found


class _Collectives:
    """Counts the collectives a rank runs (the group-of-many calls under every mapping). A split
    rms_norm's all-reduces of its rows' statistics count as all-reduces, not gathers: they sum one
    number a row and assemble no tensor, so the gathers counted are still the program's."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        # where each is looked up: the mappings' (collectives), a split norm's (comm: functional's
        # own import), a reduce-scatter's all-reduce fallback (gather_scatter)
        for module, name in ((C, "_all_gather"), (C, "_reduce_scatter"), (C, "_all_reduce"),
                             (comm_module, "_all_reduce"), (gather_scatter, "_all_reduce")):
            monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))

    def _counted(self, name, original):
        def run(x, group, *rest, **options):   # options: _all_reduce's in_place
            self.calls.append(name)
            return original(x, group, *rest, **options)
        return run


#: T5's decoder reads the encoder's output by each layer's cross-attention k and v: written, one
#: all_gather_f of it serves their products and the returned encoder state (grad_if); joined (sibling
#: products, autotp/passes/products.py: each layer's k and v as one product, a set per layer), no
#: gather is made twice either. "t5" is the written program (fuse_products=False), "t5-joined" the default's.
JOINED = {"t5-joined": "t5"}


def family_of(case: str) -> str:
    return JOINED.get(case, case)


def _family(case: str) -> tuple[str, dict]:
    """The zoo family of a case and the planning arguments it adds."""
    return (JOINED[case], {}) if case in JOINED else (case, {"fuse_products": False} if case == "t5" else {})


# OLMo-2 and T5 are where the duplicates were; the others keep none (a regression guard: slow)
@pytest.mark.parametrize("case", ["olmo2", "t5", "t5-joined", *(pytest.param(f, marks=pytest.mark.slow)
                                                                for f in ("llama", "gpt2", "mixtral"))])
def test_a_sequence_parallel_program_gathers_each_tensor_once_along_a_dim(fake_rank, monkeypatch, case):
    family, written = _family(case)
    model, config = _model(family, torch.float32)
    pm = autotp.parallelize(model, TP, **PLANNING, **written)
    if family == "t5":
        assert any(n.startswith("sibling products fused") for n in pm.plan.notes) == (case in JOINED)
    assert any(c.kind == "reduce_scatter" and c.dst == "S(1)" for c in pm.plan.comms)   # sequence-parallel
    found = gathers_by_source(pm.graph_module)
    assert {k: v for k, v in found.items() if len(v) > 1} == {}
    # and the step runs what the program holds: one forward all-gather per gathered (tensor, dim)
    batch = zoo.example_batch(family, config, batch=2, seq=7, seed=2)
    pm.train()
    counted = _Collectives(monkeypatch)
    out = pm(**batch)
    assert counted.calls.count("_all_gather") == sum(len(v) for v in found.values()), counted.calls
    forward = len(counted.calls)
    out.loss.backward()
    assert len(counted.calls) > forward
    if case in ("olmo2", "t5"):   # the shared gather's consumers read it cut or through grad_if
        targets = {n.target for n in pm.graph_module.graph.nodes if n.op == "call_function"}
        assert (rank_slice if family == "olmo2" else grad_if) in targets


@pytest.mark.parametrize("family", ["olmo2", "t5"])
def test_the_plan_lists_the_collectives_its_rank_issues_where_gathers_share_one(fake_rank, family):
    """The plan counts a shared gather once, as the rank runs it: its listed collectives (one per
    direction a communication op moves bytes in, plus the per-call agreement forward and
    backward, as tests/test_fake_backend.py counts them) are those a training step issues, one
    gather of each tensor is listed, and the priced seconds are the listed ones'. (Counting each
    consumer's gather, OLMo-2's plan listed 43 collectives where its rank issued 41, T5's 59
    where 58.)"""
    from torch.distributed.tensor.debug import CommDebugMode

    model, config = _model(family, torch.float32)
    pm = autotp.parallelize(model, TP, **PLANNING)
    plan = pm.plan
    batch = zoo.example_batch(family, config, batch=2, seq=7, seed=2)
    pm.train()
    with CommDebugMode() as comm:
        pm(**batch).loss.backward()
    listed = sum((c.fwd_bytes > 0) + (c.bwd_bytes > 0) for c in plan.comms) + 2
    assert comm.get_total_counts() == listed, [(c.kind, c.tensor) for c in plan.comms]
    gathers = collections.Counter(c.tensor for c in plan.comms if c.kind in ("all_gather", "all_gather_f", "reshard"))
    assert gathers and max(gathers.values()) == 1, gathers
    assert plan.comm_s == pytest.approx(sum(c.seconds for c in plan.comms), rel=1e-9)


def _shared_gather_matches_serial(case: str, layers: int) -> dict:
    from autotp.testing import equivalence_errors, keep_loss_precision, tolerance

    family, written = _family(case)
    model, config = _model(family, torch.float64, layers=layers)
    if zoo.family(family).task == "causal":
        keep_loss_precision(model)
    pm = autotp.parallelize(model, TP, **PLANNING, **written)
    targets = {n.target for n in pm.graph_module.graph.nodes if n.op == "call_function"}
    batch = zoo.example_batch(family, config, batch=2, seq=7, seed=3)
    return {"errors": equivalence_errors(model, pm, batch), "bound": tolerance(model, batch),
            "shared": rank_slice in targets or grad_if in targets,
            "joined": any(n.startswith("sibling products fused") for n in pm.plan.notes),
            "duplicates": {k: v for k, v in gathers_by_source(pm.graph_module).items() if len(v) > 1}}


#: the fewest layers where each family's program shares a gather (T5's second layer's plan reads
#: the encoder's output whole both ways); T5 joined, each layer's cross-attention k and v as one
SHARING = {"olmo2": 1, "t5": 2, "t5-joined": 2}


@pytest.mark.parametrize("case", sorted(SHARING))
def test_a_shared_gather_trains_as_serial(cluster_of, case):
    """float64, tp 2, seq 7 (split 4/3): the loss, the outputs and every gradient equal serial's
    (within float32's bound where the model computes in float32: OLMo-2's q/k norms)."""
    for rank, r in enumerate(cluster_of(TP).run(_shared_gather_matches_serial, case, SHARING[case])):
        assert (case in JOINED or r["shared"]) and r["duplicates"] == {}, (rank, r)
        assert r["joined"] == (case in JOINED) or family_of(case) != "t5", (rank, r)
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= r["bound"], (rank, worst, r["errors"][worst])
