"""A generation step (``autotp.generation.CachedStep``) asks the model for what it returns alone.

Cheap, one process, no capture: the step run eagerly as each rank's decode program would trace it."""
import torch

from autotp import zoo
from autotp.generation import CachedStep


def test_a_decode_step_with_the_router_loss_in_the_config_computes_no_router_loss():
    # output_router_logits=True in the config (as training with the router loss sets it): the
    # model's forward would compute transformers' load-balancing loss over the step's one token
    # and the whole grown attention mask, a shape error (2 router rows against 2 * 6 mask
    # entries); generate reads only the logits and the cache
    config = zoo.tiny_config("qwen2-moe", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2,
                             output_router_logits=True)
    model = zoo.build("qwen2-moe", config, dtype=torch.float32).eval()
    past, batch = 5, 2
    step = CachedStep(model, ("key_0", "value_0"))
    cache = torch.randn(batch, 2, past, 8, dtype=torch.float32)
    mask = torch.ones(batch, past + 1, dtype=torch.long)
    mask[0, 0] = 0   # a left-padded row: generate keeps the mask
    ids = torch.tensor([[3], [4]])
    with torch.no_grad():
        out = step(input_ids=ids, attention_mask=mask, key_0=cache, value_0=cache.clone())
        config.output_router_logits = False
        want = CachedStep(model, ("key_0", "value_0"))(input_ids=ids, attention_mask=mask, key_0=cache, value_0=cache.clone())
    assert out["logits"].shape == (batch, 48) and out["key_0"].shape == (batch, 2, past + 1, 8)
    assert torch.equal(out["logits"], want["logits"])   # the router loss never touched the logits


def _steps_against_huggingface(family: str, window: int, pads: list[int], length: int, new: int) -> None:
    """Prefill and decode steps run eagerly as generate feeds them (the mask grown each step, the
    cache the last step returned) against the model's own calls with transformers' cache."""
    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=48, positions=64,
                             sliding_window=window)
    model = zoo.build(family, config, dtype=torch.float64, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 48, (len(pads), length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        out = CachedStep(model)(input_ids=ids, attention_mask=mask, position_ids=positions)
        hf_cache = want.past_key_values
        for _ in range(new):
            assert torch.allclose(out["logits"], want.logits[:, -1], rtol=0, atol=1e-12)
            token = want.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], -1)
            positions = positions[:, -1:] + 1
            cache = {f"{kv}_{i}": out[f"{kv}_{i}"] for i in range(2) for kv in ("key", "value")}
            want = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=hf_cache,
                         use_cache=True)
            hf_cache = want.past_key_values
            out = CachedStep(model, tuple(cache))(input_ids=token, attention_mask=mask, position_ids=positions, **cache)
            # the windowed layers hold what transformers' own cache holds
            for i, layer in enumerate(hf_cache.layers):
                assert out[f"key_{i}"].shape == layer.keys.shape


def test_a_sliding_window_step_reads_a_left_padded_mask_at_its_last_positions():
    # Mistral, a window of 4, row 0 left-padded by 3 of 8: the windowed cache holds 3 positions;
    # filled as tensors it counted 3 positions seen, so the decode step read the mask's first
    # entries (row 0's pads) for its keys: logits off from the second new token, no error
    _steps_against_huggingface("mistral", window=4, pads=[3, 0], length=8, new=4)


def test_a_window_longer_than_the_prompt_and_mixed_layers_step_like_huggingface():
    # Gemma 3: a sliding layer and a full one; a window of 6 over a prompt of 4 grows past it
    _steps_against_huggingface("gemma3", window=6, pads=[0, 2], length=4, new=5)

def _prompt_then_one_step(model, names: tuple[str, ...]) -> tuple[dict, dict]:
    """The prompt's step (6 tokens) and one decode step fed its states, eagerly, checked against
    transformers' own cached decode: (prompt step's outputs, decode step's outputs)."""
    ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prompt = CachedStep(model)(input_ids=ids[:, :6])
        assert sorted(n for n in prompt if n != "logits") == sorted(names)
        states = {n: prompt[n] for n in names}
        before = {n: v.clone() for n, v in states.items()}
        step = CachedStep(model, names)(input_ids=ids[:, 6:], **states)
        first = model(input_ids=ids[:, :6], use_cache=True)
        serial = model(input_ids=ids[:, 6:], cache=first.cache, use_cache=True).logits[:, -1]
    assert all(torch.equal(states[n], before[n]) for n in names)   # the step's inputs are left as they came
    torch.testing.assert_close(step["logits"], serial, rtol=1e-12, atol=1e-12)
    return prompt, step


def test_a_hybrid_step_carries_its_mixers_conv_and_recurrent_states_to_the_next():
    # Bamba (tiny): layer 0 a Mamba2 mixer, layer 1 attention. The prompt's step returns the
    # mixer's conv and SSM states beside the attention's keys and values; a decode step fed them
    # gives the logits transformers' own cached decode gives (what the serial generate runs), and
    # returns the states of one token more
    config = zoo.tiny_config("bamba", layers=2, heads=2, head_dim=8, vocab=48)
    model = zoo.build("bamba", config, dtype=torch.float64).eval()
    prompt, step = _prompt_then_one_step(model, ("conv_0", "ssm_0", "key_1", "value_1"))
    assert step["key_1"].shape[2] == 7 and step["conv_0"].shape == prompt["conv_0"].shape
    assert not torch.equal(step["ssm_0"], prompt["ssm_0"])


def test_a_model_with_a_cache_class_of_its_own_steps_with_it_and_carries_its_states():
    # MiniMax (tiny): layer 0 lightning attention, layer 1 attention. Its model refuses any cache
    # but its own MiniMaxCache, which keeps the lightning layer's state in a list beside the
    # layers: the step makes that class (named in the model's forward signature, not its name),
    # hands the state out as linear_cache_0 and takes it back, as transformers' own cached decode
    from transformers.cache_utils import DynamicCache

    from autotp.step_cache import own_cache_class

    config = zoo.tiny_config("minimax", layers=2, heads=2, head_dim=8, vocab=48)
    config._experts_implementation = "batched_mm"
    model = zoo.build("minimax", config, dtype=torch.float64).eval()
    own = own_cache_class(model)
    assert own is not None and issubclass(own, DynamicCache) and own is not DynamicCache
    assert own_cache_class(zoo.build("llama", zoo.tiny_config("llama", layers=1, heads=2, head_dim=8, vocab=48))) is None
    prompt, step = _prompt_then_one_step(model, ("linear_cache_0", "key_1", "value_1"))
    assert step["key_1"].shape[2] == 7 and not torch.equal(step["linear_cache_0"], prompt["linear_cache_0"])
