"""Generation on a ParallelModule, its KV cache (and a hybrid's recurrent states) held as the plan splits them.

``pm.generate(input_ids, attention_mask=None, max_new_tokens=20, ...)`` computes what
HuggingFace's ``model.generate(...)`` computes for a decoder-only model: the prompt's position
ids from its attention mask (left padding), the mask dropped when it is all ones, one token per
step (argmax, or a draw with ``do_sample=True`` after HuggingFace's temperature, top-k, top-p
and min-p processors; a repetition penalty either way), a prompt's pad tokens masked when no
mask is given, and finished rows (an ``eos_token_id`` drawn) filled with ``pad_token_id``. It
runs two kinds of program under the module's one parameter layout:

* **prefill**: the prompt in, the last position's logits and every layer's keys and values out
  (a state-space or linear-attention layer's conv and recurrent states: ``conv_i``, ``ssm_i``;
  the states a model's own cache class keeps beside its layers, MiniMax's ``linear_cache_i``);
* **decode**: one token and the cache in, its logits and the grown (or updated) cache out.

Each is the model's own forward, captured through :class:`CachedStep`, which hands the cache to
the model as a ``DynamicCache`` (or the cache class the model requires of its own:
:func:`~autotp.step_cache.own_cache_class`) built from plain named tensors (``key_0``, ``value_0``, ...) and
returns the updated cache the same way. The cache outputs are planned as kept split
(``build_plan(keep_split=...)``) and the decode program's cache inputs arrive split the same
way (``input_placements``): where the plan splits attention by head, each rank keeps and feeds
back only its heads' keys and values; with fewer kv heads than ranks (GQA, MQA) the plan keeps
them whole and so does the cache; a recurrent state lies as the plan leaves its mixer's output
(split by head where the mixer is). Programs are captured on first use, agreed by the ranks and
cached like any other call's (a one-token prompt, or a cache of one position, is its own
program: torch.export specializes a dim of size 1).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .capture import Capture, capture, seq_bounds
from .errors import ConfigError, InputError, PlanError
from .placements import REPLICATE, Placement
from .step_cache import own_cache_class, own_states, step_cache, windowed_layers

#: the example batch and lengths a step is captured with (0 and 1 are specialized by export)
EXAMPLE_BATCH = 2
EXAMPLE_LENGTH = 11

#: generation-config settings that change which token generate picks and that autotp's loop
#: does not implement: a model whose generation config (or call) asks for one is refused
_UNSUPPORTED = {
    "num_beams": 1, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None,
    "guidance_scale": None, "watermarking_config": None,
}
#: ... and those that act only when sampling (HuggingFace ignores them in greedy decoding)
_UNSUPPORTED_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}

#: the settings generate implements, with HuggingFace's defaults (a setting left out, or None,
#: is the model's generation config's, else this default: HuggingFace's resolution)
SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                     "repetition_penalty": 1.0}

#: forward flags of HuggingFace models that add outputs a generation step does not return
_UNREAD_OUTPUTS = ("output_router_logits",)


class CachedStep(nn.Module):
    """``model``'s forward with its cache as plain named tensors.

    The step shares the model's parameter, buffer and submodule tables, so its parameters have
    the model's own names (a plan made for the model applies as it is). ``forward(input_ids,
    [attention_mask], [position_ids], key_0, value_0, conv_1, ssm_1, ...)`` returns ``{"logits":
    the last position's logits, "key_0": ..., ...}``: an attention layer's keys and values, a
    state-space or linear-attention layer's (transformers' ``LinearAttentionLayer``) conv and
    recurrent states, a hybrid layer both; ``names`` lists the tensors a decode step takes."""

    def __init__(self, model: nn.Module, names: tuple[str, ...] = ()):
        super().__init__()
        object.__setattr__(self, "inner", model)   # not a submodule: FQNs stay the model's
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self.training = model.training
        self.names = tuple(names)
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        # outputs a step never returns, asked off: a config with output_router_logits=True would
        # have an MoE model compute its load-balancing loss over the step's tokens and the whole
        # attention mask (one token against the grown mask, a shape error in the decode step)
        self.unread = {name: False for name in _UNREAD_OUTPUTS if name in params}
        self.cache_class = own_cache_class(model)

    def forward(self, **kwargs: Any) -> dict[str, torch.Tensor]:
        cached = {name: kwargs.pop(name) for name in self.names}
        layers = sorted({int(name.rsplit("_", 1)[1]) for name in cached})
        kv = {i: (cached[f"key_{i}"], cached[f"value_{i}"]) for i in layers if f"key_{i}" in cached}
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
        # positions seen before this step: the mask spans them and the step's tokens (a sliding
        # window layer holds fewer, and must be told: autotp.step_cache)
        past = mask.shape[-1] - ids.shape[-1] if mask is not None and ids is not None and kv else None
        cache = step_cache(self.inner.config, kv, past, self.cache_class)
        own = dict(own_states(cache))
        for i in layers:
            if f"conv_{i}" in cached or f"ssm_{i}" in cached:
                _load_states(cache.layers[i], cached.get(f"conv_{i}"), cached.get(f"ssm_{i}"))
        for name, value in cached.items():
            attr, i = name.rsplit("_", 1)
            if attr in own:   # a state the model's own cache class keeps beside its layers
                held = own[attr]
                held.extend([] for _ in range(len(held), int(i) + 1))
                held[int(i)] = value.clone()   # a copy, as _load_states makes
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.inner(**kwargs, use_cache=True, **self.unread, **{self.cache_arg: cache})
        cache = out.get(self.cache_arg, out.get("past_key_values"))
        result = {"logits": out["logits"][:, -1, :]}
        for i, layer in enumerate(cache.layers):
            for name, value in _layer_tensors(layer, i):
                result[name] = value
        for attr, held in own_states(cache):
            for i, value in enumerate(held):
                if isinstance(value, torch.Tensor):
                    result[f"{attr}_{i}"] = value
        return result


def _layer_tensors(layer: Any, i: int) -> list[tuple[str, torch.Tensor]]:
    """A cache layer's tensors under the step's names: ``key_i``/``value_i`` of attention,
    ``conv_i``/``ssm_i`` of a state-space or linear-attention mixer (one state each: transformers'
    ``state_idx`` 0), those it holds."""
    out = []
    conv, ssm = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
    if isinstance(conv, dict) and conv.get(0) is not None:
        out.append((f"conv_{i}", conv[0]))
    if isinstance(ssm, dict) and ssm.get(0) is not None:
        out.append((f"ssm_{i}", ssm[0]))
    if getattr(layer, "keys", None) is not None:
        out += [(f"key_{i}", layer.keys), (f"value_{i}", layer.values)]
    return out


def _load_states(layer: Any, conv: torch.Tensor | None, ssm: torch.Tensor | None) -> None:
    """A ``LinearAttentionLayer`` holding a step's conv and recurrent states, as transformers'
    prefill leaves it. Copies: the mixers update the states in place, and a program's inputs
    stay as they came (torch.export would otherwise record a mutated input)."""
    if conv is not None:
        layer.conv_states[0] = conv.clone()
        layer.is_conv_states_initialized[0] = True
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.device, layer.dtype = conv.device, conv.dtype
    if ssm is not None:
        layer.recurrent_states[0] = ssm.clone()
        layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True


def _step_class(names: list[str]) -> type:
    """A CachedStep whose forward names its inputs (capture binds and orders inputs by name)."""
    P = inspect.Parameter
    sig = inspect.Signature([P("self", P.POSITIONAL_OR_KEYWORD)]
                            + [P(n, P.POSITIONAL_OR_KEYWORD, default=None) for n in names])

    def forward(self, **kwargs: Any) -> dict[str, torch.Tensor]:
        return CachedStep.forward(self, **kwargs)

    forward.__signature__ = sig
    return type("CachedStep", (CachedStep,), {"forward": forward})


#: the dim of a cached key or value that grows by a position per step ([batch, heads, length, head_dim])
LENGTH_DIM = 2


@dataclass(frozen=True)
class CacheLayout:
    """The cache a decode step takes: each cached tensor by name (``key_0``, ``value_0``,
    ``conv_1``, ``ssm_1``, ...) with its shape past the batch dim (a key's or value's length,
    which grows, as 0), its dtype, and how it lies on the ranks. An attention layer's keys and
    values are read apart: multi-head latent attention (DeepSeek's MLA) caches the compressed
    latent as its "keys" and the shared rotary key as its "values", neither the config's
    ``head_dim``. A state-space or linear-attention layer's conv and recurrent states keep their
    shapes (the state of a sequence of any length), each its own dtype (Mamba2's scan keeps its
    state in float32 in a bfloat16 model)."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dtypes: tuple[tuple[str, torch.dtype], ...]
    placements: tuple[tuple[str, Placement], ...] = ()
    #: per layer, the window of a layer whose cache holds the last ``window - 1`` positions only
    #: (sliding-window or chunked attention: autotp.step_cache), else None
    windows: tuple[int | None, ...] = ()

    def held(self, layer: int, past: int) -> int:
        """How many positions layer ``layer``'s cache holds after ``past`` positions."""
        window = self.windows[layer] if layer < len(self.windows) else None
        return past if window is None else min(past, window - 1)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.shapes]

    @staticmethod
    def grows(name: str) -> bool:
        """Does this cached tensor grow a position per step (attention's keys and values)?"""
        return name.startswith(("key_", "value_"))


@dataclass
class StepSpec:
    """A generation step to capture: this call's token inputs (``input_ids`` and, where given,
    ``attention_mask`` and ``position_ids``), the cache it takes (None: the prefill) and the
    cache's length."""
    tokens: dict[str, torch.Tensor]
    cache: CacheLayout | None = None
    past: int = 0
    seq_range: tuple[int, int] | None = None

    @property
    def input_placements(self) -> dict[str, Placement]:
        return dict(self.cache.placements) if self.cache else {}

    def keep_split(self, cap: Capture) -> frozenset[str]:
        """Every cache output stays as the plan splits it; only the logits are gathered."""
        return frozenset(n for n in cap.output_names if n != "logits")


def capture_step(model: nn.Module, spec: StepSpec, own_lengths: bool = False) -> Capture:
    """Capture ``model`` as the generation step ``spec`` describes, with example inputs of a
    batch of 2 and dynamic batch and lengths (a length of 1 stays static: its own program).
    ``own_lengths``: at the step's own prompt or cache length, not the example's (a model whose
    program holds the length it was traced at, or guards its residue class of lengths)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cache = spec.cache
    names = list(spec.tokens) + (cache.names if cache else [])
    step = _step_class(names)(model, tuple(cache.names) if cache else ())
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    example: dict[str, torch.Tensor] = {}
    shapes: dict[str, Any] = {}
    if cache is None:   # the prompt: every 2-D token input has the prompt's length
        lo, hi = seq_bounds(model, spec.seq_range)
        length = spec.tokens["input_ids"].shape[1]
        dynamic = length >= 2
        if dynamic and not own_lengths:
            length = min(max(EXAMPLE_LENGTH, lo), hi)
        seq = torch.export.Dim("seq", min=lo, max=hi)
        for key, value in spec.tokens.items():
            example[key] = torch.ones(EXAMPLE_BATCH, length, dtype=value.dtype, device=device)
            shapes[key] = {0: batch, **({1: seq} if dynamic else {})}
    else:               # one token; the mask and the cache span what came before
        dynamic = spec.past >= 2
        past = EXAMPLE_LENGTH if dynamic and not own_lengths else spec.past
        grow = {1: torch.export.Dim.DYNAMIC} if dynamic else {}
        for key, value in spec.tokens.items():
            wide = key == "attention_mask"
            example[key] = torch.ones(EXAMPLE_BATCH, past + 1 if wide else 1, dtype=value.dtype, device=device)
            shapes[key] = {0: batch, **(grow if wide else {})}
        dtypes = dict(cache.dtypes)
        for name, shape in cache.shapes:
            grows = cache.grows(name)
            # a windowed layer holds at most window - 1 positions: a length of 1 there is static
            # (export specializes it) while the mask grows, and the program must serve it
            held = cache.held(int(name.rsplit("_", 1)[1]), spec.past) if grows else 0
            length = cache.held(int(name.rsplit("_", 1)[1]), past) if held >= 2 else held
            size = [length if grows and d == LENGTH_DIM - 1 else n for d, n in enumerate(shape)]
            example[name] = torch.zeros(EXAMPLE_BATCH, *size, dtype=dtypes[name], device=device)
            shapes[name] = {0: batch, **({LENGTH_DIM: torch.export.Dim.DYNAMIC} if grows and held >= 2 else {})}
    cap = capture(step, example_kwargs=example, dynamic_shapes=shapes)
    cap.model_name = f"{type(model).__name__} ({'decode' if cache else 'prefill'} step)"
    # generate runs every step under torch.no_grad(): priced forward only, as it runs (a backward
    # priced in made a decode step gather a split SSM state rather than pay an f's all-reduce
    # of a gradient that is never computed)
    cap.differentiable = False
    return cap


def cache_layout(cap: Capture, plan: Any, config: Any = None) -> CacheLayout:
    """The cache a prefill program returns: shapes from its graph, placements from its plan,
    the windowed layers from the model's ``config``."""
    import torch.utils._pytree as pytree

    out = next(n for n in cap.graph.nodes if n.op == "output")
    vals = {name: leaf.meta["val"] for name, leaf in zip(cap.output_names, pytree.tree_leaves(out.args[0]))}
    shapes, dtypes = [], []
    for name, val in vals.items():
        if name == "logits":
            continue
        if CacheLayout.grows(name) and val.dim() != 4:
            raise ConfigError(f"{cap.model_name}: its cache's {name} is {tuple(val.shape)}; autotp's generation "
                              "needs [batch, heads, length, head_dim] keys and values (a DynamicCache)")
        shape = tuple(0 if CacheLayout.grows(name) and d == LENGTH_DIM else int(n)
                      for d, n in enumerate(val.shape) if d > 0)
        shapes.append((name, shape))
        dtypes.append((name, val.dtype))
    placements = tuple((n, plan.sharded_outputs.get(n, REPLICATE)) for n, _ in shapes)
    windows = windowed_layers(config)
    layers = 1 + max((int(n.rsplit("_", 1)[1]) for n, _ in shapes), default=-1)
    return CacheLayout(tuple(shapes), tuple(dtypes), placements, tuple(windows.get(i) for i in range(layers)))


class _FromConfig:
    """The default of generate's ``eos_token_id`` and ``pad_token_id``: the model's generation
    config's. HuggingFace tells an argument left out from one passed as None: ``eos_token_id=None``
    turns the config's eos off (no row stops early), and so it does here."""

    def __repr__(self) -> str:
        return "<the model's generation config>"


FROM_CONFIG: Any = _FromConfig()


def _refuse_unsupported(info: dict[str, Any], table: dict[str, Any], what: str) -> None:
    """A ConfigError for the first setting of ``table`` (name -> its default) that the model's
    generation config sets to something else: autotp's ``what``."""
    config = info["generation_config"]
    for name, plain in table.items():
        value = getattr(config, name, plain) if config is not None else plain
        if not (value in (plain, None) or (plain is None and value in ([], ()))):
            raise ConfigError(f"{info['model_name']}'s generation config sets {name}={value!r}, which autotp's "
                              f"{what}: set it back to its default ({plain!r}) on model.generation_config before "
                              "autotp.parallelize")


def _settings(info: dict[str, Any], max_new_tokens: int | None, eos_token_id: Any,
              pad_token_id: Any) -> tuple[int, list[int], int | None]:
    """max_new_tokens, the eos ids and the pad id, from the arguments or (left out:
    ``FROM_CONFIG``) the model's generation config as HuggingFace's generate reads them; a
    config asking for what autotp's loop does not implement (beams, forced or suppressed
    tokens, ...) is refused (autotp would pick other tokens than the serial model)."""
    config = info["generation_config"]
    _refuse_unsupported(info, _UNSUPPORTED, "generate does not implement (greedy or sampled decoding with "
                                            "temperature, top_k, top_p, min_p and repetition_penalty)")
    if max_new_tokens is None:
        max_new_tokens = getattr(config, "max_new_tokens", None) or 20
    if eos_token_id is FROM_CONFIG:
        eos_token_id = config.eos_token_id if config is not None else None
    eos = [] if eos_token_id is None else [int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple))
                                                           else [eos_token_id])]
    if pad_token_id is FROM_CONFIG:
        pad_token_id = config.pad_token_id if config is not None else None
    if pad_token_id is None and eos:
        pad_token_id = eos[0]   # HuggingFace's default too
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r}: give a positive int")
    return max_new_tokens, eos, pad_token_id


def _processors(info: dict[str, Any], given: dict[str, Any], mask: torch.Tensor | None) -> tuple[bool, list]:
    """Whether to sample, and the logits processors HuggingFace's generate applies for these
    settings, in its order (repetition penalty; then, when sampling, temperature, top-k, top-p,
    min-p): HuggingFace's own classes, so the scores are the ones its generate computes. Each
    setting is the argument's, else the model's generation config's, else HuggingFace's default."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    config = info["generation_config"]
    unknown = sorted(set(given) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ConfigError(f"generate got {unknown}: autotp's generate takes max_new_tokens, eos_token_id, "
                          f"pad_token_id and {sorted(SAMPLING_DEFAULTS)}")

    def setting(name: str) -> Any:
        value = given.get(name)
        if value is None and config is not None:
            value = getattr(config, name, None)
        return SAMPLING_DEFAULTS[name] if value is None else value

    sample = bool(setting("do_sample"))
    if sample:
        _refuse_unsupported(info, _UNSUPPORTED_SAMPLING, "sampling does not implement (temperature, top_k, "
                                                         "top_p, min_p)")
    processors = LogitsProcessorList()
    penalty = setting("repetition_penalty")
    if penalty != 1.0:
        extra = {}
        if mask is not None and "prompt_ignore_length" in inspect.signature(RepetitionPenaltyLogitsProcessor).parameters:
            extra["prompt_ignore_length"] = (mask != 0).int().argmax(dim=1)   # a left-padded prompt's pads
        processors.append(RepetitionPenaltyLogitsProcessor(float(penalty), **extra))
    if sample:
        try:
            if setting("temperature") != 1.0:
                processors.append(TemperatureLogitsWarper(float(setting("temperature"))))
            if setting("top_k") != 0:
                processors.append(TopKLogitsWarper(top_k=int(setting("top_k"))))
            if setting("top_p") < 1.0:
                processors.append(TopPLogitsWarper(top_p=float(setting("top_p"))))
            if setting("min_p") is not None:
                processors.append(MinPLogitsWarper(min_p=float(setting("min_p"))))
        except ValueError as e:   # HuggingFace's own check of the value
            raise ConfigError(f"generate's sampling settings: {e}") from None
    return sample, processors


@torch.no_grad()
def generate(pm: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, eos_token_id: int | list[int] | None = FROM_CONFIG,
             pad_token_id: int | None = FROM_CONFIG, **sampling: Any) -> torch.Tensor:
    """Decoding on ``pm`` (a ParallelModule); returns the prompt followed by the new tokens,
    ``[batch, prompt + new]``, as HuggingFace's ``generate`` does: greedy, or sampled
    (``do_sample=True``) with ``temperature``, ``top_k``, ``top_p``, ``min_p``, and a
    ``repetition_penalty`` either way - each left out (or None) is the model's generation
    config's, else HuggingFace's default, so a checkpoint whose generation config samples
    samples here too. A sampled token is drawn from torch's global generator on every rank of
    the tensor-parallel group and the group takes its first rank's: seeded as the serial model
    is (``torch.manual_seed``), the tokens are the serial model's. ``eos_token_id`` and
    ``pad_token_id`` left out are the model's generation config's; passed as None they are
    none (as in HuggingFace: ``eos_token_id=None`` lets every row run to ``max_new_tokens``)."""
    info = pm._generation
    if not info["has_config"] or info["is_encoder_decoder"]:
        raise ConfigError(f"{info['model_name']}: autotp's generate runs decoder-only HuggingFace models "
                          "(a config and a DynamicCache); encoder-decoder generation is not supported yet")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise InputError("generate takes input_ids as a [batch, length] integer tensor")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise InputError(f"input_ids is {tuple(input_ids.shape)}: generate needs a batch of non-empty prompts")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise InputError(f"attention_mask is {tuple(attention_mask.shape)} but input_ids is "
                         f"{tuple(input_ids.shape)}: give one mask entry per prompt token")
    steps, eos, pad = _settings(info, max_new_tokens, eos_token_id, pad_token_id)
    limit, prompt = info.get("max_positions"), input_ids.shape[1]
    if limit and prompt + steps - 1 > limit:   # the last token is returned, never fed back
        raise InputError(f"a prompt of {prompt} tokens and max_new_tokens={steps} feed {prompt + steps - 1} positions "
                         f"to {info['model_name']}, which has {limit} positions (its config's maximum): "
                         + (f"ask for at most {limit - prompt + 1} new tokens, or shorten the prompt" if prompt <= limit
                            else f"shorten the prompt to at most {limit} tokens"))
    if eos and pad is None:
        raise ConfigError("the model's generation config names an eos_token_id but no pad_token_id; "
                          "pass pad_token_id= to generate")
    device = pm.device
    ids = input_ids.to(device)
    mask = attention_mask.to(device) if attention_mask is not None else None
    if mask is None and pad is not None and pad not in eos and bool((ids == pad).any()):
        mask = ids.ne(pad).long()   # HuggingFace infers the mask: pad tokens in the prompt are padding
    sample, processors = _processors(info, sampling, mask)
    with_positions = "position_ids" in info["forward_params"]
    positions = None
    if with_positions:   # HuggingFace: from the mask (0 under padding), else 0..n-1
        if mask is not None:
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        else:
            positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
    if mask is not None and bool((mask == 1).all()):
        mask = None   # as HuggingFace does: an all-ones mask changes nothing but the program
    tokens = {"input_ids": ids}
    if mask is not None:
        tokens["attention_mask"] = mask
    if positions is not None:
        tokens["position_ids"] = positions.contiguous()
    # every rank decodes as many steps, alike: a rank told other settings would stop early and
    # leave the others waiting in the next step (or pair its next call with their step)
    settings = (f"generate: max_new_tokens={steps}, eos_token_id={eos}, pad_token_id={pad}, "
                f"{', '.join(f'{k}={v!r}' for k, v in sorted(sampling.items()))}",)
    program, out = pm._step(StepSpec(tokens), tokens, settings)
    _check_step(program)
    layout = cache_layout(program.capture, program.plan, info["config"])
    if mask is None and any(layout.windows):
        # a windowed layer's cache holds the last window's keys only: the decode step reads how
        # many positions came before from the mask's width (autotp.step_cache)
        mask = torch.ones_like(ids)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=device)
    past = ids.shape[1]
    for step in range(steps):
        logits = out["logits"]
        cache = {n: out[n] for n in layout.names}
        scores = logits.to(torch.float32)   # as HuggingFace's generate scores them
        if processors:
            scores = processors(ids, scores)
        token = _sampled(pm, scores) if sample else scores.argmax(-1)
        if eos:
            token = torch.where(unfinished, token, torch.full_like(token, pad))
        ids = torch.cat([ids, token[:, None]], dim=-1)
        if eos:
            unfinished &= ~torch.isin(token, torch.tensor(eos, device=device))
            if not bool(unfinished.any()):
                break
        if step == steps - 1:
            break
        tokens = {"input_ids": token[:, None].contiguous()}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            tokens["attention_mask"] = mask
        if positions is not None:
            positions = positions[:, -1:] + 1
            tokens["position_ids"] = positions
        program, out = pm._step(StepSpec(tokens, layout, past), {**tokens, **cache})
        _check_step(program, layout)
        past += 1
    pm.kv_cache = {n: out[n] for n in layout.names}
    return ids


def _sampled(pm: Any, scores: torch.Tensor) -> torch.Tensor:
    """A token per row drawn as HuggingFace's generate draws it (softmax, then one multinomial
    draw from torch's global generator). Every rank of the tensor-parallel group draws, so their
    generators stay in step, and all take the first rank's tokens: ranks seeded differently
    still feed the same tokens to the next step (another would run another program)."""
    import torch.distributed as dist

    token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    mesh = pm.mesh
    if mesh.tp > 1 and mesh.tp_group is not None:
        from .distributed.comm import _comm

        with _comm("generate's broadcast of the sampled tokens", mesh.tp_group):
            dist.broadcast(token, src=mesh.tp_ranks[0], group=mesh.tp_group)
    return token


def _check_step(program: Any, layout: CacheLayout | None = None) -> None:
    """A step must return its logits whole (a token is picked from the whole row) and a decode
    step its cache split as it took it (the next step feeds it back)."""
    if "logits" in program.plan.sharded_outputs:
        raise PlanError(f"the {program.step} step returns its logits split as "
                        f"{program.plan.sharded_outputs['logits']!r}: generate would pick a token from one rank's "
                        "slice of the vocabulary (an autotp bug: please report it)")
    if layout is None:
        return
    names = program.capture.output_names
    for name, placement in layout.placements:
        returned = program.plan.sharded_outputs.get(name, REPLICATE)
        if name not in names or returned != placement:
            raise PlanError(f"the decode step returns {name} as {returned!r} but takes it as {placement!r}: "
                            "the cache would not line up across steps (please report this model)")
