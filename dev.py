#!/usr/bin/env python3
"""The repo's two commands, on a machine that has only python3.

    python3 dev.py main     # parallelize GPT-2 on local gloo ranks, print the plan, check it
    python3 dev.py test     # the test suite (fast tier; add pytest args after `test`)

Both create `.venv/` in the repo on first use and install what they need: a CPU build of
torch pinned first (an unpinned torch pulls a multi-GB CUDA build), then autotp with its test
extra in editable mode. The install is redone only when pyproject.toml changes.
"""
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
TORCH_PIN = "torch==2.13.0"


def ensure_env() -> None:
    stamp = VENV / ".autotp-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH_PIN.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return
    if not PY.exists():
        print("creating .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    have_torch = subprocess.run([str(PY), "-c", "import torch"], capture_output=True).returncode == 0
    if not have_torch:
        print(f"installing {TORCH_PIN} (CPU build) ...", flush=True)
        subprocess.check_call(pip + [TORCH_PIN])
    print("installing autotp[test] ...", flush=True)
    subprocess.check_call(pip + ["-e", f"{ROOT}[test]"])
    stamp.write_text(want)


def workers(args: list[str]) -> list[str]:
    """pytest-xdist's workers for the suite: two where there are two cores (a rank task leaves a
    core idle about a third of the time: measured 156% CPU on 2 cores in one process), one file
    per worker at a time (a file's tests share their ranks and captures), in the order the suite
    collects them (tests/conftest.py puts the longest files first; xdist's own order, most tests
    first, left the longest files to the end, one worker idle: 4.5 of 18 minutes). None when the
    caller chose (-n, -p no:xdist) or names a test (one file: workers would only add start-up)."""
    chose = any(a.startswith(("-n", "--numprocesses")) or a.endswith("no:xdist") for a in args)
    names_tests = any(not a.startswith("-") and (a.endswith(".py") or "::" in a) for a in args)
    if chose or names_tests or (os.cpu_count() or 1) < 2:
        return []
    return ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"main", "test"}:
        print(__doc__)
        return 2
    ensure_env()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if argv[0] == "main":
        cmd = [str(PY), str(ROOT / "examples" / "gpt2_tp.py"), *argv[1:]]
    else:
        cmd = [str(PY), "-m", "pytest", "-q", *workers(argv[1:]), *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
