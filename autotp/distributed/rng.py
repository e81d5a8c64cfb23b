"""Random numbers for dropout in the rewritten graph (Megatron's RNG tracker).

A replicated tensor must be dropped out with the *same* mask on every rank of the TP group, or
the copies stop being copies (and replicated parameters drift apart); each rank's shard of a
sharded tensor needs a mask of its *own*, or the ranks drop the same positions of different
data. A :class:`RNGTracker` holds two generator states per rank, advanced by every use:

* ``replicated``: seeded alike on every TP rank (the DP rank is mixed in, so data-parallel
  replicas draw different masks for their different batches);
* ``sharded``: seeded with the TP rank mixed in as well.

The rewrite wraps every op that draws random numbers (``dropout``, attention with
``dropout_p``) in a :class:`RandomOp` node that runs it under the state its output placement
calls for. The process's own generator is untouched: user code around the model draws what
it always drew. A captured training graph has ``train=True`` baked into its dropout calls;
``pm.eval()`` reaches the RandomOp nodes, which then skip dropout, as the serial model would.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

#: ops whose result depends on the generator (train-mode dropout inside attention included)
RANDOM_OPS = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
              torch.ops.aten.bernoulli.p, torch.ops.aten.scaled_dot_product_attention.default}

# Megatron's offset between the data-parallel and the tensor-parallel seed.
_SHARDED_OFFSET = 2718
_DP_STRIDE = 7919


def draws_random(target: Any, args: tuple, kwargs: dict) -> bool:
    if target is torch.ops.aten.scaled_dot_product_attention.default:
        p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        return isinstance(p, (int, float)) and p > 0
    if target is torch.ops.aten.dropout.default:
        return bool(args[2]) and args[1] > 0   # dropout(x, p, train)
    return target in RANDOM_OPS


class RNGTracker:
    """The two generator states of one rank; ``fork(kind)`` runs a block under one of them."""

    def __init__(self, seed: int, tp_rank: int, dp_rank: int, device: torch.device, counter_based: bool = False):
        self.device = torch.device(device)
        self.states: dict[str, tuple] = {}
        #: counter-based draws (below) in eager calls too, not only under torch.compile
        self.counter_based = counter_based
        #: per kind: a 32-bit key and a count of draws so far: a tensor, so that a compiled
        #: program advances it without a recompile, replaced by a new one at each draw rather
        #: than advanced in place (torch 2.11's AOTAutograd saves a graph input the program
        #: mutates for the backward, which then recomputed the masks from the advanced count:
        #: compiled gradients 0.44-0.83 off, measured on GPT-2 with dropout, aot_eager and
        #: inductor)
        self.keys: dict[str, int] = {}
        self.salts: dict[str, int] = {}
        self.counters: dict[str, torch.Tensor] = {}
        base = seed + _DP_STRIDE * dp_rank
        for kind, s in (("replicated", base), ("sharded", base + _SHARDED_OFFSET + tp_rank)):
            with self._isolated():
                torch.manual_seed(s)
                self.states[kind] = self._get()
            self.keys[kind] = _mix_int(s & _MASK32)
            self.salts[kind] = _mix_int(self.keys[kind] ^ 0x5BD1E995)
            self.counters[kind] = torch.zeros((), dtype=torch.int64, device=self.device)

    def snapshot(self) -> tuple:
        """Where every stream stands (activation checkpointing's recompute redraws from here)."""
        return dict(self.states), dict(self.counters)   # counters are never changed in place

    def restore(self, snapshot: tuple) -> None:
        states, counters = snapshot
        self.states = dict(states)
        self.counters.update(counters)

    def uniform(self, kind: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Uniform numbers in [0, 1) of ``shape`` from stream ``kind``, counter-based: a hash of
        (the stream's key, its draw count, the element's index), each advancing the count by
        one. Integer arithmetic only, the same in eager and compiled code (traced by
        torch.compile as plain tensor ops, no generator state), and the same on every rank that
        shares the key."""
        call = self.counters[kind]
        self.counters[kind] = call + 1
        n = 1
        for size in shape:
            n *= size
        key = _mix(((call & _MASK32) * _GOLDEN) & _MASK32 ^ self.keys[kind])
        index = torch.arange(n, dtype=torch.int64, device=self.device) & _MASK32
        bits = _mix(_mix(index ^ key) ^ self.salts[kind])
        return (bits.to(torch.float64) * (1.0 / 4294967296.0)).to(dtype).view(shape)

    def _get(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    @contextmanager
    def _isolated(self) -> Iterator[None]:
        saved = self._get()
        try:
            yield
        finally:
            self._set(saved)

    @contextmanager
    def fork(self, kind: str) -> Iterator[None]:
        with self._isolated():
            self._set(self.states[kind])
            yield
            self.states[kind] = self._get()


_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x1E3779B1    # odd and below 2**31: a product with a 32-bit number stays within int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, multipliers below 2**31 so that int64 never
    overflows) of the non-negative 32-bit values in ``x``."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    return int(_mix(torch.tensor(x & _MASK32, dtype=torch.int64)))


def counter_based_op(target: Any, args: tuple, kwargs: dict, tracker: RNGTracker, kind: str) -> Any:
    """``target`` (a random op of :data:`RANDOM_OPS`) with its random numbers drawn from the
    tracker's counter-based stream ``kind``."""
    aten = torch.ops.aten
    if target is aten.dropout.default or target is aten.native_dropout.default:
        x, p = args[0], float(args[1])
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        if not train:
            return x if target is aten.dropout.default else (x, torch.ones_like(x, dtype=torch.bool))
        keep = tracker.uniform(kind, tuple(x.shape), torch.float32) >= p
        out = x * keep / (1.0 - p) if p < 1 else torch.zeros_like(x)
        return out if target is aten.dropout.default else (out, keep)
    if target is aten.bernoulli.p:
        x, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        return (tracker.uniform(kind, tuple(x.shape), torch.float32) < p).to(x.dtype)
    if target is aten.scaled_dot_product_attention.default:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        bound = dict(zip(names, args), **kwargs)
        q, k = bound["query"], bound["key"]
        p = float(bound.get("dropout_p", 0.0))
        shape = tuple(q.shape[:-1]) + (k.shape[-2],)
        keep = tracker.uniform(kind, shape, torch.float32) >= p
        # the math kernel takes the mask instead of drawing one (what sdpa computes, mask given)
        return aten._scaled_dot_product_attention_math(
            q, k, bound["value"], bound.get("attn_mask"), p, bool(bound.get("is_causal", False)),
            dropout_mask=keep, scale=bound.get("scale"), enable_gqa=bool(bound.get("enable_gqa", False)))[0]
    raise NotImplementedError(f"no counter-based form of {target}")


def _without_dropout(target: Any, args: tuple, kwargs: dict) -> Any:
    aten = torch.ops.aten
    if target is aten.dropout.default:
        return args[0]
    if target is aten.native_dropout.default:
        return args[0], torch.ones_like(args[0], dtype=torch.bool)
    if target is aten.scaled_dot_product_attention.default:
        if len(args) > 4:
            args = args[:4] + (0.0,) + args[5:]
        else:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return target(*args, **kwargs)
    return target(*args, **kwargs)   # not dropout (bernoulli): eval mode does not change it


class RandomOp(nn.Module):
    """An op that draws random numbers, run under the tracker state ``kind`` (a named node of
    the rewritten graph: ``dropout_replicated_0``, ``dropout_sharded_3``)."""

    def __init__(self, target: Any, state: str, tracker: RNGTracker):
        super().__init__()
        self.target, self.state, self.tracker = target, state, tracker
        self.kind = f"{getattr(target, '_opname', 'random')}_{state}"   # the graph node's name

    def __deepcopy__(self, memo):   # shares the tracker: the states are the rank's, not the copy's
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        return new

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:   # pm.eval(): the capture baked train=True in; dropout is off now
            return _without_dropout(self.target, args, kwargs)
        if torch.compiler.is_compiling() or self.tracker.counter_based:
            # swapping generator states breaks a compiled graph: draw counter-based instead
            return counter_based_op(self.target, args, kwargs, self.tracker, self.state)
        with self.tracker.fork(self.state):
            return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.target}, state={self.state}"
