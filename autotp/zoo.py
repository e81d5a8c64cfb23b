"""The model families autotp is tested on, by their published configurations and as tiny ones.

Nothing here is specific to how autotp plans a family (the planner never sees these names): it is
the catalogue that the command line (``autotp plan llama-3-8b --tp 8``), the model-zoo benchmark
(``benchmarks/model_zoo.py`` -> ``docs/models.md``) and the per-family property tests share.

* :data:`FAMILIES`: family name -> :class:`Family` (its HuggingFace model class, the published
  configurations, and how a tiny configuration of it is spelled); beside it the tables of
  families whose tests differ (:data:`ATTENTION_FAMILIES`, :data:`EXPERT_FAMILIES`,
  :data:`RECURRENT_FAMILIES`, :data:`HYBRID_FAMILIES`).
* :func:`published_config` / :func:`build`: a published configuration (optionally with fewer
  layers) as a HuggingFace config, and a model of it on any device (``meta`` allocates nothing).
* :func:`tiny_config`: a tiny configuration from a few numbers a test draws (layers, heads, kv
  heads, head dim, vocabulary, rotary fraction), dropout off so runs are comparable.
* :func:`example_batch`: a training batch of the family's kind (causal LM, masked LM, seq2seq).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str                      # the transformers class, e.g. "LlamaForCausalLM"
    config_class: str                     # e.g. "LlamaConfig"
    published: dict = field(default_factory=dict)   # size name -> config kwargs
    #: tiny config kwargs from (layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    tiny: Callable[..., dict] = None      # type: ignore[assignment]
    task: str = "causal"                  # causal | masked | seq2seq
    kv_heads: bool = False                # do its configs take a number of kv heads (GQA)?
    rotary: bool = False                  # does it use rotary position embeddings?
    #: config attribute that sets the number of layers (for shrunken published configs)
    layers_attr: tuple = ("num_hidden_layers", "n_layer", "num_layers")


def _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim + 8,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=positions, attention_dropout=0.0, **extra)


def _neox(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    return dict(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=positions,
                rotary_pct=rotary, hidden_dropout=0.0, attention_dropout=0.0)


def _gptj(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    rotary_dim = max(2, int(head_dim * rotary) // 2 * 2)
    return dict(vocab_size=vocab, n_embd=heads * head_dim, n_layer=layers, n_head=heads, n_positions=positions,
                rotary_dim=rotary_dim, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _falcon(new_arch: bool):
    def tiny(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
        kw = dict(vocab_size=vocab, hidden_size=heads * head_dim, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=positions, hidden_dropout=0.0,
                  attention_dropout=0.0, new_decoder_architecture=new_arch)
        if new_arch:
            kw["num_kv_heads"] = kv_heads
        else:
            kw["multi_query"] = kv_heads == 1
        return kw

    return tiny


def _bigcode(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    return dict(vocab_size=vocab, n_embd=heads * head_dim, n_layer=layers, n_head=heads, n_positions=positions,
                multi_query=kv_heads == 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _opt(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    hidden = heads * head_dim
    return dict(vocab_size=vocab, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, max_position_embeddings=positions, word_embed_proj_dim=hidden,
                dropout=0.0, attention_dropout=0.0)


def _bert(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    hidden = heads * head_dim
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, max_position_embeddings=positions, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)


def _t5(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    return dict(vocab_size=vocab, d_model=heads * head_dim, d_kv=head_dim, d_ff=4 * heads * head_dim,
                num_layers=layers, num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0,
                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "GPT2LMHeadModel", "GPT2Config", {
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257),
    }, tiny=lambda layers, heads, kv_heads, head_dim, vocab, rotary, positions: dict(
        n_layer=layers, n_head=heads, n_embd=heads * head_dim, vocab_size=vocab, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    Family("llama", "LlamaForCausalLM", "LlamaConfig", {
        "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                           rope_theta=500000.0),
        "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    }, tiny=_llama_like, kv_heads=True, rotary=True),
    Family("mistral", "MistralForCausalLM", "MistralConfig", {
        "mistral-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                           sliding_window=4096),
    }, tiny=_llama_like, kv_heads=True, rotary=True),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {
        "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768),
    }, tiny=_llama_like, kv_heads=True, rotary=True),
    Family("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", {
        "gpt-neox-20b": dict(vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                             num_attention_heads=64, rotary_pct=0.25, max_position_embeddings=2048),
    }, tiny=_neox, rotary=True),
    Family("gpt-j", "GPTJForCausalLM", "GPTJConfig", {
        "gpt-j-6b": dict(vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_positions=2048),
    }, tiny=_gptj, rotary=True),
    Family("falcon", "FalconForCausalLM", "FalconConfig", {
        "falcon-7b": dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                          multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False),
    }, tiny=_falcon(False), kv_heads=True, rotary=True),
    Family("falcon-new", "FalconForCausalLM", "FalconConfig", {
        "falcon-40b": dict(vocab_size=65024, hidden_size=8192, num_hidden_layers=60, num_attention_heads=128,
                           num_kv_heads=8, new_decoder_architecture=True, parallel_attn=True, bias=False),
    }, tiny=_falcon(True), kv_heads=True, rotary=True),
    Family("gpt-bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", {
        "starcoder-15b": dict(vocab_size=49152, n_embd=6144, n_inner=24576, n_layer=40, n_head=48, n_positions=8192,
                              multi_query=True),
    }, tiny=_bigcode, kv_heads=True),
    Family("opt", "OPTForCausalLM", "OPTConfig", {
        "opt-6.7b": dict(vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                         num_attention_heads=32, max_position_embeddings=2048, word_embed_proj_dim=4096),
    }, tiny=_opt),
    Family("bert", "BertForMaskedLM", "BertConfig", {
        "bert-large": dict(vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, max_position_embeddings=512),
    }, tiny=_bert, task="masked"),
    Family("t5", "T5ForConditionalGeneration", "T5Config", {
        "t5-large": dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16,
                         decoder_start_token_id=0, pad_token_id=0),
    }, tiny=_t5, task="seq2seq"),
]}


# Families of the 2025-26 round whose attention differs from Llama's (issue 35): whole-width q/k
# norms (OLMo2), a fused q|k|v projection read back with slices (Phi-3, ModernBERT). Kept as a
# block of their own beside the mixture-of-experts families.
def _modernbert(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    hidden = heads * head_dim
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, max_position_embeddings=positions, attention_dropout=0.0,
                mlp_dropout=0.0, embedding_dropout=0.0, local_attention=positions,
                cls_token_id=0, sep_token_id=1)


#: kept beside FAMILIES, not in it (as EXPERT_FAMILIES): the per-family tests that iterate FAMILIES
#: (fake backend, stack, pipeline, checkpoint, figures) do not yet hold for them; their every-call test is
#: tests/e2e/test_calls_after_training.py
ATTENTION_FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("olmo2", "Olmo2ForCausalLM", "Olmo2Config", {
        "olmo-2-7b": dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                          rms_norm_eps=1e-6),
        "olmo-2-13b": dict(vocab_size=100352, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                           num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                           rms_norm_eps=1e-6),
    }, tiny=_llama_like, kv_heads=True, rotary=True),
    Family("phi3", "Phi3ForCausalLM", "Phi3Config", {
        "phi-3-mini": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        "phi-3-medium": dict(vocab_size=32064, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                             num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=4096),
    }, tiny=lambda **kw: {k: v for k, v in _llama_like(**kw).items() if k != "head_dim"},
        kv_heads=True, rotary=True),
    Family("modernbert", "ModernBertForMaskedLM", "ModernBertConfig", {
        "modernbert-base": dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                                num_attention_heads=12, max_position_embeddings=8192),
        "modernbert-large": dict(vocab_size=50368, hidden_size=1024, intermediate_size=2624, num_hidden_layers=28,
                                 num_attention_heads=16, max_position_embeddings=8192),
    }, tiny=_modernbert, task="masked"),
]}


# ---- sliding-window attention ---------------------------------------------------------------
def _windowed(every: int | None = None, **more):
    """A tiny configuration with sliding-window attention: llama-like sizes, a window of 4 positions
    (``sliding_window`` overrides), and where ``every`` is given, every ``every``-th layer full
    attention, the others sliding (Gemma 2's 2, Cohere 2's 4, Gemma 3's 6; the last layer full from 2 layers on,
    so a tiny model has both kinds); ``more`` adds the family's own switches."""
    def tiny(layers, heads, kv_heads, head_dim, vocab, rotary, positions, **extra) -> dict:
        kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions, sliding_window=4)
        if every is not None:
            kw["layer_types"] = ["full_attention" if (i + 1) % every == 0 or (i == layers - 1 and layers > 1)
                                 else "sliding_attention" for i in range(layers)]
        kw.update(more)
        kw.update(extra)
        return kw

    return tiny


#: families whose attention looks at a sliding window of the last positions in all or some layers
#: (Mistral's and gpt-oss's are in FAMILIES and EXPERT_FAMILIES). Kept beside FAMILIES, not in it:
#: the per-family tests that iterate FAMILIES have not been run on them; their tests are
#: tests/e2e/test_sliding_window.py (every call, generate with left padding)
WINDOW_FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("ministral", "MinistralForCausalLM", "MinistralConfig", {
        "ministral-8b": dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=32768, rope_theta=100000000.0, sliding_window=32768),
    }, tiny=_windowed(), kv_heads=True, rotary=True),
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", {
        "gemma-2-9b": dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=8192,
                           sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                           final_logit_softcapping=30.0),
    }, tiny=_windowed(2, query_pre_attn_scalar=8), kv_heads=True, rotary=True),
    Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", {
        "gemma-3-27b": dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                            num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                            max_position_embeddings=131072, sliding_window=1024, query_pre_attn_scalar=168,
                            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1000000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }, tiny=_windowed(6, query_pre_attn_scalar=8), kv_heads=True, rotary=True),
    Family("cohere2", "Cohere2ForCausalLM", "Cohere2Config", {
        "command-r7b": dict(vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                            sliding_window=4096, rope_theta=50000.0, logit_scale=0.25),
    }, tiny=_windowed(4), kv_heads=True, rotary=True),
]}


# ---- mixtures of experts -----------------------------------------------------------------------
def _moe(experts_key: str, **more):
    """A tiny MoE configuration: llama-like attention, 4 experts of 2 picked per token (``experts``
    and ``top_k`` override), dropout off; ``more`` adds the family's own switches."""
    def tiny(layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2, **extra) -> dict:
        kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
        kw.update({experts_key: experts, "num_experts_per_tok": top_k}, **more)
        kw.update(extra)
        return kw

    return tiny


#: the MoE families, by their published configurations (planned at real size: benchmarks/model_zoo.py,
#: ``autotp plan mixtral-8x7b --tp 8``) and tiny ones (tests/e2e/test_experts.py). Kept beside
#: FAMILIES, not in it: the per-family tests that iterate FAMILIES have not been run on them yet.
EXPERT_FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig", {
        "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=32768),
    }, tiny=_moe("num_local_experts"), kv_heads=True, rotary=True),
    Family("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", {
        "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              max_position_embeddings=40960),
    }, tiny=_moe("num_experts", moe_intermediate_size=12, decoder_sparse_step=1), kv_heads=True, rotary=True),
    Family("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", {
        "qwen1.5-moe-a2.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                  moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                  num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                  num_experts=60, num_experts_per_tok=4, max_position_embeddings=8192),
    }, tiny=_moe("num_experts", moe_intermediate_size=12, shared_expert_intermediate_size=20, decoder_sparse_step=1),
        kv_heads=True, rotary=True),
    Family("olmoe", "OlmoeForCausalLM", "OlmoeConfig", {
        "olmoe-1b-7b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                            max_position_embeddings=4096),
    }, tiny=_moe("num_experts"), kv_heads=True, rotary=True),
    Family("deepseek-v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", {
        "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                            n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                            topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                            max_position_embeddings=4096),
    }, tiny=lambda layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2, **extra: {
        **dict(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim + 8,
               moe_intermediate_size=12, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=experts, num_experts_per_tok=top_k,
               n_group=1, topk_group=1, first_k_dense_replace=1 if layers > 1 else 0, q_lora_rank=16,
               kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
               max_position_embeddings=positions, attention_dropout=0.0),
        **extra},   # the first layer dense (as the published model's first three), the rest MoE
        kv_heads=False, rotary=True),
    Family("gpt-oss", "GptOssForCausalLM", "GptOssConfig", {
        "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                            num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072),
    }, tiny=_moe("num_local_experts", sliding_window=4), kv_heads=True, rotary=True),
    # Llama-4's text model: every token through every expert (a stack read whole by bmm, the
    # router's scores scaling the rows), a shared expert, chunked attention with rotary in three
    # layers of four and full attention without it (and with a temperature) in the fourth
    Family("llama4", "Llama4ForCausalLM", "Llama4TextConfig", {
        "llama-4-scout": dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                              intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                              num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
                              interleave_moe_layer_step=1, attention_chunk_size=8192, use_qk_norm=True,
                              max_position_embeddings=10485760, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                               "original_max_position_embeddings": 8192}),
    }, tiny=_moe("num_local_experts", num_experts_per_tok=1, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=4,
                 intermediate_size_mlp=40), kv_heads=True, rotary=True),
]}


# ---- not transformers ------------------------------------------------------------------------------
def _mamba(layers, heads, kv_heads, head_dim, vocab, rotary, positions) -> dict:
    hidden = heads * head_dim
    # use_mambapy off: the slow path's plain loop over the sequence (what runs on CPU without the kernels)
    return dict(vocab_size=vocab, hidden_size=hidden, state_size=4, num_hidden_layers=layers, expand=2,
                conv_kernel=4, time_step_rank=4, use_mambapy=False)


#: models that are not transformers. Mamba on CPU runs transformers' slow path, a Python loop over
#: the sequence: torch.export unrolls it, so a program holds one length (Capture.fixed_dims) and a
#: call at another gets a program of its own (tests/e2e/test_fixed_length.py); generate carries its
#: recurrent state from step to step. Kept beside FAMILIES: the per-family tests that iterate
#: FAMILIES vary the sequence length.
RECURRENT_FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("mamba", "MambaForCausalLM", "MambaConfig", {
        "mamba-130m": dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2,
                           conv_kernel=4, time_step_rank=48, use_bias=False, use_conv_bias=True,
                           layer_norm_epsilon=1e-5, tie_word_embeddings=True, use_mambapy=False),
    }, tiny=_mamba),
]}


# ---- hybrids: state-space and linear-attention mixers beside attention ------------------------------
def _alternating(layers: int, mixer: str, attention: str) -> list[str]:
    """A tiny hybrid's layer pattern: the mixer on even layers, attention on odd ones (2 layers:
    one of each)."""
    return [attention if i % 2 else mixer for i in range(layers)]


def _mamba2_mixer(heads, head_dim) -> dict:
    """A tiny Mamba2 mixer (Bamba, Falcon-H1, Granite-4.0-H): twice the attention's heads of its
    head dim (the published expand of 2), one group, a state of 4 and chunks of 4 tokens, so that
    the example length of 11 spans several chunks and a padded last one."""
    return dict(mamba_n_heads=2 * heads, mamba_d_head=head_dim, mamba_n_groups=1, mamba_d_state=4,
                mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)


def _jamba(layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2, **extra) -> dict:
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.pop("head_dim")
    kw.update(num_experts=experts, num_experts_per_tok=top_k, expert_layer_period=2, expert_layer_offset=1,
              attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
              mamba_dt_rank=4, use_mamba_kernels=False)
    return {**kw, **extra}


def _bamba(layers, heads, kv_heads, head_dim, vocab, rotary, positions, **extra) -> dict:
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.pop("head_dim")
    kw.update(attn_layer_indices=[i for i in range(layers) if i % 2], **_mamba2_mixer(heads, head_dim))
    return {**kw, **extra}


def _falcon_h1(layers, heads, kv_heads, head_dim, vocab, rotary, positions, **extra) -> dict:
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.update(mamba_d_ssm=2 * heads * head_dim, **_mamba2_mixer(heads, head_dim))
    return {**kw, **extra}


def _granite_hybrid(layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2,
                    **extra) -> dict:
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.pop("head_dim")
    kw.update(num_local_experts=experts, num_experts_per_tok=top_k, shared_intermediate_size=2 * heads * head_dim,
              layer_types=_alternating(layers, "mamba", "attention"), **_mamba2_mixer(heads, head_dim))
    return {**kw, **extra}


def _gated_deltanet(layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2,
                    **extra) -> dict:
    """Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet layers (as many key heads as attention heads,
    twice the value heads, as published) and gated attention, each before a mixture of experts."""
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.update(linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=head_dim,
              linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, num_experts=experts,
              num_experts_per_tok=top_k, moe_intermediate_size=12, shared_expert_intermediate_size=12,
              layer_types=_alternating(layers, "linear_attention", "full_attention"))
    return {**kw, **extra}


def _minimax(layers, heads, kv_heads, head_dim, vocab, rotary, positions, experts=4, top_k=2, **extra) -> dict:
    """MiniMax: lightning attention (linear attention in blocks of ``block_size`` tokens, 4 here so
    the example length spans several blocks) and softmax attention, each before its experts."""
    kw = _llama_like(layers, heads, kv_heads, head_dim, vocab, rotary, positions)
    kw.update(num_local_experts=experts, num_experts_per_tok=top_k, block_size=4,
              layer_types=_alternating(layers, "linear_attention", "full_attention"))
    return {**kw, **extra}


#: hybrids: state-space (Mamba in Jamba; Mamba2 in Bamba, Falcon-H1, Granite-4.0-H) and linear-attention
#: (Gated DeltaNet in Qwen3-Next and Qwen3.5-MoE, lightning attention in MiniMax) mixers beside attention.
#: Kept beside FAMILIES: the per-family tests that iterate FAMILIES vary the sequence length, and
#: Jamba's Mamba, whose torch path loops over the sequence, holds one length per program
#: (Capture.fixed_dims); Mamba2's chunked scan, Gated DeltaNet's chunks and MiniMax's blocks are
#: captured at a dynamic length with export's guards (Capture.guards: a residue class of lengths,
#: a chunk or block count). Their every-call test is tests/e2e/test_hybrids.py.
#: The published configurations are the checkpoints' config.json values (Falcon-H1 0.5B and
#: Granite-4.0-H-Tiny: their model cards' tables).
HYBRID_FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("jamba", "JambaForCausalLM", "JambaConfig", {
        "jamba-v0.1": dict(vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, num_experts=16, num_experts_per_tok=2,
                           expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
                           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256,
                           use_mamba_kernels=False, max_position_embeddings=262144),
    }, tiny=_jamba, kv_heads=True),
    Family("bamba", "BambaForCausalLM", "BambaConfig", {
        "bamba-9b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[9, 18, 27],
                         mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
                         mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=262144),
    }, tiny=_bamba, kv_heads=True, rotary=True),
    Family("falcon-h1", "FalconH1ForCausalLM", "FalconH1Config", {
        "falcon-h1-0.5b": dict(vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536,
                               mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                               mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128, max_position_embeddings=16384),
    }, tiny=_falcon_h1, kv_heads=True, rotary=True),
    Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", {
        "granite-4.0-h-tiny": dict(vocab_size=100352, hidden_size=1536, intermediate_size=512,
                                   shared_intermediate_size=1024, num_hidden_layers=40, num_attention_heads=12,
                                   num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6,
                                   layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
                                   mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                                   mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                                   position_embedding_type="nope", max_position_embeddings=131072),
    }, tiny=_granite_hybrid, kv_heads=True),
    Family("qwen3-next", "Qwen3NextForCausalLM", "Qwen3NextConfig", {
        "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                                   num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
                                   decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=262144),
    }, tiny=_gated_deltanet, kv_heads=True, rotary=True),
    Family("qwen3.5-moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {
        "qwen3.5-35b-a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                linear_num_value_heads=32, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                                max_position_embeddings=262144),
    }, tiny=_gated_deltanet, kv_heads=True, rotary=True),
    Family("minimax", "MiniMaxForCausalLM", "MiniMaxConfig", {
        "minimax-text-01": dict(vocab_size=200064, hidden_size=6144, intermediate_size=9216, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, num_local_experts=32,
                                num_experts_per_tok=2, block_size=256,
                                layer_types=["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)],
                                max_position_embeddings=10240000),
    }, tiny=_minimax, kv_heads=True, rotary=True),
]}


def _all_families() -> dict[str, Family]:
    return {**FAMILIES, **ATTENTION_FAMILIES, **WINDOW_FAMILIES, **EXPERT_FAMILIES, **RECURRENT_FAMILIES,
            **HYBRID_FAMILIES}


def family(name: str) -> Family:
    """The family of that name, from any of the tables (FAMILIES, ATTENTION_FAMILIES, WINDOW_FAMILIES,
    EXPERT_FAMILIES, RECURRENT_FAMILIES, HYBRID_FAMILIES)."""
    return _all_families()[name]


def published_sizes() -> dict[str, str]:
    """Every published configuration name -> its family."""
    return {size: fam.name for fam in _all_families().values() for size in fam.published}


def family_of(size: str) -> Family:
    from .errors import ConfigError

    sizes = published_sizes()
    if size not in sizes:
        raise ConfigError(f"unknown model {size!r}; known configurations: {', '.join(sorted(sizes))}")
    return _all_families()[sizes[size]]


def _classes(family: Family) -> tuple[Any, Any]:
    import transformers

    return getattr(transformers, family.config_class), getattr(transformers, family.model_class)


def modeling_modules() -> list[str]:
    """The transformers modules that define every family's model (for ``autotp.testing.preload``)."""
    return sorted({_classes(fam)[1].__module__ for fam in _all_families().values()})


def _layer_lists(kwargs: dict, layers: int) -> dict:
    """A hybrid's per-layer lists shrunk to ``layers`` with every kind of layer kept: the first
    ``layers`` entries of ``layer_types``, a missing kind put in at the end; ``attn_layer_indices``
    those below ``layers``, else the last layer."""
    out = {}
    types = kwargs.get("layer_types")
    if isinstance(types, list):
        kept = types[:layers]
        missing = [kind for kind in dict.fromkeys(types) if kind not in kept]
        out["layer_types"] = (kept[:max(layers - len(missing), 0)] + missing)[:layers]
    indices = kwargs.get("attn_layer_indices")
    if isinstance(indices, list):
        out["attn_layer_indices"] = [i for i in indices if i < layers] or [layers - 1]
    return out


def published_config(size: str, layers: int | None = None) -> Any:
    """The HF config of a published model (``layers`` shrinks its depth, all else kept)."""
    family = family_of(size)
    config_cls, _ = _classes(family)
    kwargs = dict(family.published[size])
    if layers is not None:
        kwargs.update(_layer_lists(kwargs, layers))
        for attr in family.layers_attr:
            if attr in kwargs or hasattr(config_cls(), attr):
                kwargs[attr] = layers
                if family.task == "seq2seq":
                    kwargs["num_decoder_layers"] = layers
                break
    return config_cls(**kwargs)


def tiny_config(family: str, *, layers: int = 2, heads: int = 4, kv_heads: int | None = None, head_dim: int = 8,
                vocab: int = 96, rotary: float = 1.0, positions: int = 32, **extra: Any) -> Any:
    """A tiny configuration of ``family`` (dropout off). ``kv_heads`` applies where the family has
    grouped-query or multi-query attention (default: as many as ``heads``); ``extra`` goes to the
    family's own spelling (an MoE family's ``experts``, ``top_k``, or any config field)."""
    fam = _all_families()[family]
    config_cls, _ = _classes(fam)
    kwargs = fam.tiny(layers=layers, heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim, vocab=vocab,
                      rotary=rotary, positions=positions, **extra)
    # special tokens inside the tiny vocabulary (the published ids would lie outside it)
    kwargs.update(bos_token_id=0, eos_token_id=1, pad_token_id=kwargs.get("pad_token_id", 0))
    return config_cls(**kwargs)


def build(family: str, config: Any, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
          seed: int = 0) -> torch.nn.Module:
    """A model of ``config`` with random weights (``device="meta"``: no weights at all)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _, model_cls = _classes(_all_families()[family])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype)


def example_batch(family: str, config: Any, batch: int = 2, seq: int = 8, seed: int = 1) -> dict:
    """A training batch for the family's task: ids and labels (masked LM: a few positions
    labelled, the rest -100; seq2seq: an encoder input and decoder labels)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    if _all_families()[family].task == "masked":
        keep = torch.rand((batch, seq), generator=gen) < 0.5
        keep[:, 0] = True
        labels = torch.where(keep, labels, torch.full_like(labels, -100))
    return {"input_ids": ids, "labels": labels}
