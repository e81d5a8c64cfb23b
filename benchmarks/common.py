"""What every benchmark script shares: the machine line of its result file, and publishing."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """`Machine: ...` for a result file: cores, CPU model, Python and torch versions."""
    import torch

    return (f"Machine: {os.cpu_count()} cores, {cpu_model()} ({platform.machine()}); "
            f"Python {platform.python_version()}, torch {torch.__version__}.")


def status_mb(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident) of this process image, in MB. Not
    ru_maxrss: across fork+exec that keeps the parent's peak, and the parent may hold a model."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no {field} in /proc/self/status")


def timed_step(model, opt, batch) -> float:
    """Seconds of one training step: zero_grad, forward, backward, the optimizer's step."""
    import time

    start = time.perf_counter()
    opt.zero_grad()
    model(**batch).loss.backward()
    opt.step()
    return time.perf_counter() - start


#: the line of a result file from which it is written by hand: :func:`publish` keeps it and what
#: follows as they are when a script's ``--out`` rewrites the file (a reading, re-run notes)
KEPT = "<!-- written by hand from here on: --out keeps it -->"


def kept_lines(path: str | Path | None) -> list[str]:
    """The lines of ``path`` (an earlier ``--out``) from its :data:`KEPT` line on, the marker
    included (a marker naming its script, as older files have, counts too); none where the file
    or the marker is absent."""
    if not path or not Path(path).exists():
        return []
    lines = Path(path).read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(KEPT.split(":")[0] + ":")]
    return lines[marks[0]:] if marks else []


def publish(lines: list[str], path: str | Path | None) -> None:
    """Print the result and write it to ``path`` (the script's .md beside it, by convention),
    the part of an earlier ``path`` written by hand (:data:`KEPT` on) kept after it."""
    kept = kept_lines(path)
    if kept:   # one blank line between the run and the part written by hand
        lines = list(lines)
        while lines and not lines[-1]:
            lines.pop()
        lines += ["", *kept]
    text = "\n".join(lines) + "\n"
    print(text)
    if path:
        Path(path).write_text(text)


#: autotp's layout pins for a HF Llama in Megatron's layout (what the DTensor plan below does)
MEGATRON_LLAMA = {"*q_proj.weight": "column", "*k_proj.weight": "column", "*v_proj.weight": "column",
                  "*o_proj.weight": "row", "*gate_proj.weight": "column", "*up_proj.weight": "column",
                  "*down_proj.weight": "row", "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab"}


def dtensor_llama(model, mesh, loss_parallel: bool = False):
    """PyTorch's own tensor parallelism of a HF Llama with Megatron's plan written by hand
    (torchtitan's, without sequence parallelism): q/k/v/gate/up ``ColwiseParallel``, o/down
    ``RowwiseParallel``, a vocab-split embedding, and an ``lm_head`` whose logits are gathered
    (or, ``loss_parallel``, kept split as a DTensor for ``loss_parallel()``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    head = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
            else ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": head})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"self_attn.q_proj": ColwiseParallel(),
                                         "self_attn.k_proj": ColwiseParallel(),
                                         "self_attn.v_proj": ColwiseParallel(),
                                         "self_attn.o_proj": RowwiseParallel(),
                                         "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    return model
