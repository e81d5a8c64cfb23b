"""What makes a DCP checkpoint safe to write and read across ranks (used by autotp.runtime.dcp).

A checkpoint is written by every rank and published by one; anything a rank sees alone
(a path that is a file, a damaged shard, a failed rename) must reach every rank, or the others
go on and later blame it as lost. So each step ends in one small exchange
(:func:`agree_on`): every rank says what it found, and all raise the same error or none does.

- **The same operation on every rank** (:func:`agree_on` at the start): an all-gather of what
  each rank is about to do (``save ckpt``), before anything is written or read. A rank doing
  something else gets a :class:`~autotp.errors.DisagreementError`; a rank that never comes
  (``if rank == 0: save(...)``) is named by the roll call when the collective times out.
- **Collectives under the fault handling**: ours and DCP's own run inside
  :func:`autotp.runtime.collectives._comm`, so a lost rank is named on every survivor.
- **DCP's errors, reason first** (:func:`checkpoint_error`): DCP raises
  ``CheckpointException ranks:dict_keys([0, 1])`` with each rank's traceback and the reason on
  its last line; autotp raises a :class:`~autotp.errors.CheckpointError` that starts with the
  reason and names the ranks.
- **A manifest** (``autotp_manifest.json``, written last, before the folder is published): the
  save id, the world and every file's size and CRC32. A load verifies the files first, each rank
  a share of them: a flipped bit, a truncated file, two files swapped or a file copied in from
  another save is refused on every rank, naming the file (:func:`verify_files`).
- **One checkpoint operation at a time per process** (:func:`serialize`): an ``async_save`` runs
  DCP's collectives on a background thread; a second save, async save or load started while it is
  in flight would interleave its collectives with them (both hang). The later call waits for the
  earlier one first, on every rank alike (waiting is decided by program order, never by timing,
  so the ranks cannot disagree about it).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import zlib
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..errors import CheckpointError, DisagreementError

log = logging.getLogger("autotp")

MANIFEST = "autotp_manifest.json"
#: bytes each rank sends in an exchange (a description, or the first problem it found)
_WIDTH = 1024
_BLOCK = 16 << 20

_in_flight: Future | None = None


# ---------------------------------------------------------------- one operation at a time

def serialize() -> None:
    """Wait for this process's async save in flight, if any (see the module docs). Its own
    error stays with its future; it is logged here so that it is not lost if nobody waits."""
    global _in_flight
    earlier, _in_flight = _in_flight, None
    if earlier is None:
        return
    try:
        earlier.result()
    except BaseException as exc:  # noqa: BLE001 - reported through its own future
        log.warning("autotp: the earlier async_save failed (%s: %s); its future holds the error",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def in_flight(future: Future) -> None:
    global _in_flight
    _in_flight = future


# ---------------------------------------------------------------- exchanges

def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


def _size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _exchange(what: str, text: str) -> list[str]:
    """Every rank's ``text`` (at most _WIDTH bytes of it), in rank order: one all-gather on the
    world group, under the fault handling."""
    import torch.distributed as dist

    from .collectives import _comm, backend_failure

    if _size() == 1:
        return [text]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = text.encode()[:_WIDTH]
    mine = torch.zeros(_WIDTH, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    every = [torch.empty_like(mine) for _ in range(_size())]
    with _comm(what, _world(), only=backend_failure):
        dist.all_gather(every, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in every]


def agree_on(what: str, problem: str | None = None) -> None:
    """End a step: every rank says whether its part went wrong (``problem``); if any did, every
    rank raises the same CheckpointError, naming the ranks."""
    found = _exchange(what, problem or "")
    bad: dict[str, list[int]] = {}
    for r, text in enumerate(found):
        if text:
            bad.setdefault(text, []).append(r)
    if bad:
        raise CheckpointError("; ".join(f"{text} ({_ranks(rs)})" for text, rs in bad.items()))


def agree_to_start(op: str, path: str, problem: str | None = None) -> str:
    """Start a checkpoint operation: every rank must be running the same ``op`` on the same
    ``path``, and none may have found a problem with it. Returns rank 0's new save id."""
    me = json.dumps({"op": f"{op} {os.path.abspath(path)}", "problem": problem or "", "id": uuid.uuid4().hex})
    found = [json.loads(t) if t.startswith("{") else {"op": t, "problem": "", "id": ""}
             for t in _exchange(f"the start of {op} of {path}", me)]
    ops: dict[str, list[int]] = {}
    for r, f in enumerate(found):
        ops.setdefault(f["op"], []).append(r)
    if len(ops) > 1:
        raise DisagreementError(
            "the ranks run different checkpoint operations: " + "; ".join(f"{_ranks(rs)}: {o}" for o, rs in ops.items())
            + ". Every rank must call autotp.runtime.dcp's save, async_save and load together, in the same order, "
            "with the same path (a save from rank 0 alone would write part of a checkpoint)")
    problems: dict[str, list[int]] = {}
    for r, f in enumerate(found):
        if f["problem"]:
            problems.setdefault(f["problem"], []).append(r)
    if problems:
        raise CheckpointError("; ".join(f"{p}{'' if len(rs) == _size() else f' ({_ranks(rs)})'}"
                                        for p, rs in problems.items()))
    return found[0]["id"]


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()`` and None, or None and what went wrong (to be agreed on, not raised alone)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every rank raises it together, in agree_on
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"{type(exc).__name__}: {first}" if not isinstance(exc, CheckpointError) else first


# ---------------------------------------------------------------- DCP's own calls

def run_dcp(op: str, path: str, fn: Callable[[], Any]) -> Any:
    """Call DCP: its collectives under the fault handling, its CheckpointException turned
    into a CheckpointError that starts with the reason."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .collectives import _comm, backend_failure

    try:
        if _world() is None:
            return fn()
        with _comm(f"torch.distributed.checkpoint's {op} of {path}", _world(), only=backend_failure):
            return fn()
    except CheckpointException as exc:
        raise checkpoint_error(op, path, exc) from None


def checkpoint_error(op: str, path: str, exc: BaseException) -> CheckpointError:
    """DCP's CheckpointException, reason first: ``FileNotFoundError: ... (ranks 0, 1): dcp.load
    of ckpt failed on every rank``."""
    failures = getattr(exc, "failures", {}) or {}
    reasons: dict[str, list[int]] = {}
    for r, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        reasons.setdefault(f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": "), []).append(r)
    said = "; ".join(f"{reason} ({_ranks(rs)})" for reason, rs in reasons.items()) or str(exc).splitlines()[0]
    return CheckpointError(f"{said}: autotp.runtime.dcp's {op} of {path} failed (torch.distributed.checkpoint "
                           "raised it on every rank)")


# ---------------------------------------------------------------- paths

def save_path_problem(path: str) -> str | None:
    """Why ``path`` cannot take a checkpoint: a file, or a folder of files that is not one.
    A save replaces the folder at ``path``, so it refuses one it did not write."""
    if os.path.isdir(path):
        if os.listdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
            return (f"{path} is a folder that holds files but no DCP checkpoint (no .metadata): a save replaces the "
                    "folder at its path, so it refuses one it did not write; choose another path")
        return None
    if os.path.lexists(path):
        return (f"{path} is a file, not a checkpoint folder: a save replaces the folder at its path, so it "
                "refuses anything else; remove the file or choose another path")
    return None


def load_path_problem(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint, pointing at the one to load instead."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return None
    what = (f"{path} is a file, not a DCP checkpoint folder" if os.path.lexists(path) and not os.path.isdir(path)
            else f"{path} is not a complete DCP checkpoint (no .metadata)")
    old, partial = f"{path}.old", f"{path}.partial"
    if os.path.isfile(os.path.join(old, ".metadata")) and os.path.isfile(os.path.join(old, MANIFEST)):
        what += (f"; {old} is the previous checkpoint, complete (a save was cut short between its two renames): "
                 f"load {old}, or move it back to {path}")
    if os.path.exists(partial):
        what += f"; {partial} is a save that did not finish and is never loaded"
    return what + ": load a folder autotp.runtime.dcp.save (or async_save, once its future is done) wrote"


def stage(path: str) -> str:
    """``<path>.partial``, emptied of an earlier interrupted save's files (on rank 0; every rank
    waits for it)."""
    staging = f"{path}.partial"

    def empty() -> None:
        if os.path.isdir(staging) and not os.path.islink(staging):
            shutil.rmtree(staging)
        elif os.path.lexists(staging):
            os.remove(staging)

    problem = attempt(empty)[1] if rank() == 0 else None
    agree_on(f"the staging of {path}", problem and f"cannot empty {staging}: {problem}")
    return staging


def publish(staging: str, path: str) -> None:
    """On rank 0: the complete ``staging`` folder becomes ``path``. An earlier checkpoint is moved
    aside to ``<path>.old`` first and removed last, so a crash between the two renames leaves it
    whole there (a load of ``path`` then names it). An ``.old`` left by such a crash, with no
    ``path`` beside it, is the only complete checkpoint: it stays until the new one is in place."""
    old = f"{path}.old"
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- the manifest

def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _own_files(staging: str) -> list[str]:
    """The files this rank wrote into ``staging`` (DCP names them ``__<rank>_<n>.distcp``; the
    coordinator writes ``.metadata``)."""
    mine = [f for f in os.listdir(staging) if f.startswith(f"__{rank()}_") and f.endswith(".distcp")]
    return sorted(mine + ([".metadata"] if rank() == 0 else []))


def write_manifest(staging: str, save_id: str, extra: dict) -> None:
    """Every rank sums its own files; rank 0 writes the manifest of them all. Collective."""
    def describe_own() -> None:
        files = {f: {"bytes": os.path.getsize(os.path.join(staging, f)), "crc32": _crc32(os.path.join(staging, f))}
                 for f in _own_files(staging)}
        with open(os.path.join(staging, f".autotp-files-{rank()}.json"), "w") as out:
            json.dump(files, out)

    agree_on(f"the checksums of {staging}", attempt(describe_own)[1])

    def merge() -> None:
        files: dict[str, dict] = {}
        for r in range(_size()):
            part = os.path.join(staging, f".autotp-files-{r}.json")
            with open(part) as f:
                files.update(json.load(f))
            os.remove(part)
        manifest = {"format": 1, "save_id": save_id, "world": _size(), **extra, "files": dict(sorted(files.items()))}
        with open(os.path.join(staging, MANIFEST + ".tmp"), "w") as out:
            json.dump(manifest, out, indent=1)
        os.replace(os.path.join(staging, MANIFEST + ".tmp"), os.path.join(staging, MANIFEST))

    agree_on(f"the manifest of {staging}", attempt(merge)[1] if rank() == 0 else None)


def verify_files(path: str) -> dict | None:
    """Check every file the manifest lists against its size and CRC32, each rank reading a
    share of them; every rank raises the same CheckpointError naming the first bad file, or none
    does. A folder without a manifest (written before autotp kept one) is loaded unchecked,
    with a warning. Collective."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        if rank() == 0:
            log.warning("autotp: %s has no %s (saved by an older autotp): its files cannot be checked", path, MANIFEST)
        return None

    def check() -> dict:
        with open(file) as f:
            manifest = json.load(f)
        names = sorted(manifest["files"])
        for i, name in enumerate(names):
            want = manifest["files"][name]
            on_disk = os.path.join(path, name)
            if not os.path.isfile(on_disk):
                raise CheckpointError(f"{name} is missing from {path}")
            size = os.path.getsize(on_disk)
            if size != want["bytes"]:
                raise CheckpointError(f"{name} in {path} holds {size} bytes, the save wrote {want['bytes']} "
                                      "(truncated or replaced)")
            if i % _size() == rank() and _crc32(on_disk) != want["crc32"]:
                raise CheckpointError(f"{name} in {path} is not the file save {manifest['save_id'][:8]} wrote (its "
                                      "CRC32 differs: damaged, or swapped with or copied from another file)")
        return manifest

    manifest, problem = attempt(check)
    if problem is not None:
        problem += ": the checkpoint is damaged and is not loaded; load another one, or save again"
    agree_on(f"the check of {path}'s files", problem)
    return manifest
