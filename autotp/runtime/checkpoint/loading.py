"""Reading a HuggingFace checkpoint folder into a parallel model: the model built on the meta
device from the folder's config, the buffers the checkpoint does not hold computed by the model's
own initializer, and each rank's slices read from the safetensors files
(:mod:`autotp.runtime.checkpoint.hf`) as the parallel module asks for them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ...placements import Placement


def open_checkpoint(path: str, model_class: Any = None, dtype: torch.dtype | None = None,
                    progress: bool = True) -> tuple[nn.Module, Callable[[Any, nn.Module], Any]]:
    """The model ``path`` holds, built on the meta device from its config (``model_class(config)``,
    default: the class the config names, see :func:`_architecture`; ``dtype`` defaults to the
    config's), and ``weights(mesh, meta_model)``: what reads this rank's slices of it."""
    from .hf import CheckpointReader

    config = read_config(path)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    reader = CheckpointReader(path)    # fails early, before any collective, on a folder without weights
    with torch.device("meta"):
        if model_class is None:
            model = _architecture(config).from_config(config, dtype=dtype)
        else:
            model = model_class(config).to(dtype)
    computed = _compute_buffers(model, set(reader.names()))

    def weights(mesh: Any, meta_model: nn.Module) -> _CheckpointWeights:
        return _CheckpointWeights(reader, meta_model, mesh, progress, computed)

    return model, weights


def read_config(path: str) -> Any:
    """The transformers config of the checkpoint folder ``path``, or a CheckpointError naming what
    is wrong with its ``config.json`` and how to write it again (transformers' own errors for a
    missing file speak of a missing ``model_type``, and a path that is no folder is taken for a
    model on the Hub)."""
    from transformers import AutoConfig

    from ...errors import CheckpointError

    folder, file = Path(path), Path(path) / "config.json"
    rewrite = f"write it again: model.config.save_pretrained({str(path)!r}) (model.save_pretrained writes it too)"
    if not folder.is_dir():
        raise CheckpointError(f"{path} is not a folder: autotp.from_pretrained reads a HuggingFace checkpoint folder "
                              "on this machine (config.json and safetensors files); download the model into one "
                              "first (huggingface_hub.snapshot_download) and pass its path")
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json: autotp builds the model from it before it reads any "
                              f"weights; {rewrite}")
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file} is not a readable JSON file ({type(exc).__name__}: {exc}); {rewrite}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise CheckpointError(f"{file} names no model_type (the architecture transformers builds: 'llama', 'gpt2', "
                              f"...); {rewrite}")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers' validation errors have no common base
        first = str(exc).strip().splitlines()
        raise CheckpointError(f"transformers cannot make a config of {file}: {type(exc).__name__}: "
                              f"{' '.join(ln.strip() for ln in first[:2])}; fix that field, or {rewrite}") from exc


def _architecture(config: Any) -> Any:
    """What builds the model a checkpoint was saved from: the class its config names
    (``BertForMaskedLM``, ``T5ForConditionalGeneration``, ...), else ``AutoModelForCausalLM``."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return _FromConfig(cls)
    return transformers.AutoModelForCausalLM


class _FromConfig:
    """``cls`` with the ``from_config(config, dtype=)`` call of the Auto classes."""

    def __init__(self, cls: Any):
        self.cls = cls

    def from_config(self, config: Any, dtype: torch.dtype) -> nn.Module:
        return self.cls._from_config(config, dtype=dtype)


def _compute_buffers(model: nn.Module, saved: set[str]) -> dict[str, torch.Tensor]:
    """The values, on the CPU, of the buffers a checkpoint does not hold (rotary ``inv_freq``,
    BERT's ``position_ids``, GPT-BigCode's causal ``bias``: computed, not saved) that the model's
    own initializer (``_init_weights``) computes, by dotted name (plain tensor attributes such as
    rotary's ``original_inv_freq`` too). The initializer runs twice per module, the missing
    tensors filled with two different values first: a tensor it computes comes out the same both
    times. The model is left as it was, all on the meta device (every later capture sees one
    device); the parallel module takes the values from here, and reports a buffer neither here
    nor in the checkpoint."""
    init = getattr(model, "_init_weights", None)
    values: dict[str, torch.Tensor] = {}
    if init is None:
        return values
    for prefix, module in model.named_modules():
        held = {**{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}, **module._buffers}
        missing = {name: b for name, b in held.items() if b is not None and b.is_meta
                   and f"{prefix}.{name}".lstrip(".") not in saved}
        if not missing:
            continue
        runs = []
        for fill in (0, 1):
            for name, b in missing.items():
                _set_tensor(module, name, torch.full(b.shape, fill, dtype=b.dtype))
            with torch.no_grad():
                try:
                    init(module)
                except Exception:   # an initializer that cannot run on this module: nothing computed
                    pass
            runs.append({name: getattr(module, name) for name in missing})
        for name, b in missing.items():
            first, second = runs[0][name], runs[1][name]
            _set_tensor(module, name, b)
            if (isinstance(first, torch.Tensor) and not first.is_meta and first.shape == b.shape
                    and torch.equal(first, second) and not (first.is_floating_point() and first.isnan().any())):
                values[f"{prefix}.{name}".lstrip(".")] = first.clone()
    return values


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, value)


def _saved_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Parameter name -> checkpoint key, for the keys transformers renames when it loads this
    model class (GPT-NeoX's checkpoints hold ``embed_out.weight`` for ``lm_head.weight``). Only
    plain renames: a transform that merges or splits tensors is not applied (``find`` then names
    the missing tensor)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renames = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]
    except (ImportError, AttributeError, TypeError):   # an older transformers renames nothing
        return {}
    out = {}
    for key in keys:
        name = key
        for rename in renames:   # each source pattern (a regex) becomes the first target
            for source in rename.source_patterns:
                name = re.sub(source, rename.target_patterns[0], name)
        if name != key:
            out[name] = key
    return out


class _CheckpointWeights:
    """``weights(fqn, placement)`` for ParallelModule: this rank's slices, read from a checkpoint,
    with a progress bar on the first rank while it is entered. A tied parameter is found under
    any of its names (GPT-2's checkpoints hold ``transformer.wte.weight``, not ``lm_head.weight``)."""

    def __init__(self, reader: Any, meta_model: nn.Module, mesh: Any, progress: bool,
                 buffers: dict[str, torch.Tensor] | None = None):
        from rich.progress import Progress

        self.reader, self.tp, self.rank = reader, mesh.tp, mesh.tp_rank
        #: values of the buffers the checkpoint does not hold, computed by the model's initializer
        self.buffers = dict(buffers or {})
        self.params = dict(meta_model.named_parameters(remove_duplicate=False))
        self.twins: dict[int, list[str]] = {}
        for name, p in self.params.items():
            self.twins.setdefault(id(p), []).append(name)
        self.saved_as = _saved_names(meta_model, reader.names())
        shown = progress and mesh.tp_rank == 0 and mesh.dp_rank == 0
        self.bar = Progress(transient=True, disable=not shown)
        self.task = self.bar.add_task(f"loading {reader.folder.name} (TP rank {mesh.tp_rank} of {mesh.tp})",
                                      total=len(self.twins))

    def __enter__(self) -> "_CheckpointWeights":
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def __call__(self, fqn: str, placement: Placement) -> torch.Tensor:
        meta = self.params[fqn]
        names = [fqn] + [n for n in self.twins[id(meta)] if n != fqn]
        names += [self.saved_as[n] for n in names if n in self.saved_as]
        local = self.reader.read_local(self.reader.find(names), tuple(meta.shape), placement, self.tp, self.rank,
                                       meta.dtype)
        self.bar.advance(self.task)
        return local
