"""Local ranks without torchrun: started processes with an initialized torch.distributed world.

``launch(fn, world_size, *args, **kwargs)`` starts ``world_size`` processes, runs
``fn(*args, **kwargs)`` once on each and returns the per-rank results in rank order.
``LocalCluster(world_size)`` keeps its rank processes (and their process group) alive and runs
many tasks on them, so that hundreds of test examples do not each pay a spawn.

Contract, for both:

- ``fn`` is sent by reference (pickle): a module-level function the children can import; its
  arguments and results must pickle. In each rank torch.distributed is initialized (``backend``,
  gloo by default: CPU tensors, any number of ranks on one machine), ``torch.set_num_threads(1)``
  is set, and RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are in the environment.
- An exception in a rank is raised in the caller with the rank and its traceback in the message.
  An ``AutotpError`` keeps its type (a ``ConfigError`` in a rank is a ``ConfigError`` here);
  anything else arrives as ``CommError``. When several ranks fail the root cause is reported
  (an error other than a ``CommError``, lowest rank first).
- Nothing hangs. A rank that dies (killed, segfault, ``os._exit``), or a task that does not finish
  within ``timeout`` seconds, raises ``CommError`` naming the ranks. After one rank failed, the
  others get ``error_grace`` seconds to report back; ranks still running then (typically stuck in
  a collective the failed rank never joined) are killed. A task that timed out with no rank
  failed names where each stuck rank was (its Python stack). A cluster that killed or lost
  workers starts fresh ones on its next ``run``.
- Ranks are forked from a server process that has imported torch and autotp once (``preload``
  adds modules to it), on Linux; each rank gets the caller's environment as it is at the start.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from autotp.errors import AutotpError, CommError, ConfigError

__all__ = ["launch", "LocalCluster", "preload"]

_STOP = b""  # the message that tells a worker to leave

#: modules the rank processes import before they are forked (forkserver); see ``preload``
_PRELOAD = ["torch", "torch.distributed", "autotp", "autotp.api", "autotp.testing", "autotp.distributed.faults"]


def preload(*modules: str) -> None:
    """Import ``modules`` once, in the server the ranks are forked from, instead of in every rank.

    Ranks start from a fork server (``multiprocessing``'s forkserver, on Linux) that has imported
    torch and autotp: a rank then starts in a fraction of a second instead of importing them
    again (seconds of CPU each). Add the modules your rank functions import (a model library,
    its modeling modules) before the first ``launch`` or ``LocalCluster`` of the process: the
    server starts then, and later additions do not reach it. A module that is not installed is
    skipped. Each rank takes the caller's environment as it is at its start, but what a preloaded
    module read from the environment when imported is the server's: set such variables (e.g.
    ``TORCH_LOGS``) before the first launch. ``AUTOTP_START_METHOD=spawn`` starts every rank as
    a fresh interpreter instead (as on platforms without a fork server).
    """
    for module in modules:
        if module not in _PRELOAD:
            _PRELOAD.append(module)


def _context():
    """The start method for rank processes: a fork server that has imported ``_PRELOAD`` where
    the platform has one (forking this process itself would copy its threads and torch state;
    the server is a fresh interpreter that has only imported), spawn elsewhere."""
    method = os.environ.get("AUTOTP_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"AUTOTP_START_METHOD={method!r}: choose forkserver or spawn")
    if method == "forkserver" and sys.platform == "linux" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # the last import freezes what the others made (autotp/distributed/frozen.py)
        ctx.set_forkserver_preload(list(_PRELOAD) + ["autotp.distributed.frozen"])
        return ctx
    return mp.get_context("spawn")


def launch(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0,
           **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` once on ``world_size`` fresh ranks; per-rank results.

    ``timeout`` bounds the whole call, start-up included. (``backend`` and ``timeout`` are
    launch's own keywords: they are not passed on to ``fn``.)
    """
    deadline = time.monotonic() + timeout
    task = _pack(fn, args, kwargs)  # before spawning: a lambda fails fast
    cluster = LocalCluster(world_size, backend=backend, timeout=timeout)
    cluster._restart_note = "all ranks were stopped"
    try:
        cluster._start(deadline)
        return cluster._run(task, _name(fn), deadline)
    finally:
        cluster.close()


class LocalCluster:
    """``world_size`` persistent rank processes that run tasks: ``cluster.run(fn, *args)``.

    ``timeout`` (seconds) bounds the start-up and each task, and is the ranks' collective
    timeout unless ``collective_timeout`` gives another. ``error_grace`` is how long the other
    ranks may still report after one failed.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 120.0,
                 error_grace: float = 3.0, collective_timeout: float | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r}: world_size must be a positive integer")
        self.world_size, self.backend = world_size, backend
        self.timeout, self.error_grace = float(timeout), float(error_grace)
        self.collective_timeout = float(collective_timeout if collective_timeout is not None else timeout)
        self._procs: list = []
        self._conns: list[Connection] = []
        self._store = None
        self._restart_note = "the cluster stopped its workers and starts fresh ones on next use"
        self._finalizer = None

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "LocalCluster":
        """Spawn the ranks and initialize their process group (a no-op when they are running)."""
        self._start(time.monotonic() + self.timeout)
        return self

    def close(self) -> None:
        """Ask the ranks to leave; kill those that do not within a few seconds."""
        close_all([self])

    def _detach(self) -> tuple[list, list]:
        """This cluster's processes and pipes, handed to the caller to stop; the cluster is empty."""
        held = (self._procs, self._conns)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._procs, self._conns, self._store, self._finalizer = [], [], None, None
        if getattr(self, "_stacks", None):
            shutil.rmtree(self._stacks, ignore_errors=True)
            self._stacks = None
        return held

    def _kill(self) -> None:
        """Stop the ranks at once: some are stuck, or the world lost a member."""
        _shutdown(*self._detach(), grace=0.0)

    def _start(self, deadline: float) -> None:
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self._kill()  # a worker died while idle: the world is broken, start a new one
        import torch.distributed as dist

        # The store lives in this process (port 0: the OS picks a free one, no race), so every
        # rank is a client and a restart gets a fresh store.
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout))
        procs, conns = [], []
        ctx = _context()
        self._stacks = tempfile.mkdtemp(prefix="autotp-stacks-")   # where a stuck rank writes its stack
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, name=f"autotp-rank{rank}",
                args=(rank, self.world_size, self.backend, store.port, self.timeout,
                      self.collective_timeout, child_end, dict(os.environ),
                      os.path.join(self._stacks, f"rank{rank}.txt")),
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        self._procs, self._conns, self._store = procs, conns, store
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns)

        replies, pending, dead = self._collect(deadline)
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ready"}
        if failed or pending or dead:
            self._kill()
            parts = [f"rank {r} died (exit code {_exit_name(code)})" for r, code in sorted(dead.items())]
            parts += [f"rank {r} did not start within {self.timeout:g} s" for r in sorted(pending)]
            parts += [f"rank {r} raised {rep[1][1]}: {rep[1][2]}\n{rep[1][3]}"
                      for r, rep in sorted(failed.items())]
            hint = ("\n(ranks re-import the __main__ module: a script that starts ranks needs an "
                    "`if __name__ == '__main__':` guard)") if dead else ""
            raise CommError(
                f"LocalCluster({self.world_size}, backend={self.backend!r}) could not start: "
                + "; ".join(parts) + hint
            )

    # ------------------------------------------------------------ tasks

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        task = _pack(fn, args, kwargs)
        self._start(time.monotonic() + self.timeout)
        return self._run(task, _name(fn), time.monotonic() + self.timeout)

    def _run(self, task: bytes, name: str, deadline: float) -> list:
        for conn in self._conns:
            try:
                conn.send_bytes(task)
            except OSError:  # a dead worker: _collect sees its sentinel and reports it
                pass
        try:
            replies, pending, dead = self._collect(deadline)
        except BaseException:  # Ctrl-C while the ranks work: do not leave them running
            self._kill()
            raise
        timed_out = pending and not dead and all(rep[0] == "ok" for rep in replies.values())
        stacks = self._stacks_of(pending) if timed_out else {}
        if pending or dead:
            self._kill()
        if not (pending or dead) and all(rep[0] == "ok" for rep in replies.values()):
            return [replies[r][1] for r in range(self.world_size)]
        error = self._error(name, replies, pending, dead)
        if stacks:
            error.args = (str(error) + "".join(f"\nrank {r} was here (most recent call first):\n{text}"
                                               for r, text in sorted(stacks.items())),)
        raise error

    def _stacks_of(self, ranks: set[int], lines: int = 30) -> dict[int, str]:
        """The Python stacks of ranks that did not finish in time, each rank's main thread's
        innermost ``lines`` frames (faulthandler, on SIGUSR1; where the platform has it)."""
        if not hasattr(signal, "SIGUSR1") or not getattr(self, "_stacks", None):
            return {}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)
        out = {}
        for r in ranks:
            try:
                with open(os.path.join(self._stacks, f"rank{r}.txt")) as f:
                    text = f.read()
            except OSError:
                continue
            current = text.split("\n\n")   # one block per thread, the current one marked
            main = next((b for b in current if b.startswith("Current thread")), current[0])
            out[r] = "\n".join(main.strip().splitlines()[:lines])
        return out

    def _collect(self, deadline: float) -> tuple[dict[int, tuple], set[int], dict[int, Any]]:
        """Wait for one reply per rank: (replies, ranks that never answered, dead ranks' codes)."""
        pending, replies, dead = set(range(self.world_size)), {}, {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = {self._conns[r]: r for r in pending}
            waiting.update({self._procs[r].sentinel: r for r in pending})
            for ready in wait(list(waiting), remaining):
                rank = waiting[ready]
                if rank not in pending:
                    continue
                conn, proc = self._conns[rank], self._procs[rank]
                pending.discard(rank)
                try:  # a rank may have written its reply just before it exited
                    if ready is conn or conn.poll():
                        replies[rank] = _loads_reply(conn.recv_bytes())
                        continue
                except (EOFError, OSError):
                    pass
                proc.join(1.0)
                dead[rank] = proc.exitcode
            if dead or any(rep[0] == "err" for rep in replies.values()):
                # One rank failed: the others may wait forever in a collective it never joins.
                deadline = min(deadline, time.monotonic() + self.error_grace)
        return replies, pending, dead

    def _error(self, name: str, replies: dict, pending: set[int], dead: dict) -> Exception:
        errors = {r: rep[1] for r, rep in replies.items() if rep[0] == "err"}
        notes = []
        if dead:
            lost = ", ".join(f"rank {r} (exit code {_exit_name(c)})" for r, c in sorted(dead.items()))
            notes.append(f"lost {lost} while running {name}")
        if pending:
            why = "after another rank failed" if (errors or dead) else f"within {self.timeout:g} s"
            notes.append(f"ranks {sorted(pending)} did not finish {name} {why} (a rank waiting in "
                         "a collective that another rank never joined does not return)")
        if dead or pending:
            notes.append(self._restart_note)
        if dead or not errors:
            notes += [f"rank {r} raised {e[1]}: {e[2]}" for r, e in sorted(errors.items())]
            return CommError("\n".join(notes))
        # The root cause: an error that is not a CommError (those follow from it), lowest rank.
        rank = min(errors, key=lambda r: (_follows_from_another(errors[r]), r))
        exc, type_name, message, tb = errors[rank]
        text = (f"{message}\n[raised on rank {rank} of {self.world_size} in {name}; "
                f"ranks that failed: {sorted(errors)}]")
        text = "\n".join([text] + notes + [f"--- rank {rank} traceback ---\n{tb}"])
        if isinstance(exc, AutotpError):
            try:
                return type(exc)(text)
            except Exception:  # a subclass with another constructor: say what it was
                pass
        return CommError(f"rank {rank} raised {type_name}: {text}")


# ------------------------------------------------------------------ the rank side

def _worker_main(rank: int, world_size: int, backend: str, port: int, timeout: float,
                 collective_timeout: float, conn: Connection, environ: dict, stack_file: str) -> None:
    # the caller's environment as it is now (a fork server's children inherit the server's, from
    # when it started), then the rank's own variables
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if hasattr(signal, "SIGUSR1"):   # the caller asks for this rank's stack when it does not finish
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # world_size ranks share this machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        from autotp.distributed.faults import register_process

        register_process()  # a roll call can then tell that this rank died
        reply = ("ready", None)
    except BaseException as e:
        conn.send_bytes(_dumps_error(e))
        return
    conn.send_bytes(pickle.dumps(reply))
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if task == _STOP:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            reply = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # report everything, even SystemExit: the caller decides
            reply = _dumps_error(e)
        conn.send_bytes(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Leave without the interpreter's finalization (spawn's exit runs it): a rank that imported
    # torch and transformers spends a second or more of CPU tearing down modules nothing reads.
    # multiprocessing's own exit hooks still run (as its bootstrap would after this function):
    # they release what the rank registered with the resource tracker (torch.compile's locks).
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _follows_from_another(error: tuple) -> bool:
    """A CommError (a lost peer, a disagreement) reports another rank's failure, not its own."""
    exc, type_name = error[0], error[1]
    if exc is not None:
        return isinstance(exc, CommError)
    return type_name in ("CommError", "DisagreementError", "LostRankError")


def _pack(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise ConfigError(
            f"cannot send {fn!r} to the ranks ({type(e).__name__}: {e}): fn must be a "
            "module-level function, and its arguments must pickle"
        ) from e


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _dumps_error(e: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    exc = None
    if isinstance(e, AutotpError):  # sent whole, so that the caller can raise the same type
        try:
            pickle.loads(pickle.dumps(e))
            exc = e
        except Exception:
            pass
    return pickle.dumps(("err", (exc, type(e).__name__, str(e), tb)))


def _loads_reply(blob: bytes) -> tuple:
    try:
        return pickle.loads(blob)
    except Exception as e:  # e.g. a result whose class this process cannot import
        return ("err", (None, type(e).__name__, f"could not unpickle the rank's reply: {e}", ""))


def _exit_name(code) -> str:
    if code is not None and code < 0:
        try:
            return f"{code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return str(code)


def close_all(clusters) -> None:
    """Close several clusters at once: every rank is asked to leave before any is waited for, so
    that their exits (a second or two each: the process group's teardown, the interpreter's)
    overlap instead of adding up."""
    procs, conns = [], []
    for cluster in clusters:
        p, c = cluster._detach()
        procs += p
        conns += c
    _shutdown(procs, conns)


def _shutdown(procs: list, conns: list[Connection], grace: float = 5.0) -> None:
    """Stop workers politely (``grace`` seconds), then by force: never leave a rank behind."""
    for conn in conns:
        try:
            conn.send_bytes(_STOP)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
