"""What a rank keeps of the model it parallelized: gpt2-medium built in memory on each of two
gloo ranks, ``autotp.parallelize(model, tp=2)``, then dropped by the caller (``del model``).

    .venv/bin/python benchmarks/dropped_model.py [--baseline DIR]   # writes benchmarks/dropped_model.md

Each rank reports its resident set size (VmRSS): after importing torch, transformers and autotp;
with the model built (float32, random weights); after parallelize; after ``del model`` and a
garbage collection; and after a call of a signature parallelize did not capture (eval, with an
attention mask: a new program is captured then). ``--baseline DIR`` runs the same ranks on the
autotp package of another checkout (``git worktree add DIR REV``) first, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from common import machine, publish, status_mb

TP = 2
CONFIG = dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257)   # gpt2-medium


def on_rank() -> dict:
    import gc

    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    row = {"imported": status_mb("VmRSS")}
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    row["model_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    row["built"] = status_mb("VmRSS")
    pm = autotp.parallelize(model, TP)
    row["parallelized"] = status_mb("VmRSS")
    row["held_mb"] = sum(p.numel() * p.element_size() for p in pm.local_parameters().values()) / 1e6
    del model
    gc.collect()
    row["dropped"] = status_mb("VmRSS")
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    pm.eval()
    with torch.no_grad():
        pm(input_ids=ids, attention_mask=torch.ones_like(ids))
    row["new_call"] = status_mb("VmRSS")
    row["rank"] = pm.mesh.tp_rank
    return row


def _measure(package_root: str) -> list[dict]:
    """The ranks' rows, run on the autotp package under ``package_root``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, str(Path(__file__).parent)]))
    done = subprocess.run([sys.executable, __file__, "--ranks"], env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="a checkout of another autotp, measured beside this one")
    parser.add_argument("--baseline-label", default="baseline", help="what the baseline is (a commit), for the table")
    parser.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks:
        from autotp.testing import launch

        print(json.dumps(launch(on_rank, TP, timeout=1500.0)))
        return 0
    here = str(Path(__file__).resolve().parent.parent)
    runs = ([(args.baseline_label, _measure(args.baseline))] if args.baseline else []) + [("this tree", _measure(here))]
    shown = [a if a != args.baseline else "DIR" for a in sys.argv[1:]]   # no machine's path in the file
    lines = [
        "# What a rank keeps of the model it parallelized: gpt2-medium, tp=2",
        "",
        f"Command: `.venv/bin/python benchmarks/dropped_model.py{' ' + shlex.join(shown) if shown else ''}` "
        "(writes this file"
        + ("; DIR: `git worktree add DIR <baseline>`)." if args.baseline else ")."),
        f"{machine()} {TP} local gloo ranks on the CPU, float32; each rank builds the model itself.",
        "",
        "RSS (VmRSS, MB) of each rank: after the imports; with the model built; after "
        "`autotp.parallelize(model, tp=2)`; after `del model` and `gc.collect()`; after an eval call with an "
        "attention mask (a signature parallelize did not capture: its program is captured then). *held*: the "
        "bytes of the parameters the rank holds; *dropped - imported - held*: what the rank keeps besides its "
        "shards once the caller has dropped the model (the programs, the allocator's slack, and before the "
        "shape twin the whole serial model, which later captures read).",
        "",
        "| autotp | rank | model MB | imported | built | parallelized | dropped | new call | held MB | "
        "dropped - imported - held |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in runs:
        for r in sorted(rows, key=lambda r: r["rank"]):
            lines.append(f"| {label} | {r['rank']} | {r['model_mb']:.0f} | {r['imported']:.0f} | {r['built']:.0f} | "
                         f"{r['parallelized']:.0f} | {r['dropped']:.0f} | {r['new_call']:.0f} | {r['held_mb']:.0f} | "
                         f"{r['dropped'] - r['imported'] - r['held_mb']:.0f} |")
    publish(lines, Path(__file__).with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
