"""Vocab-parallel embeddings, output heads and cross-entropy on untied (Llama, GPT-NeoX) and tied
(OPT, BERT's masked-LM decoder) families: the parallel model on gloo ranks equals the serial one in
float64 (loss, logits, every gradient), including uneven vocabularies, ignored labels, logits kept
vocab-sharded, and the padding token in the input (Llama's, OPT's and BERT's embeddings have a
``padding_idx`` row that gets no gradient from the lookup)."""
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autotp
from autotp import zoo
from autotp.testing import keep_loss_precision

#: the parameters a family's vocabulary lives in (OPT ties lm_head to embed_tokens)
VOCAB_PARAMS = {"llama": ("model.embed_tokens.weight", "lm_head.weight"),
                "gpt-neox": ("gpt_neox.embed_in.weight", "lm_head.weight"),
                "opt": ("model.decoder.embed_tokens.weight", "lm_head.weight"),
                "bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")}


def _vanishing_gradients(model, pm, errors: dict) -> None:
    """A key projection's bias has an exactly-zero gradient in exact arithmetic (softmax ignores
    a constant added to every score), so its serial gradient is rounding noise (~1e-17) and the
    relative error means nothing: judge those by the absolute error against the largest gradient."""
    from autotp.distributed.shards import local_shard

    scale = max(p.grad.norm().item() for p in model.parameters() if p.grad is not None)
    for name, param in model.named_parameters():
        if param.grad is None or param.grad.norm().item() > 1e-12 * scale:
            continue
        held = pm.plan.aliases.get(name, name)
        placement = pm.plan.params[held]
        expected = local_shard(param.grad, placement, pm.plan.tp, pm.mesh.tp_rank) \
            if isinstance(placement, autotp.Shard) else param.grad
        errors[f"grad:{held}"] = (pm.local_grad(held) - expected).norm().item() / scale


def vocab_parallel_errors(case: dict) -> tuple[dict, dict]:
    family = case["family"]
    config = zoo.tiny_config(family, layers=1, heads=2, head_dim=4, vocab=case["vocab"])
    model = zoo.build(family, config, dtype=torch.float64, seed=case["seed"])
    if zoo.FAMILIES[family].task == "causal":
        keep_loss_precision(model)
    layout = {name: "vocab" for name in VOCAB_PARAMS[family]}
    pm = autotp.parallelize(model, tp=case["tp"], layout=layout, gather_logits=case["gather"])
    inputs = zoo.example_batch(family, config, batch=case["batch"], seq=case["seq"], seed=case["seed"])
    pad = getattr(model.get_input_embeddings(), "padding_idx", None)
    if pad is not None and case["seq"] > 1:   # the padding row's gradient: the head's alone (or zero)
        # not the first token: the padding row is zeros, and a first token that looks it up leaves a
        # 2-token causal model nothing to learn from
        inputs["input_ids"][0, 1 + case["seed"] % (case["seq"] - 1)] = pad
    labels = inputs["labels"]
    ignored = torch.rand(labels.shape, generator=torch.Generator().manual_seed(case["seed"])) < 0.3
    ignored[:, -1] = False   # a causal LM's loss needs one label kept (the shift drops the first)
    if zoo.FAMILIES[family].task == "masked":   # ... a masked LM's, one label at a position it keeps
        ignored[:, 0] = False
    inputs["labels"] = torch.where(ignored, torch.full_like(labels, -100), labels)
    from autotp.testing import equivalence_errors

    errors = equivalence_errors(model, pm, inputs)
    _vanishing_gradients(model, pm, errors)
    return errors, dict(pm.plan.params)


@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),   # 6: CI budget
          suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(family=st.sampled_from(sorted(VOCAB_PARAMS)), vocab=st.integers(9, 70), gather=st.booleans(),
       batch=st.integers(1, 2), seq=st.integers(2, 7), seed=st.integers(0, 999))
def test_vocab_parallel_embedding_head_and_loss_equal_serial(cluster_of, family, vocab, gather, batch, seq, seed):
    tp = 2
    case = dict(family=family, vocab=vocab, gather=gather, batch=batch, seq=seq, seed=seed, tp=tp)
    for errors, params in cluster_of(tp).run(vocab_parallel_errors, case):
        split = {name: params[name] for name in VOCAB_PARAMS[family] if name in params}   # a tied pair once
        assert split and all(p == autotp.Shard(0) for p in split.values()), split
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-9, (worst, errors[worst])
