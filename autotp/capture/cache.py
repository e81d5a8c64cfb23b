"""Capture once per structure: models that differ only in their weights share one capture.

torch.export costs seconds per model and dominates planning a small model; a process that
parallelizes many models of one structure (property tests drawing seeds and tp, a sweep over
tp) pays it once. :func:`capture` is a drop-in for :func:`autotp.capture.capture`.

Why reuse is exact. Export fakifies parameters and buffers (strict=False traces them as fake
tensors), so the captured graph cannot depend on their values; it depends on the code, the
module tree and every non-tensor value the code reads, and the example inputs' signature. The
key is all of those:

* the model's class; for every submodule: its path, class, training flag and every plain
  attribute in its ``__dict__`` (numbers, strings, dtypes, HF configs as their full JSON,
  functions by qualified name, tensors that are not parameters by dtype, shape and values);
* every parameter and buffer: name, shape, dtype, device, requires_grad;
* the example inputs: names, and per tensor dtype, device and shape, with the dims that
  capture makes dynamic reduced to "0", "1" or "n" (export specializes 0 and 1 only), and
  which token inputs share a length (each distinct length is a symbol of its own);
* the ``dynamic`` flag, the sequence range the capture accepts, and the state of the grad mode.

A capture whose program holds export's guards on the lengths (:attr:`Capture.guards`: a
chunked scan's residue classes) is handed out only for example inputs that satisfy them;
another example replaces the entry.

A module's hooks are keyed as functions with the values their closures hold (transformers
installs an output-capturing hook on a model's layers at its first call: before, every later
capture of such a model missed). A model with an attribute or a hook of another kind (an
object the key cannot read, a bound method) is not cached: it is captured afresh every time
(logged at debug level). On a hit the
capture is re-checked against the model: every lifted parameter and buffer placeholder must
name one of the model's tensors with the shape and dtype it was traced with. The entry handed
out is a shallow copy whose per-model fields (tied aliases, signature, name) are recomputed;
later stages read the cached graph and never mutate it (rewrite builds a new graph).

The cache holds :data:`SIZE` entries per process, least recently used evicted; :func:`clear`
empties it and :func:`disabled` turns it off within a block.

Across processes: where the environment variable ``AUTOTP_CAPTURE_CACHE`` names a folder, a
capture this process made is also written there (:mod:`autotp.capture.wire`'s bytes, one file
per key), and a miss here reads the folder before exporting: the processes of one job (the
ranks of several groups, a planner beside them) or of a test session export each structure once.
A file's name adds to the key what the program also depends on outside the model: the torch,
transformers and Python versions, a digest of autotp's own sources and of the source files
that define the model's module classes; a file that cannot be read, or whose capture does not
fit the model, is passed over (logged at debug level) and replaced. :func:`folder_stats` counts
what this process read and wrote there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import sys
import tempfile
import types
from collections import OrderedDict
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

from .export import capture as _export
from .inputs import _length_groups, bind_inputs, forward_signature, seq_bounds
from .program import Capture, _tied_aliases, fits_call
from .structure import _TORCH_BOOKKEEPING, Uncacheable, _describe, _qualname

log = logging.getLogger(__name__)

SIZE = 16
_entries: "OrderedDict[str, Capture]" = OrderedDict()
_state = {"enabled": True, "hits": 0, "misses": 0}

#: the environment variable naming a folder of captures shared by processes (see the module docs)
FOLDER_ENV = "AUTOTP_CAPTURE_CACHE"
_folder_counts = {"read": 0, "written": 0}


def folder_stats() -> dict[str, int]:
    """Captures this process read from and wrote to the ``AUTOTP_CAPTURE_CACHE`` folder."""
    return dict(_folder_counts)


def stats() -> dict[str, int]:
    """Hits and misses since the last :func:`clear` (tests and benchmarks read them)."""
    return {"hits": _state["hits"], "misses": _state["misses"], "entries": len(_entries)}


def clear() -> None:
    _entries.clear()
    _state["hits"] = _state["misses"] = 0


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


def capture(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
            dynamic: bool = True, seq_range: tuple[int, int] | None = None) -> Capture:
    """:func:`autotp.capture.capture`, reusing an earlier capture of the same structure."""
    found, key = _lookup(model, example_inputs, example_kwargs, dynamic, seq_range)
    if found is not None:
        _state["hits"] += 1
        return found
    if key is not None:
        _state["misses"] += 1
        read = _read(key, model, example_inputs, example_kwargs)
        if read is not None:
            return read
    cap = _export(model, example_inputs, example_kwargs, dynamic, seq_range)
    if key is not None:
        _keep(key, cap)
        _write(key, model, cap)
    return cap


def lookup(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
           dynamic: bool = True, seq_range: tuple[int, int] | None = None) -> Capture | None:
    """The capture :func:`capture` would hand out from the cache for these arguments, or None
    (nothing is captured: a rank asks before another rank's capture is sent to it). A capture
    handed out counts as a hit; none found is not a miss (nothing was captured)."""
    found = _lookup(model, example_inputs, example_kwargs, dynamic, seq_range)[0]
    _state["hits"] += found is not None
    return found


def adopt(cap: Capture, model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
          dynamic: bool = True, seq_range: tuple[int, int] | None = None) -> Capture:
    """``cap`` (another process's capture of ``model``'s structure, loaded by
    :mod:`autotp.capture.wire`) kept as if captured here; the entry for ``model`` handed out."""
    key = _key(model, example_inputs, example_kwargs, dynamic, seq_range)
    if key is not None:
        _keep(key, cap)
    return _for_model(cap, model)


def key_of(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
           dynamic: bool = True, seq_range: tuple[int, int] | None = None) -> str | None:
    """:func:`structure_key`, or None for a model it cannot read (cache on or off)."""
    try:
        return structure_key(model, example_inputs, example_kwargs, dynamic, seq_range)
    except Uncacheable as why:
        log.debug("capture not keyed (not cached, not shared): %s", why)
        return None


def _key(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None, dynamic: bool,
         seq_range: tuple[int, int] | None) -> str | None:
    """The structure key, or None where the cache is off or cannot key the model."""
    return key_of(model, example_inputs, example_kwargs, dynamic, seq_range) if _state["enabled"] else None


def _lookup(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None, dynamic: bool,
            seq_range: tuple[int, int] | None) -> tuple[Capture | None, str | None]:
    key = _key(model, example_inputs, example_kwargs, dynamic, seq_range)
    cached = _entries.get(key) if key is not None else None
    if cached is not None and _fits(cached, model) and _guards_fit(cached, model, example_inputs, example_kwargs):
        _entries.move_to_end(key)
        return _for_model(cached, model), key
    return None, key


def _keep(key: str, cap: Capture) -> None:
    _entries[key] = cap
    _entries.move_to_end(key)
    while len(_entries) > SIZE:
        _entries.popitem(last=False)


def _file(key: str, model: torch.nn.Module) -> Path | None:
    """The folder's file for ``key`` and ``model``'s code, or None where no folder is named."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return None
    sources = sorted({_source_of(type(m)) for m in model.modules()})
    digest = hashlib.sha256("\n".join([key, _software(), *(_file_digest(s) for s in sources)]).encode())
    return Path(folder) / f"{digest.hexdigest()}.capture"


def _source_of(cls: type) -> str:
    try:
        return inspect.getsourcefile(cls) or _qualname(cls)
    except TypeError:   # a built-in class
        return _qualname(cls)


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return path


@functools.lru_cache(maxsize=1)
def _software() -> str:
    """The versions and autotp's own sources a capture's program also depends on."""
    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "none"
    own = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        own.update(path.read_bytes())
    return f"torch {torch.__version__} transformers {transformers} python {sys.version} autotp {own.hexdigest()}"


def _read(key: str, model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None) -> Capture | None:
    """The folder's capture for ``key`` kept here and handed out, or None."""
    from . import wire

    path = _file(key, model)
    if path is None or not path.exists():
        return None
    try:
        cap = wire.loads(path.read_bytes())
    except (OSError, wire.WireError) as exc:
        log.debug("capture in %s not read (%s); capturing afresh", path, exc)
        return None
    if not (_fits(cap, model) and _guards_fit(cap, model, example_inputs, example_kwargs)):
        return None
    _folder_counts["read"] += 1
    cap = _for_model(cap, model)
    _keep(key, cap)
    return cap


def _write(key: str, model: torch.nn.Module, cap: Capture) -> None:
    """``cap`` written to the folder (whole or not at all: a temporary file renamed)."""
    from . import wire

    path = _file(key, model)
    if path is None:
        return
    part = None
    try:
        data = wire.dumps(cap)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as out:
            part = out.name
            out.write(data)
        os.replace(part, path)
        _folder_counts["written"] += 1
    except (OSError, wire.WireError) as exc:
        log.debug("capture not written to %s (%s)", path, exc)
        if part is not None and os.path.exists(part):
            os.unlink(part)


def structure_key(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
                  dynamic: bool = True, seq_range: tuple[int, int] | None = None) -> str:
    """The key described in the module docs, as a hex digest. Raises :class:`Uncacheable`."""
    parts: list[str] = [_qualname(type(model)), f"dynamic={dynamic}", f"grad={torch.is_grad_enabled()}",
                        f"seq={seq_bounds(model, seq_range)}"]
    for path, module in model.named_modules(remove_duplicate=False):
        parts.append(f"M {path} {_qualname(type(module))} training={module.training}")
        for kind in _HOOKS:
            for hook in (getattr(module, kind, None) or {}).values():
                parts.append(f"  {kind} {_describe_hook(hook, (path or 'root') + '.' + kind)}")
        for attr, value in sorted(module.__dict__.items()):
            if attr in _TORCH_BOOKKEEPING:
                continue   # _parameters, _modules, ...: keyed below, or hooks (keyed above)
            parts.append(f"  {attr}={_describe(value, f'{path}.{attr}')}")
    for name, p in model.named_parameters(remove_duplicate=False):
        parts.append(f"P {name} {tuple(p.shape)} {p.dtype} {p.device.type} {p.requires_grad}")
    for name, b in model.named_buffers(remove_duplicate=False):
        parts.append(f"B {name} {tuple(b.shape)} {b.dtype} {b.device.type}")
    if example_inputs or example_kwargs is not None:
        inputs = bind_inputs(forward_signature(model), tuple(example_inputs),
                                      dict(example_kwargs or {}), type(model).__name__)
        # which inputs share a length: capture gives each distinct length its own symbol
        groups = _length_groups(inputs)
        for name, value in inputs.items():
            parts.append(f"I {name} {_describe_input(value, name)} length-group={groups.get(name)}")
    else:
        parts.append("I synthesized")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


#: a module's own hooks, in the order the key lists them (each dict in the order they were added)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _describe_hook(hook: Any, where: str) -> str:
    """A hook as a function and the values its closure holds: transformers' output-capturing hook
    (installed on a model's layers at its first call) is one function whose closure names the
    output it records. Anything else a hook could read (a bound method's object, a callable
    instance) the key cannot: Uncacheable."""
    if isinstance(hook, functools.partial):
        return f"partial {_describe_hook(hook.func, where)} {_describe(hook.args, where)} {_describe(hook.keywords, where)}"
    if not isinstance(hook, types.FunctionType):
        raise Uncacheable(f"{where} holds a {type(hook).__name__} hook, which the structure key cannot read")
    cells = []
    for name, cell in zip(hook.__code__.co_freevars, hook.__closure__ or ()):
        try:
            cells.append(f"{name}={_describe(cell.cell_contents, f'{where} {name}')}")
        except ValueError:   # a cell not yet filled
            cells.append(f"{name}=<empty>")
    return f"{_qualname(hook)}[{','.join(cells)}]"


def _describe_input(value: Any, name: str) -> str:
    if not isinstance(value, torch.Tensor):
        return _describe(value, name)
    dims: list = list(value.shape)
    # the dims capture makes dynamic: batch and seq of integer inputs, batch of any other
    dynamic = 2 if value.dim() >= 2 and not value.is_floating_point() else min(value.dim(), 1)
    dims[:dynamic] = [str(d) if d < 2 else "n" for d in dims[:dynamic]]
    return f"{value.dtype} {value.device.type} {dims}"


def _fits(cap: Capture, model: torch.nn.Module) -> bool:
    """Every lifted parameter/buffer placeholder names a tensor of the model with its shape and dtype."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    placeholders = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    for names in (cap.param_names, cap.buffer_names):
        for placeholder, fqn in names.items():
            t, val = tensors.get(fqn), placeholders[placeholder].meta.get("val")
            if t is None or val is None or tuple(t.shape) != tuple(val.shape) or t.dtype != val.dtype:
                log.debug("cached capture does not fit %s (%s); capturing afresh", type(model).__name__, fqn)
                return False
    return True


def _guards_fit(cap: Capture, model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None) -> bool:
    """The key reduces lengths to "n"; a capture with guards (a chunked scan's residue class of
    lengths: :attr:`Capture.guards`) serves only examples whose sizes satisfy them, and one that
    holds a length as a number (:attr:`Capture.fixed_dims`: Mamba's loop over the sequence) only
    examples of that length. Before, a third length's example got the second's capture: a
    ParallelModule's second inference call at a new length was refused (an InputError)."""
    if not (cap.guards or cap.fixed_dims) or not (example_inputs or example_kwargs):
        return True
    inputs = bind_inputs(forward_signature(model), tuple(example_inputs), dict(example_kwargs or {}),
                         type(model).__name__)
    return fits_call(cap, inputs)


def _for_model(cap: Capture, model: torch.nn.Module) -> Capture:
    """The cached capture with the fields that belong to this model instance recomputed."""
    fresh = dataclasses.replace(cap, aliases={})
    fresh.aliases = _tied_aliases(model, fresh)
    fresh.signature, fresh.model_name = forward_signature(model), type(model).__name__
    return fresh
