"""Every family of autotp.zoo, parallelized by the planner, computes what the serial model computes.

Hypothesis draws, per family and tp (1..4, 3 included): one of a few tiny structures (layers,
heads, kv heads with kv < tp among them, head dim, vocabulary, rotary fraction), the batch, a
sequence length (the capture's own length 8 among them), the weights' seed and the dtype (the
fast tier runs each family at one tp, FAST_TP, with the structure and dtype fixed per tp,
FAST_PAIRS); loss,
logits and every gradient must match the serial model within TOLERANCE (float64 1e-9, float32
1e-4; float32's for a float64 model that casts down, autotp.testing.tolerance). The structure is drawn from a small fixed set so that the rank processes, which persist
across examples, capture each structure once (autotp.capture.cache) and vary everything else.

A family known not to pass yet is marked xfail(strict=True) with the reason, so that it turns
into a failure once it is fixed and the mark must go; the fast tier runs a family's first broken
tp only (the slow tier every one), since each failing run still pays a capture.
"""
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autotp.capture import EXAMPLE_SEQ

#: (layers, heads, kv_heads, head_dim, vocab, rotary): 6 heads split evenly at tp 1-3 and
#: unevenly at 4, 2 kv heads (fewer than tp at 3 and 4); 4 heads with one kv head (multi-query
#: where the family has it), half-rotary heads; odd vocabularies (uneven vocab split)
STRUCTURES = [(2, 6, 2, 4, 53, 1.0), (1, 4, 1, 8, 40, 0.5)]
FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "gpt-neox", "gpt-j", "falcon", "falcon-new", "gpt-bigcode",
            "opt", "bert", "t5"]
#: (family, tp) -> why it does not pass yet (measured when this file was last changed)
KNOWN_BROKEN: dict[tuple[str, int], str] = {}
#: family -> why float64 agreement is not held to 1e-9: its serial model computes in float32 there
FLOAT32_ONLY = {"gpt-j": "GPTJAttention upcasts q and k to float32, so even tp=1 differs from the eager "
                         "model by float32 rounding (5.8e-8 relative on a q_proj gradient, measured)"}


_PLANS: dict = {}   # per rank process: (family, structure, tp, dtype) -> the plan solved for it


def check_family_case(case: dict) -> tuple[dict, dict, float]:
    """On each rank: build the drawn tiny model, parallelize it, compare with serial."""
    import autotp
    from autotp import zoo
    from autotp.capture import cache as capture_cache
    from autotp.testing import equivalence_errors, keep_loss_precision, tolerance

    layers, heads, kv_heads, head_dim, vocab, rotary = case["structure"]
    family, dtype = case["family"], getattr(torch, case["dtype"])
    config = zoo.tiny_config(family, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             vocab=vocab, rotary=rotary)
    device = case.get("device", "cpu")   # benchmarks/gpu.py runs the same check on CUDA
    model = zoo.build(family, config, dtype=dtype, seed=case["seed"], device=device)
    if zoo.FAMILIES[family].task == "causal":
        keep_loss_precision(model)
    inputs = {k: v.to(device) for k, v in zoo.example_batch(family, config, batch=case["batch"], seq=case["seq"],
                                                             seed=case["seed"] + 1).items()}
    # a large planning workload, so that the cost model splits even these tiny models; the solver's
    # answer depends on the structure and tp only (not the weights), so it is solved once per rank
    # process and replayed (plan=) for the structure's later examples
    key = (family, case["structure"], case["tp"], case["dtype"])
    pm = autotp.parallelize(model, case["tp"], batch=64, seq=4096, profile="h100-dgx", plan=_PLANS.get(key))
    _PLANS.setdefault(key, pm.programs[0].plan)
    errors = equivalence_errors(model, pm, inputs)
    # the dtype's bound, or float32's where the model casts down (an RMSNorm's float32 variance):
    # a plan that sums in another order (a sequence-parallel region) moves those values by
    # float32's rounding (autotp.testing.tolerance)
    return rescale_zero_gradients(model, pm, errors), capture_cache.stats(), tolerance(model, inputs)


def rescale_zero_gradients(model, pm, errors: dict) -> dict:
    """A gradient that is zero in exact arithmetic (the key bias of softmax attention: it adds one
    constant to a row of scores) is rounding noise in the serial model too, and its relative
    error means nothing. Where a serial gradient's norm is below 1e4 machine epsilons of the
    largest one (float64 2e-12, float32 1e-3), its error is taken relative to the largest gradient
    norm instead (absolute, at the model's scale). Measured: Qwen2's key bias in float32 at tp=3
    has a rounding-noise gradient that the parallel model matches to only 1.9e-4 relative."""
    norms = {pm.plan.aliases.get(n, n): p.grad.norm().item() for n, p in model.named_parameters()
             if p.grad is not None}
    scale = max(norms.values(), default=0.0)
    noise = 1e4 * torch.finfo(next(model.parameters()).dtype).eps
    for name, norm in norms.items():
        key = f"grad:{name}"
        if key in errors and norm < noise * scale:   # relative_error is absolute where norm is 0
            errors[key] = errors[key] * (norm if norm > 0 else 1.0) / scale
    return errors


#: The fast tier's (structure, dtype) per tp. A structure and dtype not yet seen on a rank cost a
#: capture and a solve (seconds on 2 cores) where another example of them costs a fraction of one,
#: so the fast tier gives each tp one pair and draws the rest (batch, length, weights) twice;
#: over tp 1..4 every family meets both structures in both dtypes: MQA (one kv head) split
#: unevenly at tp 3, six heads unevenly at 4 with two kv heads (fewer than the ranks at 3 and 4).
#: The slow tier draws the structure and dtype too.
#: family -> the shortest input its model takes (T5's relative-position buckets need 3 tokens:
#: export narrows the capture to it, test_capture checks that, and a shorter call is refused with
#: an InputError naming the bound, not an equivalence case)
MIN_SEQ = {"t5": 3}
#: The fast tier runs each family at one tp (the slow tier at every tp 1..4): CI's budget on 2
#: cores buys twelve captures here, not forty. The tps are dealt so that each of 2, 3 and 4 meets
#: several families, and with FAST_PAIRS every family still meets a split: multi-query (one kv
#: head) split unevenly at tp 3 (Falcon, BigCode, NeoX's plain heads), six heads unevenly at tp 4
#: with two kv heads, fewer than the ranks (Llama-like GQA, Mistral, BERT, Falcon's new layout),
#: float32 at tp 2 (GPT-J upcasts anyway, Qwen2's biases, OPT). T5, the dearest family (six
#: captures per structure: 33 s at tp 2), runs at tp 1 here; split at tp 2 under Megatron's layout
#: by test_encoders.py's lengths test and by the slow tier's draws
FAST_TP = {"gpt2": 4, "llama": 3, "mistral": 4, "qwen2": 2, "gpt-neox": 3, "gpt-j": 2, "falcon": 3,
           "falcon-new": 4, "gpt-bigcode": 3, "opt": 2, "bert": 4, "t5": 1}
SLOW_ONLY = {(f, tp) for f in FAMILIES for tp in (1, 2, 3, 4) if FAST_TP[f] != tp}
FAST_PAIRS = {1: (1, "float32"), 2: (0, "float32"), 3: (1, "float64"), 4: (0, "float64")}


def cases(family: str, tp: int, fast: bool = False):
    dtypes = ["float32"] if family in FLOAT32_ONLY else ["float64", "float32"]
    structure, dtype = st.sampled_from(STRUCTURES), st.sampled_from(dtypes)
    if fast:
        index, name = FAST_PAIRS[tp]
        structure, dtype = st.just(STRUCTURES[index]), st.just(name if name in dtypes else dtypes[0])
    return st.fixed_dictionaries({
        "family": st.just(family), "tp": st.just(tp),
        "structure": structure,
        "batch": st.integers(1, 3),
        "seq": st.one_of(st.just(EXAMPLE_SEQ), st.integers(MIN_SEQ.get(family, 2), 16)),
        "dtype": dtype,
        "seed": st.integers(0, 2**16),
    })


def assert_family_case(cluster_of, case: dict) -> None:
    results = cluster_of(case["tp"]).run(check_family_case, case)
    for errors, _, bound in results:
        worst = max(errors, key=errors.get)
        assert errors[worst] <= bound, f"{case}: {worst} relative error {errors[worst]:.3e} > {bound:.0e}"


def _cases(fast: bool):
    """(tp, family) pairs, grouped by tp (one set of ranks per world size). In the fast tier a
    family runs its first known-broken tp only, where the strict xfail flips once it is fixed."""
    pairs, seen_broken = [], set()
    for tp in (1, 2, 3, 4):
        for f in FAMILIES:
            if fast and (f, tp) in SLOW_ONLY:
                continue
            reason = KNOWN_BROKEN.get((f, tp))
            if reason is None:
                pairs.append((tp, f))
            elif not (fast and f in seen_broken):
                seen_broken.add(f)
                pairs.append(pytest.param(tp, f, marks=pytest.mark.xfail(strict=True, reason=reason)))
    return pairs


def check_capture_reused(family: str) -> dict:
    """Two models of one structure and different weights on this rank: one capture."""
    from autotp.capture import cache as capture_cache

    capture_cache.clear()
    case = dict(family=family, tp=1, structure=STRUCTURES[0], batch=2, seq=5, dtype="float64", seed=0)
    check_family_case(case)
    check_family_case(dict(case, seed=1, seq=EXAMPLE_SEQ))
    return capture_cache.stats()


def test_examples_of_one_structure_capture_once_per_rank(cluster_of):
    for stats in cluster_of(1).run(check_capture_reused, "gpt2"):
        assert stats["misses"] == 1 and stats["hits"] == 1, stats


_settings = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture],
                 phases=[Phase.explicit, Phase.generate])   # no shrinking: a failure reports its case


@pytest.mark.parametrize("tp, family", _cases(fast=True))
@settings(max_examples=2, **_settings)      # 2 examples per family at its FAST_TP
@given(data=st.data())
def test_family_matches_serial(cluster_of, tp, family, data):
    assert_family_case(cluster_of, data.draw(cases(family, tp, fast=True)))


@pytest.mark.slow
@pytest.mark.parametrize("tp, family", _cases(fast=False))
@settings(max_examples=25, **_settings)
@given(data=st.data())
def test_family_matches_serial_many(cluster_of, tp, family, data):
    assert_family_case(cluster_of, data.draw(cases(family, tp)))
