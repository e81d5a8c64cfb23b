"""pm.generate: greedy and sampled decoding with the KV cache split by head, token for token the
serial model's ``generate``.

Hypothesis draws the family (GPT-2; Llama with grouped-query attention, 2 kv heads for 4 query
heads, so kv < tp at tp 3 and 4), the batch, the prompt length (1 included: its own program),
left padding (with its mask, or pad tokens alone, from which generate infers the mask as HF
does), how many tokens to generate, whether an eos token stops some rows early, and greedy or
sampled decoding (temperature, top-k, top-p, min-p, a repetition penalty; both seeded alike, each
rank's generator seeded apart, so the ranks must take one rank's draw). The ranks keep one parallel model per (family, tp) across examples, as a serving loop would."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autotp
from autotp import zoo
from autotp.errors import ConfigError, InputError

VOCAB = 96
PAD = VOCAB - 1
LAYOUTS = {
    "gpt2": {"*.c_attn.weight": "column", "*.attn.c_proj.weight": "row", "*.mlp.c_fc.weight": "column",
             "*.mlp.c_proj.weight": "row"},
    "llama": {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
              "*.o_proj.weight": "row", "*.gate_proj.weight": "column", "*.up_proj.weight": "column",
              "*.down_proj.weight": "row"},
}
KV_HEADS = {"gpt2": 4, "llama": 2}
_MODELS: dict = {}   # per rank process: (family, tp) -> (serial model, parallel model)


def _models(family: str, tp: int):
    if (family, tp) not in _MODELS:
        config = zoo.tiny_config(family, heads=4, kv_heads=KV_HEADS[family], vocab=VOCAB, positions=64)
        model = zoo.build(family, config, dtype=torch.float64, seed=5).eval()
        layout = dict(LAYOUTS[family])
        if tp > KV_HEADS[family]:   # fewer kv heads than ranks: k and v cannot split, the planner places them
            layout = {k: v for k, v in layout.items() if not k.startswith(("*.k_proj", "*.v_proj"))}
        _MODELS[family, tp] = (model, autotp.parallelize(model, tp, layout=layout))
    return _MODELS[family, tp]


def generate_both(case: dict) -> dict:
    model, pm = _models(case["family"], case["tp"])
    gen = torch.Generator().manual_seed(case["seed"])
    b, s = case["batch"], case["length"]
    ids = torch.randint(2, VOCAB - 1, (b, s), generator=gen)
    mask = None
    if case["padded"] and s > 1:
        mask = torch.ones(b, s, dtype=torch.long)
        for row, n in enumerate(case["pads"][:b]):
            mask[row, :min(n, s - 1)] = 0          # left padding; every row keeps a token
            ids[row, :min(n, s - 1)] = PAD
    if mask is not None and not case["mask_given"]:
        mask = None   # the pad tokens stay in the prompt: generate infers the mask from them, as HF does
    n = case["new"]
    eos = None
    if case["eos"] == "drawn":   # a token the serial model draws mid-way in row 0: some rows stop early
        free = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None)
        eos = int(free[0, s + (n - 1) // 2])
    # "none": eos_token_id=None, which turns the config's eos off; "config": left out, the config's
    eos_kw = {} if case["eos"] == "config" else {"eos_token_id": eos}
    sampling = case["sampling"] or {"do_sample": False}
    torch.manual_seed(case["seed"])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=PAD, **eos_kw, **sampling)
    # each rank's generator seeded apart: the group samples as its first rank, seeded as serial was
    rank = torch.distributed.get_rank()
    torch.manual_seed(case["seed"] + (rank % case["tp"]) * 1000)
    got = pm.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=PAD, **eos_kw,
                      **(case["sampling"] or {}))
    return {"want": want.tolist(), "got": got.tolist(), "cache_heads": int(pm.kv_cache["key_0"].shape[1]),
            "programs": [p.step for p in pm.programs]}


#: sampled decoding's settings (None: greedy), HuggingFace's processors in HuggingFace's order
SAMPLING = st.one_of(st.none(), st.fixed_dictionaries(
    {"do_sample": st.just(True)},
    optional={"temperature": st.sampled_from([0.5, 1.0, 1.7]), "top_k": st.sampled_from([0, 5, 50]),
              "top_p": st.sampled_from([0.8, 1.0]), "min_p": st.sampled_from([None, 0.05]),
              "repetition_penalty": st.sampled_from([1.0, 1.3])}),
    st.fixed_dictionaries({"repetition_penalty": st.just(1.4)}))


def _cases(tp: int):
    return st.fixed_dictionaries({
        "tp": st.just(tp), "family": st.sampled_from(["gpt2", "llama"]), "batch": st.integers(1, 3),
        "length": st.integers(1, 7), "padded": st.booleans(), "mask_given": st.booleans(), "pads": st.lists(st.integers(0, 4), min_size=3,
                                                                                 max_size=3),
        "new": st.integers(1, 6), "eos": st.sampled_from(["drawn", "none", "config"]),
        "sampling": SAMPLING, "seed": st.integers(0, 999)})


def assert_generation(cluster_of, case: dict) -> None:
    results = cluster_of(case["tp"]).run(generate_both, case)
    for r in results:
        assert r["got"] == r["want"], (case, r)
    heads = [r["cache_heads"] for r in results]
    total, tp = KV_HEADS[case["family"]], case["tp"]
    if tp <= total:   # split by head: each head's keys and values on exactly one rank
        assert sum(heads) == total and max(heads) - min(heads) <= 1, (case, heads)
    else:             # fewer kv heads than ranks: every rank holds them all (its query heads need them)
        assert heads == [total] * tp, (case, heads)


#: chosen cases, one per tp, that cover what the slow tier draws (hypothesis's first derandomized
#: draw is its simplest case, the same for every tp: GPT-2, greedy, one token); the fast tier runs
#: tp 2 and 3 (sampling with top-p, min-p and a repetition penalty over a padded batch; greedy
#: from one token with the config's eos), the slow tier all four
FAST = [
    dict(tp=1, family="llama", batch=3, length=5, padded=True, mask_given=True, pads=[2, 0, 4], new=4,
         eos="none", sampling={"do_sample": True, "temperature": 0.7, "top_k": 5}, seed=11),
    dict(tp=2, family="gpt2", batch=2, length=6, padded=True, mask_given=False, pads=[3, 0, 0], new=5,
         eos="drawn", sampling={"do_sample": True, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.3},
         seed=12),
    dict(tp=3, family="llama", batch=2, length=1, padded=False, mask_given=False, pads=[0, 0, 0], new=3,
         eos="config", sampling={"repetition_penalty": 1.4}, seed=13),
    dict(tp=4, family="gpt2", batch=3, length=7, padded=True, mask_given=True, pads=[1, 4, 0], new=6,
         eos="drawn", sampling={"do_sample": True, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.3},
         seed=14),
]


@pytest.mark.parametrize("case", [c if c["tp"] in (2, 3) else pytest.param(c, marks=pytest.mark.slow) for c in FAST],
                         ids=[f"tp{c['tp']}-{c['family']}" for c in FAST])
def test_generation_equals_serial_with_a_head_split_cache(cluster_of, case):
    assert_generation(cluster_of, case)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_generation_equals_serial_many(cluster_of, tp, data):
    assert_generation(cluster_of, data.draw(_cases(tp)))


def programs_and_errors() -> dict:
    model, pm = _models("gpt2", 2)
    gen = torch.Generator().manual_seed(2)   # prompts alike on every rank
    ids = torch.randint(2, VOCAB - 1, (2, 5), generator=gen)
    out = {"training": pm.training}                      # a model in eval() gives a module in eval()
    pm.generate(ids, max_new_tokens=3, pad_token_id=PAD)
    first = len(pm.programs)
    pm.generate(torch.randint(2, VOCAB - 1, (3, 9), generator=gen), max_new_tokens=5, pad_token_id=PAD)
    out["reused"] = len(pm.programs) == first            # another batch and length: the same two programs
    for name, call in {"empty": lambda: pm.generate(ids[:, :0]),
                       "mask": lambda: pm.generate(ids, attention_mask=torch.ones(2, 4, dtype=torch.long)),
                       "float": lambda: pm.generate(ids.double()),
                       "steps": lambda: pm.generate(ids, max_new_tokens=0)}.items():
        try:
            call()
            out[name] = "ran"
        except (InputError, ConfigError) as e:
            out[name] = type(e).__name__
    model.generation_config.no_repeat_ngram_size = 2
    try:
        autotp.parallelize(model, 2, layout=LAYOUTS["gpt2"]).generate(ids)
        out["ngram"] = "ran"
    except ConfigError as e:
        out["ngram"] = str(e)
    finally:
        model.generation_config.no_repeat_ngram_size = 0
    # a checkpoint whose generation config samples (as many chat models' do) samples here too
    config = model.generation_config
    config.do_sample, config.temperature, config.top_p, config.top_k = True, 0.6, 0.9, 20
    try:
        sampled = autotp.parallelize(model, 2, layout=LAYOUTS["gpt2"])
        torch.manual_seed(3)
        want = model.generate(ids, max_new_tokens=6, pad_token_id=PAD)
        torch.manual_seed(3 + 1000 * torch.distributed.get_rank())
        out["config sampling"] = torch.equal(sampled.generate(ids, max_new_tokens=6, pad_token_id=PAD), want)
        out["greedy differs"] = not torch.equal(model.generate(ids, max_new_tokens=6, pad_token_id=PAD,
                                                               do_sample=False), want)
        for name, call in {"top_p": lambda: sampled.generate(ids, top_p=-0.5),
                           "unknown": lambda: sampled.generate(ids, num_beams=4)}.items():
            try:
                call()
                out[name] = "ran"
            except ConfigError as e:
                out[name] = str(e)
    finally:
        config.do_sample, config.temperature, config.top_p, config.top_k = None, None, None, None
    return out


def test_eos_and_pad_left_out_are_the_configs_and_none_is_none_as_in_huggingface():
    """HuggingFace's generate tells an argument left out (the generation config's) from one passed
    as None (none: no row stops early; a pad of None falls back to the first eos)."""
    from autotp.generation import FROM_CONFIG, _settings

    config = zoo.tiny_config("llama", heads=2, head_dim=4, vocab=VOCAB)
    info = {"generation_config": zoo.build("llama", config, device="meta").generation_config, "model_name": "m"}
    assert (info["generation_config"].eos_token_id, info["generation_config"].pad_token_id) == (1, 0)
    assert _settings(info, 3, FROM_CONFIG, FROM_CONFIG) == (3, [1], 0)
    assert _settings(info, 3, None, FROM_CONFIG) == (3, [], 0)
    assert _settings(info, 3, FROM_CONFIG, None) == (3, [1], 1)
    assert _settings(info, 3, None, None) == (3, [], None)
    assert _settings(info, 3, [5, 7], 9) == (3, [5, 7], 9)


def test_sampling_settings_resolve_as_in_huggingface_and_what_is_not_implemented_is_refused():
    """The processors HuggingFace applies, in its order, from the call, else the generation
    config, else HuggingFace's defaults; a sampling-only setting autotp does not implement is
    refused when sampling and ignored (as HuggingFace ignores it) when not."""
    from transformers import GenerationConfig

    from autotp.generation import _processors

    def kinds(config, **given):
        sample, processors = _processors({"generation_config": config, "model_name": "M"}, given, None)
        return sample, [type(p).__name__ for p in processors]

    plain = GenerationConfig()
    assert kinds(plain) == (False, [])
    assert kinds(plain, do_sample=True) == (True, ["TopKLogitsWarper"])   # HF's default top_k=50
    assert kinds(plain, do_sample=True, top_k=0, temperature=0.5, top_p=0.9, min_p=0.1, repetition_penalty=1.2) == (
        True, ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"])
    chat = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert kinds(chat) == (True, ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                                  "TopPLogitsWarper"])
    assert kinds(chat, do_sample=False) == (False, ["RepetitionPenaltyLogitsProcessor"])   # the call wins
    typical = GenerationConfig(typical_p=0.5)
    assert kinds(typical) == (False, [])                    # greedy: HuggingFace ignores it too
    with pytest.raises(ConfigError, match=r"typical_p=0.5, which autotp's sampling does not implement"):
        kinds(typical, do_sample=True)
    with pytest.raises(ConfigError, match=r"generate got \['num_return_sequences'\]"):
        kinds(plain, num_return_sequences=2)


def test_programs_are_reused_and_bad_calls_are_refused_on_every_rank(cluster_of):
    for out in cluster_of(2).run(programs_and_errors):
        assert out["reused"] and out["training"] is False
        assert out["empty"] == out["mask"] == out["float"] == "InputError"
        assert out["steps"] == "ConfigError"
        assert "no_repeat_ngram_size=2" in out["ngram"] and "does not implement" in out["ngram"], out["ngram"]
        assert out["config sampling"] and out["greedy differs"], {k: out[k] for k in ("config sampling", "greedy differs")}
        assert "top_p" in out["top_p"] and "generate's sampling settings" in out["top_p"], out["top_p"]
        assert "['num_beams']" in out["unknown"], out["unknown"]


#: fused multi-query projections with the tailed layout (each rank its query heads, k and v whole):
#: family, tp, query heads, kv heads, the fused projection and the attention output
FUSED = [("gpt-bigcode", 3, 5, 1, "attn.c_attn", "attn.c_proj"),
         ("falcon", 2, 6, 1, "self_attention.query_key_value", "self_attention.dense"),
         ("falcon-new", 3, 12, 2, "self_attention.query_key_value", "self_attention.dense"),
         # 2 groups of 3 heads at tp 4: each group dealt to its own 2 ranks (a per-block shard)
         ("falcon-new", 4, 6, 2, "self_attention.query_key_value", "self_attention.dense")]


def fused_generation(family: str, tp: int, heads: int, kv: int, fused: str, out: str) -> tuple:
    config = zoo.tiny_config(family, layers=2, heads=heads, kv_heads=kv, head_dim=4, vocab=VOCAB, positions=64)
    model = zoo.build(family, config, dtype=torch.float64, seed=3).eval()
    pm = autotp.parallelize(model, tp, layout={f"*.{fused}.*": "column", f"*.{out}.weight": "row"},
                            batch=64, seq=2048, profile="h100-dgx")   # a workload at which the split pays
    prompt = torch.randint(2, VOCAB - 1, (2, 5), generator=torch.Generator().manual_seed(4))
    want = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    got = pm.generate(prompt, max_new_tokens=5, pad_token_id=PAD)
    return pm.plan.params[f"transformer.h.0.{fused}.weight"], torch.equal(got, want), pm.plan.attention


@pytest.mark.parametrize("family, tp, heads, kv, fused, out", [
    case if case[0] == "gpt-bigcode" else pytest.param(*case, marks=pytest.mark.slow) for case in FUSED],
    ids=[f"{case[0]}-tp{case[1]}" for case in FUSED])
def test_greedy_generation_over_a_fused_multi_query_split_equals_serial(cluster_of, family, tp, heads, kv,
                                                                        fused, out):
    for placement, same, attention in cluster_of(tp).run(fused_generation, family, tp, heads, kv, fused, out):
        assert placement.tail == 2 and attention, (placement, attention)
        assert same
