"""Checkpoints: read only this rank's slices of a HuggingFace folder; save and gather shards.

Reading (:class:`CheckpointReader`): a folder holding ``model.safetensors`` or a sharded
``model.safetensors.index.json``. :meth:`CheckpointReader.read_local` returns the slices of one
tensor that a placement gives this rank, copied out of the memory-mapped file: row slices (a
vocab-parallel embedding, a row-parallel weight) touch only their own pages; column slices of a
row-major matrix (a column-parallel Conv1D weight) touch the pages of every row. The file is
mapped per tensor and unmapped again, so no more than one tensor's pages are resident at once:
a rank's peak memory is its shards plus the largest column-sliced tensor.

Writing: :func:`save_sharded` writes this rank's shards (``rank-00003-of-00008.safetensors``)
with the plan beside them, to be resumed by :func:`load_sharded` under the same plan;
:func:`gather_to_hf` all-gathers every parameter to one rank and writes a HuggingFace folder
(``config.json`` + ``model.safetensors``) that ``from_pretrained`` loads into a serial model.

No pickle anywhere: tensors go through safetensors, the plan through its versioned JSON.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
import torch

from ..errors import CheckpointError
from ..placements import Placement, Shard, local_ranges

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

def _rank_file(folder: Path, rank: int, tp: int) -> Path:
    return folder / f"rank-{rank:05d}-of-{tp:05d}.safetensors"


def save_sharded(pm, folder: str | Path) -> Path:
    """Write this rank's parameter shards and the plan; every rank of every TP group calls it
    (data-parallel replicas write the same bytes, so DP rank 0 of each TP rank writes)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tp, rank = pm.plan.tp, pm.mesh.tp_rank if pm.mesh is not None else 0
    if getattr(pm.mesh, "dp_rank", 0) != 0:
        return _rank_file(folder, rank, tp)
    tensors = {fqn: p.detach().cpu().contiguous() for fqn, p in pm.local_parameters().items()}
    path = _rank_file(folder, rank, tp)
    save_file(tensors, str(path), metadata={"autotp_tp": str(tp), "autotp_rank": str(rank)})
    if rank == 0:
        (folder / "autotp_plan.json").write_text(pm.plan.to_json())
    return path


def load_sharded(pm, folder: str | Path) -> None:
    """Resume ``pm`` from :func:`save_sharded`'s folder: the plan must be the one it was saved
    under (same tp, same placements); every tensor is checked by name and shape."""
    from ..plan import Plan

    folder = Path(folder)
    plan_file = folder / "autotp_plan.json"
    if not plan_file.is_file():
        raise CheckpointError(f"{folder} has no autotp_plan.json: not a sharded autotp checkpoint")
    saved = Plan.from_json(plan_file.read_text())
    tp, rank = pm.plan.tp, pm.mesh.tp_rank if pm.mesh is not None else 0
    if saved.tp != tp or saved.params != pm.plan.params:
        differ = sorted(k for k in pm.plan.params if saved.params.get(k) != pm.plan.params[k])[:3]
        raise CheckpointError(
            f"{folder} was saved under another plan (tp={saved.tp}; differs at {differ or 'tp'}); "
            "parallelize with plan=autotp.Plan.from_json(open(.../autotp_plan.json).read())"
        )
    path = _rank_file(folder, rank, tp)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no shard for TP rank {rank}")
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with torch.no_grad():
        for fqn, param in pm.local_parameters().items():
            if fqn not in tensors:
                raise CheckpointError(f"{path.name} has no tensor {fqn}")
            if tuple(tensors[fqn].shape) != tuple(param.shape):
                raise CheckpointError(f"{path.name}: {fqn} has shape {list(tensors[fqn].shape)}, "
                                      f"this rank holds {list(param.shape)}")
            param.copy_(tensors[fqn])


def gather_to_hf(pm, folder: str | Path, config=None) -> Path | None:
    """All-gather every parameter and write one HuggingFace folder on TP rank 0 (None elsewhere).

    A tied pair is written once, under the name the model declares and the graph does not use
    (GPT-2: ``transformer.wte.weight``), as ``save_pretrained`` does. Every rank must call it."""
    from safetensors.torch import save_file

    from .collectives import gather_from_tp

    folder = Path(folder)
    rank = pm.mesh.tp_rank if pm.mesh is not None else 0
    group = pm.mesh.tp_group if pm.mesh is not None else None
    written = {held: twin for twin, held in pm.plan.aliases.items()}
    tensors = {}
    with torch.no_grad():
        for fqn, param in pm.local_parameters().items():
            placement = pm.plan.params[fqn]
            full = param.detach()
            if isinstance(placement, Shard):
                full = gather_from_tp(full, group, placement, pm.plan.shapes[fqn][placement.dim])
            tensors[written.get(fqn, fqn)] = full.cpu().contiguous()
    if rank != 0 or getattr(pm.mesh, "dp_rank", 0) != 0:   # one writer per world
        return None
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / SINGLE), metadata={"format": "pt"})
    if config is not None:
        config.save_pretrained(str(folder))
    return folder
