"""A ParallelModule's parameters are DTensors on the (dp, tp) mesh, under the model's names,
whose placements say exactly what each rank holds: full_tensor() is the serial parameter,
clip_grad_norm_ gives the serial norm on every rank, clipped AdamW steps are serial steps."""
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autotp
from autotp.placements import layout

from .test_collectives import cases as collective_cases

LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}
VOCAB = 22   # not a multiple of 2 or 3: the vocab-parallel lm_head is split unevenly too


def _pair(tp: int, heads: int, seed: int = 0):
    from tests.helpers import tiny_gpt2

    model = tiny_gpt2(n_layer=2, n_head=heads, head_dim=2, vocab=VOCAB, seed=seed)
    return model, autotp.parallelize(model, tp=tp, layout=LAYOUT, uneven=True)


def _described_exactly(tp: int, heads: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model, pm = _pair(tp, heads)
    serial = dict(model.named_parameters())
    params = list(pm.named_parameters())
    qkv = dict(params)["transformer.h.0.attn.c_attn.weight"]
    try:   # torch's Shard(1) would relabel the runs: refused, where Replicate() gathers them
        qkv.redistribute(qkv.device_mesh, [Replicate(), Shard(1)])
        relabelled = "allowed"
    except autotp.ConfigError as exc:
        relabelled = str(exc)
    saved = {k: v.clone() for k, v in pm.state_dict().items()}
    with torch.no_grad():
        for p in pm.parameters():
            p.mul_(3)
    pm.load_state_dict(saved)   # DTensor values back into the DTensor parameters, in place
    reloaded = all(torch.equal(p.full_tensor(), serial[n].detach()) for n, p in params)
    shares = all(pm.local_parameter(n).data_ptr() == p.to_local().data_ptr() for n, p in params)
    # assigned: the DTensors of a state dict put in place of the parameters (load_state_dict(assign=
    # True)); the programs read the new ones (they once kept reading the old: the load ignored)
    ids = torch.tensor([[1, 2, 3, 4]])
    changed = "transformer.h.0.mlp.c_fc.weight"
    with torch.no_grad():
        doubled = {k: (v * 2 if k == changed else v.clone()) for k, v in pm.state_dict().items()}
        pm.load_state_dict(doubled, assign=True)
        want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in doubled.items()}
        serial_after = torch.func.functional_call(model, want, (ids,), tie_weights=False).logits
        assigned = (pm.get_parameter(changed) is not params[[n for n, _ in params].index(changed)][1]
                    and torch.allclose(pm(ids).logits, serial_after, rtol=1e-5, atol=1e-6))
    try:   # whole tensors assigned in place of the shards: refused, naming the fix
        pm.load_state_dict({k: want[k] for k in doubled}, assign=True)
        whole = "allowed"
    except autotp.ConfigError as exc:
        whole = str(exc)
    return {
        "assigned": assigned, "whole assigned": whole,
        "reloaded": reloaded,
        "relabelled": relabelled,
        "gathered": torch.equal(qkv.redistribute(qkv.device_mesh, [Replicate(), Replicate()]).to_local(),
                                serial["transformer.h.0.attn.c_attn.weight"].detach()),
        "names": [n for n, _ in params], "serial_names": list(serial),
        "not_dtensor": [n for n, p in params if not isinstance(p, DTensor)],
        "inexact": [n for n, p in params if not torch.equal(p.full_tensor(), serial[n].detach())],
        "over_tp": {n: repr(p.placements[1]) for n, p in params},
        "over_dp": {repr(p.placements[0]) for _, p in params},
        "shares_storage": shares,
        "state_dict": sorted(pm.state_dict()), "serial_state_dict": sorted(model.state_dict()),
        "local_numel": {n: pm.local_parameter(n).numel() for n, _ in params},
    }


def _clipped_gradients(tp: int, heads: int, seed: int, max_norm: float) -> tuple[float, float, float]:
    from tests.helpers import batch

    model, pm = _pair(tp, heads, seed)
    data = batch(VOCAB, b=2, s=5, seed=seed)
    model(**data).loss.backward()
    pm(**data).loss.backward()
    serial = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    got = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)
    serial_grads = dict(model.named_parameters())
    worst = max((p.grad.full_tensor() - serial_grads[n].grad).abs().max().item() for n, p in pm.named_parameters())
    return serial.item(), got.full_tensor().item(), worst / serial.item()


def _clipped_adamw(case: dict) -> tuple[list[str], dict[str, float]]:
    from autotp.testing import relative_error
    from tests.helpers import batch

    model, pm = _pair(dist.get_world_size(), case["heads"], case["seed"])
    serial_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallel_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(case["steps"]):
        data = batch(VOCAB, b=case["batch"], s=case["seq"], seed=100 * case["seed"] + step)
        for module, opt in ((model, serial_opt), (pm, parallel_opt)):
            opt.zero_grad()
            module(**data).loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), case["max_norm"])
            opt.step()
    group, tp = pm.mesh.tp_group, pm.plan.tp
    drifted = []
    for name, local in pm.local_parameters().items():
        if not isinstance(pm.plan.params[name], autotp.Shard):
            copies = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(copies, local.contiguous(), group=group)
            if not all(torch.equal(c, copies[0]) for c in copies):
                drifted.append(name)
    serial = dict(model.named_parameters())
    errors = {n: relative_error(p.full_tensor(), serial[n]) for n, p in pm.named_parameters()}
    return drifted, errors


def _check_described(results: list[dict], tp: int) -> None:
    for r in results:
        assert r["names"] == r["serial_names"]               # the model's names, tied weight once
        assert r["not_dtensor"] == [] and r["inexact"] == []
        assert r["over_dp"] == {"Replicate()"}
        assert r["shares_storage"] and r["reloaded"]
        assert r["assigned"] and "load_state_dict(assign=True)" in r["whole assigned"], r["whole assigned"]
        assert r["gathered"] and "cannot redistribute between RunShard" in r["relabelled"]
        assert r["state_dict"] == r["serial_state_dict"]
        # the fused q|k|v weight (a run of each of q, k, v per rank, heads split unevenly) and the
        # unevenly split vocab are run layouts; a plain even split is torch's own Shard
        assert r["over_tp"]["transformer.h.0.attn.c_attn.weight"].startswith("RunShard(")
        assert r["over_tp"]["transformer.h.0.ln_1.weight"] == "Replicate()"
    sizes = [r["local_numel"]["transformer.h.0.attn.c_attn.weight"] for r in results]
    assert len(set(sizes)) > 1 and len(sizes) == tp   # uneven: ranks hold different numbers of heads


def test_parameters_are_dtensors_under_the_models_names_at_tp2(cluster_of):
    _check_described(cluster_of(2).run(_described_exactly, 2, 3), 2)


def test_clip_grad_norm_is_the_serial_norm_on_every_rank_at_tp2(cluster_of):
    for heads, seed, max_norm in ((3, 0, 0.5), (4, 1, 1e-3), (3, 2, 100.0)):
        for serial, got, worst in cluster_of(2).run(_clipped_gradients, 2, heads, seed, max_norm):
            assert abs(got - serial) <= 1e-12 * serial, (heads, got, serial)
            assert worst <= 1e-12, (heads, worst)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(heads=st.sampled_from([2, 3]), batch=st.integers(1, 2), seq=st.integers(2, 6), steps=st.integers(1, 3),
       max_norm=st.sampled_from([1e-3, 0.1, 10.0]), seed=st.integers(0, 99))
def test_clipped_adamw_keeps_replicas_identical_and_equals_serial_at_tp2(cluster_of, heads, batch, seq, steps,
                                                                         max_norm, seed):
    case = dict(heads=heads, batch=batch, seq=seq, steps=steps, max_norm=max_norm, seed=seed)
    for drifted, errors in cluster_of(2).run(_clipped_adamw, case):
        assert drifted == []
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-9, (worst, errors[worst])


def test_parameters_are_dtensors_under_the_models_names_at_tp3(cluster_of):
    _check_described(cluster_of(3).run(_described_exactly, 3, 4), 3)


def test_clip_grad_norm_is_the_serial_norm_on_every_rank_at_tp3(cluster_of):
    for serial, got, worst in cluster_of(3).run(_clipped_gradients, 3, 4, 3, 0.05):
        assert abs(got - serial) <= 1e-12 * serial, (got, serial)
        assert worst <= 1e-12, worst


def test_clipped_adamw_at_tp3_equals_serial(cluster_of):
    case = dict(heads=4, batch=2, seq=5, steps=2, max_norm=0.1, seed=7)
    for drifted, errors in cluster_of(3).run(_clipped_adamw, case):
        assert drifted == []
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-9, (worst, errors[worst])


def _layouts_round_trip(cases: list[tuple]) -> list[str]:
    """Each (atoms, chunks, unit, rotate, dim): a tensor split by autotp's Shard, as a DTensor
    with the placement torch_placement gives it; what full_tensor(), a split of a replicated
    DTensor, a norm and an in-place update make of it. Returns the cases that went wrong."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from autotp.placements import local_ranges
    from autotp.runtime.module import dtensor
    from autotp.distributed.mesh import get_mesh

    dtensor.install()
    mesh = get_mesh(dist.get_world_size()).device_mesh
    tp, rank = dist.get_world_size(), dist.get_rank()
    wrong = []
    for atoms, chunks, unit, rotate, dim in cases:
        shard = autotp.Shard(dim, chunks, unit, rotate % tp)
        n = atoms * chunks * unit
        full = torch.arange(n * 3, dtype=torch.float64).reshape((n, 3) if dim == 0 else (3, n)) + 1
        ranges = local_ranges(n, shard, tp, rank)
        local = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim) if ranges else full.narrow(dim, 0, 0)
        placements = [Replicate(), dtensor.torch_placement(shard, n, tp)]
        dt = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape,
                                stride=full.stride())
        split = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, placements)
        norm = torch.linalg.vector_norm(dt).full_tensor()
        dt.mul_(2)
        if not (torch.equal(dt.full_tensor(), 2 * full) and torch.equal(split.to_local(), local)
                and abs(norm.item() - full.norm().item()) <= 1e-12 * full.norm().item()
                and dt.placements == tuple(placements)):
            wrong.append(repr((atoms, chunks, unit, rotate, dim, placements[1])))
    return wrong


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(cases=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2),
                                st.integers(0, 1)), min_size=1, max_size=8))
def test_every_layout_round_trips_through_its_dtensor_placement_at_tp3(cluster_of, cases):
    # atoms below tp leave a rank empty; uneven atoms, fused chunks, units and rotations: run layouts
    for wrong in cluster_of(3).run(_layouts_round_trip, cases):
        assert wrong == []


def test_a_run_layout_survives_copy_and_pickle():
    # torch's Shard copies and pickles its dim alone; dynamo copies placements into its guards
    import copy
    import pickle

    from autotp.placements import Shard
    from autotp.runtime.module.dtensor import RunShard

    run = RunShard(Shard(1, 3, 4, 1, 2))
    for again in (copy.copy(run), copy.deepcopy(run), pickle.loads(pickle.dumps(run))):
        assert again == run and again.shard == run.shard and again.dim == 1


def _gradients_reach_parameters_as_autograd_would(tp: int) -> dict:
    """What a user does with parameter gradients, through the local leaves (runtime.module's
    LocalLeaves) and the per-call Function beside them, each against the serial model."""
    from torch.distributed.tensor import DTensor

    from tests.helpers import batch

    model, pm = _pair(tp, 3)
    data = batch(VOCAB, b=2, s=5, seed=3)
    serial = dict(model.named_parameters())

    def worst(scale: float = 1.0) -> float:
        return max((p.grad.full_tensor() - scale * serial[n].grad).abs().max().item() for n, p in pm.named_parameters())

    out = {}
    model(**data).loss.backward()
    seen = []   # a post-accumulate hook (optimizer in backward): once per parameter, .grad set
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(isinstance(p.grad, DTensor)))
               for p in pm.parameters()]
    pm(**data).loss.backward()
    out["hooks"] = (len(seen), len(list(pm.parameters())), all(seen))
    out["one backward"] = worst()
    for h in handles:
        h.remove()
    pm(**data).loss.backward()   # accumulated onto the gradients there, as autograd does
    out["accumulated"] = worst(2.0)
    pm.zero_grad(set_to_none=False)   # zeros kept: added to in place
    pm(**data).loss.backward()
    out["onto zeros"] = worst()
    # a gradient hook (before accumulation) sees and changes the DTensor gradient
    name, first = next(iter(pm.named_parameters()))
    h = first.register_hook(lambda g: g * 3)
    pm.zero_grad()
    pm(**data).loss.backward()
    out["hooked"] = ((first.grad.full_tensor() - 3 * serial[name].grad).abs().max().item(),
                     max((p.grad.full_tensor() - serial[n].grad).abs().max().item()
                         for n, p in pm.named_parameters() if p is not first))
    h.remove()
    # a local tensor replaced (param.data = ...): the next call reads the new one
    with torch.no_grad():
        first.data = first.data * 1.0
    pm.zero_grad()
    pm(**data).loss.backward()
    out["replaced"] = worst()
    # backward(create_graph=True): differentiable gradients, the same values
    pm.zero_grad()
    pm(**data).loss.backward(create_graph=True)
    out["create_graph"] = (worst(), all(p.grad.requires_grad for p in pm.parameters()))
    # torch.autograd.grad with respect to the parameters: they are in autograd's graph only
    # without the leaves (local_leaves = False)
    params = list(pm.parameters())
    out["grad of leaves"] = torch.autograd.grad(pm(**data).loss, params, allow_unused=True)[0] is None
    pm.local_leaves = False
    grads = torch.autograd.grad(pm(**data).loss, params)
    out["autograd.grad"] = max((g.full_tensor() - serial[n].grad).abs().max().item()
                               for (n, _), g in zip(pm.named_parameters(), grads))
    pm.local_leaves = True
    return out


def test_gradients_reach_parameters_as_autograd_would_at_tp2(cluster_of):
    for r in cluster_of(2).run(_gradients_reach_parameters_as_autograd_would, 2):
        assert r["hooks"][0] == r["hooks"][1] and r["hooks"][2], r["hooks"]
        assert max(r["one backward"], r["accumulated"], r["onto zeros"], r["replaced"]) <= 1e-12, r
        assert max(r["hooked"]) <= 1e-12, r["hooked"]
        assert r["create_graph"][0] <= 1e-12 and r["create_graph"][1], r["create_graph"]
        assert r["grad of leaves"] and r["autograd.grad"] <= 1e-12, r


@settings(max_examples=150, deadline=None)
@given(case=collective_cases(tps=range(1, 9), tails=True), rank=st.integers(0, 7), replicate=st.booleans())
def test_a_rank_parameter_is_its_local_shard_a_copy_placed_as_torch_placement_says(case, rank, replicate):
    # the state computes a shard's layout once, for the slice and for the DTensor placement:
    # the slice is what local_shard takes, the placement what torch_placement gives, and the
    # tensor a copy of the model's (its storage never the parameter's)
    import types

    from autotp.distributed.shards import local_shard
    from autotp.placements import REPLICATE
    from autotp.runtime.module import dtensor

    rank %= case.tp
    full = torch.nn.Parameter(torch.arange(torch.Size(case.shape).numel(), dtype=torch.float64).reshape(case.shape))
    placement = REPLICATE if replicate else case.shard
    mesh = types.SimpleNamespace(tp_rank=rank)   # no DeviceMesh: the plain local tensor
    got = dtensor.parameter(full, placement, case.tp, mesh, torch.device("cpu"))
    want = full.detach() if replicate else local_shard(full.detach(), case.shard, case.tp, rank)
    assert torch.equal(got, want) and not got.requires_grad
    assert got.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    if not replicate:
        size = case.full_size
        assert dtensor.torch_placement(case.shard, size, case.tp, layout(size, case.shard, case.tp)) == \
            dtensor.torch_placement(case.shard, size, case.tp)
