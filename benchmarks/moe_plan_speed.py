"""How long ``autotp plan NAME --tp 8 --full`` takes for the MoE models at real size (meta device,
default profile, the CLI's float32), split into capture, the main solves, the experts note and the
rest, for this tree and another checkout side by side: one fresh process per (tree, model), the
trees alternating, so both meet the same load. Each process times ``autotp.cli.main`` in process
(imports excluded) and writes the printed plan, which must be byte-identical between the trees
for every model whose plan the change between them was not meant to change.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/moe_plan_speed.py --before /tmp/base --out benchmarks/moe_plan_speed.md
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time

from common import publish

#: published MoE configurations; DeepSeek-V3 with 4 layers of its shape (3 dense, 1 MoE), as
#: benchmarks/model_zoo.py plans it
MODELS = {"mixtral-8x7b": None, "qwen3-30b-a3b": None, "deepseek-v3": 4, "gpt-oss-20b": None}


def child(name: str) -> None:
    """In a fresh process: the CLI's plan of ``name``, timed by part; JSON on stdout's last line."""
    import autotp.api as api
    from autotp.planner import planner
    from autotp import cli

    spent: dict = {}

    def timed(module, attr, key):
        original = getattr(module, attr)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
        setattr(module, attr, wrapper)

    timed(api, "capture_model", "capture")
    timed(planner, "solve", "solve")
    timed(planner, "experts_note", "experts_note")
    argv = ["plan", name, "--tp", "8", "--full"] + (["--layers", str(MODELS[name])] if MODELS[name] else [])
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.main(argv)
    total = time.perf_counter() - start
    note = next((line.strip() for line in out.getvalue().splitlines() if "note: experts" in line), "")
    print(json.dumps({"total": total, **spent, "plan": out.getvalue(), "note": note}))


def run(tree: str, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name], capture_output=True,
                          text=True, env=env, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout's root, timed beside this one")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    this = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": args.before, "after": this} if args.before else {"after": this}
    rows = []
    for i, name in enumerate(args.models.split(",")):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        got = {key: run(trees[key], name) for key in order}
        rows.append((name, got))
        print(name, {k: {m: round(v, 2) for m, v in r.items() if isinstance(v, float)} for k, r in got.items()},
              file=sys.stderr)
    part = lambda r: " / ".join(f"{r.get(k, 0.0):.2f}" for k in ("total", "capture", "solve", "experts_note"))  # noqa: E731
    cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# MoE plans at tp 8: time",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/moe_plan_speed.py'] + sys.argv[1:])}`",
        "",
        f"Machine: {cpu} cores (`nproc`); torch {__import__('torch').__version__}; Python {platform.python_version()}; "
        f"load average {os.getloadavg()[0]:.1f} at the end. One fresh process per tree and model, the trees "
        "alternating; seconds inside the process (imports excluded): `autotp plan NAME --tp 8 --full` "
        "(deepseek-v3: `--layers 4`), of which capture, the main solves (every `solve` the planner calls: "
        "the CLI plans again without the memory limit where the model does not fit it) and the experts note.",
        "",
        "| model | " + " | ".join(f"{k}: total / capture / solves / experts note s" for k in trees) +
        (" | speed-up | printed plan |" if len(trees) > 1 else " |"),
        "|---|" + "---|" * len(trees) + ("---|---|" if len(trees) > 1 else ""),
    ]
    for name, got in rows:
        cells = [part(got[k]) for k in trees]
        if len(trees) > 1:
            same = "identical" if got["before"]["plan"] == got["after"]["plan"] else "differs"
            cells += [f"{got['before']['total'] / got['after']['total']:.1f}x", same]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Experts notes:", ""]
    for name, got in rows:
        for k in trees:
            lines.append(f"- {name}, {k}: {got[k]['note']}")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
