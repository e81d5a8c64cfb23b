"""The Megatron-LM paper's weak-scaling table, predicted by autotp's planner.

The paper (Shoeybi et al. 2019, Table 1 / Figure 5) grows the model with the GPUs on a DGX-2H
(V100 32GB, NVSwitch): 1.2B on 1 GPU, 2.5B on 2, 4.2B on 4, 8.3B on 8 (hidden 1536/1920/2304/
3072, heads 16/20/24/32, layers 40/54/64/72, vocabulary 51200, seq 1024, batch 8) and reports
weak-scaling efficiency against the 1-GPU run: 100% / 95% / 82% / 77%.

Here each model is captured on the meta device, planned by autotp with the v100-dgx2h profile
at tp = GPUs (logits kept vocab-sharded, as in training), and efficiency is

    (model FLOPs / (GPUs x predicted step)) / (1.2B FLOPs / 1-GPU predicted step)

with model FLOPs = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step (forward + backward, no
recomputation). The planner's memory limit is lifted: the paper fits these models with
activation checkpointing, which autotp's cost model does not price.

    .venv/bin/python benchmarks/weak_scaling.py --out benchmarks/weak_scaling.md
"""
from __future__ import annotations

import argparse
import sys

import torch
from common import publish

PAPER = [  # name, hidden, heads, layers, gpus, reported weak-scaling efficiency
    ("1.2B", 1536, 16, 40, 1, 1.00),
    ("2.5B", 1920, 20, 54, 2, 0.95),
    ("4.2B", 2304, 24, 64, 4, 0.82),
    ("8.3B", 3072, 32, 72, 8, 0.77),
]
VOCAB, SEQ, BATCH = 51200, 1024, 8


def model_flops(h: int, layers: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> float:
    return 72 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))


def recompute_step(plan) -> float:
    """The predicted step with activation checkpointing as the paper ran it: every layer's
    forward runs again in backward, its compute (a third of forward + backward) and its forward
    all-reduces (the g's) included."""
    g_seconds = sum(c.seconds for c in plan.comms if c.kind == "g" and c.module.startswith("transformer.h."))
    return plan.cost["step_s"] + plan.cost["compute_s"] / 3 + g_seconds


def plan_for(hidden: int, heads: int, layers: int, tp: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from autotp.planner import build_plan
    from autotp.capture import capture

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB,
                                           n_positions=SEQ))
    cap = capture(model)
    return build_plan(cap, tp, batch=BATCH, seq=SEQ, profile="v100-dgx2h", gather_logits=False,
                      memory_limit=float("inf"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the markdown result here too")
    args = ap.parse_args()
    rows = []
    for name, hidden, heads, layers, gpus, reported in PAPER:
        plan = plan_for(hidden, heads, layers, gpus)
        flops = model_flops(hidden, layers)
        rows.append((name, hidden, heads, layers, gpus, reported, plan, flops))
        print(f"{name}: step {plan.cost['step_s'] * 1e3:.1f} ms, {plan.comm_counts()}", file=sys.stderr)
    base = rows[0][7] / rows[0][6].cost["step_s"]
    base_rc = rows[0][7] / recompute_step(rows[0][6])
    lines = [
        "# Weak scaling of the Megatron-LM paper's configurations, predicted",
        "",
        f"Command: `{' '.join(['.venv/bin/python'] + sys.argv)}`",
        "",
        "Profile v100-dgx2h (62.5 TFLOP/s per GPU sustained on products, 900 GB/s memory, 150 GB/s ring bus "
        "bandwidth, 2 us per ring step, fp16 bytes); batch 8, seq 1024, vocabulary 51200; logits kept "
        "vocab-sharded; memory limit lifted (see below).",
        "",
        "| model | hidden | heads | layers | GPUs | predicted step ms | compute ms | comm ms | all-reduces/layer fwd+bwd "
        "| TFLOP/s per GPU | predicted efficiency | with recomputation | paper |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, hidden, heads, layers, gpus, reported, plan, flops in rows:
        cost = plan.cost
        per_gpu = flops / gpus / cost["step_s"]
        eff = per_gpu / base
        counts = plan.comm_counts()
        per_layer = (counts.get("f", 0) + counts.get("g", 0) - 2 * (gpus > 1)) / layers
        eff_rc = flops / gpus / recompute_step(plan) / base_rc
        lines.append(f"| {name} | {hidden} | {heads} | {layers} | {gpus} | {cost['step_s'] * 1e3:.1f} | "
                     f"{cost['compute_s'] * 1e3:.1f} | {cost['comm_s'] * 1e3:.1f} | {per_layer:g} | "
                     f"{per_gpu / 1e12:.1f} | {eff:.0%} | {eff_rc:.0%} | {reported:.0%} |")
    lines += [
        "",
        "\"all-reduces/layer\": f + g per layer (2 g forward, 2 f backward): the planner chose Megatron's layout "
        "at every size, with vocab-parallel embedding and cross-entropy.",
        "",
        "## Why the prediction is higher than the paper's figures",
        "",
        "The predicted efficiencies track the paper's trend (communication grows from 0 to about 16% of the step "
        "at 8-way) but sit 1-8 points above it, because the cost model leaves out things that cost the paper's runs "
        "more as the GPUs grow:",
        "",
        "- **Activation checkpointing.** The paper recomputes each layer's forward during backward to fit memory, "
        "which repeats the two forward all-reduces per layer (6 instead of 4 per layer per step). The planner prices "
        "no recomputation (and so lifts the memory limit here). The \"with recomputation\" column adds it by hand "
        "(a third more compute and the layers' g all-reduces again): it lowers the prediction by 1-2 points, "
        "since recomputation adds compute and communication in about the same proportion.",
        "- **Kernel efficiency at smaller shards.** The profile runs every product at one sustained rate; the "
        "paper's 1-GPU run reaches 39 TFLOP/s (30% of peak) while 8-way shards are 8x thinner GEMMs that run "
        "less efficiently. The predicted per-GPU rates (56.7 TFLOP/s at 1 GPU) are above the paper's for the "
        "same reason.",
        "- **Ideal collectives.** Ring all-reduce is priced at the bus bandwidth with 2 us per step and no "
        "contention, and no overlap is assumed either way; NCCL on the DGX-2H in 2019 reached less than this "
        "at 8 GPUs for the 25-50 MB messages of these models.",
        "- **The rest of a step.** The optimizer update is priced (AdamW reads and writes 16 B of state per "
        "parameter held, at memory bandwidth: about 37-44 ms of each step, as parameters per GPU stay about "
        "constant); gradient clipping and data loading are not; "
        "replicated layer norms, dropouts and residual adds are (they do not shrink with tp, which is part of "
        "the predicted loss of efficiency).",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
