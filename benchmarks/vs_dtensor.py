"""Training step time of one Llama three ways, side by side in one run on local gloo ranks:
serial (the HF model in one process), autotp (``autotp.parallelize``) and PyTorch's own DTensor
tensor parallelism (``parallelize_module`` with the Megatron plan written by hand, torchtitan style).

    .venv/bin/python benchmarks/vs_dtensor.py --out benchmarks/vs_dtensor.md

Every rank builds the same random ``LlamaForCausalLM`` (float32, no hub) once per version, on the
same batch. Before timing, each version's loss and every gradient (gathered to full size) are
compared with the serial model's, and the collectives of one forward and one backward are counted
with ``torch.distributed.tensor.debug.CommDebugMode``. Then the versions take turns step by step
(serial, DTensor, autotp, autotp pinned to the Megatron layout): ``--warmup`` steps, then
``--steps`` timed ones. A step is ``zero_grad``, forward with labels and backward (timed), then an
AdamW step (timed separately). Every rank runs each version, serial included, on ``--threads``
torch thread(s), so each ratio compares programs on the same share of the machine; a barrier
starts every step. Reported: per rank the median and the best over the timed steps, then the
slowest rank.

DTensor's plan (torchtitan's, without sequence parallelism): q/k/v/gate/up ``ColwiseParallel``,
o/down ``RowwiseParallel``, ``embed_tokens`` ``RowwiseParallel(input_layouts=Replicate())``,
``lm_head`` ``ColwiseParallel(output_layouts=Replicate())`` (full logits on every rank, the HF
loss on them). autotp returns full logits too (``gather_logits=True``, its default) and computes
the loss vocab-parallel. Two more versions keep the logits split by vocabulary: DTensor's
``loss_parallel()`` (``lm_head`` output ``Shard(-1)``, HF's loss run on the DTensor logits inside
the context) and autotp pinned with ``gather_logits=False``; their "vs DTensor" ratio is against
DTensor's loss-parallel version.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MEGATRON_LLAMA, dtensor_llama, machine, publish  # noqa: E402

MEGATRON = MEGATRON_LLAMA
VERSIONS = ("serial", "dtensor", "autotp", "autotp_pinned", "dtensor_lp", "autotp_pinned_lp")
LABEL = {"serial": "serial (HF model, 1 process)", "dtensor": "DTensor parallelize_module (Megatron plan)",
         "autotp": "autotp (its own plan)", "autotp_pinned": "autotp (Megatron layout pinned)",
         "dtensor_lp": "DTensor, loss parallel (logits stay split)",
         "autotp_pinned_lp": "autotp pinned, `gather_logits=False` (logits stay split)"}
BASELINE = {"serial": "dtensor", "dtensor": "dtensor", "autotp": "dtensor", "autotp_pinned": "dtensor",
            "dtensor_lp": "dtensor_lp", "autotp_pinned_lp": "dtensor_lp"}


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=max(256, args.seq),
                       tie_word_embeddings=False, attention_dropout=0.0)


def _model(args: argparse.Namespace):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config(args)).float().train()


def _dtensor_model(args: argparse.Namespace, tp: int, loss_parallel: bool = False):
    from torch.distributed.device_mesh import init_device_mesh

    return dtensor_llama(_model(args), init_device_mesh("cpu", (tp,)), loss_parallel)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _comm_counts(fn) -> dict:
    """Collectives of one forward and of its backward, by op name."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as fwd:
        loss = fn()
    with CommDebugMode() as bwd:
        loss.backward()
    name = lambda op: str(op).split(".")[-1].rstrip("_")  # noqa: E731
    return {"forward": {name(k): v for k, v in fwd.get_comm_counts().items()},
            "backward": {name(k): v for k, v in bwd.get_comm_counts().items()}}


def run_rank(args: argparse.Namespace, tp: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*backward hook", category=UserWarning)  # CommDebugMode's hooks
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    models, setup_s = {}, {}
    for v in VERSIONS:
        start = time.perf_counter()
        if v == "serial":
            models[v] = _model(args)
        elif v.startswith("dtensor"):
            models[v] = _dtensor_model(args, tp, loss_parallel=v.endswith("_lp"))
        else:
            models[v] = autotp.parallelize(_model(args), tp, batch=args.batch, seq=args.seq,
                                           layout=MEGATRON if "pinned" in v else None,
                                           gather_logits=not v.endswith("_lp"))
        setup_s[v] = time.perf_counter() - start
    layouts = {v: dict(models[v].plan.param_layouts) for v in ("autotp", "autotp_pinned")}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}

    def fwd(v):
        return models[v](input_ids=ids, labels=ids).loss

    def fwd_bwd(v):
        # DTensor's loss parallelism is a context around the loss and its backward.
        with loss_parallel() if v == "dtensor_lp" else contextlib.nullcontext():
            loss = fwd(v)
            loss.backward()
        return loss

    # Equal work: the same loss and gradients as the serial model (first call also captures autotp).
    check = {}
    ref_loss = fwd("serial")
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in models["serial"].named_parameters()}
    for v in VERSIONS[1:]:
        loss = _full(fwd_bwd(v))
        grads = dict(models[v].named_parameters())
        check[v] = {"loss": abs(loss.item() - ref_loss.item()),
                    "grad": max((_full(grads[n].grad) - g).abs().max().item() for n, g in ref_grads.items()),
                    "missing": sorted(set(ref_grads) - set(grads))}
    for m in models.values():
        m.zero_grad(set_to_none=True)
    counts = {}
    for v in VERSIONS:
        with loss_parallel() if v == "dtensor_lp" else contextlib.nullcontext():
            counts[v] = _comm_counts(lambda v=v: fwd(v))
    for m in models.values():
        m.zero_grad(set_to_none=True)

    times = {v: {"step": [], "adamw": []} for v in VERSIONS}
    for step in range(args.warmup + args.steps):
        for v in VERSIONS:
            dist.barrier()
            start = time.perf_counter()
            opts[v].zero_grad(set_to_none=True)
            fwd_bwd(v)
            mid = time.perf_counter()
            opts[v].step()
            end = time.perf_counter()
            if step >= args.warmup:
                times[v]["step"].append(1e3 * (mid - start))
                times[v]["adamw"].append(1e3 * (end - mid))
    stats = {v: {k: {"median": statistics.median(t), "best": min(t)} for k, t in times[v].items()}
             for v in VERSIONS}
    return {"rank": dist.get_rank(), "ref_loss": ref_loss.item(), "check": check, "counts": counts,
            "stats": stats, "layouts": layouts, "setup_s": setup_s}


def _counts_text(c: dict) -> str:
    def one(d):
        return ", ".join(f"{k} {n}" for k, n in sorted(d.items())) or "none"
    return f"fwd: {one(c['forward'])}; bwd: {one(c['backward'])}"


def _layout_text(layouts: dict) -> str:
    """Distinct roles by parameter-name suffix (layer index dropped)."""
    import re

    seen: dict[str, set] = {}
    for name, role in layouts.items():
        key = re.sub(r"\.\d+\.", ".N.", name)
        seen.setdefault(key, set()).add(str(role))
    return "; ".join(f"`{k}` {'/'.join(sorted(r))}" for k, r in seen.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from autotp.testing import launch

    load_start = os.getloadavg()
    per_tp = {tp: launch(run_rank, tp, args, tp, timeout=3600) for tp in args.tp}
    load = os.getloadavg()

    lines = [
        "# Training step: autotp vs PyTorch DTensor tensor parallelism vs serial",
        "",
        f"Command: `.venv/bin/python benchmarks/vs_dtensor.py {' '.join(sys.argv[1:])}`",
        "",
        machine() + f" `nproc` {os.cpu_count()}. Load average (1, 5, 15 min) at the start "
        f"{load_start[0]:.1f}, {load_start[1]:.1f}, {load_start[2]:.1f}, at the end {load[0]:.1f}, {load[1]:.1f}, "
        f"{load[2]:.1f} (the machine is shared with other work). Each rank runs {args.threads} torch thread(s); "
        f"world = tp ranks on {os.cpu_count()} cores, so tp 4 is oversubscribed (4 processes on "
        f"{os.cpu_count()} cores: times include waiting for a core, every version alike).",
        "",
        f"Model: `LlamaForCausalLM`, {args.layers} layers, hidden {args.hidden}, intermediate {args.ffn}, "
        f"{args.heads} heads ({args.kv_heads} KV heads), vocab {args.vocab}, untied embeddings, float32, random "
        f"weights. Batch {args.batch} x seq {args.seq}, labels = inputs. Step = zero_grad + forward + backward; "
        f"AdamW step timed separately. {args.warmup} warm-up steps, {args.steps} timed; the versions take turns "
        "step by step in the same rank processes, a barrier before each step. Figures: median and best over the "
        "timed steps per rank, the slowest rank shown.",
        "",
    ]
    for tp, results in per_tp.items():
        r0 = results[0]
        worst = {v: {k: {s: max(r["stats"][v][k][s] for r in results) for s in ("median", "best")}
                     for k in ("step", "adamw")} for v in VERSIONS}
        lines += [f"## tp {tp}", "",
                  f"Equal work: serial loss {r0['ref_loss']:.6f}; largest difference over ranks from the serial "
                  "loss / any gradient element (float32; one ulp of the loss is about 1e-6): "
                  + "; ".join(f"{v} {max(r['check'][v]['loss'] for r in results):.1e} / "
                              f"{max(r['check'][v]['grad'] for r in results):.1e}" for v in VERSIONS[1:]) + ".",
                  "",
                  "| version | fwd+bwd ms median | fwd+bwd ms best | AdamW ms median | vs DTensor, same logits: median "
                  "(best) | vs serial: median (best) | collectives per step (rank 0, CommDebugMode) |",
                  "|---|---|---|---|---|---|---|"]
        for v in VERSIONS:
            w = worst[v]
            b, s = worst[BASELINE[v]]["step"], worst["serial"]["step"]
            lines.append(f"| {LABEL[v]} | {w['step']['median']:.1f} | {w['step']['best']:.1f} | "
                         f"{w['adamw']['median']:.1f} | {w['step']['median'] / b['median']:.2f}x "
                         f"({w['step']['best'] / b['best']:.2f}x) | {w['step']['median'] / s['median']:.2f}x "
                         f"({w['step']['best'] / s['best']:.2f}x) | {_counts_text(r0['counts'][v])} |")
        lines += ["", f"autotp's own plan: {_layout_text(r0['layouts']['autotp'])}.", "",
                  "Set-up s (rank 0: building each version's model and parallelizing it; the first "
                  "autotp.parallelize in a process captures the model with torch.export, the later ones "
                  "reuse that capture): "
                  + ", ".join(f"{v} {r0['setup_s'][v]:.1f}" for v in VERSIONS) + ".", ""]
    lines += [
        "## Reading the table", "",
        "- Collectives: DTensor's `ColwiseParallel` turns each module's input into a replicated DTensor on its "
        "own, so in backward each of q, k, v, gate and up all-reduces its own input gradient: 5 all-reduces per "
        "layer, plus one for `lm_head`. autotp's Megatron `f` sums the three (two) branch gradients first and "
        "all-reduces once per attention (MLP) block: 2 per layer, plus one for `lm_head`. Forward, both issue "
        "one all-reduce after o_proj and down_proj (`g`) and one for a vocab-split embedding. autotp computes "
        "the loss vocab-parallel (2 all-reduces of b x s numbers: the row max, then the sum of exps with the "
        "target's logit), with full logits too, beside their all-gather; DTensor computes the HF loss on the "
        "gathered logits, or under `loss_parallel()` with 3 all-reduces. Each autotp call also all-reduces 2 "
        "numbers to check that the ranks got inputs of one signature (`pm.check_inputs = False` skips it).",
        "- autotp's own plan splits the untied input embedding by hidden columns (an all-gather of b x s x h) "
        "instead of by vocabulary (an all-reduce, DTensor's `RowwiseParallel` embedding); everything else is "
        "the Megatron layout, so the pinned version differs from it only in the embedding.",
        "- \"vs serial\" compares one rank's step with the serial model's step in the same process on the same "
        "share of the machine (ideal: 1/tp plus communication). The machine is shared with other sessions' "
        "work (see the load average), so medians carry others' load: the best-step ratios in parentheses are "
        "the less disturbed ones. At tp 4 the 4 ranks share 2 cores, so a collective also waits for the "
        "other ranks to be scheduled.",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
