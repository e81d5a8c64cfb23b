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
    step = CachedStep(model, layers=1)
    cache = torch.randn(batch, 2, past, 8, dtype=torch.float32)
    mask = torch.ones(batch, past + 1, dtype=torch.long)
    mask[0, 0] = 0   # a left-padded row: generate keeps the mask
    ids = torch.tensor([[3], [4]])
    with torch.no_grad():
        out = step(input_ids=ids, attention_mask=mask, key_0=cache, value_0=cache.clone())
        config.output_router_logits = False
        want = CachedStep(model, layers=1)(input_ids=ids, attention_mask=mask, key_0=cache, value_0=cache.clone())
    assert out["logits"].shape == (batch, 48) and out["key_0"].shape == (batch, 2, past + 1, 8)
    assert torch.equal(out["logits"], want["logits"])   # the router loss never touched the logits
