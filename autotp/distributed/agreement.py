"""Ranks agree before they talk.

Tensor parallelism is SPMD: every rank of a TP group must run the same program, calling the
same collectives in the same order on tensors of the same shapes. When they do not (another
layout on one rank, another autotp or torch version, a batch of another length, two modules
called in another order), the first collective hangs until the timeout or, worse, sums
unrelated tensors. So, before its first real collective, each rank:

* fingerprints what it is about to run (:func:`fingerprint`): the software versions, the plan's
  parameter placements, the plan's collectives, the rewritten graph (nodes, their targets, the
  comm modules with their global shard layouts; local sizes, which legitimately differ between
  ranks of an uneven split, are left out), the captured graph before the rewrite (every
  constant kept: it is the whole model's program, the same on every rank) and, at
  ``parallelize``, a digest of every parameter and buffer as the rank received them
  (:func:`state_entries`), of every tensor attribute the program reads (lifted as a constant:
  :func:`constant_entries`) and which parameters are frozen (:func:`grad_entries`);
* compares the fingerprints with one small all-reduce on the group (:func:`check_agreement`),
  which also agrees on the module's number: its name in every later check.

Each call is checked the same way (:func:`check_call`): which call of which module this rank is
in (forward, or the backward pass of a call), the inputs' names, shapes and dtypes (and,
with ``check_inputs="values"``, a hash of their values), and the state the call runs in (its
``context``: grad mode, autocast, the frozen parameters, the optimizer steps taken). Every
exchange has one shape (see :func:`exchange`), so ranks out of step pair their checks with
each other's and find they differ. When the digests differ, every rank sees it from the same all-reduce, so every rank
then exchanges its entries (two more small collectives) and raises the same
:class:`~autotp.errors.DisagreementError`, saying what differs on which rank. The exchange is
JSON bytes in tensors: nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx

from ..capture.program import op_name
from ..errors import DisagreementError
from .comm import _comm, group_ranks, group_size

__all__ = ["Fingerprint", "fingerprint", "check_agreement", "check_call", "start_call_check", "input_signature",
           "value_digest", "state_entries", "constant_entries", "grad_entries", "exchange", "start_exchange"]

# Digests are cut to 62 bits so that both h and -h fit an int64 (one MAX all-reduce finds min and max).
_BITS = 62


@dataclass(frozen=True)
class Fingerprint:
    """What one rank will run, as named sections of short text entries (compared by digest)."""

    sections: tuple[tuple[str, tuple[str, ...]], ...]

    def digests(self) -> list[int]:
        return [_digest(entries) for _, entries in self.sections]


def _digest(entries: Sequence[str]) -> int:
    h = hashlib.sha256("\n".join(entries).encode()).digest()
    return int.from_bytes(h[:8], "little") >> (64 - _BITS)


# ---------------------------------------------------------------- what a rank will run

def fingerprint(plan: Any, graph_module: fx.GraphModule, captured: fx.Graph | None = None,
                state: Sequence[str] = (), constants: Sequence[str] = (), grads: Sequence[str] = ()) -> Fingerprint:
    """``captured``: the capture's graph, before the rewrite: the whole model's program, the same
    on every rank, so its integer constants are compared too (the rewritten graph's differ
    legitimately, as local sizes). ``state``: :func:`state_entries` of the model as this rank
    received it; ``constants``: :func:`constant_entries` of the capture; ``grads``:
    :func:`grad_entries` of the model."""
    from ..version import __version__

    software = (f"autotp {__version__}", f"torch {torch.__version__}")
    params = tuple(f"{fqn}: {p!r} {list(plan.shapes.get(fqn, ()))}" for fqn, p in sorted(plan.params.items()))
    params += (f"tp={plan.tp}",)
    params += tuple(f"alias {a} -> {b}" for a, b in sorted(plan.aliases.items()))
    params += tuple(f"output {k} kept split {v!r}" for k, v in sorted(plan.sharded_outputs.items()))
    comms = tuple(f"{c.kind} of {c.tensor} for {c.consumer} ({c.src} -> {c.dst})" for c in plan.comms)
    sections = [
        ("the software versions differ", software),
        ("the plan's parameter placements differ", params),
        ("the plan's collectives differ", comms),
        ("the rewritten graphs differ", tuple(_graph_entries(graph_module))),
    ]
    if captured is not None:
        sections.append(("the captured graphs differ (the model's forward computes something else on some "
                         "ranks: an integer or other constant that depends on the rank?)",
                         tuple(_graph_entries(captured, sizes=False))))
    if state:
        sections.append(("the model's parameters and buffers differ (as each rank received them, before "
                         "slicing: a digest of each tensor's values)", tuple(state)))
    if constants:
        sections.append(("the tensor attributes the model's forward reads differ (neither parameter nor buffer: "
                         "lifted as constants of the program; a digest of each one's values)", tuple(constants)))
    if grads:
        sections.append(("the parameters' requires_grad differ (a parameter frozen on some ranks only: the "
                         "others would run collectives of its backward alone)", tuple(grads)))
    return Fingerprint(tuple(sections))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _graph_entries(gm: fx.GraphModule | fx.Graph, sizes: bool = True) -> list[str]:
    """One entry per node; ``sizes``: every int written as ``int``, as the local sizes of a
    rewritten graph differ between the ranks of an uneven split."""
    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, bool) or not isinstance(a, int) or not sizes:
            return _ADDRESS.sub("", repr(a))   # an object's address differs per process, not its meaning
        return "int"

    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    out = []
    for node in graph.nodes:
        args = pytree.tree_map(arg, (node.args, dict(node.kwargs)))
        if node.op == "call_module" and isinstance(gm, fx.GraphModule):
            mod = gm.get_submodule(node.target)
            layout = f"{mod.shard!r} of {mod.full_size}" if hasattr(mod, "shard") else ""
            target = f"{type(mod).__name__}({layout})"
        elif node.op == "call_function":
            target = op_name(node.target)
        else:
            target = str(node.target)
        out.append(f"{node.op} {node.name} = {target}{args}")
    return out


def input_signature(names: Sequence[str], values: Sequence[Any], digest_values: bool = False) -> tuple[str, ...]:
    """The part of a call's inputs every rank of a TP group must share: names, shapes, dtypes;
    with ``digest_values`` also a digest of each tensor's values (``check_inputs="values"``)."""
    out = tuple(f"{n}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor)
                else f"{n}: {v!r}" for n, v in zip(names, values))
    if digest_values:
        out += tuple(f"{n} values: {value_digest(v)}" for n, v in zip(names, values) if isinstance(v, torch.Tensor))
    return out


#: bytes hashed at once: bounds the host copy a large tensor on an accelerator is read through
_CHUNK_BYTES = 1 << 24
_BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_digest(t: torch.Tensor) -> str:
    """A hash of ``t``'s bytes: SHA-256 of its shape, dtype and every element's bits in order
    (read to the host in chunks). Equal tensors give equal digests on any device and thread
    count; tensors that differ anywhere (another seed, another batch, two values swapped) give
    others, as a hash does. Bits, not values: -0.0 and 0.0, or two NaNs of other payloads,
    count as different."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_BITS_OF[flat.element_size()])   # integers: numpy has no bfloat16 or float8
    h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype}".encode())
    step = max(1, _CHUNK_BYTES // bits.element_size())
    for start in range(0, bits.numel(), step):
        h.update(bits[start:start + step].cpu().numpy().data)
    return h.hexdigest()[:16]


def state_entries(model: torch.nn.Module) -> tuple[str, ...]:
    """``name: digest`` of each parameter and buffer of ``model`` that holds values (not on the
    meta device: from_pretrained's ranks read one checkpoint), tied ones once."""
    seen: dict[int, str] = {}
    out = []
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        if t is None or t.is_meta:
            continue
        if id(t) not in seen:
            seen[id(t)] = value_digest(t)
        out.append(f"{name}: {seen[id(t)]}")
    return tuple(out)


def constant_entries(constants: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """``name: digest`` of each tensor constant a capture lifted (a plain tensor attribute of the
    model, neither parameter nor buffer, that its forward reads) and that holds values."""
    return tuple(f"{name}: {value_digest(t)}" for name, t in sorted(constants.items())
                 if isinstance(t, torch.Tensor) and not t.is_meta)


def grad_entries(model: torch.nn.Module) -> tuple[str, ...]:
    """``name: trainable`` or ``name: frozen`` for each parameter of ``model``: a parameter frozen on
    some ranks only would leave the others running collectives of its backward alone."""
    return tuple(f"{name}: {'trainable' if p.requires_grad else 'frozen'}"
                 for name, p in model.named_parameters(remove_duplicate=False))


# ---------------------------------------------------------------- comparing
#
# Every agreement is the same exchange, whatever it checks: one all-reduce(MAX) of three int64,
# [h, -h, n], where h digests what this rank is doing (``doing``: "call 3 of GPT2LMHeadModel
# #1", "the backward pass of call 2 of ...", "autotp.parallelize") and what it checks, and n
# is a number the ranks agree on by taking the largest (the module creation counter at
# parallelize). Only when the digests differ do the ranks exchange their entries (two more
# small collectives, on every rank alike). One shape for every exchange matters: ranks that
# are out of step (one in a forward's check, another in a backward's, or in another module's)
# pair their exchanges with each other's and find they differ, instead of pairing tensors of
# other sizes (a gloo abort) or one check with a model's own collective.

def exchange(doing: str, sections: Sequence[tuple[str, Sequence[str]]], group, number: int = 0,
             note: str = "") -> tuple[list[dict] | None, int]:
    """Compare ``doing`` and ``sections`` across ``group``: (None, agreed number) where every
    rank has the same, else (every rank's ``{"doing", "sections", "note"}`` in group-rank order,
    the number). ``number``: this rank's; the agreed one is the largest. ``note``: what this rank
    tells the others where they differ (not compared)."""
    return start_exchange(doing, sections, group, number, note).result()


class PendingExchange:
    """An exchange whose all-reduce is issued (:func:`start_exchange`) and not yet read: the
    control group's collective runs on its backend's own thread while this one goes on (a call's
    forward is queued meanwhile), and :meth:`result` reads it. Every rank must read it, at the same
    point of its program: a disagreement exchanges the entries (two more collectives)."""

    def __init__(self, doing: str, sections: Sequence[tuple[str, Sequence[str]]], group, number: int,
                 note: str = ""):
        self.doing, self.sections, self.group, self.number, self.note = doing, sections, group, number, note
        self.both = self.work = None
        if group is None or group_size(group) == 1:
            return
        h = _digest([doing] + [f"{title}\n" + "\n".join(entries) for title, entries in sections])
        # on the host: the control group is gloo (or the TP group where that is a CPU backend),
        # so reading the result never waits for an accelerator's queue
        self.both = torch.tensor([h, -h, number], dtype=torch.int64)
        with _comm("all_reduce(max) in autotp's agreement check", group):
            self.work = dist.all_reduce(self.both, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result(self) -> tuple[list[dict] | None, int]:
        if self.both is None:
            return None, self.number
        if self.work is not None:
            with _comm("all_reduce(max) in autotp's agreement check", self.group):
                self.work.wait()
            self.work = None
        agreed = int(self.both[2])
        if int(self.both[0]) == -int(self.both[1]):
            return None, agreed
        mine = {"doing": self.doing, "sections": [[title, list(entries)] for title, entries in self.sections],
                "note": self.note}
        return _all_gather_json(mine, self.group), agreed


def start_exchange(doing: str, sections: Sequence[tuple[str, Sequence[str]]], group, number: int = 0,
                   note: str = "") -> PendingExchange:
    """:func:`exchange`, issued now and read by the result's ``result()``."""
    return PendingExchange(doing, sections, group, number, note)


def _ranks(group) -> list[int]:
    return list(group_ranks(group) or range(group_size(group)))


def _out_of_step(per_rank: list[dict], ranks: list[int], what: str) -> DisagreementError | None:
    """The error for ranks that are doing different things (another call, another module, a
    backward pass on some ranks and a forward on others), or None where they do the same."""
    doing = [[r["doing"]] for r in per_rank]
    if all(d == doing[0] for d in doing):
        return None
    return DisagreementError(
        f"ranks {ranks} of the {what} are in different calls, so their collectives would pair up wrongly "
        f"(silently wrong results, or a process abort where the sizes differ): "
        f"{_first_difference(doing, ranks).removeprefix('entry 0: ')}. The ranks call their parallel modules, "
        "or run their backward passes, in a different order: every rank of the group must make the same "
        "calls in the same order (an exception caught on one rank that skips a call or a loss.backward() "
        "there, or control flow that depends on the rank, is the usual cause).")


_SAME_MODEL = ("Every rank must call autotp.parallelize with the same model (the same weights: seed the model's "
               "construction, or load it from one checkpoint), tp, layout or plan, profile and planning sizes, "
               "under the same autotp and torch versions.")


def check_agreement(fp: Fingerprint, group, what: str = "before their first collective",
                    doing: str = "autotp.parallelize", number: int = 0, advice: str = _SAME_MODEL,
                    note: tuple[str, str] = ("", "")) -> int:
    """Raise DisagreementError on every rank of ``group`` unless all fingerprints are equal.
    Returns the largest ``number`` of the group's ranks (see :func:`exchange`). ``note``: a
    title and this rank's text, listed with the other ranks' in the error (not compared)."""
    per_rank, agreed = exchange(doing, fp.sections, group, number, note[1])
    if per_rank is None:
        return agreed
    ranks = _ranks(group)
    stepped = _out_of_step(per_rank, ranks, "TP group")
    if stepped is not None:
        raise stepped
    lines = []
    for i, (title, _) in enumerate(fp.sections):
        entries = [r["sections"][i][1] if i < len(r["sections"]) else [] for r in per_rank]
        if any(e != entries[0] for e in entries):
            lines.append(f"- {title}: {_first_difference(entries, ranks)}")
    if note[0]:
        notes = [[r.get("note", "")] for r in per_rank]
        lines.append(f"- {note[0]}: " + (_first_difference(notes, ranks).removeprefix("entry 0: ")
                                         if any(n != notes[0] for n in notes) else f"every rank: {notes[0][0]!r}"))
    raise DisagreementError(
        f"ranks {ranks} of the TP group disagree {what}, so their collectives would hang or mix "
        "unrelated tensors:\n" + "\n".join(lines) + "\n" + advice
    )


#: what to do where the state a call runs in (its ``context``) differs, by the entry's first words
CONTEXT_ADVICE = {
    "grad mode": "enable or disable gradients (torch.no_grad, torch.inference_mode) alike on every rank",
    "autocast": "enter torch.autocast with the same device type and dtype on every rank, or on none",
    "frozen": "freeze or unfreeze (requires_grad_) the same parameters on every rank",
    "optimizer steps": "every rank must step its optimizer over this module's parameters as often: an opt.step() "
                       "made or skipped on some ranks only leaves their replicated parameters other than the "
                       "others' (every later result silently wrong). Load one checkpoint on every rank "
                       "(autotp.runtime.dcp.load), or make the ranks' replicas equal and call pm.check_replicas(), "
                       "to go on",
    "generate": "pass generate the same arguments on every rank (max_new_tokens, eos_token_id, pad_token_id, the "
                "sampling settings): a rank that decodes fewer steps leaves the others waiting in the next one",
    "replicated": "the replicated parameters drifted apart since the ranks last agreed on them (an optimizer with "
                  "other settings on some ranks, a gradient or a parameter changed on one rank only): every later "
                  "result would be silently wrong. Load one checkpoint on every rank (autotp.runtime.dcp.load), or "
                  "make the replicas equal and call pm.check_replicas(), to go on",
}


def check_call(doing: str, signature: tuple[str, ...], group, what: str = "TP group",
               context: tuple[str, ...] = ()) -> None:
    """Raise DisagreementError on every rank of ``group`` unless all are ``doing`` the same
    call (module, call number, forward or backward) with inputs of one ``signature``, in one
    ``context`` (entries ``key: value`` whose key is one of :data:`CONTEXT_ADVICE`'s).
    ``what`` names the group in the error (a TP group, or a pipeline's stages and their TP ranks).
    Where the contexts differ, the error's ``context_keys`` holds the keys that do."""
    start_call_check(doing, signature, group, what, context).finish()


class PendingCallCheck:
    """:func:`check_call` issued (:func:`start_call_check`) and finished later by :meth:`finish`,
    which raises what check_call raises. A ParallelModule with ``deferred_checks`` issues a call's
    check as the call starts and finishes it before handing back the outputs (the backward pass's
    check: as that pass starts, finished as it ends), so its host never stops for the group in
    between; see docs/errors.md for what that leaves open."""

    def __init__(self, doing: str, signature: tuple[str, ...], group, what: str, context: tuple[str, ...] = ()):
        self.group, self.what = group, what
        sections = [("inputs", signature)] + ([("context", context)] if context else [])
        self.pending = start_exchange(doing, sections, group)

    def finish(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        per_rank, _ = pending.result()
        if per_rank is not None:
            _raise_call_disagreement(per_rank, self.group, self.what)


def start_call_check(doing: str, signature: tuple[str, ...], group, what: str = "TP group",
                     context: tuple[str, ...] = ()) -> PendingCallCheck:
    return PendingCallCheck(doing, signature, group, what, context)


def _raise_call_disagreement(per_rank: list[dict], group, what: str) -> None:
    ranks = _ranks(group)
    stepped = _out_of_step(per_rank, ranks, what)
    if stepped is not None:
        raise stepped
    entries = [r["sections"][0][1] if r["sections"] else [] for r in per_rank]
    if any(e != entries[0] for e in entries):
        raise DisagreementError(
            f"the inputs of this call differ across the {what} of ranks {ranks}: "
            f"{_first_difference(entries, ranks)}. Every rank of a {what} must get the same batch "
            f"(split data across data-parallel groups, not across the ranks of one {what})."
        )
    states = [r["sections"][1][1] if len(r["sections"]) > 1 else [] for r in per_rank]
    i = _first_index(states)
    keys = sorted({next((k for k in CONTEXT_ADVICE if e[i].startswith(k)), e[i]) for e in states if i < len(e)})
    error = DisagreementError(
        f"ranks {ranks} of the {what} would run this call in different states, so their collectives would pair "
        f"up wrongly (a process abort, or silently wrong results): {_first_difference(states, ranks)}. "
        + "; ".join(CONTEXT_ADVICE.get(k, "") for k in keys) + ".")
    error.context_keys = frozenset(keys)
    raise error


def _all_gather_json(value: Any, group) -> list[Any]:
    """Every rank's ``value`` (JSON-able), as a list in group-rank order."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(group_size(group))]
    with _comm("all_gather of sizes in autotp's agreement check", group):
        dist.all_gather(sizes, size, group=group)
    width = max(int(s) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    received = [torch.empty_like(padded) for _ in sizes]
    with _comm("all_gather of fingerprints in autotp's agreement check", group):
        dist.all_gather(received, padded, group=group)
    return [json.loads(bytes(r[: int(s)].tolist()).decode()) for r, s in zip(received, sizes)]


def _first_index(per_rank: list[list[str]]) -> int:
    """The index of the first entry the ranks' lists differ in (the shorter lists' length where one
    is a prefix of the others)."""
    length = max(len(e) for e in per_rank)
    for i in range(length):
        if len({e[i] if i < len(e) else None for e in per_rank}) > 1:
            return i
    return length


def _first_difference(per_rank: list[list[str]], ranks: list[int]) -> str:
    """Where the ranks' entry lists first part ways, with each distinct entry and its ranks."""
    length = max(len(e) for e in per_rank)
    for i in range(length):
        seen: dict[str, list[int]] = {}
        for rank, entries in zip(ranks, per_rank):
            seen.setdefault(entries[i] if i < len(entries) else "(nothing: fewer entries)", []).append(rank)
        if len(seen) > 1:
            shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v!r}"
                              for v, r in seen.items())
            return f"entry {i}: {shown}"
    return "the same entries in another order"


# ---------------------------------------------------------------- capture and planning, on every rank or none

def _on_every_rank_or_none(mesh: Any, step: Any) -> Any:
    """Run ``step`` (a capture, made on TP rank 0 and sent to the others by
    autotp/distributed/captures.py, or a plan, searched on TP rank 0 and rebuilt by the others,
    autotp/distributed/plans.py: no collective of the model) and tell the TP
    group whether it worked, with one small all-reduce, before anyone waits in a collective of
    the model. A
    rank that failed raises its own error; the others raise at once, with its message and
    class (one more small exchange, on failure only), instead of waiting for it until the
    collective timeout. A rank that died meanwhile is named (the collectives go through the
    fault handling of autotp.distributed.collectives)."""
    from .. import errors

    try:
        value, failure = step(), None
    except Exception as exc:   # re-raised below, after the group has been told
        value, failure = None, exc
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is not None:
        ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int64)
        with _comm("all_reduce(min) telling the TP group whether capture and planning worked", group):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if ok.item() == 0:
            said = None if failure is None else [type(failure).__name__, str(failure)]
            per_rank = _all_gather_json(said, group)
            if failure is None:
                rank, (kind, text) = next((r, e) for r, e in zip(mesh.tp_ranks, per_rank) if e is not None)
                error = getattr(errors, kind, None)
                if not (isinstance(error, type) and issubclass(error, errors.AutotpError)):
                    error, text = DisagreementError, f"{kind}: {text}"
                raise error(f"rank {rank} failed to capture or plan the model: {text}")
    if failure is not None:
        raise failure
    return value


def _agreed_seed(mesh: Any, seed: int | None) -> int:
    """One dropout seed for the whole TP group: ``seed``, or TP rank 0's initial seed."""
    seed = torch.initial_seed() % (1 << 62) if seed is None else int(seed)
    group = getattr(mesh, "control_group", None) or mesh.tp_group
    if group is None:
        return seed
    value = torch.tensor([seed], dtype=torch.int64)
    with _comm("broadcast of the dropout seed", group):   # a rank lost here is named
        dist.broadcast(value, src=mesh.tp_ranks[0], group=group)
    return int(value.item())
