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


def publish(lines: list[str], path: str | Path | None) -> None:
    """Print the result and write it to ``path`` (the script's .md beside it, by convention)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if path:
        Path(path).write_text(text)
