"""``autotp plan`` and ``autotp check``: the planner and the equivalence check from a shell.

    autotp plan gpt2-xl --tp 8                       # the plan for gpt2-xl at tp=8 (meta device)
    autotp plan path/to/hf-folder --tp 4 --json      # any HF config folder; the plan as JSON
    autotp check gpt2 --tp 4 --layers 2              # real weights on 4 local gloo ranks vs serial

MODEL is a GPT-2 size (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a folder holding a
HuggingFace ``config.json``. Planning never allocates weights; checking builds random weights
(from the config, optionally with fewer layers) on every rank.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

GPT2_SIZES = {  # name: (layers, heads, hidden); vocabulary 50257
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def load_config(model: str, layers: int | None = None) -> Any:
    from transformers import AutoConfig, GPT2Config

    from .errors import ConfigError

    if model in GPT2_SIZES:
        n_layer, n_head, n_embd = GPT2_SIZES[model]
        config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=50257)
    elif (Path(model) / "config.json").is_file():
        config = AutoConfig.from_pretrained(model)
    else:
        raise ConfigError(f"{model!r} is neither a GPT-2 size ({', '.join(GPT2_SIZES)}) nor a folder with a "
                          "config.json")
    if layers is not None:
        for name in ("n_layer", "num_hidden_layers"):
            if hasattr(config, name):
                setattr(config, name, layers)
    return config


def build(config: Any, meta: bool, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def cmd_plan(args: argparse.Namespace) -> int:
    import autotp

    model = build(load_config(args.model, args.layers), meta=True)
    limit = args.memory_limit * 1024 ** 3 if args.memory_limit else None
    plan = autotp.plan(model, tp=args.tp, batch=args.batch, seq=args.seq, profile=args.profile,
                       gather_logits={"auto": None, "gather": True, "split": False}[args.logits],
                       memory_limit=limit)
    print(plan.to_json() if args.json else plan)
    return 0


def _check_rank(model_name: str, layers: int | None, tp: int, dtype: str, batch: int, seq: int) -> dict:
    import torch

    import autotp
    from autotp.testing import equivalence_errors, keep_loss_precision

    config = load_config(model_name, layers)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, name):
            setattr(config, name, 0.0)   # no dropout: the runs must be comparable
    model = build(config, meta=False, dtype=dtype)
    if dtype == "float64":
        keep_loss_precision(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    pm = autotp.parallelize(model, tp=tp)
    errors = equivalence_errors(model, pm, {"input_ids": ids, "labels": ids})
    worst = max(errors, key=errors.get)
    return {"worst": worst, "error": errors[worst], "plan": str(pm.plan) if pm.mesh.tp_rank == 0 else ""}


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from autotp.testing import TOLERANCE, launch

    results = launch(_check_rank, args.tp, args.model, args.layers, args.tp, args.dtype, args.batch, args.seq,
                     timeout=1800.0)
    print(results[0]["plan"])
    bound = TOLERANCE[getattr(torch, args.dtype)]
    ok = all(r["error"] <= bound for r in results)
    for rank, r in enumerate(results):
        print(f"rank {rank}: worst relative error {r['error']:.2e} at {r['worst']} (bound {bound:.0e})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autotp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan for a model (no weights, no process group)")
    p.add_argument("model")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--profile", default=None, help="device profile (h100-dgx, a100-dgx, v100-dgx2h, cpu-gloo)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--memory-limit", type=float, default=None, help="GiB per rank")
    p.add_argument("--logits", choices=("auto", "gather", "split"), default="auto",
                   help="logits gathered or kept split by vocabulary (auto: split when the call returns a loss)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=cmd_plan)
    c = sub.add_parser("check", help="parallelize on local gloo ranks and compare with the serial model")
    c.add_argument("model")
    c.add_argument("--tp", type=int, required=True)
    c.add_argument("--layers", type=int, default=None)
    c.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq", type=int, default=16)
    c.set_defaults(run=cmd_check)
    args = parser.parse_args(argv)
    from .errors import AutotpError

    try:
        return args.run(args)
    except AutotpError as exc:
        print(f"autotp: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
