"""Which rank is lost: a roll call through the rendezvous store after a collective fails.

A collective that fails tells a rank only that *some* peer went away (gloo: "Connection closed
by peer [127.0.0.1]:32424") or that it waited too long. To name the lost rank, every rank whose
collective fails answers a roll call in the torch.distributed store (which lives outside the
ranks: in the torchrun agent, or in the process that started local ranks):

1. it writes ``autotp/rollcall/<group>/<collective's sequence number>/<rank>``;
2. it waits for the other ranks of the group to answer. A rank whose process has exited is lost
   at once, when that can be seen from here: every rank publishes its pid and the identity of its
   pid namespace when its mesh is made (:func:`register_process`), so ranks on the same host see
   a dead peer immediately. Other ranks get until the collective timeout has passed since the
   failed collective started (ranks still waiting in it time out by then and answer), plus a
   little slack;
3. ranks that have not answered by then are named: dead, or stuck outside this collective.

No thread and no heartbeat: nothing runs until a collective has already failed.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RollCall", "StepGuard", "register_process", "roll_call", "watch_backward"]

#: How long a rank waits for answers beyond the collective timeout (and at least, when its own
#: collective failed by timing out: the others have long answered or are gone).
SLACK_S = 5.0



@dataclass(frozen=True)
class RollCall:
    """The answer to one roll call: ``exited`` ranks are known dead, ``silent`` did not answer in
    time, ``waiting`` had not answered yet when the dead ones were found."""

    exited: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    note: str = ""

    @property
    def lost(self) -> tuple[int, ...]:
        return tuple(sorted(self.exited + self.silent))

    def describe(self, wait_s: float) -> str:
        parts = []
        if self.exited:
            parts.append(f"lost rank{'s' if len(self.exited) > 1 else ''} "
                         f"{', '.join(map(str, self.exited))}: the process has exited")
        if self.silent:
            parts.append(f"lost rank{'s' if len(self.silent) > 1 else ''} "
                         f"{', '.join(map(str, self.silent))}: no answer to autotp's roll call within "
                         f"{wait_s:.0f} s (the process died, or it is stuck outside this collective)")
        if self.waiting:
            parts.append(f"ranks {list(self.waiting)} had not answered yet (still waiting in the "
                         "collective, or on another host)")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def _collective_id(group) -> str:
    """Names the failed collective alike on every rank in it: the group and its sequence number
    (every collective on a group advances it by one on each rank)."""
    name = getattr(group, "group_name", None) or "world"
    try:  # private API; without it, a roll call per group
        return f"{name}/{group._get_sequence_number_for_group()}"
    except Exception:
        return f"{name}/0"


def _store():
    # The default group's store: the same rendezvous every rank used, outside the ranks themselves.
    return dist.distributed_c10d._get_default_store()


def _namespace() -> str | None:
    """Identity of this process's pid namespace on this boot: equal means pids are comparable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def register_process() -> None:
    """Publish this rank's pid, so that a roll call on its host can tell it has exited."""
    try:
        _store().set(f"autotp/proc/{dist.get_rank()}",
                     json.dumps({"ns": _namespace(), "pid": os.getpid()}))
    except Exception:  # only ever used to word an error: never fail a healthy start on it
        pass


def _exited(store, rank: int, namespace: str | None) -> bool:
    try:
        if not store.check([f"autotp/proc/{rank}"]):
            return False
        info = json.loads(store.get(f"autotp/proc/{rank}"))
    except Exception:
        return False
    if namespace is None or info.get("ns") != namespace:
        return False  # another host or container: its pids mean nothing here
    try:
        with open(f"/proc/{int(info['pid'])}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError, ValueError):
        return False
    return state in ("Z", "X")  # killed but not yet reaped by its parent: dead all the same


def roll_call(group, ranks: tuple[int, ...], started: float, timeout_s: float,
              since: float | None = None) -> RollCall:
    """Take the roll call of ``ranks`` (global ranks of ``group``) after a collective that
    started at ``started`` (``time.monotonic()``) failed on this rank. See the module docs.
    What it finds is published as this rank's fault, so that a rank of another group left
    waiting on this one names the cause instead of blaming this live rank.

    ``since`` (``time.time()``) is when this rank's previous collective on the group started:
    a fault another rank published before then belongs to an earlier call (that collective
    needed the other rank too, so a rank that raised in this call did so after it began) and is
    not named. None: every published fault counts."""
    found = _roll_call(group, ranks, started, timeout_s, since)
    try:
        error = ("LostRankError: " if found.lost else "CommError: ") + (found.describe(timeout_s) or "a collective failed")
        _store().set(f"autotp/fault/last/{dist.get_rank()}",
                     json.dumps({"rank": dist.get_rank(), "error": error[:300], "comm": True, "at": time.time()}))
    except Exception:
        pass
    return found


def _roll_call(group, ranks: tuple[int, ...], started: float, timeout_s: float,
               since: float | None) -> RollCall:
    me = dist.get_rank()
    try:
        store = _store()
        prefix = f"autotp/rollcall/{_collective_id(group)}"
        store.set(f"{prefix}/{me}", "here")
    except Exception as e:
        return RollCall(note=f"no roll call: the store is unreachable ({type(e).__name__}: {e})")
    now = time.monotonic()
    timed_out = now - started >= 0.9 * timeout_s
    slack = min(SLACK_S, timeout_s)
    deadline = now + slack + (0.0 if timed_out else max(0.0, started + timeout_s - now))
    namespace = _namespace()
    others = [r for r in ranks if r != me]
    while True:
        try:
            missing = [r for r in others if not store.check([f"{prefix}/{r}"])]
        except Exception as e:
            return RollCall(note=f"the roll call was cut short: the store is unreachable ({type(e).__name__})")
        exited = tuple(r for r in missing if _exited(store, r, namespace))
        if exited:  # the group is broken for good: no need to wait for the others
            return RollCall(exited=exited, waiting=tuple(r for r in missing if r not in exited))
        raised = {r: f for r in missing if (f := _published_fault(store, r, since)) is not None}
        if raised:  # alive, but it left the call: this collective will never complete
            return RollCall(note="; ".join(
                f"rank {r} raised {f['error']} inside {'this call' if f.get('where', 'a call') == 'a call' else f['where']} "
                "and left its collectives unfinished "
                "(restart every rank, or make that code raise on every rank alike)" for r, f in raised.items()))
        remaining = deadline - time.monotonic()
        if not missing or remaining <= 0:
            return RollCall(silent=tuple(missing))
        time.sleep(min(0.1, remaining))  # a look every 0.1 s; the store's own wait logs each timeout


# ---- a call abandoned on some ranks ----------------------------------------------------------
#
# An exception raised inside a call (a forward or a generation step) on one rank leaves the
# others waiting in a collective of that call. If the rank catches it and calls again, its next
# collectives would pair with the ones the others are still waiting in: gloo aborts the process
# on the mismatch, or, where the shapes happen to agree, every later result is silently another
# call's. A StepGuard stops that: a rank whose call raised publishes the fault in the store and,
# before its next call's first collective, waits (through the store, never a collective) for
# every rank of the group to have left the same call. If every rank did, and no collective
# failed, they stopped at the same collective and the group goes on in step; otherwise every
# rank gets a clear error: the ones still inside the call when their collective times out (the
# roll call names the rank that raised), the one that raised when it calls again.

_guards_made = 0

#: time.time() of this process's last failed collective (autotp.distributed.comm._comm)
_last_comm_failure = 0.0


def note_comm_failure() -> None:
    global _last_comm_failure
    _last_comm_failure = time.time()


def watch_backward(guard: "StepGuard", outputs: list, agree=None) -> None:
    """Tell ``guard`` when a backward pass through a call's differentiable ``outputs`` begins
    (:meth:`StepGuard.backward_started`): a hook on the first of their gradients to be computed,
    which fires before any of the call's backward collectives. ``agree()``, when given, then
    checks that every rank is in this same backward pass (autotp.distributed.agreement.check_call),
    raising out of ``loss.backward()`` where one is not. A hook, not an identity autograd
    Function, so the outputs are returned as computed rather than as views (FSDP2 warns on
    every call of a module returning views)."""
    def started(grad: torch.Tensor) -> None:
        guard.backward_started()
        if agree is not None:
            agree()

    torch.autograd.graph.register_multi_grad_hook(tuple(outputs), started, mode="any")


def _fault_key(guard: str, epoch: int, rank: int) -> str:
    return f"autotp/fault/{guard}/{epoch}/{rank}"


def _published_fault(store, rank: int, since: float | None) -> dict | None:
    """The last fault rank ``rank`` published (any guard) at or after ``since``, or None."""
    try:
        if store.check([f"autotp/fault/last/{rank}"]):
            fault = json.loads(store.get(f"autotp/fault/last/{rank}"))
            if since is None or fault.get("at", 0.0) >= since:
                return fault
    except Exception:
        pass
    return None


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception, and of its cause where it wraps one (torch's
    pipeline stages re-raise a chunk's error as "[Stage 1] failed to run forward", from it)."""
    def line(e: BaseException) -> str:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"{type(e).__name__}: {first}" if first else type(e).__name__

    cause = exc.__cause__
    return line(exc) if cause is None else f"{line(exc)} (from {line(cause)})"


class StepGuard:
    """Keeps the ranks of ``group`` in step across an exception raised inside a call."""

    def __init__(self, group, ranks: tuple[int, ...] | None) -> None:
        global _guards_made
        _guards_made += 1    # modules are made in the same order on every rank: the same name
        self.name = f"g{_guards_made}"
        self.group, self.ranks = group, ranks
        self.epoch = 0
        self.fault: dict | None = None     # this rank's unresolved fault
        #: time.time() when a backward pass of this module's outputs began and has not ended
        self.backward_began: float | None = None

    @property
    def active(self) -> bool:
        return self.ranks is not None and len(self.ranks) > 1

    def __enter__(self) -> "StepGuard":
        if self.backward_began is not None and self.active and self.fault is None:
            # the previous call's backward pass began and never reached its end: it raised
            began, self.backward_began = self.backward_began, None
            broken = _last_comm_failure >= began
            self._publish_fault("a collective that failed" if broken else "an exception (the pass stopped before its end)",
                                broken, "the backward pass of a call")
        if self.fault is not None:
            self._rejoin()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and self.active and self.fault is None:
            self._publish(exc)
        return False

    # A call's backward runs outside the module's forward, yet its collectives pair across the
    # ranks as a forward's do. The runtime passes each call's differentiable outputs through
    # :func:`watch_backward`: its hook, on the pass's first gradient, notes the start and asks
    # the autograd engine for a callback at the pass's successful end. A pass that raised (on
    # this rank, or in a collective a peer left) never gets the callback, and the next call
    # treats it as a fault of the call, as above.

    def backward_started(self) -> None:
        if self.backward_began is None:
            self.backward_began = time.time()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        self.backward_began = None

    def _publish(self, exc: BaseException) -> None:
        from ..errors import CommError, DisagreementError

        broken = isinstance(exc, CommError) and not isinstance(exc, DisagreementError)
        self._publish_fault(_describe(exc), broken)

    def _publish_fault(self, error: str, broken: bool, where: str = "a call") -> None:
        self.fault = {"rank": dist.get_rank(), "error": error[:300], "where": where,
                      "comm": broken, "guard": self.name, "epoch": self.epoch, "at": time.time()}
        try:
            store = _store()
            text = json.dumps(self.fault)
            store.set(_fault_key(self.name, self.epoch, dist.get_rank()), text)
            store.set(f"autotp/fault/last/{dist.get_rank()}", text)
        except Exception:  # no store: the next call still refuses to go on out of step
            self.fault["no_store"] = True

    def _rejoin(self) -> None:
        from ..errors import CommError
        from .timeouts import group_timeout

        mine = self.fault
        if mine.get("comm") or mine.get("no_store"):
            raise CommError(
                f"rank {mine['rank']}'s previous call failed in a collective"
                f"{'' if mine.get('where', 'a call') == 'a call' else ' of its backward pass'} ({mine['error']}): "
                "the process group can no longer be trusted to be in step. Restart every rank.")
        timeout = group_timeout(self.group).total_seconds() + SLACK_S
        store, me = _store(), dist.get_rank()
        namespace = _namespace()
        others = [r for r in self.ranks if r != me]
        deadline = time.monotonic() + timeout
        faults: dict[int, dict] = {}
        while True:
            for r in others:
                if r not in faults and store.check([_fault_key(self.name, self.epoch, r)]):
                    faults[r] = json.loads(store.get(_fault_key(self.name, self.epoch, r)))
            missing = [r for r in others if r not in faults]
            exited = [r for r in missing if _exited(store, r, namespace)]
            if not missing or exited or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raised = f"rank {me} raised {mine['error']} inside {mine.get('where', 'a call')}"
        if exited or missing:
            gone = (f"rank{'s' if len(exited) > 1 else ''} {', '.join(map(str, exited))} exited" if exited else
                    f"ranks {missing} did not leave it within {timeout:.0f} s (still waiting in its collectives, "
                    "or stuck)")
            raise CommError(
                f"{raised}, leaving that call's collectives unfinished on the other ranks; {gone}. Calling "
                "again would pair this rank's collectives with another call's (a process abort or silently "
                "wrong results), so the module refuses: restart every rank, or make the failing code raise "
                "on every rank alike.")
        broken = {r: f["error"] for r, f in faults.items() if f.get("comm")}
        if broken:
            raise CommError(
                f"{raised}; ranks {sorted(broken)} then failed in a collective of that call "
                f"({next(iter(broken.values()))}): the process group can no longer be trusted. Restart every rank.")
        # every rank left the call by raising, none inside a collective: they stopped at the same
        # collective (none could pass one without all), so the group is in step
        self.epoch += 1
        self.fault = None
        try:
            store.delete_key(f"autotp/fault/last/{me}")
        except Exception:
            pass
