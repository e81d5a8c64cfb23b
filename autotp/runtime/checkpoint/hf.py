"""Checkpoints: read only this rank's slices of a HuggingFace folder; save and gather shards.

Reading (:class:`CheckpointReader`): a folder holding ``model.safetensors`` or a sharded
``model.safetensors.index.json``. :meth:`CheckpointReader.read_local` returns the slices of one
tensor that a placement gives this rank, copied out of the memory-mapped file: row slices (a
vocab-parallel embedding, a row-parallel weight) touch only their own pages; column slices of a
row-major matrix (a column-parallel Conv1D weight) touch the pages of every row. The file is
mapped per tensor and unmapped again, so no more than one tensor's pages are resident at once:
a rank's peak memory is its shards plus the largest column-sliced tensor.

Writing: training checkpoints go through :mod:`autotp.runtime.dcp` (the retired
:func:`save_sharded`/:func:`load_sharded` call it); :func:`gather_to_hf` gathers each parameter to one writer and streams a HuggingFace folder
(``config.json`` + ``model.safetensors``, or size-bounded files with their index) that
``from_pretrained`` loads into a serial model.

No pickle anywhere: tensors go through safetensors, the plan through its versioned JSON.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
import torch

from ...errors import CheckpointError, ConfigError
from ...placements import Placement, Shard, local_ranges

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """The tensors of a HuggingFace checkpoint folder, by name, read in slices."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            try:
                weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{self.folder / INDEX} is not a safetensors index ({exc})") from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE).is_file():
            self.files = {name: self.folder / SINGLE for name in _keys(self.folder / SINGLE)}
        else:
            raise CheckpointError(
                f"no {SINGLE} or {INDEX} in {self.folder}: autotp reads safetensors checkpoints "
                "(save the model with save_pretrained(..., safe_serialization=True))"
            )

    def names(self) -> list[str]:
        return sorted(self.files)

    def find(self, candidates: list[str]) -> str:
        """The first of ``candidates`` (a parameter and its tied twins) the checkpoint holds."""
        for name in candidates:
            if name in self.files:
                return name
        near = [n for n in self.files if n.rsplit(".", 1)[-1] == candidates[0].rsplit(".", 1)[-1]][:4]
        raise CheckpointError(
            f"checkpoint {self.folder} has no tensor {' or '.join(candidates)}"
            + (f" (it has e.g. {near})" if near else "")
            + "; was it saved from the same model class and config?"
        )

    def read_local(self, name: str, shape: tuple[int, ...], placement: Placement, tp: int, rank: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of tensor ``name`` (full ``shape``) under ``placement``, as ``dtype``."""
        with _open(self.files[name]) as f:
            sl = f.get_slice(name)
            found = tuple(sl.get_shape())
            if found != tuple(shape):
                raise CheckpointError(
                    f"checkpoint tensor {name} in {self.files[name].name} has shape {list(found)}, "
                    f"the model expects {list(shape)}: the checkpoint is for another config"
                )
            if not isinstance(placement, Shard):
                return sl[:].to(dtype)
            cut = [slice(None)] * len(shape)
            pieces = []
            for a, b in local_ranges(shape[placement.dim], placement, tp, rank):
                cut[placement.dim] = slice(a, b)
                pieces.append(sl[tuple(cut)].to(dtype))
            return torch.cat(pieces, dim=placement.dim)


@contextmanager
def _open(path: Path):
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except Exception as exc:
        raise CheckpointError(f"cannot read {path} as safetensors: {exc}") from None
    try:
        yield f
    finally:
        del f   # unmaps the file: its pages need not stay resident


def _keys(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


# ---------------------------------------------------------------- writing

def save_sharded(pm, folder: str | Path) -> Path:
    """Retired: saves with :func:`autotp.runtime.dcp.save` (staged, checksummed, published once
    every rank succeeded, loadable at another tp). Its own per-rank files could be left half old,
    half new by a rank killed mid-save, written by one rank alone, swapped or mixed with another
    model's and still load; one checkpoint path that cannot lose data replaced them."""
    import warnings

    from . import dcp

    warnings.warn("autotp.runtime.checkpoint.save_sharded is retired: it now calls autotp.runtime.dcp.save, "
                  "which you can call directly", FutureWarning, stacklevel=2)
    dcp.save(pm, str(folder))
    return Path(folder)


def load_sharded(pm, folder: str | Path) -> None:
    """Retired: loads with :func:`autotp.runtime.dcp.load` (see :func:`save_sharded`)."""
    import warnings

    from . import dcp

    warnings.warn("autotp.runtime.checkpoint.load_sharded is retired: it now calls autotp.runtime.dcp.load, "
                  "which you can call directly", FutureWarning, stacklevel=2)
    folder = Path(folder)
    if (folder / "autotp_plan.json").is_file() and not (folder / ".metadata").is_file():
        raise CheckpointError(
            f"{folder} holds per-rank files of the retired save_sharded, which carry no save id or checksums (a "
            "mix of two saves would load unnoticed): load them with the autotp version that wrote them, save "
            "with autotp.runtime.dcp.save, and load that")
    dcp.load(pm, str(folder))


def gather_to_hf(pm, folder: str | Path, config=None, max_shard_bytes: int = 2 << 30) -> Path | None:
    """Write a HuggingFace folder of the whole model from TP rank 0 of DP replica 0 (None
    elsewhere), streamed: each parameter is gathered to that one writer (never all-gathered to
    every rank) and written out with the file it belongs to, files of at most
    ``max_shard_bytes`` each (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json`` as ``save_pretrained`` shards). The writer holds one
    file's tensors at a time; the other ranks only their own shards.

    A tied pair is written once, under the name the model declares and the graph does not use
    (GPT-2: ``transformer.wte.weight``), as ``save_pretrained`` does. Every rank must call it.

    ``config`` (written as ``config.json``) defaults to the source model's own, which the module
    keeps; a model without one gets a warning: transformers cannot load a folder without it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if getattr(pm.mesh, "pp", 1) > 1:
        raise ConfigError("gather_to_hf writes from one stage's TP ranks, and a pipelined model's stages hold "
                          "different layers: save with autotp.runtime.dcp.save, load that into a module "
                          "parallelized with pp=1 (dcp.load reshards), and gather from it")
    if getattr(pm.mesh, "dp_rank", 0) != 0:      # a data-parallel replica: replica 0 writes
        return None
    rank = pm.mesh.tp_rank if pm.mesh is not None else 0
    written = {held: twin for twin, held in pm.plan.aliases.items()}
    local = pm.local_parameters()
    files = _shard_files(pm, local, max_shard_bytes)
    writer = rank == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0
    with torch.no_grad():
        for i, names in enumerate(files):
            for fqn in names:
                full = _gather_to_writer(pm, fqn, local[fqn].detach())
                if writer:
                    tensors[written.get(fqn, fqn)] = full.cpu().contiguous()
            if writer:
                name = SINGLE if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                save_file(tensors, str(folder / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in tensors})
                total += sum(t.numel() * t.element_size() for t in tensors.values())
                tensors = {}
    if not writer:
        return None
    if len(files) > 1:
        (folder / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = config if config is not None else _own_config(pm)
    if config is not None:
        config.save_pretrained(str(folder))
    else:
        import warnings

        warnings.warn(f"gather_to_hf wrote {folder} without a config.json: the model had no config and none was "
                      "passed, so transformers cannot load the folder; pass config=", stacklevel=2)
    return folder


def _own_config(pm):
    """The source model's config as parallelize found it, naming its class as save_pretrained does."""
    import copy

    info = getattr(pm, "_generation", None) or {}
    config = copy.deepcopy(info.get("config"))
    if config is not None and hasattr(config, "save_pretrained") and not getattr(config, "architectures", None):
        config.architectures = [info.get("model_name")]
    return config if hasattr(config, "save_pretrained") else None


def _shard_files(pm, local: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The parameters of each output file, in order, each file at most ``max_bytes`` (a larger
    tensor alone in its file); every rank computes the same from the plan's full shapes."""
    files: list[list[str]] = [[]]
    size = 0
    for fqn, t in local.items():
        n = t.element_size()
        for d in pm.plan.shapes[fqn]:
            n *= d
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(fqn)
        size += n
    return files


def _gather_to_writer(pm, fqn: str, piece: torch.Tensor) -> torch.Tensor | None:
    """The whole of parameter ``fqn`` on TP rank 0 (None on the others), from every rank's
    ``piece``: one gather of flat pieces padded to the longest (uneven splits)."""
    import torch.distributed as dist

    from ...distributed.comm import _comm
    from ...distributed.shards import assemble

    placement = pm.plan.params[fqn]
    group = pm.mesh.tp_group if pm.mesh is not None else None
    if not isinstance(placement, Shard) or group is None:
        return piece
    tp, rank = pm.plan.tp, pm.mesh.tp_rank
    full_shape = pm.plan.shapes[fqn]
    shapes = []
    for r in range(tp):
        shape = list(full_shape)
        shape[placement.dim] = sum(b - a for a, b in local_ranges(full_shape[placement.dim], placement, tp, r))
        shapes.append(shape)
    longest = max(math.prod(s) for s in shapes)
    flat = torch.zeros(longest, dtype=piece.dtype, device=piece.device)
    flat[:piece.numel()] = piece.reshape(-1)
    out = [torch.empty_like(flat) for _ in range(tp)] if rank == 0 else None
    with _comm(f"gather of {fqn} to the writer", group):
        dist.gather(flat, out, dst=pm.mesh.tp_ranks[0], group=group)
    if rank != 0:
        return None
    pieces = [o[:math.prod(s)].view(s) for o, s in zip(out, shapes)]
    return assemble(pieces, placement, full_shape[placement.dim])
