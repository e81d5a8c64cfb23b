"""What a rank reads to the host: in eager the read itself; under torch.compile one opaque op.

An expert layer whose rank runs its own experts' rows alone reads a few numbers to the host once
(the bounds of its rows, the all-to-all's split sizes: ``autotp.distributed.experts``); they size
every tensor of the layer after them. In eager that is a ``tolist`` (or a ``nonzero``, whose size
the host reads). Under ``torch.compile`` with dynamo's defaults such a read breaks the graph:
dynamo's shape environment takes data-dependent sizes only when ``fullgraph=True`` or
``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops`` are set
(``torch/_dynamo/output_graph.py``: the ``ShapeEnv``'s ``allow_scalar_outputs`` and
``allow_dynamic_output_shape_ops``), and so does a custom op whose fake implementation asks
``ctx.new_dynamic_size()``, which checks the same flag (``torch/_library/fake_impl.py``). The flag
is there so that dynamo may break the graph rather than carry an unbacked size; the trace a
break would cut is the one ``fullgraph=True`` makes, the program proved under it
(``tests/e2e/test_compile.py``). So these reads are two ops of autotp's own, ``autotp::host_ints``
(a 1-D integer tensor's values) and ``autotp::nonzero_rows`` (the positions of a 1-D mask's true
entries), whose fake implementations allocate their unbacked sizes from the trace's shape
environment as ``new_dynamic_size`` does (``torch._library.fake_impl.allocate_size``), without
the flag's check: dynamo sees one opaque op, never a ``.tolist()``, and traces the layer into the
one graph under its defaults. The eager path calls neither op: the same ``tolist`` and
``nonzero`` as before, no dispatch of a custom op, no copy.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("autotp", "FRAGMENT")
_LIB.define("host_ints(Tensor values) -> SymInt[]")
_LIB.define("nonzero_rows(Tensor mask) -> Tensor")


@torch.library.impl(_LIB, "host_ints", "CompositeExplicitAutograd")
def _host_ints(values: torch.Tensor) -> list[int]:
    return values.tolist()


@torch.library.impl(_LIB, "nonzero_rows", "CompositeExplicitAutograd")
def _nonzero_rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero().squeeze(1)


def _unbacked_size() -> torch.SymInt:
    """A new data-dependent size (an unbacked SymInt, at least 0) in the trace's shape environment:
    what ``ctx.new_dynamic_size()`` makes, less its check of dynamo's capture flags (see the
    module's docs). Without a shape environment (a fake mode of no dynamic shapes) the context's
    own call raises as torch does, and dynamo breaks the graph there, still correct."""
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is None:
        return ctx.new_dynamic_size()
    from torch._library.fake_impl import allocate_size

    return allocate_size(shape_env)


@torch.library.register_fake("autotp::host_ints", lib=_LIB)
def _host_ints_fake(values: torch.Tensor) -> list[torch.SymInt]:
    return [_unbacked_size() for _ in range(int(values.shape[0]))]


@torch.library.register_fake("autotp::nonzero_rows", lib=_LIB)
def _nonzero_rows_fake(mask: torch.Tensor) -> torch.Tensor:
    return mask.new_empty((_unbacked_size(),), dtype=torch.long)


def host_ints(values: torch.Tensor) -> list[int]:
    """The values of a 1-D integer tensor on the host (``values.tolist()``); under torch.compile
    unbacked sizes of one opaque op (``autotp::host_ints``), each at least 0: use it for counts
    and bounds of rows only."""
    if torch.compiler.is_compiling():
        return torch.ops.autotp.host_ints(values)
    return values.tolist()


def nonzero_rows(mask: torch.Tensor) -> torch.Tensor:
    """The positions of a 1-D bool mask's true entries (``mask.nonzero().squeeze(1)``); under
    torch.compile one opaque op (``autotp::nonzero_rows``) whose count is an unbacked size."""
    if torch.compiler.is_compiling():
        return torch.ops.autotp.nonzero_rows(mask)
    return mask.nonzero().squeeze(1)
