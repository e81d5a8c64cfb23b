"""The PTD-P paper's table by autotp's cost model: Narayanan et al. (2021), "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1 (GPT models
1.7B-1T on DGX A100 nodes, the published t, p, GPU count and batch, and the teraFLOP/s per GPU
they achieved), predicted from autotp's own tensor-parallel plans.

    .venv/bin/python benchmarks/ptdp_table.py --out benchmarks/ptdp_table.md

For each row a GPT-2-architecture model of the row's hidden size, heads and vocabulary (51,200;
sequence 2,048) is captured on the meta device at 2 and 3 layers and planned by autotp at the
row's t (micro-batch 1, bfloat16, the a100-dgx profile): the difference prices one layer, the
rest what lies outside the layers. autotp.cost_model.pipeline puts the layers into the row's
pipeline (interleaved 1F1B as the paper's section 5.1 ran it, the chunks per GPU the fastest the
layers allow; full recomputation, micro-batch 1), adds the stage-to-stage and data-parallel
traffic over each GPU's 200 Gb/s InfiniBand link and the optimizer, and counts the paper's
model FLOPs (its eq. 3). The same model then searches (t, p, d, micro-batch) for the row's GPU
count and batch and reports its fastest choice beside the published one.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, publish  # noqa: E402

# billions of parameters, heads, hidden, layers, t, p, GPUs, batch, published teraFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
VOCAB, SEQ, PEAK = 51200, 2048, 312e12


@functools.lru_cache(maxsize=None)
def layer_cost(hidden: int, heads: int, t: int, micro_batch: int, gemm_fraction: float):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from autotp.capture_expand import find_stacks
    from autotp.cost_model import PROFILES
    from autotp.ptd import layer_cost as priced

    hf_logging.set_verbosity_error()
    profile = dataclasses.replace(PROFILES["a100-dgx"], flops=PEAK * gemm_fraction)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_head=heads, n_layer=4, vocab_size=VOCAB,
                                           n_positions=SEQ)).to(torch.bfloat16)
    # autotp.ptd.layer_cost: the plans of the model cut to 2 and 3 layers (what autotp.plan(model,
    # world=N) prices with)
    return priced(model, find_stacks(model)[0], t, micro_batch, SEQ, profile), profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--gemm-fraction", type=float, nargs="+", default=[0.5, 0.6, 0.75],
                        help="matmul rates to price with, as fractions of the A100's 312 TFLOP/s bf16 peak "
                             "(0.5 is the a100-dgx profile's own)")
    args = parser.parse_args()
    from autotp.cost_model.pipeline import Cluster, choose, memory, model_flops, step_time
    from autotp.ptd import VIRTUAL

    start = time.time()
    lines = [
        "# PTD-P: the paper's Table 1 by autotp's cost model", "",
        f"Command: `.venv/bin/python benchmarks/ptdp_table.py{' --out ' + args.out if args.out else ''}`", "",
        machine() + " Nothing here runs a model: every figure is predicted (meta-device plans).", "",
        "Published: Narayanan et al. (2021), Table 1 (DGX A100 80 GB nodes, 8 per node, NVSwitch inside, "
        "8 x 200 Gb/s InfiniBand out; sequence 2048, vocabulary 51,200; the teraFLOP/s count the paper's "
        "eq. 3, recomputation included). Predicted: autotp's plan of one layer at the published t (micro-batch 1, "
        "bfloat16) on the a100-dgx profile, with its matmul rate set to the fraction of the 312 TFLOP/s peak "
        "in the column's title, put into the paper's interleaved 1F1B pipeline with full recomputation "
        "(autotp.cost_model.pipeline).", "",
    ]
    for frac in args.gemm_fraction:
        lines += [f"## Matmuls at {frac:.2f} of peak", "",
                  "| params (B) | h | layers | published t, p, d | micro-batches | 1F1B TF/GPU | interleaved: chunks "
                  "per GPU | step s | bubble | predicted TF/GPU | published TF/GPU | gap | memory GiB/GPU | "
                  "search's choice (t, p, d, micro-batch, chunks) | its TF/GPU |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (size, heads, h, layers, t, p, gpus, batch, published) in ROWS:
            cost, profile = layer_cost(h, heads, t, 1, frac)
            cluster = Cluster(profile)
            d = gpus // (t * p)
            flops = model_flops(batch=batch, seq=SEQ, layers=layers, hidden=h, vocab=VOCAB)
            # the paper's section 5.1: "we use the interleaved pipeline schedule with the scatter/gather
            # optimization enabled"; it does not list the chunks per GPU, so the cost model picks them
            # among those the row's layers allow (every divisor of layers / p), as autotp.plan would
            runs = []
            for v in [v for v in range(1, layers // p + 1) if (layers // p) % v == 0 and (v == 1 or p > 1)]:
                step, bubble, parts = step_time(cost, cluster, layers=layers, t=t, p=p, d=d, batch=batch,
                                                micro_batch=1, virtual=v, balanced=False)   # Megatron's even cut
                mem = memory(cost, cluster, layers=layers, p=p, micro_batch=1, virtual=v,
                             micro_batches=parts["micro_batches"], balanced=False)
                runs.append((step, v, bubble, parts, mem))
            plain = runs[0]
            fits = [r for r in runs if r[4] <= profile.memory] or runs
            step, v, bubble, parts, mem = min(fits[1:] or fits[:1])
            tf = flops / step / gpus / 1e12
            best = choose(lambda tt, mb: layer_cost(h, heads, tt, mb, frac)[0], cluster, gpus=gpus, layers=layers,
                          batch=batch, seq=SEQ, hidden=h, vocab=VOCAB, micro_batches=(1, 2), virtual=VIRTUAL)
            pick = (f"{best[0].t}, {best[0].p}, {best[0].d}, {best[0].micro_batch}, {best[0].virtual}" if best
                    else "none fits")
            pick_tf = f"{best[0].flops_per_gpu / 1e12:.0f}" if best else ""
            lines.append(f"| {size} | {h} | {layers} | {t}, {p}, {d} | {parts['micro_batches']} | "
                         f"{flops / plain[0] / gpus / 1e12:.0f} | {v if v > 1 else '- (p = 1)'} | {step:.2f} | "
                         f"{bubble:.1%} | {tf:.0f} | {published} | {tf / published - 1:+.0%} | {mem / 2**30:.0f} | "
                         f"{pick} | {pick_tf} |")
            print(lines[-1], flush=True)
        lines.append("")
    lines += [
        "## The gaps", "",
        "- **The schedule.** Section 5.1 of the paper: \"we use the interleaved pipeline schedule with the "
        "scatter/gather optimization enabled\". Its chunks per GPU are not listed, so each published row is "
        "priced at the count the cost model finds fastest among those its layers allow (every divisor of "
        "layers / p; the \"1F1B TF/GPU\" column is the same row without interleaving). It lifts the six "
        "pipelined rows by 1-7% (1T: bubble 10.9% -> 5.8% with its 2 layers per GPU in 2 chunks); the "
        "interleaved schedule's longer warm-up holds about 1 + 1/chunks times 1F1B's layer inputs on the "
        "first GPU, counted in the memory column (1T: 191 layer inputs instead of 128, 51 GiB).",
        "- **One matmul rate for every GEMM.** The profile prices every matrix product at one rate, and the "
        "table depends on that rate more than on anything else. At 0.50 of peak (the a100-dgx profile's own, "
        "set before this table was made) eight rows of ten are within 15% (-2% to -14%) and the two largest "
        "are not (530B -20%, 1T -21%). At 0.60 every row is within 15% (+14% to -6%) -- but 0.60 is the rate "
        "of the three scanned here that fits this table best: a one-parameter fit to the rows it is compared "
        "with, not a prediction made before seeing them. What no flat rate removes is the trend: the predicted "
        "teraFLOP/s per GPU stay nearly flat across the rows (121-134 at 0.50) while the published rise from "
        "137 to 163, so at any one rate the small rows come out high against the large ones.",
        "- **What the trend is.** The paper's own explanation (section 5.1): \"GPU utilization improves as the "
        "models get larger (larger matrix multiplications)\". autotp's cost model has no size-dependent GEMM "
        "rate for the A100 to price that with: the one measured curve it has (an H200, `benchmarks/gpu.md`: "
        "248 TFLOP/s at 2048 x 1024 x 1024, 700-811 from hidden 4096 up, 695 at 8192) is flat over these rows' "
        "shapes, and would slow the smallest row's products by about 4% (a fixed 12 us per product fits "
        "it). What the model does price is small here: memory-bound ops (attention is one fused product) "
        "are 5-15% of a layer, the TP all-reduces shrink as h grows (bytes per layer grow as h, work as "
        "h^2/t), the stage-to-stage sends use the paper's scatter/gather (1/t of the boundary per InfiniBand "
        "card), and the data-parallel all-reduce is 7% of the smallest row's step and 0.2% of the largest. "
        "The ends of the pipeline are priced apart: the first GPU runs the embedding, the last the head and "
        "loss, on top of Megatron's even cut of the layers (at 1T: 1.2 ms and 14.3 ms beside the 221 ms of "
        "a GPU's two layers per micro-batch, recomputation included). Left out, each helping the large "
        "rows: Megatron's fused kernels (below); micro-batch sizes the paper tuned per run and does not "
        "list. Measuring one A100 layer at two sizes would tell the GEMM-rate part from the rest.",
        "- **Kernel fusion.** Megatron fuses bias+GeLU, bias+dropout+add and the scaled masked softmax "
        "(11-19% in the paper's section 5.8); autotp prices each ATen op's memory traffic separately.",
        "- **Overlap.** Nothing is overlapped here: not the data-parallel all-reduce with the pipeline flush, "
        "not the stage-to-stage sends (which the paper's scatter/gather makes small anyway).",
        "- **The search** ranges over t in 1, 2, 4, 8 (inside a node), p dividing the layers, micro-batch 1 "
        "or 2, and 1, 2 or 4 chunks per GPU (what `autotp.plan(model, world=N)` searches); its memory check "
        "counts the training state (16 bytes per parameter) and, with recomputation, each layer's input for "
        "the micro-batches the schedule keeps in flight plus one layer's activations. Where it picks a smaller t or p than the paper, its model finds the TP all-reduces or "
        "the bubble dearer than the paper's runs did; the paper's runs also fixed t = 8 from 18B on by "
        "design (tensor parallelism up to the node size, then pipeline).",
        "",
        f"Run time: {time.time() - start:.0f} s.",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
