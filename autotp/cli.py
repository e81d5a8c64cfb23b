"""``autotp plan`` and ``autotp check``: the planner and the equivalence check from a shell.

    autotp plan gpt2-xl --tp 8                       # the plan for gpt2-xl at tp=8 (meta device)
    autotp plan starcoder-15b --tp 8 --layers 2      # any published configuration of autotp.zoo
    autotp plan path/to/hf-folder --tp 4 --json      # any HF config folder; the plan as JSON
    autotp plan gpt2-xl --tp 8 --full                # every layer's parameters and collectives
    autotp plan gpt2-xl --tp 8 --figure plan.svg     # one layer drawn: splits, placements, f and g
    autotp plan gpt2-xl --tp 4 --diff tp8.json       # what changes against a saved plan
    autotp plan gpt2-xl --tp 8 --no-fuse-activations # GELU planned as the 8 ops HF writes, not aten.gelu
    autotp plan llama-3-8b --tp 8 --no-fuse-norms    # RMSNorm's statistic as HF writes it, not aten.rms_norm
    autotp check llama-3-8b --tp 4 --layers 1        # random weights on 4 local gloo ranks vs serial

MODEL is a published configuration of a family autotp is tested on (``autotp.zoo``: gpt2 ...
gpt2-xl, llama-3-8b, llama-2-7b, mistral-7b, qwen2-7b, gpt-neox-20b, gpt-j-6b, falcon-7b,
falcon-40b, starcoder-15b, opt-6.7b, bert-large, t5-large) or a folder holding a HuggingFace
``config.json`` (a causal LM). Planning never allocates weights; checking builds random weights
(from the config, optionally with fewer layers) on every rank.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

#: config attributes that turn dropout on, zeroed for ``check`` (the runs must be comparable)
_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "hidden_dropout", "attention_dropout", "dropout", "dropout_rate", "activation_dropout")


def load_model(model: str, layers: int | None = None, meta: bool = True, dtype: str = "float32",
               no_dropout: bool = False) -> tuple[Any, str | None]:
    """(the model, its zoo family or None for a folder's causal LM)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from . import zoo
    from .errors import ConfigError

    hf_logging.set_verbosity_error()
    if model in zoo.published_sizes():
        family = zoo.family_of(model).name
        config = zoo.published_config(model, layers)
    elif (Path(model) / "config.json").is_file():
        try:
            family, config = None, AutoConfig.from_pretrained(model)
        except Exception as exc:   # a broken or foreign config.json: one line, not transformers' traceback
            raise ConfigError(f"{Path(model) / 'config.json'} is not a HuggingFace config transformers can read "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None
        if layers is not None:
            for name in ("n_layer", "num_hidden_layers"):
                if hasattr(config, name):
                    setattr(config, name, layers)
    else:
        raise ConfigError(f"{model!r} is neither a published configuration ({', '.join(zoo.published_sizes())}) "
                          "nor a folder with a config.json")
    if no_dropout:
        for name in _DROPOUT:
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
    device = "meta" if meta else "cpu"
    if family is not None:
        return zoo.build(family, config, device=device, dtype=getattr(torch, dtype)), family
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)), None


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _positive(kind: type) -> Any:
    """An argparse type: a positive ``kind`` (int or float)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse, its errors on one line (and exit status 2, as argparse's)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def cmd_plan(args: argparse.Namespace) -> int:
    from .capture import gc_paused

    # The cyclic collector's passes over the heap that importing transformers and building the
    # model leave free nothing a plan needs, in a process that ends with it: at real size they
    # were a quarter of the command's time (qwen3-30b-a3b at tp 8: 5.2-5.6 s with them, 4.2-4.5 s without)
    with gc_paused():
        return _print_plan(args)


def _print_plan(args: argparse.Namespace) -> int:
    import autotp

    model, _ = load_model(args.model, args.layers)
    limit = args.memory_limit * 1024 ** 3 if args.memory_limit else None
    options = dict(tp=args.tp, batch=args.batch, seq=args.seq, profile=args.profile,
                   gather_logits={"auto": None, "gather": True, "split": False}[args.logits],
                   fuse_activations=args.fuse_activations, fuse_norms=args.fuse_norms,
                   fuse_products=args.fuse_products)
    try:
        plan = autotp.plan(model, memory_limit=limit, **options)
    except autotp.MemoryLimitError as exc:
        if limit is not None:   # the caller's own limit: theirs to change
            raise
        # the profile's memory: still show the layout tp would give (as docs/models.md does), said
        # first and kept in the plan's notes, so a plan that cannot train here is never read as one that can
        print(f"autotp: {exc}\nautotp: the plan below is solved without the memory limit", file=sys.stderr)
        plan = (exc.plan_without_limit() if exc.plan_without_limit is not None   # the search done, not again
                else autotp.plan(model, memory_limit=float("inf"), **options))
        plan.notes.insert(0, f"does not fit the profile's memory: the fastest plan needs {exc.needed_bytes / 2**30:.2f} "
                             f"GiB per rank (training state {exc.state_bytes / 2**30:.2f} GiB) against "
                             f"{exc.limit_bytes / 2**30:.2f} GiB; solved without the limit")
    if args.figure:
        plan.figure(args.figure)
        print(f"autotp: drew one layer of the plan to {args.figure}", file=sys.stderr)
    if args.diff:
        from .plan import Plan

        other = Plan.from_json(Path(args.diff).read_text())
        print(other.diff(plan, names=(args.diff, "this plan")))
    elif args.json:
        print(plan.to_json())
    else:
        print(plan.table(full=args.full))
    return 0


def _check_rank(model_name: str, layers: int | None, tp: int, dtype: str, batch: int, seq: int) -> dict:
    import torch

    import autotp
    from autotp.testing import equivalence_errors, keep_loss_precision

    from . import zoo

    model, family = load_model(model_name, layers, meta=False, dtype=dtype, no_dropout=True)
    if dtype == "float64" and (family is None or zoo.family(family).task == "causal"):
        keep_loss_precision(model)
    if family is not None:
        inputs = zoo.example_batch(family, model.config, batch=batch, seq=seq, seed=1)
    else:
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "labels": ids}
    pm = autotp.parallelize(model, tp=tp)
    errors = equivalence_errors(model, pm, inputs)
    worst = max(errors, key=errors.get)
    return {"worst": worst, "error": errors[worst], "plan": str(pm.plan) if pm.mesh.tp_rank == 0 else ""}


def _check_dtype(model_name: str, layers: int | None, asked: str | None) -> str:
    """The dtype ``check`` runs in: ``asked``, else float64 (the tightest comparison) where the
    model runs it on CPU. Experts running torch's grouped product (transformers' default
    ``grouped_mm``) have no float64 kernel on CPU: float32 then, said on stderr; float64 asked
    for them is a ConfigError before any rank starts."""
    from .capture.experts import experts_configs
    from .errors import ConfigError

    if asked == "float32":
        return asked
    model, _ = load_model(model_name, layers)   # on the meta device: no weights
    grouped = sorted({type(c).__name__ for c in experts_configs(model)
                      if getattr(c, "_experts_implementation", None) == "grouped_mm"})
    if not grouped:
        return asked or "float64"
    why = (f"{type(model).__name__}'s experts run experts_implementation='grouped_mm': torch's grouped "
           "product, which has no float64 kernel on CPU")
    if asked == "float64":
        raise ConfigError(f"cannot check in float64: {why}; pass --dtype float32 (or leave --dtype out: float32 is "
                          "chosen for such models)")
    print(f"autotp: checking in float32: {why} (compared at float32's tolerance)", file=sys.stderr)
    return "float32"


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from autotp import zoo
    from autotp.testing import TOLERANCE, launch, preload

    dtype = _check_dtype(args.model, args.layers, args.dtype)   # before any rank starts
    preload("transformers", *zoo.modeling_modules())   # once, not per rank
    results = launch(_check_rank, args.tp, args.model, args.layers, args.tp, dtype, args.batch, args.seq,
                     timeout=1800.0)
    print(results[0]["plan"])
    bound = TOLERANCE[getattr(torch, dtype)]
    ok = all(r["error"] <= bound for r in results)
    for rank, r in enumerate(results):
        print(f"rank {rank}: worst relative error {r['error']:.2e} at {r['worst']} (bound {bound:.0e})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="autotp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan for a model (no weights, no process group)")
    p.add_argument("model")
    p.add_argument("--tp", type=_positive(int), required=True)
    p.add_argument("--layers", type=_positive(int), default=None, help="override the number of layers")
    p.add_argument("--profile", default=None, help="device profile (h100-dgx, a100-dgx, v100-dgx2h, cpu-gloo)")
    p.add_argument("--batch", type=_positive(int), default=8)
    p.add_argument("--seq", type=_positive(int), default=None)
    p.add_argument("--memory-limit", type=_positive(float), default=None,
                   help="GiB per rank (default: the profile's device memory; where no plan fits that, the plan is "
                        "shown solved without it, with a note saying what it needs)")
    p.add_argument("--logits", choices=("auto", "gather", "split"), default="auto",
                   help="logits gathered or kept split by vocabulary (auto: split when the call returns a loss)")
    p.add_argument("--fuse-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="plan an activation written out as pointwise ops (GPT-2's tanh-GELU, a SiLU) as the one "
                        "ATen op that computes it (default); --no-fuse-activations keeps the ops as written")
    p.add_argument("--fuse-norms", action=argparse.BooleanOptionalAction, default=True,
                   help="plan an RMSNorm's statistic written out (pow, mean, add, rsqrt, mul: Llama's) as one "
                        "aten.rms_norm (default); --no-fuse-norms keeps the ops as written")
    p.add_argument("--fuse-products", action=argparse.BooleanOptionalAction, default=True,
                   help="plan sibling products (linears of one input: q, k, v; gate, up) as one product of their "
                        "weights joined where the cost model finds it cheaper (default); --no-fuse-products keeps "
                        "them apart")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--full", action="store_true",
                   help="every parameter of every layer and every collective (default: repeated layers folded)")
    p.add_argument("--figure", metavar="PLAN.svg", default=None,
                   help="draw one repeated layer (its matrices' splits, placements, f and g) as SVG")
    p.add_argument("--diff", metavar="OTHER.json", default=None,
                   help="print what changes from a saved plan to this one (autotp plan ... --json > OTHER.json)")
    p.set_defaults(run=cmd_plan)
    c = sub.add_parser("check", help="parallelize on local gloo ranks and compare with the serial model")
    c.add_argument("model")
    c.add_argument("--tp", type=_positive(int), required=True)
    c.add_argument("--layers", type=_positive(int), default=None)
    c.add_argument("--dtype", choices=["float32", "float64"], default=None,
                   help="default: float64, or float32 for a model whose experts have no float64 kernel on CPU")
    c.add_argument("--batch", type=_positive(int), default=2)
    c.add_argument("--seq", type=_positive(int), default=16)
    c.set_defaults(run=cmd_check)
    args = parser.parse_args(argv)
    from .errors import AutotpError

    try:
        return args.run(args)
    except Exception as exc:   # one line and exit status 2; AUTOTP_TRACEBACK=1 shows where an unforeseen one came from
        if not isinstance(exc, AutotpError) and os.environ.get("AUTOTP_TRACEBACK"):
            raise
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        hint = "" if isinstance(exc, AutotpError) else " (set AUTOTP_TRACEBACK=1 for the traceback)"
        print(f"autotp: {type(exc).__name__}: {text}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
