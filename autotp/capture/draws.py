"""Random draws under capture: a 0-d ``torch.rand`` is a draw that a Python comparison answers
wherever every draw would answer it alike (LayerDrop at probability 0), and refused otherwise.
"""
from __future__ import annotations

from typing import Any

import torch


class RandomBranchError(Exception):
    """A 0-d ``torch.rand`` draw decides a Python branch whose outcome depends on the draw."""


class _UnitDraw:
    """What a 0-d ``torch.rand`` gives a model while it is captured: a draw from [0, 1) that a
    Python comparison with a number answers wherever every draw would answer it alike, and
    refuses to answer otherwise. LayerDrop (OPT, BART, Whisper... under transformers before
    5.2x) skips a layer ``if torch.rand([]) < layerdrop`` in training: with ``layerdrop`` 0
    (their default) no draw is below it, so the layer always runs, exactly; export alone cannot
    branch on a traced value. Any other use of the draw (arithmetic, a tensor op) fails the
    capture."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _answer(self, op: str, p: Any, below: bool | None, above: bool | None) -> bool:
        """``below``: the answer when p <= 0 (or p < 0 for op <=, >), ``above``: when p >= 1."""
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            low = p <= 0 if op in ("<", ">=") else p < 0
            if low and below is not None:
                return below
            if p >= 1 and above is not None:
                return above
        raise RandomBranchError(
            f"a Python branch on a random draw ({self.where}: torch.rand([]) {op} {p!r}) that differs from "
            "draw to draw, such as LayerDrop with a probability above 0: a captured program cannot branch "
            "on it. Set that probability to 0 (for LayerDrop, config.layerdrop = 0) or capture in eval mode")

    def __lt__(self, p: Any) -> bool:
        return self._answer("<", p, False, True)

    def __le__(self, p: Any) -> bool:
        return self._answer("<=", p, False, True)

    def __gt__(self, p: Any) -> bool:
        return self._answer(">", p, True, False)

    def __ge__(self, p: Any) -> bool:
        return self._answer(">=", p, True, False)

    def __bool__(self) -> bool:
        raise RandomBranchError(f"a 0-d random draw used as a truth value ({self.where}): a captured program "
                                "cannot branch on it")

    def __float__(self) -> float:
        raise RandomBranchError(f"a 0-d random draw used as a number ({self.where}): a captured program would "
                                "fix one draw for every call")


class _UnitDraws(torch.overrides.TorchFunctionMode):
    """Under capture, ``torch.rand([])`` (a single draw, no generator or out) is a
    :class:`_UnitDraw`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand and kwargs.get("out") is None and kwargs.get("generator") is None \
                and not kwargs.get("requires_grad"):
            size = args[0] if len(args) == 1 else kwargs.get("size", None) if not args else None
            if isinstance(size, (list, tuple)) and len(size) == 0:
                import traceback

                frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                              if "site-packages/torch" not in f.filename), None)
                return _UnitDraw(f"{frame.filename}:{frame.lineno}" if frame else "in forward")
        return func(*args, **kwargs)
