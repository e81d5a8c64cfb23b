"""Pipeline parallelism (autotp.runtime.pipeline): the cut points (by the cost model), the cut
program, and PTD-P steps on gloo ranks against the serial model (float64).

Fast tier: one task on the shared four ranks runs GPT-2 (tied embedding and head: a parameter
on two stages) at pp 2 x tp 2 under 1F1B for two AdamW steps, the second at another sequence
length; Llama at pp 2 x tp 2 under interleaved 1F1B (two chunks per stage) with activation
checkpointing; Llama at pp 2 x dp 2 under GPipe with an asked cut and ignored labels in one
replica's rows (the replicas count different tokens), GPT-2's second step with a first micro-batch all
ignored (a mean of 0/0 that must not reach the loss); BERT's masked LM (labels mostly -100: the
micro-batches count different tokens); a hand-written model whose
forward writes in place outside its layers at pp 4; from_pretrained, DCP and per-rank files,
eval mode; and the errors. The slow tier adds pp 2 x tp 2 x dp 2 on eight ranks for GPT-2 and Llama, T5 (an
encoder-decoder: the encoder's output travels to every decoder stage), and drawn pipelines of
every family the zoo builds. Every plan is solved for a large workload, so that these tiny
models' matrices are split at tp > 1 (a replicated plan would test no tensor parallelism)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autotp
from autotp.errors import ConfigError
from autotp.cost_model.pipeline import balance
from autotp.runtime.pipeline import check_pipeline
from autotp.zoo import FAMILIES


# ---- where to cut: exact, by brute force on small stacks --------------------------------------

def _slowest(sizes, costs, first, last):
    out, start = 0.0, 0
    for k, n in enumerate(sizes):
        out = max(out, sum(costs[start:start + n]) + (first if k == 0 else 0) + (last if k == len(sizes) - 1 else 0))
        start += n
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(costs=st.lists(st.integers(1, 9), min_size=1, max_size=8), first=st.integers(0, 12),
       last=st.integers(0, 12), data=st.data())
def test_balance_is_the_fastest_contiguous_cut(costs, first, last, data):
    chunks = data.draw(st.integers(1, len(costs)))
    sizes = balance([float(c) for c in costs], float(first), float(last), chunks)
    assert len(sizes) == chunks and sum(sizes) == len(costs) and min(sizes) >= 1
    best = min(_slowest(s, costs, first, last) for s in itertools.product(range(1, len(costs) + 1), repeat=chunks)
               if sum(s) == len(costs))
    assert _slowest(sizes, costs, first, last) == best


def _slowest_gpu(sizes, costs, first, last, gpus):
    work, start = [0.0] * gpus, 0
    for k, n in enumerate(sizes):
        work[k % gpus] += sum(costs[start:start + n]) + (first if k == 0 else 0) + (last if k == len(sizes) - 1 else 0)
        start += n
    return max(work)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(gpus=st.integers(2, 3), virtual=st.integers(2, 3), more=st.integers(0, 4),
       first=st.integers(0, 12), last=st.integers(0, 12), data=st.data())
def test_with_several_chunks_a_gpu_the_slowest_gpu_is_what_balance_shortens(gpus, virtual, more, first, last, data):
    """Virtual stages: chunk c runs on GPU c mod gpus, so a GPU's chunks add up. The cut is
    never slower on its slowest GPU than the even cut or the slowest-chunk cut."""
    chunks = gpus * virtual
    costs = data.draw(st.lists(st.integers(1, 4), min_size=chunks + more, max_size=chunks + more))
    sizes = balance([float(c) for c in costs], float(first), float(last), chunks, gpus)
    assert len(sizes) == chunks and sum(sizes) == len(costs) and min(sizes) >= 1
    n = len(costs)
    even = [n // chunks + (1 if c < n % chunks else 0) for c in range(chunks)]
    per_chunk = balance([float(c) for c in costs], float(first), float(last), chunks)
    got = _slowest_gpu(sizes, costs, first, last, gpus)
    assert got <= _slowest_gpu(even, costs, first, last, gpus)
    assert got <= _slowest_gpu(per_chunk, costs, first, last, gpus)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(gpus=st.sampled_from([2, 3, 4]), virtual=st.integers(1, 3), more=st.integers(0, 12),
       first=st.integers(0, 16), last=st.integers(0, 24))
def test_for_equal_layers_the_runtime_cuts_as_fast_as_the_cost_model_predicts(gpus, virtual, more, first, last):
    """The planner prices a pipeline with the cost model's cut (exact for equal layers); the
    runtime's cut of equal layers is as fast on its slowest GPU."""
    from autotp.cost_model.pipeline import _uniform_balance

    chunks = gpus * virtual
    n = chunks + more
    runtime = balance([1.0] * n, first / 4, last / 4, chunks, gpus)
    model = _uniform_balance(n, 1.0, first / 4, last / 4, chunks, gpus)
    assert sum(model) == n and min(model) >= 1
    ones = [1.0] * n
    assert _slowest_gpu(runtime, ones, first / 4, last / 4, gpus) == _slowest_gpu(model, ones, first / 4, last / 4, gpus)


def test_the_head_gpu_is_not_handed_the_layers_of_two_chunks():
    """6 equal layers in 4 chunks on 2 GPUs, the head 1.5 layers: the slowest-chunk cut 1+2+2+1
    gives GPU 1 (chunks 1 and 3) 3 layers and the head, 4.5; the GPUs' totals want 2+1+2+1, 4."""
    per_chunk = balance([1.0] * 6, 0.0, 1.5, 4)
    assert per_chunk == [1, 2, 2, 1] and _slowest_gpu(per_chunk, [1.0] * 6, 0.0, 1.5, 2) == 4.5
    sizes = balance([1.0] * 6, 0.0, 1.5, 4, gpus=2)
    assert sizes == [2, 1, 2, 1] and _slowest_gpu(sizes, [1.0] * 6, 0.0, 1.5, 2) == 4.0


def test_balance_splits_equal_layers_evenly_and_moves_layers_off_a_heavy_head():
    assert balance([1.0] * 8, 0.0, 0.0, 4) == [2, 2, 2, 2]
    assert balance([1.0] * 8, 0.1, 0.1, 2) == [4, 4]
    assert balance([1.0] * 8, 0.0, 4.0, 2) == [6, 2]      # the head costs four layers
    with pytest.raises(ConfigError, match="cannot be cut into 5 pipeline chunks"):
        balance([1.0] * 4, 0.0, 0.0, 5)


def test_the_cut_at_real_size_weighs_the_head_and_the_embedding_by_the_cost_model():
    """GPT-2 XL's plan at tp 8 on meta: its vocabulary head and loss cost more than a layer (1.2 of
    one on h100-dgx, where a layer's norms, residuals and collectives are priced at what they move
    and the vocabulary-parallel loss as the kernels it runs: its float32 logits' passes; 0.8 of one
    when the loss was priced as one op) and more than the embedding. The cut minimizes the slowest
    stage with them counted: the head's stage holds fewer layers than the others, and no layer moved
    between neighbouring stages makes the slowest one faster."""
    from autotp import zoo
    from autotp.planner import build_plan
    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.runtime.module.outline import layer_paths
    from autotp.runtime.pipeline import layer_costs

    model = zoo.build("gpt2", zoo.published_config("gpt2-xl"), device="meta")
    _, index, prop = build_plan(capture(model), 8, batch=8, seq=1024, profile="h100-dgx")
    costs, before, after = layer_costs(index, prop, get_profile("h100-dgx"), layer_paths(model))
    assert len(costs) == 48 and max(costs) / min(costs) < 1.01      # identical layers, priced alike
    assert after > costs[0] and after > before > 0  # head + loss > a layer, > embedding

    def slowest(sizes):
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        stages = [sum(costs[e - n:e]) for n, e in zip(sizes, ends)]
        stages[0] += before
        stages[-1] += after
        return max(stages)

    sizes = balance(costs, before, after, 8)
    assert sum(sizes) == 48 and all(sizes), sizes
    assert sizes[-1] < max(sizes[:-1]), sizes   # the head's stage gives up a layer
    for i in range(7):
        for moved in ((1, -1), (-1, 1)):
            other = list(sizes)
            other[i] += moved[0]
            other[i + 1] += moved[1]
            if min(other) > 0:
                assert slowest(other) >= slowest(sizes) * (1 - 1e-12), (sizes, other)


def test_pipeline_arguments_are_checked_before_anything_runs():
    assert check_pipeline(4, None, None, 1) == (4, "1f1b", 1)
    assert check_pipeline(2, 4, "Interleaved-1F1B", 2) == (4, "interleaved1f1b", 2)
    with pytest.raises(ConfigError, match="at least 4 micro-batches"):
        check_pipeline(4, 2, "1f1b", 1)
    with pytest.raises(ConfigError, match="not one of"):
        check_pipeline(2, 2, "zero-bubble", 1)
    with pytest.raises(ConfigError, match="need schedule='interleaved1f1b'"):
        check_pipeline(2, 2, "1f1b", 2)


# ---- steps on ranks ----------------------------------------------------------------------------

def _grad_errors(pm, reference: dict) -> dict:
    from autotp.testing import relative_error

    out = {}
    for name, p in pm.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        # a gradient zero in exact arithmetic (a key bias) is measured against its layer's
        scale = max(g.norm().item() for n, g in reference.items() if n.rsplit(".", 2)[0] == name.rsplit(".", 2)[0])
        out[name] = relative_error(grad, reference[name], scale)
    return out


#: the workload the pipelines' plans are solved for (see _step_case)
PLANNING = dict(profile="h100-dgx", batch=64, seq=4096)


def _step_case(family: str, *, tp: int, pp: int, microbatches: int, schedule: str | None = None, virtual: int = 1,
               layers: int = 4, batch: int = 4, seqs=(7,), steps: int = 1, stage_layers=None,
               checkpointing: bool = False, planning: dict | None = None, padded: bool = False) -> dict:
    """Serial AdamW steps on the whole batch against the pipeline's on each dp replica's part:
    the losses, the gradients of the first step and the parameters after the last.

    The plan is solved for a large workload (PLANNING, the families tests' own), so that the
    cost model splits these tiny models: at their own size every matrix would run replicated
    and tp > 1 would test nothing of tensor parallelism (checked: a tp > 1 plan has an f or g)."""
    from autotp import zoo
    from autotp.testing import keep_loss_precision, relative_error, tolerance

    config = zoo.tiny_config(family, layers=layers, heads=4, kv_heads=2, head_dim=4, vocab=48)
    model = zoo.build(family, config, dtype=torch.float64, seed=0)
    if zoo.FAMILIES[family].task == "causal":
        keep_loss_precision(model)
    pm = autotp.parallelize(model, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule, virtual=virtual,
                            stage_layers=stage_layers, activation_checkpointing=checkpointing,
                            **{**PLANNING, **(planning or {})})
    kinds = {c.kind for c in pm.plan.comms}
    assert tp == 1 or kinds & {"f", "g"}, f"{family}: the tp {tp} plan runs replicated ({sorted(kinds)})"
    serial_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    dp, dp_rank = pm.mesh.dp, pm.mesh.dp_rank
    part = batch // dp
    losses, grads = [], {}
    for step in range(steps):
        data = zoo.example_batch(family, config, batch=batch, seq=seqs[step % len(seqs)], seed=10 + step)
        if padded:    # the first row's last tokens are padding: micro-batches count different tokens
            data["labels"][0, -3:] = -100
            if step == 1:   # the first micro-batch all padding: its mean is 0/0, the batch's is a number
                data["labels"][:part // microbatches] = -100
        serial_opt.zero_grad()
        loss = model(**data).loss
        loss.backward()
        opt.zero_grad()
        mine = {k: v[dp_rank * part:(dp_rank + 1) * part] for k, v in data.items()}
        got = pm.step(**mine)
        whole = model(**mine).loss.detach() if dp > 1 else loss.detach()   # this replica's batch
        losses.append(relative_error(got, whole))
        if step == 0:
            # a float64 Llama takes its norms' statistics in float32 (T5 too): a plan that sums
            # them in another order (the norm split by columns or along the sequence) moves the
            # gradients by float32's rounding, and the bound is that precision's
            bound = tolerance(model, data)
            reference = {n: p.grad for n, p in model.named_parameters()}
            grads = _grad_errors(pm, reference)
            # a gradient zero in exact arithmetic (OPT's key bias) is rounding noise on both sides,
            # which AdamW scales up to a full step: such parameters are compared by gradient only
            noise = {n for n, g in reference.items()
                     if g.norm() <= 1e-9 * max(r.norm() for m, r in reference.items()
                                               if m.rsplit(".", 2)[0] == n.rsplit(".", 2)[0])}
        serial_opt.step()
        opt.step()
    full = dict(model.named_parameters())
    params = {n: relative_error(p.full_tensor() if hasattr(p, "full_tensor") else p, full[n])
              for n, p in pm.named_parameters() if n not in noise}
    return {"losses": losses, "grads": grads, "params": params, "bound": bound, "chunks": pm.describe(),
            "collectives": sorted({c.kind for c in pm.plan.comms})}


class _WritesInPlace(torch.nn.Module):
    """Outside its layers, a forward that builds its targets in place (T5's shift of the labels:
    zeros, then copy_ and fill_ into slices): the writes have no readers in the graph."""

    def __init__(self, width: int = 8, layers: int = 4, vocab: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                                              torch.nn.Linear(2 * width, width))
                                          for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 3
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten())}


def _in_place_case() -> dict:
    from autotp.testing import relative_error

    torch.manual_seed(0)
    model = _WritesInPlace().double()
    gen = torch.Generator().manual_seed(4)
    data = {"input_ids": torch.randint(0, 16, (4, 6), generator=gen), "labels": torch.randint(0, 16, (4, 6), generator=gen)}
    loss = model(**data)["loss"]
    loss.backward()
    pm = autotp.parallelize(model, tp=1, pp=4, microbatches=4, example_kwargs=data)
    got = pm.step(**data)
    return {"loss": relative_error(got, loss.detach()),
            "grads": _grad_errors(pm, {n: p.grad for n, p in model.named_parameters()})}


def _eval_case() -> dict:
    """With dropout in the model: a training step draws masks (its loss is not the eval loss);
    pm.eval() makes the step a forward without dropout, equal to the serial model in eval."""
    from autotp import zoo
    from autotp.testing import keep_loss_precision, relative_error

    config = zoo.tiny_config("gpt2", layers=4, heads=4, head_dim=4, vocab=48)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.3
    model = keep_loss_precision(zoo.build("gpt2", config, dtype=torch.float64))
    data = zoo.example_batch("gpt2", config, batch=4, seq=6, seed=2)
    pm = autotp.parallelize(model, tp=2, pp=2, microbatches=2, **PLANNING)
    trained = pm.step(**data)
    model.eval()
    serial = model(**data).loss.detach()
    pm.eval()
    with torch.no_grad():
        evaluated = pm.step(**data)
    return {"train vs eval": relative_error(trained, serial), "eval": relative_error(evaluated, serial)}


def _llama_config():
    from autotp import zoo

    return zoo.tiny_config("llama", layers=4, heads=4, kv_heads=2, head_dim=4, vocab=48)


def _from_pretrained_case(folder: str) -> dict:
    """Each rank reads its stage's parameters alone from a save_pretrained folder (written by
    the test process: transformers writes the config from the main process of a world alone)."""
    from autotp import zoo
    from autotp.testing import tolerance

    model = zoo.build("llama", _llama_config(), dtype=torch.float64)
    data = zoo.example_batch("llama", _llama_config(), batch=4, seq=6, seed=2)
    pm = autotp.from_pretrained(folder, tp=2, pp=2, microbatches=2, dtype=torch.float64, progress=False,
                                stage_layers=[2, 2], **PLANNING)
    model(**data).loss.backward()   # the model's own loss (float32 logits, as the loaded program's)
    pm.step(**data)
    # float32's bound: Llama's RMSNorm casts down, and a plan that sums in another order (a
    # sequence-parallel region) moves its values by float32's rounding (autotp.testing.tolerance)
    return {"grads": _grad_errors(pm, {n: p.grad for n, p in model.named_parameters()}),
            "held": sorted(pm.local_parameters()), "stage": pm.mesh.pp_rank, "bound": tolerance(model, data)}


def _dcp_case(folder: str) -> dict:
    """A stage's parameters and AdamW state through DCP: resumed at pp 2 x tp 2 bit for bit (and
    the next step too), loaded at pp 1 x tp 4 (a ParallelModule) to the same loss; autotp's
    per-rank files resumed at the same tp and pp; gather_to_hf refused with the way round."""
    from autotp import zoo
    from autotp.runtime.checkpoint import dcp
    from autotp.testing import keep_loss_precision, relative_error

    config = zoo.tiny_config("gpt2", layers=4, heads=4, head_dim=4, vocab=48)
    data = zoo.example_batch("gpt2", config, batch=4, seq=6, seed=2)

    def fresh(**kw):
        model = keep_loss_precision(zoo.build("gpt2", config, dtype=torch.float64, seed=kw.pop("seed")))
        return autotp.parallelize(model, **kw, **PLANNING)

    pm = fresh(seed=0, tp=2, pp=2, microbatches=2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.step(**data)
    opt.step()
    dcp.save(pm, f"{folder}/pipeline", opt)
    resumed = fresh(seed=9, tp=2, pp=2, microbatches=2)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    dcp.load(resumed, f"{folder}/pipeline", resumed_opt)
    equal = [torch.equal(a.to_local(), b.to_local()) for a, b in zip(pm.parameters(), resumed.parameters())]
    for module, optimizer in ((pm, opt), (resumed, resumed_opt)):
        optimizer.zero_grad()
        loss = module.step(**data)
        optimizer.step()
    equal += [torch.equal(a.to_local(), b.to_local()) for a, b in zip(pm.parameters(), resumed.parameters())]
    flat = fresh(seed=9, tp=4)
    dcp.load(flat, f"{folder}/pipeline")
    # autotp's own per-rank files: one per (stage, TP rank), resumed at the same tp and pp
    from autotp.runtime.checkpoint import gather_to_hf, load_sharded, save_sharded

    save_sharded(pm, f"{folder}/sharded")
    torch.distributed.barrier()
    again = fresh(seed=5, tp=2, pp=2, microbatches=2)
    load_sharded(again, f"{folder}/sharded")
    equal += [torch.equal(a.to_local(), b.to_local()) for a, b in zip(pm.parameters(), again.parameters())]
    with pytest.raises(ConfigError) as gather:
        gather_to_hf(pm, f"{folder}/hf")
    return {"equal": all(equal), "loss at tp 4": relative_error(flat(**data).loss.detach(), loss),
            "gather": str(gather.value)}


def _errors_case() -> list[str]:
    from autotp import zoo
    from autotp.errors import InputError
    from autotp.distributed.mesh import get_mesh
    from autotp.testing import relative_error

    seen = []
    with pytest.raises(ConfigError) as world:
        get_mesh(1, pp=3)
    seen.append(str(world.value))
    config = zoo.tiny_config("gpt2", layers=2, heads=2, head_dim=4, vocab=32)
    model = zoo.build("gpt2", config, dtype=torch.float64)
    with pytest.raises(ConfigError) as layers:
        autotp.parallelize(model, tp=2, pp=2, microbatches=2, schedule="interleaved1f1b", virtual=2)
    seen.append(str(layers.value))
    from autotp.errors import PlanError

    with pytest.raises(ConfigError) as asked:
        autotp.parallelize(model, tp=2, pp=2, microbatches=2, stage_layers=[1, 2])
    seen.append(str(asked.value))

    with pytest.raises(PlanError) as memory:
        autotp.parallelize(model, tp=2, pp=2, microbatches=2, memory_limit=4096)
    seen.append(str(memory.value))
    pm = autotp.parallelize(model, tp=2, pp=2, microbatches=2)
    with pytest.raises(InputError) as odd:
        pm.step(**zoo.example_batch("gpt2", config, batch=3, seq=5))
    seen.append(str(odd.value))
    bad = zoo.example_batch("gpt2", config, batch=2, seq=5)
    bad["input_ids"][1, 2] = 32    # past the vocabulary: stage 0's embedding would fail alone
    with pytest.raises(InputError) as index:
        pm.step(**bad)
    seen.append(str(index.value))
    with pytest.raises(InputError) as call:
        pm(**zoo.example_batch("gpt2", config, batch=2, seq=5))
    seen.append(str(call.value))
    # the second stage handed longer sequences: refused on every rank before any send (torch's
    # receive of the wrong size aborted the process); the next step runs
    from autotp.errors import DisagreementError

    seq = 6 if torch.distributed.get_rank() >= 2 else 5
    with pytest.raises(DisagreementError) as shapes:
        pm.step(**zoo.example_batch("gpt2", config, batch=2, seq=seq))
    seen.append(str(shapes.value))
    data = zoo.example_batch("gpt2", config, batch=2, seq=5)
    model.zero_grad()
    seen.append(relative_error(pm.step(**data), model(**data).loss.detach()))
    return seen


def _fast_cases(folder: str) -> dict:
    return {
        "gpt2 1f1b": _step_case("gpt2", tp=2, pp=2, microbatches=2, steps=2, seqs=(7, 5), padded=True),
        "in place": _in_place_case(),
        "from_pretrained": _from_pretrained_case(folder),
        "dcp": _dcp_case(f"{folder}/dcp"),
        "errors": _errors_case(),
    }


def _more_cases() -> dict:
    """The slow tier's four-rank cases beside the fast ones: interleaved 1F1B with recomputation,
    GPipe over a replica pair, an encoder, and eval mode (each a capture and a solve more: 60 s
    of the fast tier's budget)."""
    return {
        "llama interleaved": _step_case("llama", tp=2, pp=2, microbatches=2, schedule="interleaved1f1b", virtual=2,
                                        checkpointing=True, steps=2, seqs=(7, 4)),
        # ignored labels in one replica's rows only: the whole batch's mean weighs the replicas by tokens
        "llama gpipe dp2": _step_case("llama", tp=1, pp=2, microbatches=2, schedule="gpipe", batch=8,
                                      stage_layers=[3, 1], padded=True),
        "bert masked lm": _step_case("bert", tp=2, pp=2, microbatches=2),
        "eval": _eval_case(),
    }


def _worst(errors: dict) -> str:
    """The key of the largest error, a nan above all (``max`` would pass over a nan)."""
    return max(errors, key=lambda k: math.inf if math.isnan(errors[k]) else errors[k])


def _check_step(case: dict, name: str) -> None:
    assert all(loss <= 1e-12 for loss in case["losses"]), (name, case["losses"])   # a nan fails too
    bound = case["bound"]       # the precision the model computes in (float32 past a Llama's norms)
    worst = _worst(case["grads"])
    assert case["grads"][worst] <= bound, (name, worst, case["grads"][worst], bound)
    worst = _worst(case["params"])
    assert case["params"][worst] <= bound, (name, worst, case["params"][worst], bound)


def test_pipeline_steps_equal_serial_steps_on_four_ranks(own_cluster, tmp_path):
    # ranks of its own: twice in the two-worker fast tier this task hung on the shared ranks
    # after whatever else its worker had run there (passed 240 s; 26-28 s alone, 58 s beside the
    # other worker, 77 s beside two other pytest sessions); not reproduced on fresh ranks
    from autotp import zoo

    zoo.build("llama", _llama_config(), dtype=torch.float64).save_pretrained(tmp_path)
    results = own_cluster.run(_fast_cases, str(tmp_path))
    stages = set()
    for rank, result in enumerate(results):
        for name in ("gpt2 1f1b",):
            _check_step(result[name], name)
        stages.add(frozenset(result["gpt2 1f1b"]["grads"]))
        assert result["in place"]["loss"] <= 1e-12
        assert max(result["in place"]["grads"].values()) <= 1e-9
        loaded = result["from_pretrained"]
        assert max(loaded["grads"].values()) <= loaded["bound"], loaded["grads"]
        own = {0: ("model.layers.0.", "model.layers.1.", "model.embed_tokens."),
               1: ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")}[loaded["stage"]]
        assert loaded["held"] and all(name.startswith(own) for name in loaded["held"]), loaded["held"]
        assert result["dcp"]["equal"] and result["dcp"]["loss at tp 4"] <= 1e-12, result["dcp"]
        assert "stages hold different layers: save with autotp.runtime.dcp.save" in result["dcp"]["gather"]
        world, layers, asked, memory, odd, index, call, shapes, after = result["errors"]
        assert "differ across the pipeline replica of ranks [0, 1, 2, 3]" in shapes, shapes
        assert "'input_ids: (2, 5) int64'" in shapes and "'input_ids: (2, 6) int64'" in shapes, shapes
        assert after <= 1e-12, after
        assert "input_ids" in index and "32" in index
        assert "stage_layers=[1, 2] adds up to 3 layers but the model has 2 repeated layers" in asked
        assert f"pipeline stage {rank // 2} of 2 does not fit" in memory and "use more stages (pp)" in memory
        assert "not dp * pp * tp" in world and "choose pp in {1, 2, 4}" in world
        assert "2 repeated layers cannot be cut into 4 pipeline chunks" in layers
        assert "does not split into 2 equal micro-batches" in odd
        assert "call pm.step(**batch)" in call
    # each stage holds its own layers; the tied embedding and head is on both stages
    first, second = sorted(stages, key=lambda s: "transformer.h.0.ln_1.weight" not in s)
    assert "transformer.h.0.ln_1.weight" in first and "transformer.h.3.ln_1.weight" in second
    assert "transformer.h.3.ln_1.weight" not in first and "transformer.h.0.ln_1.weight" not in second
    assert "transformer.wte.weight" in first and "transformer.wte.weight" in second


@pytest.mark.slow
def test_more_pipeline_schedules_and_modes_equal_serial_on_four_ranks(own_cluster):
    results = own_cluster.run(_more_cases)
    for result in results:
        for name in ("llama interleaved", "llama gpipe dp2", "bert masked lm"):
            _check_step(result[name], name)
        assert result["eval"]["eval"] <= 1e-12 and result["eval"]["train vs eval"] > 1e-3, result["eval"]
    assert "chunk 1 on stage 1: 1 layers (model.layers.1)" in results[0]["llama interleaved"]["chunks"]
    assert "chunk 0 on stage 0: 3 layers (model.layers.0 .. model.layers.2)" in results[0]["llama gpipe dp2"]["chunks"]


def _slow_cases() -> dict:
    return {f"{family} pp2 tp2 dp2": _step_case(family, tp=2, pp=2, microbatches=2, batch=8, steps=2)
            for family in ("gpt2", "llama")}


@pytest.mark.slow
def test_ptd_p_on_eight_ranks_equals_serial_steps(cluster_of):
    for result in cluster_of(8).run(_slow_cases):
        for name, case in result.items():
            _check_step(case, name)


def _sequence_parallel_case() -> dict:
    """Megatron's layout with sequence parallelism (the planning profile's link free, so the
    solver takes it) at an uneven length: sequence-sharded activations cross the stages."""
    import dataclasses

    from autotp.cost_model import get_profile
    from autotp.testing import MEGATRON_GPT2

    free = dataclasses.replace(get_profile("h100-dgx"), name="free-link", link_bw=1e30, link_latency=0.0)
    return _step_case("gpt2", tp=2, pp=2, microbatches=2, seqs=(7, 6), steps=2,
                      planning=dict(sequence_parallel=True, profile=free, batch=8, seq=1024, layout=MEGATRON_GPT2))


def _t5_case() -> dict:
    return {"t5": _step_case("t5", tp=2, pp=2, microbatches=2, layers=2),
            "sequence parallel": _sequence_parallel_case()}


@pytest.mark.slow
def test_an_encoder_decoder_and_sequence_parallel_stages_equal_serial(cluster):
    for result in cluster.run(_t5_case):
        _check_step(result["t5"], "t5")
        _check_step(result["sequence parallel"], "sequence parallel")
        assert "reduce_scatter" in result["sequence parallel"]["collectives"], result["sequence parallel"]


def _drawn_case(case: dict) -> dict:
    return _step_case(case["family"], tp=case["tp"], pp=case["pp"], microbatches=case["microbatches"],
                      schedule=case["schedule"], virtual=case["virtual"], layers=case["layers"],
                      batch=case["microbatches"] * case["dp"] * case["micro"], seqs=(case["seq"],), steps=2,
                      checkpointing=case["checkpointing"])


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[__import__("hypothesis").HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FAMILIES)), layers=st.integers(2, 6),
       shape=st.sampled_from([(1, 2), (2, 2), (1, 4)]), schedule=st.sampled_from(["gpipe", "1f1b", "interleaved1f1b"]),
       extra=st.integers(0, 2), micro=st.integers(1, 2), seq=st.integers(3, 9), checkpointing=st.booleans())
def test_drawn_pipelines_equal_serial_steps(cluster, family, layers, shape, schedule, extra, micro, seq,
                                            checkpointing):
    tp, pp = shape
    virtual = 2 if schedule == "interleaved1f1b" else 1
    if layers < pp * virtual:
        schedule, virtual = "1f1b", 1
    if layers < pp:
        layers = pp
    case = dict(family=family, tp=tp, pp=pp, dp=4 // (tp * pp), microbatches=pp + extra, schedule=schedule,
                virtual=virtual, layers=layers, micro=micro, seq=seq, checkpointing=checkpointing)
    for result in cluster.run(_drawn_case, case):
        _check_step(result, str(case))


def _a_healthy_pp2_step() -> tuple:
    """A tiny GPT-2 at pp 2 and its batch, after one healthy step (every connection is up)."""
    from autotp import zoo

    config = zoo.tiny_config("gpt2", layers=2, heads=2, head_dim=4, vocab=32)
    pm = autotp.parallelize(zoo.build("gpt2", config, dtype=torch.float64), tp=1, pp=2, microbatches=2)
    data = zoo.example_batch("gpt2", config, batch=2, seq=5)
    pm.step(**data)
    return pm, data


def _steps_where_a_stage_dies(inside_the_schedule: bool) -> None:
    import os
    import signal

    pm, data = _a_healthy_pp2_step()
    if torch.distributed.get_rank() == 1:
        def dies(*args):
            os.kill(os.getpid(), signal.SIGKILL)

        if inside_the_schedule:   # past the step's check: the loss surfaces in the schedule's sends
            pm._chunk_modules[0].forward = dies
        else:
            dies()
    pm.step(**data)


def _steps_where_a_stage_raises() -> str:
    pm, data = _a_healthy_pp2_step()
    if torch.distributed.get_rank() == 1:
        def broken(*args):
            raise RuntimeError("a bug in the last stage's code")
        pm._chunk_modules[0].forward = broken
    try:
        pm.step(**data)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
def test_a_stage_that_raises_is_named_by_the_stage_left_waiting():
    # without the step guard the first stage waited in its receive and failed naming nobody
    from autotp.distributed import faults
    from autotp.distributed.launch import LocalCluster

    with LocalCluster(2, timeout=120, collective_timeout=12.0, error_grace=12.0 + faults.SLACK_S) as cluster:
        first, last = cluster.run(_steps_where_a_stage_raises)
    assert last.startswith("RuntimeError") and "[Stage 1] failed to run forward" in last, last
    assert "CommError" in first and "rank 1 raised RuntimeError: [Stage 1] failed to run forward: (from " \
        "RuntimeError: a bug in the last stage's code)" in first, first


@pytest.mark.slow
@pytest.mark.parametrize("inside_the_schedule", [False, True])
def test_a_lost_stage_is_named_by_its_neighbour(inside_the_schedule):
    from autotp.errors import CommError
    from autotp.distributed import faults
    from autotp.distributed.launch import LocalCluster

    with LocalCluster(2, timeout=120, collective_timeout=12.0, error_grace=12.0 + faults.SLACK_S) as cluster:
        with pytest.raises(CommError) as info:
            cluster.run(_steps_where_a_stage_dies, inside_the_schedule)
    text = str(info.value)
    assert "lost rank 1 (exit code -9, SIGKILL)" in text
    assert "rank 0 raised LostRankError: lost rank 1: the process has exited" in text
    if not inside_the_schedule:   # the step's first collective: its agreement check (made with
        # check_inputs=False too: it carries the step's number, so steps never pair out of order)
        assert "all_reduce(max) in autotp's agreement check failed" in text, text
    else:
        assert "the pipeline's sends and receives between stages failed" in text, text
