"""Export with dynamic dims: :func:`capture`, an unmodified model -> a :class:`Capture`.

``torch.export.export(strict=False)`` is used because ``torch.fx.symbolic_trace`` fails on
transformers 5 models. The model is exported with its batch and sequence dims dynamic
(:mod:`~autotp.capture.inputs`), its stacks of alike blocks cut and the graph expanded
(:mod:`~autotp.capture.expand`), narrowing the dims to torch's suggested fixes where the model
allows less than asked, mask-free calls traced as transformers runs them eagerly
(:mod:`~autotp.capture.masks`) and random draws answered (:mod:`~autotp.capture.draws`); the
program then becomes a normalized Capture (:mod:`~autotp.capture.normalize`).
"""
from __future__ import annotations

import collections
import contextlib
import gc
import logging
import re
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..errors import CaptureError, ConfigError
from .experts import capturable_experts, experts_hint, top_k_problem
from .draws import RandomBranchError, _UnitDraws
from .inputs import _dynamic_shapes, _example_seqs, _forward_params, bind_inputs, forward_signature, \
    hf_example_kwargs, seq_bounds
from .masks import eager_masks
from .normalize import _from_exported
from .program import Capture, _tied_aliases
from .structure import _qualname
from .twin import _CHECKED, on_meta

log = logging.getLogger(__name__)


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
    with gc_paused(), capturable_experts(model), _no_cache_object(model, kwargs):
        try:
            ep, expanded = _export_cut(model, kwargs, dynamic_shapes) if EXPAND else (None, None)
            if ep is None:
                ep = _export(model, kwargs, dynamic_shapes, fake_cache=_repeats_blocks(model))
        except Exception as exc:  # torch raises many types here; all mean "not capturable"
            config_problem = top_k_problem(model, exc)
            if config_problem is not None:   # the model itself cannot run: its config is the fix
                raise ConfigError(config_problem) from exc
            raise CaptureError(_explain_export_failure(model, exc)) from exc
        finally:
            model.train(was_training)
        cap = _from_exported(ep, kwargs, expanded)
    if expanded is not None:
        cap.expanded = expanded.stacks
    cap.training = was_training
    cap.fixed_dims = fixed_dims(cap, dynamic_shapes)
    if cap.fixed_dims:
        log.warning("autotp: %s's program holds %s only: torch.export fixed %s while tracing (the forward reads "
                    "the length as a number, e.g. loops over it); a call at another length gets a program of its own",
                    type(model).__name__, ", ".join(f"{k.replace('.', ' dim ')} = {n}" for k, n in cap.fixed_dims.items()),
                    "these dims" if len(cap.fixed_dims) > 1 else "this dim")
    cap.aliases = _tied_aliases(model, cap)
    cap.signature, cap.model_name = forward_signature(model), type(model).__name__
    return cap


def fixed_dims(cap: Capture, dynamic_shapes: Any) -> dict[str, int]:
    """Input dims asked dynamic (a ``Dim`` in ``dynamic_shapes``) that the program holds as a
    number: torch.export specialized them, silently where the dim was ``Dim.DYNAMIC`` (a
    forward that loops over the sequence is traced once per position of the example)."""
    if not isinstance(dynamic_shapes, dict):
        return {}
    from torch.export.dynamic_shapes import _Dim, _DimHint, _DimHintType

    metas = {n.name: n.meta.get("val") for n in cap.graph.nodes if n.op == "placeholder"}
    out = {}
    for key, node in zip(cap.input_keys, cap.user_inputs):
        spec, val = dynamic_shapes.get(key), metas.get(node)
        if not isinstance(spec, dict) or not isinstance(val, torch.Tensor):
            continue
        for d, dim in spec.items():
            asked = (isinstance(dim, _Dim) and type(dim).__name__ != "_StaticDim") or (
                isinstance(dim, _DimHint) and dim.type is _DimHintType.DYNAMIC)
            if asked and d < val.dim() and not isinstance(val.shape[d], torch.SymInt):
                out[f"{key}.{d}"] = int(val.shape[d])
    return out


@contextlib.contextmanager
def _no_cache_object(model: torch.nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """While ``model`` is exported: a forward that takes ``use_cache`` only through ``**kwargs``
    (Granite-4.0-H's causal LM hands it on to its decoder) gets its config's ``use_cache``
    default turned off, as a forward that names it gets ``use_cache=False``: a training call's
    program has no cache object among its outputs (torch.export cannot return a
    ``DynamicCache``). The call's own ``use_cache`` wins; the config is restored after."""
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or "use_cache" in _forward_params(model) or getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


#: capture a stack of alike blocks cut to three (a head and two periods) and expand the graph (autotp.capture.expand);
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
    two blocks), else two (block 1 checked against block 0), else three. A stack whose blocks
    repeat with a period over 1 (gpt-oss: sliding | full attention) keeps a head and two
    periods, on every capture (:meth:`~autotp.capture.expand.Stack.kept`)."""
    from . import expand as capture_expand

    try:
        stacks = capture_expand.find_stacks(model)
        if not stacks:
            log.debug("autotp: %s has no stack of blocks to cut; capturing it whole", type(model).__name__)
            return None, None
        checked = _CHECKED.get(model, {})
        tries = [capture_expand.KEEP]
        if all(s.uniform and s.path in checked and s.period == 1 for s in stacks):
            tries.insert(0, 2)
            if all(checked[s.path] is not None for s in stacks):   # learned of period-1 stacks only
                tries.insert(0, 1)
        for keep in tries:
            # the block calls a template is learned from (three kept) or read against (one)
            calls = tuple(f"{s.path}.{i}" for s in stacks if s.period == 1 for i in range(keep)) if keep != 2 else ()
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
    replaying = False
    if key is not None and key in _NARROWED:
        before, sizes = _NARROWED[key]
        replayed = _replayed(asked, before, sizes, _sizes(kwargs))
        if replayed is not None:
            dynamic_shapes, replaying = replayed, True
            log.debug("autotp: capture starts from the dims %s needed before", type(model).__name__)
    kind = _unnamed_key(model, kwargs) if dynamic_shapes is not None else None
    if not replaying and kind in _UNNAMED_KINDS and not _unnamed(asked):
        relaxed = _unnamed_dims(asked)
        if relaxed != asked:   # another config of a class whose scan refused named dims: start unnamed
            dynamic_shapes, replaying = relaxed, True
            log.debug("autotp: capture starts from unnamed dims, as %s needed before", type(model).__name__)
    attempt = 0
    pinned = None   # the pin torch forced from guards it could not prove, kept while unnamed dims are tried
    while True:
        try:
            with _ListIndicesOnCPU() if meta else contextlib.nullcontext(), _no_stack_traces(), \
                    contextlib.nullcontext() if fake_cache else _fake_cache_off(), _UnitDraws(), \
                    eager_masks(kwargs):
                ep = torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=dynamic_shapes,
                                         preserve_module_call_signature=calls)
            if key is not None and dynamic_shapes is not asked:
                _NARROWED[key] = (dynamic_shapes, _sizes(kwargs))
                _NARROWED.move_to_end(key)
                while len(_NARROWED) > NARROWED_KEPT:
                    _NARROWED.popitem(last=False)
            if kind is not None and _unnamed(dynamic_shapes) and not _unnamed(asked):
                _UNNAMED_KINDS[kind] = None
                while len(_UNNAMED_KINDS) > NARROWED_KEPT:
                    _UNNAMED_KINDS.pop(next(iter(_UNNAMED_KINDS)))
            # traced with unnamed dims, export proved none of its guards over the range: the
            # Capture keeps them and a call is checked against them (capture.program.guards_hold)
            ep._autotp_unnamed = _unnamed(dynamic_shapes)
            return ep
        except Exception as exc:   # a constraint violation names its fix; anything else is final
            if pinned is not None:   # unnamed dims refused where the pin was not: the length fixed, as torch said
                log.info("autotp: %s refuses unnamed dims too (%s); its program holds the example's length",
                         type(model).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                dynamic_shapes, pinned = pinned, None
                continue
            if replaying:   # the dims an equal model needed do not hold here: start over from those asked
                log.debug("autotp: %s refuses the dims an equal model needed (%s); exporting as asked",
                          type(model).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                _NARROWED.pop(key, None)
                _UNNAMED_KINDS.pop(kind, None)
                dynamic_shapes, replaying = asked, False
                continue
            fixes = _suggested_fixes(str(exc))
            forced = fixes and _forced_pin(str(exc))
            if _derived(fixes) or forced:   # not a narrowing: a residue class of lengths, guards unproven
                fixes = ""
            if dynamic_shapes is not None and not fixes and "Constraints violated" in str(exc) \
                    and attempt < EXPORT_REFINEMENTS:
                relaxed = _unnamed_dims(dynamic_shapes)
                if relaxed != dynamic_shapes:
                    lines = str(exc).splitlines()
                    log.info("autotp: capture retries with unnamed dynamic dims (%s)", next(
                        (ln.strip(" -") for ln in lines if "resulted in a specialized value" in ln), lines[-1]))
                    if forced:
                        pinned = refine_dynamic_shapes_from_suggested_fixes(
                            "Suggested fixes:\n" + _suggested_fixes(str(exc)), dynamic_shapes)
                    dynamic_shapes = relaxed
                    attempt += 1
                    continue
            if dynamic_shapes is None or not fixes or attempt == EXPORT_REFINEMENTS:
                raise
            # torch's exc.msg is the block alone; str(exc) appends advice the parser cannot read
            refined = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + fixes, dynamic_shapes)
            if refined == dynamic_shapes:
                raise
            log.info("autotp: capture narrowed the dynamic dims to torch's suggested fixes and tries again")
            dynamic_shapes = refined
            attempt += 1


#: the dynamic dims torch.export narrowed a model to, by :func:`_narrowing_key`, with the sizes
#: of the example it traced: a later capture of a model of the same class and config, at any
#: length, starts from them (:func:`_replayed`) instead of failing its first export again.
#: T5's decoder needs 3 target tokens or more (its tiny models: 1.6-2.1 s of a 3.4-4.0 s
#: capture); Bamba's chunked scan is refused named dims (a residue class of lengths) and traced
#: unnamed; so is Qwen3-Next's Gated DeltaNet over 64-token chunks (torch forces "seq = 11" from
#: the padding's guards it cannot prove, :func:`_forced_pin`): its first export is the symbolic
#: trace that fails, 11-25 CPU s of a tiny model's capture, paid once per structure instead of
#: once per chunk count. The newest NARROWED_KEPT are kept.
_NARROWED: collections.OrderedDict = collections.OrderedDict()
NARROWED_KEPT = 64

#: the kinds of model (:func:`_unnamed_key`) whose export took unnamed dims where named ones were
#: asked (a chunked scan's residue classes, Gated DeltaNet's padded chunks): the first export of
#: another config of that class (a test's other widths, a sweep over heads) starts there instead of
#: failing its symbolic trace first (Bamba's tiny mixer: 3-7 of a 6-10 s capture). Where unnamed dims
#: fail for that config, it exports as asked and the kind is forgotten; where they hold, the program
#: is the one a fresh capture's relaxation exports (the same dims). The newest NARROWED_KEPT are kept.
_UNNAMED_KINDS: dict = {}


def _unnamed_key(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple:
    """The kind of export :data:`_UNNAMED_KINDS` remembers: the model's class (a wrapper's, with its
    first child's: a generation step), train or eval, the tensor inputs' names."""
    inner = next(iter(model.children()), None)
    return (_qualname(type(model)), _qualname(type(inner)) if inner is not None else None, model.training,
            tuple(sorted(n for n, v in kwargs.items() if isinstance(v, torch.Tensor))))


def _narrowing_key(model: torch.nn.Module, kwargs: dict[str, Any], dynamic_shapes: Any, calls: tuple):
    """What decides the dims export allows: the model's class, its whole config, its modules
    (a cut model has fewer), train or eval, the inputs' names, dtypes and shapes but for the
    dims asked dynamic (the lengths: :func:`_replayed` carries a narrowing over to another),
    the dims asked and the block calls recorded. ``None`` (no memo) for a model without a
    serializable config."""
    to_json = getattr(_config_of(model), "to_json_string", None)
    if dynamic_shapes is None or to_json is None:
        return None
    try:
        config = to_json(use_diff=False)
    except Exception:   # a config holding something JSON cannot write: no memo, export as asked
        return None
    inputs: list[tuple] = []
    for name, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            spec = dynamic_shapes.get(name) if isinstance(dynamic_shapes, dict) else None
            asked = spec if isinstance(spec, dict) else {}
            inputs.append((name, tuple("n" if _asked(asked.get(d)) else n for d, n in enumerate(v.shape)), v.dtype))
        else:
            inputs.append((name, repr(v)))
    # the class by name, with every module's: a wrapper made per call (a generation step's
    # class, made for its inputs' names) is one model whenever it wraps an equal one
    classes = tuple(_qualname(type(m)) for m in model.modules())
    return (classes, config, model.training, tuple(inputs), _spec_key(dynamic_shapes), tuple(calls))


def _config_of(model: torch.nn.Module) -> Any:
    """The model's config, else its first child's (a wrapper of a transformers model, such as a
    generation step, holds the model's submodules as its own)."""
    config = getattr(model, "config", None)
    if config is None:
        config = next((getattr(m, "config") for m in model.children() if getattr(m, "config", None) is not None),
                      None)
    return config


def _asked(dim: Any) -> bool:
    """Is ``dim`` (one entry of a dynamic-shapes spec) a dim asked dynamic: a named ``Dim`` or a hint?"""
    from torch.export.dynamic_shapes import _Dim, _DimHint, _DimHintType

    return (isinstance(dim, _Dim) and type(dim).__name__ != "_StaticDim") or (
        isinstance(dim, _DimHint) and dim.type is not _DimHintType.STATIC)


def _sizes(kwargs: dict[str, Any]) -> dict[str, tuple]:
    """Each tensor input's sizes."""
    return {name: tuple(v.shape) for name, v in kwargs.items() if isinstance(v, torch.Tensor)}


def _replayed(asked: Any, narrowed: Any, before: dict[str, tuple], now: dict[str, tuple]) -> Any:
    """``narrowed`` (the dims export allowed an example of sizes ``before``) carried over to an
    example of sizes ``now``, for the dims ``asked``; None where it does not carry over.

    A dim export fixed at the example's size (a forward that loops over the length) is fixed
    at the new example's; a narrowed range or an unnamed dim holds if it takes the new size;
    a fixed size other than the example's (none export suggests) does not carry over."""
    from torch.export.dynamic_shapes import _Dim, _DimHint

    if not isinstance(asked, dict) or not isinstance(narrowed, dict) or set(asked) != set(narrowed):
        return None
    out = {}
    for name, spec in narrowed.items():
        wanted = asked[name]
        if not isinstance(wanted, dict) or not isinstance(spec, dict):
            if spec != wanted:   # a spec autotp does not read by dim: only one left as asked carries over
                return None
            out[name] = spec
            continue
        if name not in now or name not in before:
            return None
        dims = {}
        for d, dim in spec.items():
            if not _asked(wanted.get(d)):
                dims[d] = dim
            elif isinstance(dim, int):
                if before[name][d] != dim:
                    return None
                dims[d] = now[name][d]
            elif isinstance(dim, (_Dim, _DimHint)):
                lo, hi = dim.min, dim.max
                if (lo is not None and now[name][d] < lo) or (hi is not None and now[name][d] > hi):
                    return None
                dims[d] = dim
            else:
                return None
        out[name] = dims
    return out


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


def _repeats_blocks(model: torch.nn.Module) -> bool:
    """Does a whole export of ``model`` run a stack of alike blocks (more than a cut keeps)?
    FakeTensorMode's dispatch cache pays there: each later block's ops are answered from the
    first's entries (gpt2-xl whole: 6 s with it, 12 s without; a tiny GPT-2 of 24 layers 2.9 CPU s
    against 3.7). Elsewhere it is off (:func:`_fake_cache_off`): a model of a few blocks runs
    each op a few times, and the entries of a chunked scan, whose sizes are expressions of the
    length padded to the chunk, cost more to rebuild than the dispatches they save (tiny
    Qwen3-Next, 2 layers: capture 9.0-10.5 CPU s off against 18.6-22.7 on; tiny Bamba 3.6-3.7
    against 7.4-10.6; tiny GPT-2 0.5 against 0.6-1.0)."""
    from . import expand as capture_expand

    return bool(capture_expand.find_stacks(model))


def _fake_cache_off() -> contextlib.AbstractContextManager:
    """FakeTensorMode's dispatch cache, off for one export: its entries are checked and rebuilt
    with symbolic sizes at a cost above the dispatch they save in a trace that runs each op a
    few times (gpt2-xl cut to three blocks: export 0.85 s without it against 1.07 s with it).
    A whole export of a stack of alike blocks runs each block's ops N times and gains from it
    (:func:`_repeats_blocks`)."""
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


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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
    ) + experts_hint(model)
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


def _unnamed(dynamic_shapes: Any) -> bool:
    """Does ``dynamic_shapes`` hold a ``Dim.DYNAMIC`` (or ``Dim.AUTO``) anywhere?"""
    from torch.export.dynamic_shapes import _DimHint

    if isinstance(dynamic_shapes, _DimHint):
        return True
    if isinstance(dynamic_shapes, dict):
        return any(_unnamed(v) for v in dynamic_shapes.values())
    if isinstance(dynamic_shapes, (list, tuple)):
        return any(_unnamed(v) for v in dynamic_shapes)
    return False


def _derived(fixes: str) -> bool:
    """Does torch's suggestion define a dim as a multiple of a new one (``seq = 4*_seq - 1``)?
    That is no range to narrow to but the lengths of one residue class: Mamba2's chunked scan
    pads the sequence to its chunk and branches on ``length % chunk``. Such a model is traced
    with unnamed dims instead, and its program keeps export's guards (a call of another residue
    class is another program)."""
    return bool(re.search(r"^\s*\w+ = \d+\*\w+", fixes, re.MULTILINE))


def _forced_pin(text: str) -> bool:
    """Does torch pin a dim to the example's size (``seq = 11``) only because its solver could not
    prove the guards export generated over the range ("solving the guards generated for seq ...
    resulted in a specialized value of 11"), the trace itself keeping the length symbolic?

    Gated DeltaNet pads the sequence to its 64-token chunk, ``(64 - s % 64) % 64``, and reshapes
    it into chunks: guards such as ``(s + (64 - s % 64) % 64) // 64 == 1`` hold for every length
    below 64 but are no range torch can solve for. Traced with unnamed dims the program stays
    symbolic in the length and keeps those guards (a call at a length that breaks one, another
    chunk count, gets a program of its own). A forward that reads the length as a number (a loop
    over the positions) makes torch say instead that the code "specialized it to be a constant":
    that pin is the program's only length, and it is taken as torch suggests."""
    return "resulted in a specialized value" in text and "specialized it to be a constant" not in text


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
