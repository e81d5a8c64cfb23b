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

    def __init__(self, seed: int, tp_rank: int, dp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, tuple] = {}
        base = seed + _DP_STRIDE * dp_rank
        for kind, s in (("replicated", base), ("sharded", base + _SHARDED_OFFSET + tp_rank)):
            with self._isolated():
                torch.manual_seed(s)
                self.states[kind] = self._get()

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
        with self.tracker.fork(self.state):
            return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.target}, state={self.state}"
