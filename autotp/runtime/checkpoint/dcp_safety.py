"""What makes a DCP checkpoint safe to write and read across ranks (used by autotp.runtime.checkpoint.dcp).

A checkpoint is written by every rank and published by one; anything a rank sees alone
(a path that is a file, a damaged shard, a failed rename) must reach every rank, or the others
go on and later blame it as lost. So each step ends in one small exchange
(:func:`agree_on`): every rank says what it found, and all raise the same error or none does.

- **The same operation on every rank** (:func:`agree_to_start`): an all-gather of what each rank
  is about to do (``save ckpt``), before anything is written or read. A rank doing something
  else gets a :class:`~autotp.errors.DisagreementError`; a rank that never comes
  (``if rank == 0: save(...)``) is named by the roll call when the collective times out. The
  exchanges carry texts of any length (a long path, a long message): the first all-gather holds
  each rank's length, a second the rest when one is longer than its width.
- **Nothing replaced that is not the module's** (:func:`replace_problem`): a save refuses a
  folder holding the checkpoint of another model, or of another training run of this one (the
  manifest names the run: the first save's id, carried on by every module that saves or loads
  it), unless told ``overwrite=True``.
- **Collectives under the fault handling**: ours and DCP's own run inside
  :func:`autotp.distributed.comm._comm`, so a lost rank is named on every survivor.
- **DCP's errors, reason first** (:func:`checkpoint_error`): DCP raises
  ``CheckpointException ranks:dict_keys([0, 1])`` with each rank's traceback and the reason on
  its last line; autotp raises a :class:`~autotp.errors.CheckpointError` that starts with the
  reason and names the ranks.
- **A manifest** (``autotp_manifest.json``, written last, before the folder is published): the
  save id, the world and every file's size and CRC32. A load verifies the files first, each rank
  a share of them: a flipped bit, a truncated file, two files swapped or a file copied in from
  another save is refused on every rank, naming the file (:func:`verify_files`).
- **One checkpoint operation at a time per process** (:func:`one_at_a_time`): an ``async_save``
  runs DCP's collectives on a background thread, and a user's threads may start saves at once;
  a second operation started meanwhile would interleave its collectives with the first's (both
  hang). The later call waits for the earlier one: after an async save, on every rank alike
  (program order decides it); between threads, each rank in the order its threads came, and
  ranks whose orders differ are told so by the start's exchange.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
import zlib
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ...errors import CheckpointError, DisagreementError

log = logging.getLogger("autotp")

MANIFEST = "autotp_manifest.json"
#: bytes each rank sends in an exchange's first all-gather (its text's length and start; a longer
#: text takes a second all-gather)
_WIDTH = 1024
_BLOCK = 16 << 20

_in_flight: Future | None = None
#: held for the whole of each save, async save (until it returns) and load of the process
_one_at_a_time = threading.Lock()


# ---------------------------------------------------------------- one operation at a time

@contextmanager
def one_at_a_time() -> Iterator[None]:
    """Run a checkpoint operation alone in this process: threads that start one while another
    runs wait for it (their collectives would otherwise interleave on the world group: both
    waited out the collective timeout, and each left a ``.partial`` folder), and an async save
    in flight is waited for first (:func:`serialize`). Each rank takes its threads' operations in
    the order they came; ranks that took them in different orders are told so by the start's
    exchange (a DisagreementError naming both operations), never left waiting."""
    with _one_at_a_time:
        serialize()
        yield


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
    """Every rank's whole ``text``, in rank order: one all-gather of _WIDTH bytes on the world
    group (each rank's length, then its text's start), and a second of the rest only when some
    rank's text is longer (every rank sees every length, so all make the same choice). Under the
    fault handling."""
    import torch.distributed as dist

    from ...distributed.comm import _comm, backend_failure

    if _size() == 1:
        return [text]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = text.encode()
    room = _WIDTH - 8

    def gather(payload: bytes, width: int) -> list[bytes]:
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        every = [torch.empty_like(mine) for _ in range(_size())]
        with _comm(what, _world(), only=backend_failure):
            dist.all_gather(every, mine)
        return [bytes(t.cpu().tolist()) for t in every]

    first = gather(len(data).to_bytes(8, "little") + data[:room], _WIDTH)
    lengths = [int.from_bytes(f[:8], "little") for f in first]
    texts = [f[8:8 + min(n, room)] for f, n in zip(first, lengths)]
    if max(lengths) > room:   # a long path or message: the rest of every text, padded to the longest
        rest = gather(data[room:], max(lengths) - room)
        texts = [t + r[:max(0, n - room)] for t, r, n in zip(texts, rest, lengths)]
    return [t.decode(errors="replace") for t in texts]


def agree_on(what: str, problem: str | None = None, error: type[Exception] = CheckpointError) -> None:
    """End a step: every rank says whether its part went wrong (``problem``); if any did, every
    rank raises the same ``error``, naming the ranks."""
    found = _exchange(what, problem or "")
    bad: dict[str, list[int]] = {}
    for r, text in enumerate(found):
        if text:
            bad.setdefault(text, []).append(r)
    if bad:
        raise error("; ".join(f"{text} ({_ranks(rs)})" for text, rs in bad.items()))


def agree_to_start(op: str, path: str, problem: str | None = None, run: str | None = None) -> tuple[str, str]:
    """Start a checkpoint operation: every rank must be running the same ``op`` on the same
    ``path``, and none may have found a problem with it. Returns rank 0's new save id and the
    training run its module is in (``run``; the save id where it has none)."""
    me = json.dumps({"op": f"{op} {os.path.abspath(path)}", "problem": problem or "", "id": uuid.uuid4().hex,
                     "run": run or ""})
    found = [json.loads(t) if t.startswith("{") else {"op": t, "problem": "", "id": "", "run": ""}
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
    return found[0]["id"], found[0]["run"] or found[0]["id"]


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()`` and None, or None and what went wrong (to be agreed on, not raised alone)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every rank raises it together, in agree_on
        return None, describe(exc)


def describe(exc: BaseException) -> str:
    """An error as one line for :func:`agree_on`: its first line, after its type unless it is a
    CheckpointError."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return first if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {first}"


# ---------------------------------------------------------------- DCP's own calls

def run_dcp(op: str, path: str, fn: Callable[[], Any]) -> Any:
    """Call DCP: its collectives under the fault handling, its CheckpointException turned
    into a CheckpointError that starts with the reason."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ...distributed.comm import _comm, backend_failure

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
    """Why ``path`` cannot take a checkpoint: a file, or a folder of files that is not one (a
    save replaces the folder at ``path``, so it refuses one it did not write); or a last name too
    long for the ``.partial`` and ``.old`` folders beside it."""
    name, longest = os.path.basename(path), _name_max(os.path.dirname(path) or ".")
    if len(os.fsencode(name)) + len(".partial") > longest:
        return (f"the checkpoint folder's name is {len(os.fsencode(name))} bytes long: a save stages in "
                f"<name>.partial and moves an earlier checkpoint to <name>.old, names of at most {longest} bytes here; "
                f"choose a name of at most {longest - len('.partial')} bytes")
    if os.path.isdir(path):
        if os.listdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
            return (f"{path} is a folder that holds files but no DCP checkpoint (no .metadata): a save replaces the "
                    "folder at its path, so it refuses one it did not write; choose another path")
        return None
    if os.path.lexists(path):
        return (f"{path} is a file, not a checkpoint folder: a save replaces the folder at its path, so it "
                "refuses anything else; remove the file or choose another path")
    return None


def _name_max(folder: str) -> int:
    """The longest file name the file system at ``folder`` (or its nearest existing parent) takes."""
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder.rstrip(os.sep)) or os.sep
    try:
        return os.pathconf(folder or os.sep, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def replace_problem(path: str, run: str | None, tensors: dict[str, tuple[int, ...]], whole: bool = True) -> str | None:
    """Why a save must not replace the checkpoint at ``path``: it is another model's, or another
    training run's. A module is in the run of the checkpoints it saved or loaded (the manifest
    names it: ``run``, the first save's id); ``run`` None: it has done neither. ``tensors`` are
    the module's saved keys (``model.<name>``) and full shapes, to tell another model from
    another run of this one (``whole``: the module holds every layer, not a pipeline stage's)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None
    manifest = read_manifest(path)
    theirs = (manifest.get("run") or manifest.get("save_id")) if manifest else None
    if run is not None and theirs == run:
        return None
    keep = ("choose another path, or pass overwrite=True to replace it")
    other = _other_model(path, tensors, whole)
    if other:
        return f"{path} holds the checkpoint of another model ({other}): a save would replace it; {keep}"
    if manifest is None:
        return (f"{path} holds a checkpoint with no record of the training run that saved it (no {MANIFEST}: "
                f"an older autotp, or not autotp): a save would replace it; {keep}")
    return (f"{path} holds the checkpoint of another training run (save {str(manifest.get('save_id'))[:8]}), which "
            f"this module neither loaded nor saved: a save would replace it. To go on with that run, "
            f"autotp.runtime.dcp.load it first; else {keep}")


def _other_model(path: str, tensors: dict[str, tuple[int, ...]], whole: bool) -> str | None:
    """How the model checkpointed at ``path`` differs from ``tensors`` (None: the same names and
    shapes, as far as DCP's metadata tells)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = {k: tuple(v.size) for k, v in FileSystemReader(path).read_metadata().state_dict_metadata.items()
                 if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    except Exception as exc:  # noqa: BLE001 - a folder DCP cannot read is not this module's checkpoint
        return f"its .metadata cannot be read: {type(exc).__name__}"
    shapes = [f"{k.removeprefix('model.')}: saved {list(saved[k])}, the module holds {list(v)}"
              for k, v in tensors.items() if k in saved and saved[k] != tuple(v)]
    lacks = [k.removeprefix("model.") for k in tensors if k not in saved]
    extra = [k.removeprefix("model.") for k in saved if whole and k not in tensors]
    said = ([f"{len(shapes)} tensor(s) of other shapes, e.g. {shapes[0]}"] if shapes else []) + (
        [f"{len(lacks)} of the module's tensors missing, e.g. {lacks[0]}"] if lacks else []) + (
        [f"{len(extra)} tensor(s) the module lacks, e.g. {extra[0]}"] if extra else [])
    return "; ".join(said) or None


def read_manifest(path: str) -> dict | None:
    """The manifest of the checkpoint at ``path`` (None: none, or not one autotp can read)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


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
