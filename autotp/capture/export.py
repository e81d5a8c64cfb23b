"""Capture: an unmodified model -> an ATen fx graph with dynamic batch and sequence dims.

Input: an ``nn.Module`` (real or meta device) and, optionally, example inputs.
Output: a :class:`Capture` holding the exported program's graph (parameters lifted to
placeholders), which placeholder is which parameter, the user inputs' names and the
output structure. ``torch.export.export(strict=False)`` is used because
``torch.fx.symbolic_trace`` fails on transformers 5 models.

The graph is normalized for the later stages: ``addmm``/``linear`` with a bias become a
product followed by an ``add`` (so that a row-parallel bias can be added once, after the
all-reduce), and ``_assert_tensor_metadata`` checks are dropped (they pin the capture's
device and dtype, which the rewritten per-rank graph must not).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import gc
import inspect
import itertools
import logging
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.overrides import TorchFunctionMode

from ..errors import CaptureError, ConfigError
from .higher_order import inline_regions
from .masks import eager_masks

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: Example sizes used for tracing: 0 and 1 are avoided since export specializes them, and the
#: length is chosen (`_example_seq`) so it does not equal a static size of the model.
EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 11


@dataclass
class Capture:
    graph_module: fx.GraphModule
    param_names: dict[str, str]          # placeholder name -> parameter FQN
    buffer_names: dict[str, str]         # placeholder name -> buffer FQN
    constant_names: dict[str, str]       # placeholder name -> lifted constant name
    constants: dict[str, torch.Tensor]
    user_inputs: list[str]               # placeholder names of user inputs, in call order
    input_keys: list[str]                # the kwargs keys, same order as user_inputs
    constant_inputs: dict[str, Any]      # non-tensor kwargs traced as constants (use_cache=False)
    out_spec: Any
    range_constraints: dict[str, tuple[int, int]]   # "input_ids.1" -> (min, max)
    dim_symbols: dict[str, str] = field(default_factory=dict)  # sympy symbol name -> "batch"/"seq"
    #: every other symbol export's shapes may hold -> what the cost model prices it at: an
    #: expression of the input dims' symbols where export replaced it by one (a string), else its
    #: value in the example (an op's data-dependent size, a size export could not relate)
    symbol_hints: dict[str, int | str] = field(default_factory=dict)
    input_dims: dict[str, str] = field(default_factory=dict)   # "input_ids.1" -> its symbol name
    aliases: dict[str, str] = field(default_factory=dict)  # unused tied param FQN -> the FQN used
    signature: inspect.Signature | None = None   # model.forward's, to name positional inputs
    training: bool = True                # the model's mode at capture (dropout is in the graph or not)
    model_name: str = "the model"
    #: the stacks captured cut and expanded (autotp.capture.expand), e.g. ("transformer.h",); () when whole
    expanded: tuple = ()

    @property
    def output_names(self) -> list[str]:
        """Names of the flat outputs: the ModelOutput/dict keys where there are some."""
        context = getattr(self.out_spec, "context", None)
        n = self.out_spec.num_leaves
        if isinstance(context, (list, tuple)) and len(context) == n and all(isinstance(c, str) for c in context):
            return list(context)
        return [str(i) for i in range(n)]

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def output_nodes(self) -> list:
        """The graph's flat outputs, in :attr:`output_names`' order."""
        out = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        return pytree.tree_leaves(out.args[0])


def hf_example_kwargs(model: torch.nn.Module, batch: int = EXAMPLE_BATCH, seq: int = EXAMPLE_SEQ,
                      device: torch.device | str | None = None, target_seq: int | None = None) -> dict[str, Any]:
    """Example inputs for a HuggingFace model, synthesized from its config: ids and labels. An
    encoder-decoder model's labels (the decoder's side) are ``target_seq`` long, so that the
    captured program takes source and target of different lengths (one symbol each)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise CaptureError(
            f"cannot synthesize example inputs for {type(model).__name__}: it has no HuggingFace "
            "config with vocab_size; pass example_kwargs={...} (or example_inputs=(...)) to autotp"
        )
    n_pos = _max_positions(model)
    if n_pos is not None:
        seq = min(seq, n_pos)
    if seq < 2:
        raise CaptureError(f"{type(model).__name__} accepts at most {n_pos} positions; cannot trace")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    target = target_seq if target_seq is not None and getattr(config, "is_encoder_decoder", False) else seq
    labels = torch.randint(0, config.vocab_size, (batch, target), generator=gen)
    if device is not None:
        # A meta model gets meta inputs: buffers it indexes with them (BERT's token types)
        # live on the meta device too, and export only needs shapes.
        ids, labels = ids.to(device), labels.to(device)
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def bind_inputs(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any],
                owner: str = "the model") -> dict[str, Any]:
    """Positional inputs named by the model's forward signature: everything downstream of
    capture is keyed by argument name, so ``pm(x)`` and ``pm(input_ids=x)`` are one call."""
    if not args:
        return dict(kwargs)
    if signature is None:
        raise ConfigError(f"{owner}.forward has no readable signature: pass the inputs as keyword arguments")
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        raise ConfigError(f"{owner}.forward takes *args, so positional inputs have no names: "
                          "pass them as keyword arguments")
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"inputs do not fit {owner}.forward{signature}: {exc}") from None
    return dict(bound.arguments)


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def config_int(model: torch.nn.Module, *names: str) -> int | None:
    """The first of ``names`` that the model's config holds as an int, or None."""
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _max_positions(model: torch.nn.Module) -> int | None:
    return config_int(model, "n_positions", "max_position_embeddings", "n_ctx")


#: the widest sequence range tried when neither the model's config nor the caller bounds it
DEFAULT_SEQ_RANGE = (2, 1 << 20)


def _token_inputs(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inputs whose dim 1 is a sequence: every integer tensor of 2 dims or more."""
    return {k: v for k, v in kwargs.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point()}


def _length_groups(kwargs: dict[str, Any]) -> dict[str, int]:
    """Each token input -> the index of its length among the distinct lengths, in order of
    first appearance: inputs of one length share a symbol, an encoder-decoder's source and
    target lengths get one each."""
    lengths: dict[int, int] = {}
    return {k: lengths.setdefault(int(v.shape[1]), len(lengths)) for k, v in _token_inputs(kwargs).items()}


def _dynamic_shapes(kwargs: dict[str, Any], seq_range: tuple[int, int]) -> dict[str, Any]:
    """Batch (dim 0) and sequence (dim 1) of every 2-D integer input are dynamic; inputs of one
    length in the example share one sequence dim, each other length has its own."""
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    groups = _length_groups(kwargs)
    seqs = [torch.export.Dim("seq" if i == 0 else f"seq{i}", min=seq_range[0], max=seq_range[1])
            for i in range(max(groups.values(), default=-1) + 1)]
    shapes: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in groups:
            shapes[key] = {0: batch, 1: seqs[groups[key]]}
        elif isinstance(value, torch.Tensor) and value.dim() >= 1:
            shapes[key] = {0: batch}
        else:
            shapes[key] = None
    return shapes


def seq_bounds(model: torch.nn.Module, seq_range: tuple[int, int] | None = None) -> tuple[int, int]:
    """The sequence lengths a capture should accept: ``seq_range`` if given, else 2 up to the
    config's maximum positions, else :data:`DEFAULT_SEQ_RANGE` (export then narrows it to what
    the model allows, e.g. a position table's length, or a minimum length the model needs)."""
    if seq_range is not None:
        lo, hi = seq_range
        if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi):
            raise ConfigError(f"seq_range={seq_range!r}: give (min, max) lengths with 2 <= min <= max "
                              "(lengths 0 and 1 are specialized by torch.export)")
        return lo, hi
    n_pos = _max_positions(model)
    return (2, n_pos) if n_pos else DEFAULT_SEQ_RANGE


def _example_seq(seq_range: tuple[int, int]) -> int:
    """An example length inside the range that is unlikely to equal a static size of the model
    (a head dim, a rotary dim: export would then tie the sequence to it)."""
    return _example_seqs(seq_range, 1)[0]


def _example_seqs(seq_range: tuple[int, int], n: int) -> list[int]:
    """``n`` distinct example lengths inside the range, the likeliest to be no static size of
    the model first (fewer where the range is narrower)."""
    lo, hi = seq_range
    picks = [length for length in (11, 13, 7, 5, 3, 2) if lo <= length <= hi]
    picks += [length for length in range(lo, min(hi, lo + n + 6) + 1) if length not in picks]
    return picks[:n] or [lo]


def example_like(inputs: dict[str, Any], seq_range: tuple[int, int]) -> dict[str, Any]:
    """Example inputs for capturing a call like ``inputs``: the same names, dtypes and values,
    resized (tiled, then cut) to a batch of 2 and, for 2-D integer inputs, to example lengths,
    since export specializes a dim of size 0 or 1 (a one-token call) or one equal to a static
    size of the model: inputs of one length in the call get one example length, inputs of
    another length another (an encoder-decoder's source and target), so the program's symbols
    equate what the call does and no more. Non-tensor inputs are kept as they are."""
    groups = _length_groups(inputs)
    lengths = _example_seqs(seq_range, max(groups.values(), default=0) + 1)
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() == 0:
            out[key] = value
            continue
        shape = list(value.shape)
        shape[0] = EXAMPLE_BATCH
        if key in groups:
            shape[1] = lengths[min(groups[key], len(lengths) - 1)]
        reps = [-(-want // have) for want, have in zip(shape, value.shape)]
        out[key] = value.repeat(*reps)[tuple(slice(0, n) for n in shape)].clone()
    return out


#: how often capture narrows the dynamic dims to torch's suggested fixes and tries again
EXPORT_REFINEMENTS = 3


def capture(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
            dynamic: bool = True, seq_range: tuple[int, int] | None = None,
            dynamic_shapes: dict[str, Any] | None = None) -> Capture:
    """Export ``model`` and normalize its graph. See the module docstring.

    ``seq_range=(min, max)``: the sequence lengths the captured program accepts (default: from
    the model's config, else as wide as export allows). ``dynamic_shapes`` replaces the default
    batch/sequence dims with torch.export's own spec (a generation step's cache lengths)."""
    bounds = seq_bounds(model, seq_range)
    if example_inputs or example_kwargs is not None:
        kwargs = bind_inputs(forward_signature(model), tuple(example_inputs), dict(example_kwargs or {}),
                             type(model).__name__)
    else:
        source, target = (_example_seqs(bounds, 2) * 2)[:2]
        kwargs = hf_example_kwargs(model, seq=source, device=_device_of(model), target_seq=target)
    if "use_cache" in _forward_params(model) and "use_cache" not in kwargs:
        kwargs["use_cache"] = False   # a KV cache is an inference-time output, not part of the graph
    if dynamic_shapes is None and dynamic:
        dynamic_shapes = _dynamic_shapes(kwargs, bounds)
    was_training = model.training
    with gc_paused():
        try:
            ep, expanded = _export_cut(model, kwargs, dynamic_shapes) if EXPAND else (None, None)
            if ep is None:
                ep = _export(model, kwargs, dynamic_shapes)
        except Exception as exc:  # torch raises many types here; all mean "not capturable"
            raise CaptureError(_explain_export_failure(model, exc)) from exc
        finally:
            model.train(was_training)
        cap = _from_exported(ep, kwargs, expanded)
    if expanded is not None:
        cap.expanded = expanded.stacks
    cap.training = was_training
    cap.aliases = _tied_aliases(model, cap)
    cap.signature, cap.model_name = forward_signature(model), type(model).__name__
    return cap


#: capture a stack of identical blocks cut to three and expand the graph (autotp.capture.expand);
#: False exports every model whole
EXPAND = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Tracing, planning and rewriting allocate many short-lived objects; the cyclic collector's
    passes over a large heap cost time and free nothing these still need. They run after it.
    A context manager, and a decorator (``@gc_paused()``): gpt2-xl's first plan at tp=8 takes
    0.35-0.42 CPU s paused against 0.62-0.68 s with the collector on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: models whose stacks passed the three-block check: model -> {stack path: its
#: capture_expand.Template or None}. Their later captures (other call signatures) cut them to
#: one block where a template describes how the blocks are called, else to two, where block 0
#: is alike the rest
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _export_cut(model: torch.nn.Module, kwargs: dict[str, Any], dynamic_shapes: Any) -> tuple:
    """The program of ``model`` with its stacks cut, and its graph expanded to the whole model;
    ``(None, None)`` when the model has no stack to cut or the cut graph fails a check.

    A model's first capture keeps three blocks per stack: block 2 must repeat block 1 *with*
    whatever the parent runs between blocks, which catches a parent that treats alternate
    blocks differently. It also records each block's call signature (torch.export's
    ``preserve_module_call_signature``) and learns a :class:`~autotp.capture.expand.Template`:
    which arguments every block shares and which it takes from the block before. Once that
    held, a later capture of the same model keeps **one** block where block 0 is alike the rest
    and its call fits the template (gpt2-xl's new signature: export 0.32 s against 0.48 s for
    two blocks), else two (block 1 checked against block 0), else three."""
    from . import expand as capture_expand

    try:
        stacks = capture_expand.find_stacks(model)
        if not stacks:
            log.debug("autotp: %s has no stack of blocks to cut; capturing it whole", type(model).__name__)
            return None, None
        checked = _CHECKED.get(model, {})
        tries = [capture_expand.KEEP]
        if all(s.uniform and s.path in checked for s in stacks):
            tries.insert(0, 2)
            if all(checked[s.path] is not None for s in stacks):
                tries.insert(0, 1)
        for keep in tries:
            # the block calls a template is learned from (three kept) or read against (one)
            calls = tuple(f"{s.path}.{i}" for s in stacks for i in range(keep)) if keep != 2 else ()
            try:
                ep = _export_calls(model, stacks, keep, kwargs, dynamic_shapes, calls)
                expanded = capture_expand.expand(ep, model, stacks, keep, templates=checked)
            except capture_expand.NotExpandable as exc:
                if keep == tries[-1]:
                    raise
                log.debug("autotp: %s cut to %d blocks does not expand (%s)", type(model).__name__, keep, exc)
                continue
            if keep == capture_expand.KEEP:
                _CHECKED[model] = {s.path: expanded.templates.get(s.path) for s in stacks}
            return ep, expanded
    except Exception as exc:   # a failed check, or a cut model export refuses: export it whole
        log.debug("autotp: capturing %s whole (%s: %s)", type(model).__name__, type(exc).__name__, exc)
    return None, None


def shape_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` for later captures, holding no weights: every parameter and buffer
    on the meta device (export reads only their shapes and dtypes; a tied pair stays one
    tensor), the module tree, configs and other attributes copied. A rank program keeps this
    for the call signatures it has not met yet, so that the model's own weights (the whole
    serial model, on every rank) are not kept alive by autotp once its shards are held: a user
    who drops the model gets its memory back. What the model's first capture learned about its
    stacks carries over. A model already all on the meta device is its own twin, and so is one
    ``copy.deepcopy`` refuses (logged)."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as exc:   # an attribute deepcopy refuses (a lock, a process group, a file)
        log.warning("autotp: %s cannot be copied without its weights (%s: %s); later captures read the model "
                    "itself, which stays referenced", type(model).__name__, type(exc).__name__, exc)
        return model
    if model in _CHECKED:
        _CHECKED[twin] = dict(_CHECKED[model])
    return twin


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds any tensor on the meta device (then export gets meta inputs)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _export_calls(model: torch.nn.Module, stacks: list, keep: int, kwargs: dict[str, Any],
                  dynamic_shapes: Any, calls: tuple) -> torch.export.ExportedProgram:
    """The model cut to ``keep`` blocks, exported with the block calls ``calls`` recorded. A
    model whose block calls torch.export cannot record (their arguments are not pytrees) is
    exported without them: cut to three it then teaches no template; cut to one it cannot
    expand."""
    from . import expand as capture_expand

    try:
        with capture_expand.cut(model, stacks, keep):
            return _export(model, kwargs, dynamic_shapes, fake_cache=False, calls=calls)
    except capture_expand.NotExpandable:
        raise   # the cut itself was refused (a forward that hooked modules): recording changes nothing
    except Exception as exc:
        if not calls:
            raise
        if keep == 1:
            raise capture_expand.NotExpandable(f"block 0's call signature cannot be recorded ({exc})") from exc
        log.debug("autotp: %s: block calls not recorded (%s: %s)", type(model).__name__, type(exc).__name__, exc)
    with capture_expand.cut(model, stacks, keep):
        return _export(model, kwargs, dynamic_shapes, fake_cache=False)


def _export(model: torch.nn.Module, kwargs: dict[str, Any], dynamic_shapes: Any,
            fake_cache: bool = True, calls: tuple = ()) -> torch.export.ExportedProgram:
    """torch.export, narrowing the dynamic dims to torch's own suggested fixes when the model
    allows less than asked (T5's decoder needs 3 target tokens or more; a position table bounds
    the length).
    ``calls``: submodules whose call signatures the program records (its ``module_call_graph``)."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    meta = on_meta(model)
    key = _narrowing_key(model, kwargs, dynamic_shapes, calls)
    asked = dynamic_shapes
    if key is not None and key in _NARROWED:
        dynamic_shapes = _NARROWED[key]
        log.debug("autotp: capture starts from the dims %s needed before", type(model).__name__)
    for attempt in range(EXPORT_REFINEMENTS + 1):
        try:
            with _ListIndicesOnCPU() if meta else contextlib.nullcontext(), _no_stack_traces(), \
                    contextlib.nullcontext() if fake_cache else _fake_cache_off(), _UnitDraws(), \
                    eager_masks(kwargs):
                ep = torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=dynamic_shapes,
                                         preserve_module_call_signature=calls)
            if key is not None and dynamic_shapes is not asked:
                _NARROWED[key] = dynamic_shapes
                while len(_NARROWED) > NARROWED_KEPT:
                    _NARROWED.popitem(last=False)
            return ep
        except Exception as exc:   # a constraint violation names its fix; anything else is final
            fixes = _suggested_fixes(str(exc))
            if dynamic_shapes is not None and not fixes and "Constraints violated" in str(exc) \
                    and attempt < EXPORT_REFINEMENTS:
                relaxed = _unnamed_dims(dynamic_shapes)
                if relaxed != dynamic_shapes:
                    log.info("autotp: capture retries with unnamed dynamic dims (%s)", str(exc).splitlines()[-1])
                    dynamic_shapes = relaxed
                    continue
            if dynamic_shapes is None or not fixes or attempt == EXPORT_REFINEMENTS:
                raise
            # torch's exc.msg is the block alone; str(exc) appends advice the parser cannot read
            refined = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + fixes, dynamic_shapes)
            if refined == dynamic_shapes:
                raise
            log.info("autotp: capture narrowed the dynamic dims to torch's suggested fixes and tries again")
            dynamic_shapes = refined
    raise AssertionError("unreachable")


#: the dynamic dims torch.export narrowed a model to (its suggested fixes: T5's decoder needs 3
#: target tokens or more), by :func:`_narrowing_key`: a later capture of a model of the same
#: class and config starts from them instead of failing its first export again (T5's tiny
#: models: 1.6-2.1 s of a 3.4-4.0 s capture). The newest NARROWED_KEPT are kept.
_NARROWED: collections.OrderedDict = collections.OrderedDict()
NARROWED_KEPT = 64


def _narrowing_key(model: torch.nn.Module, kwargs: dict[str, Any], dynamic_shapes: Any, calls: tuple):
    """What decides the dims export allows: the model's class, its whole config, its modules
    (a cut model has fewer), train or eval, the inputs' names, shapes and dtypes, the dims asked
    and the block calls recorded. ``None`` (no memo) for a model without a serializable config."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if dynamic_shapes is None or to_json is None:
        return None
    try:
        config = to_json(use_diff=False)
    except Exception:   # a config holding something JSON cannot write: no memo, export as asked
        return None
    inputs = tuple((name, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v))
                   for name, v in kwargs.items())
    return (type(model), config, sum(1 for _ in model.modules()), model.training, inputs,
            _spec_key(dynamic_shapes), tuple(calls))


def _spec_key(spec: Any) -> Any:
    """A hashable copy of a dynamic-shapes spec: each Dim as its name and range."""
    if isinstance(spec, dict):
        return tuple(sorted((str(k), _spec_key(v)) for k, v in spec.items()))
    if isinstance(spec, (list, tuple)):
        return tuple(_spec_key(v) for v in spec)
    if isinstance(spec, torch.export.Dim):
        return ("dim", spec.__name__, spec.min, spec.max)
    return repr(spec)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without recording each node's Python stack trace (``torch.fx.config``, where
    this torch has the switch): nothing in autotp reads them, and collecting them is a tenth
    of a cut export (gpt2-xl cut to two blocks: 0.50 s against 0.56-0.58 s)."""
    import torch.fx.config as fx_config

    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _fake_cache_off() -> contextlib.AbstractContextManager:
    """FakeTensorMode's dispatch cache, off for one export: its entries are checked and rebuilt
    with symbolic sizes at a cost above the dispatch they save in a trace that runs each op a
    few times (gpt2-xl cut to three blocks: export 0.85 s without it against 1.07 s with it).
    A whole export runs each block's ops N times and gains from it: 6 s with, 12 s without."""
    config = torch._dynamo.config
    if not hasattr(config, "fake_tensor_cache_enabled"):
        return contextlib.nullcontext()
    return config.patch(fake_tensor_cache_enabled=False)


class _ListIndicesOnCPU(TorchFunctionMode):
    """While a meta-device model is exported: a Python list of ints or bools used as an index
    of a meta tensor (Falcon's ``qkv[..., [-2]]``) becomes a CPU tensor first. torch would make
    it on the indexed tensor's device, and a lifted constant on the meta device has lost its
    values; a CPU one keeps them, and the run moves it to the run's device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta:
            index = args[1]
            index = tuple(_list_on_cpu(i) for i in index) if isinstance(index, tuple) else _list_on_cpu(index)
            args = (args[0], index)
        return func(*args, **(kwargs or {}))


def _list_on_cpu(index: Any) -> Any:
    if isinstance(index, list) and index and all(type(v) in (int, bool) for v in index) \
            and len({type(v) for v in index}) == 1:
        return torch.tensor(index)
    return index


def _tied_aliases(model: torch.nn.Module, cap: Capture) -> dict[str, str]:
    """Tied parameters (GPT-2's wte and lm_head) are one tensor: the graph uses one name and
    leaves the other placeholder unused. Map the unused name to the used one."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    used = {cap.param_names[n.name] for n in cap.graph.nodes if n.op == "placeholder"
            and n.name in cap.param_names and n.users}
    aliases = {}
    for names in by_id.values():
        live = [n for n in names if n in used]
        for n in names:
            if n not in used and live:
                aliases[n] = live[0]
    return aliases


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class RandomBranchError(Exception):
    """A 0-d ``torch.rand`` draw decides a Python branch whose outcome depends on the draw."""


class _UnitDraw:
    """What a 0-d ``torch.rand`` gives a model while it is captured: a draw from [0, 1) that a
    Python comparison with a number answers wherever every draw would answer it alike, and
    refuses to answer otherwise. LayerDrop (OPT, BART, Whisper... under transformers before
    5.2x) skips a layer ``if torch.rand([]) < layerdrop`` in training: with ``layerdrop`` 0
    (their default) no draw is below it, so the layer always runs, exactly; export alone cannot
    branch on a traced value. Any other use of the draw (arithmetic, a tensor op) fails the
    capture."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _answer(self, op: str, p: Any, below: bool | None, above: bool | None) -> bool:
        """``below``: the answer when p <= 0 (or p < 0 for op <=, >), ``above``: when p >= 1."""
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            low = p <= 0 if op in ("<", ">=") else p < 0
            if low and below is not None:
                return below
            if p >= 1 and above is not None:
                return above
        raise RandomBranchError(
            f"a Python branch on a random draw ({self.where}: torch.rand([]) {op} {p!r}) that differs from "
            "draw to draw, such as LayerDrop with a probability above 0: a captured program cannot branch "
            "on it. Set that probability to 0 (for LayerDrop, config.layerdrop = 0) or capture in eval mode")

    def __lt__(self, p: Any) -> bool:
        return self._answer("<", p, False, True)

    def __le__(self, p: Any) -> bool:
        return self._answer("<=", p, False, True)

    def __gt__(self, p: Any) -> bool:
        return self._answer(">", p, True, False)

    def __ge__(self, p: Any) -> bool:
        return self._answer(">=", p, True, False)

    def __bool__(self) -> bool:
        raise RandomBranchError(f"a 0-d random draw used as a truth value ({self.where}): a captured program "
                                "cannot branch on it")

    def __float__(self) -> float:
        raise RandomBranchError(f"a 0-d random draw used as a number ({self.where}): a captured program would "
                                "fix one draw for every call")


class _UnitDraws(torch.overrides.TorchFunctionMode):
    """Under capture, ``torch.rand([])`` (a single draw, no generator or out) is a
    :class:`_UnitDraw`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand and kwargs.get("out") is None and kwargs.get("generator") is None \
                and not kwargs.get("requires_grad"):
            size = args[0] if len(args) == 1 else kwargs.get("size", None) if not args else None
            if isinstance(size, (list, tuple)) and len(size) == 0:
                import traceback

                frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                              if "site-packages/torch" not in f.filename), None)
                return _UnitDraw(f"{frame.filename}:{frame.lineno}" if frame else "in forward")
        return func(*args, **kwargs)


def _explain_export_failure(model: torch.nn.Module, exc: Exception) -> str:
    if isinstance(exc, RandomBranchError):
        return f"autotp could not capture {type(model).__name__}: {exc}"
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    where = ""
    for line in text:
        m = re.search(r'File "([^"]+)", line (\d+)', line)
        if m and "site-packages/torch" not in m.group(1):
            where = f" (at {m.group(1)}:{m.group(2)})"
    hint = "data-dependent control flow" if "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__ else type(exc).__name__
    message = (
        f"autotp could not capture {type(model).__name__} with torch.export(strict=False): "
        f"{hint}{where}: {first}. Make the forward traceable (no Python branches on tensor values, "
        "use torch.where/torch.cond), or pass example_kwargs that avoid that path."
    )
    fixes = _suggested_fixes(str(exc))
    if fixes:
        message += (" torch suggests:\n" + fixes + "\n(autotp's sequence dim is 'seq' ('seq1', 'seq2', ... for inputs "
                    "of other lengths, an encoder-decoder's target), its batch dim 'batch': pass seq_range=(min, max) "
                    "or example inputs of another length)")
    return message


def _unnamed_dims(dynamic_shapes: Any) -> Any:
    """``dynamic_shapes`` with every named ``Dim`` replaced by ``Dim.DYNAMIC`` of the same range.

    torch 2.11's non-strict export can fail to prove a guard that holds on the whole range
    (GQA's ``repeat_kv`` reshape: ``Min(8*s, 16*s) == 8*s`` for s in [2, 32], "Constraints
    violated (seq)" with no suggested fix); a named Dim turns such a guard into an error, while
    ``Dim.DYNAMIC`` keeps the dim symbolic over the same range (each input its own symbol, which
    export then ties together from the guards it finds)."""
    from torch.export.dynamic_shapes import _Dim

    def relax(x):
        if isinstance(x, _Dim) and type(x).__name__ != "_StaticDim":
            return torch.export.Dim.DYNAMIC(min=x.min, max=x.max)
        if isinstance(x, dict):
            return {k: relax(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(relax(v) for v in x)
        return x

    return relax(dynamic_shapes)


def _suggested_fixes(text: str) -> str:
    """torch's own "Suggested fixes:" block of a constraint violation, if the error has one."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Suggested fixes"):
            block = []
            for follow in lines[i + 1:]:
                if not follow.strip():
                    break
                block.append(follow.rstrip())
            return "\n".join(block)
    return ""


def _from_exported(ep: torch.export.ExportedProgram, kwargs: dict[str, Any], expanded: Any = None) -> Capture:
    """The Capture of ``ep``; ``expanded`` (autotp.capture.expand.Expanded): the whole model's
    graph and lifted inputs grown from ``ep``, a cut model's program."""
    sig = ep.graph_signature
    params, buffers, consts = {}, {}, {}
    from torch.export.graph_signature import InputKind

    if expanded is not None:
        params, buffers, consts = expanded.params, expanded.buffers, expanded.constants
        gm = expanded.graph_module
    else:
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                params[name] = spec.target
            elif spec.kind == InputKind.BUFFER:
                buffers[name] = spec.target
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                consts[name] = spec.target
        gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_lifted = len(params) + len(buffers) + len(consts)
    user_nodes = placeholders[n_lifted:]
    keys = list(kwargs.keys())
    if len(user_nodes) != len(keys):
        raise CaptureError(f"captured {len(user_nodes)} user inputs for {len(keys)} kwargs {keys}")
    constant_inputs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    ranges: dict[str, tuple[int, int]] = {}
    dim_symbols: dict[str, str] = {}
    input_dims: dict[str, str] = {}
    constraints = {str(sym): vr for sym, vr in ep.range_constraints.items()}
    for node, key in zip(user_nodes, keys):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                sym = str(size.node.expr)
                vr = constraints.get(sym)
                if vr is not None:
                    ranges[f"{key}.{d}"] = (int(vr.lower), _bound(vr.upper))
                input_dims[f"{key}.{d}"] = sym
                dim_symbols.setdefault(sym, "batch" if d == 0 else "seq")
    symbol_hints = _symbol_hints(gm)
    inline_regions(gm)   # no_grad/autocast blocks in forward become plain ops (autotp.capture.higher_order)
    _normalize(gm.graph)
    gm = _renamed(gm)
    return Capture(
        graph_module=gm,
        param_names=params,
        buffer_names=buffers,
        constant_names=consts,
        constants={k: v for k, v in ep.constants.items()},
        user_inputs=[n.name for n in user_nodes],
        input_keys=keys,
        constant_inputs=constant_inputs,
        out_spec=ep.call_spec.out_spec,
        range_constraints=ranges,
        dim_symbols=dim_symbols,
        input_dims=input_dims,
        symbol_hints={k: v for k, v in symbol_hints.items() if k not in dim_symbols},
    )


def _symbol_hints(gm: fx.GraphModule) -> dict[str, int | str]:
    """Every symbol export's shape environment knows: the expression export replaced it by
    (a string), else its value in the example (backed and, where recorded, data-dependent)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        sizes = val.shape if isinstance(val, torch.Tensor) else ()
        env = next((size.node.shape_env for size in sizes if isinstance(size, torch.SymInt)), None)
        if env is None:
            continue
        hints: dict[str, int | str] = {}
        backed = getattr(env, "backed_var_to_val", None)
        for table in (backed if backed is not None else getattr(env, "var_to_val", {}),
                      getattr(env, "unbacked_var_to_val", {})):
            for sym, value in table.items():
                try:
                    hints[str(sym)] = int(value)
                except (TypeError, ValueError):
                    pass
        for sym, expr in getattr(env, "replacements", {}).items():
            hints[str(sym)] = str(expr)
        return hints
    return {}


#: an unbounded dim's upper bound (Dim.DYNAMIC's int_oo)
UNBOUNDED = 1 << 62


def _bound(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):   # sympy's and torch's infinities
        return UNBOUNDED


try:   # generates the capture's Python code when it is first run or read, not at capture
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:   # pragma: no cover - present in every torch autotp supports
    _LazyGraphModule = fx.GraphModule


def _renamed(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph with its ops named afresh in graph order (``addmm``, ``addmm_1``, ...).
    torch.export's names count nodes it traced and later dropped; these depend on the graph
    alone, so a whole export and a cut-and-expanded one name every op alike (the plan's
    collectives name the tensors they apply to).

    Renamed in place, with the names fx would give the nodes of a fresh graph built in this
    order (a copy of gpt2-xl's graph costs 0.045 s, the renaming a tenth of it)."""
    graph = gm.graph
    names = fx.graph._Namespace()
    for node in graph.nodes:
        kept = node.op in ("placeholder", "get_attr", "output")
        name = names.create_name(node.name if kept else graph._target_to_str(node.target), None)
        names.associate_name_with_obj(name, node)
        node.name = name
    graph._graph_namespace = names
    out = _LazyGraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def _normalize(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, x, w = node.args[:3]
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (x, w))
                mm.meta = dict(node.meta)   # same shape, dtype and source module
            if _bias_after_view(graph, node, mm, bias):
                continue
            with graph.inserting_before(node):
                add = graph.call_function(aten.add.Tensor, (mm, bias))
                add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
        elif node.target is aten.linear.default and len(node.args) == 3 and node.args[2] is not None:
            x, w, bias = node.args
            with graph.inserting_before(node):
                lin = graph.call_function(aten.linear.default, (x, w))
                lin.meta = dict(node.meta)
                add = graph.call_function(aten.add.Tensor, (lin, bias))
                add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
    graph.lint()


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _bias_after_view(graph: fx.Graph, addmm: fx.Node, mm: fx.Node, bias: Any) -> bool:
    """``addmm`` on flattened tokens ``(b*s, n)`` whose only use views it back to ``(b, s, n)``:
    view the product first and add the bias to the view. The sum is the same; what changes is
    that a row-parallel Partial product now reaches the bias add with the sequence dim apart,
    so sequence parallelism can reduce-scatter it along s (it cannot split the merged b*s)."""
    users = list(addmm.users)
    if len(users) != 1 or users[0].target not in _VIEWS or not isinstance(bias, fx.Node):
        return False
    view = users[0]
    out, b = view.meta.get("val"), bias.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 1
            and out.dim() >= 2 and out.shape[-1] == addmm.meta["val"].shape[-1]):
        return False
    view.replace_input_with(addmm, mm)
    with graph.inserting_after(view):
        add = graph.call_function(aten.add.Tensor, (view, bias))
    add.meta = dict(view.meta)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):   # the bias belongs to the linear
        if key in addmm.meta:
            add.meta[key] = addmm.meta[key]
    view.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    graph.erase_node(addmm)
    return True


def module_path(node: fx.Node) -> str:
    """The dotted name of the module whose forward produced ``node`` ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        return _clean_path(path)
    return ""


def _clean_path(path: str) -> str:
    # torch.export writes "L['self'].transformer.h[0].attn" style paths in some versions.
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def shape_of(node: Any) -> tuple[sympy.Expr, ...] | None:
    """A node's tensor shape as sympy expressions (cached in node.meta)."""
    if not isinstance(node, fx.Node):
        return None
    cached = node.meta.get("autotp_shape")
    if cached is not None:
        return cached
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    shape = tuple(to_sympy(d) for d in val.shape)
    node.meta["autotp_shape"] = shape
    return shape


def to_sympy(d: Any) -> sympy.Expr:
    if isinstance(d, torch.SymInt):
        return sympy.sympify(d.node.expr)
    return sympy.Integer(int(d))


def flat_inputs(capture: Capture, kwargs: dict[str, Any]) -> list[Any]:
    """The user's call kwargs in the captured order; traced constants filled in and checked."""
    unknown = set(kwargs) - set(capture.input_keys)
    if unknown:
        raise ConfigError(
            f"inputs {sorted(unknown)} were not part of the captured call {capture.input_keys}; "
            "pass the same keyword arguments as at capture"
        )
    flat = []
    for key in capture.input_keys:
        if key in capture.constant_inputs:
            value = kwargs.get(key, capture.constant_inputs[key])
            if value != capture.constant_inputs[key]:
                raise ConfigError(
                    f"{key}={value!r} differs from the captured {key}={capture.constant_inputs[key]!r}"
                )
            flat.append(value)
        elif key not in kwargs:
            raise ConfigError(f"missing input {key!r}: the graph was captured with {capture.input_keys}")
        else:
            flat.append(kwargs[key])
    return flat


def unflatten_outputs(capture: Capture, outputs: Any) -> Any:
    return pytree.tree_unflatten(list(outputs), capture.out_spec)
