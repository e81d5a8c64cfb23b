"""What a hybrid's decode step moves between ranks inside its state-space or linear-attention
mixer: the tiny models of tests/e2e/test_recurrent_states.py (2 layers, float32, tp 2, planned on
meta at batch 64, seq 4096, h100-dgx as the test plans them) and one of tests/e2e/test_mamba_layouts.py
(Bamba at tp 3 with 4 groups of 2 heads, split by group unevenly), the prompt's program planned first
(its cache layout: which states it leaves split), then one decode step replayed under the model's
plan as ``generate`` makes it. Each collective of the step inside layer 0's mixer with the bytes
one rank sends forward at batch 64 (one token a row), and the mixer's totals.

    python benchmarks/decode_step_comms.py --out benchmarks/decode_step_comms.md

Plans, not measurements: nothing runs but capture and planning.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autotp  # noqa: E402
from autotp import zoo  # noqa: E402
from autotp.generation import StepSpec, cache_layout, capture_step  # noqa: E402
from autotp.planner.planner import build_plan  # noqa: E402

#: Qwen3-Next's Gated DeltaNet pinned by head, as the e2e test does (its tiny plan keeps it whole)
DELTANET = {"*linear_attn.in_proj_qkvz.weight": "column", "*linear_attn.in_proj_ba.weight": "column",
            "*linear_attn.out_proj.weight": "row"}
#: case -> (family, extra config, layout, layer 0's mixer module, tp)
CASES = {"bamba": ("bamba", {"mamba_n_groups": 2}, None, "model.layers.0.mamba", 2),
         "qwen3-next": ("qwen3-next", {}, DELTANET, "model.layers.0.linear_attn", 2),
         # 8 Mamba heads in 4 groups at tp 3 (tests/e2e/test_mamba_layouts.py): split by group, unevenly
         "bamba-4-groups-tp3": ("bamba", {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3,
                                          "mamba_n_heads": 8, "mamba_d_head": 6, "mamba_n_groups": 4},
                                None, "model.layers.0.mamba", 3)}
BATCH, SEQ, PROFILE = 64, 4096, "h100-dgx"


def rows(case: str) -> list[str]:
    family, extra, layout, mixer, tp = CASES[case]
    config = zoo.tiny_config(family, layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64, **extra)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    model = zoo.build(family, config, device="meta").eval()
    start = time.time()
    plan = autotp.plan(model, tp=tp, batch=BATCH, seq=SEQ, profile=PROFILE, layout=layout)
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    prompt = StepSpec({"input_ids": ids, "attention_mask": mask})
    cap = capture_step(model, prompt)
    planned = dict(batch=BATCH, profile=PROFILE, seq=SEQ, plan=plan, gather_logits=True)
    prefill, *_ = build_plan(cap, tp, keep_split=prompt.keep_split(cap), **planned)
    cache = cache_layout(cap, prefill, config)
    step = StepSpec({"input_ids": torch.ones(2, 1, dtype=torch.long),
                     "attention_mask": torch.ones(2, 6, dtype=torch.long)}, cache, 5)
    dcap = capture_step(model, step)
    decode, *_ = build_plan(dcap, tp, input_placements=step.input_placements, keep_split=step.keep_split(dcap),
                            **planned)
    seconds = time.time() - start
    shapes = {n.name: tuple(n.meta["val"].shape) for n in dcap.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    states = ", ".join(f"{n} {p!r}" for n, p in cache.placements if n.endswith("_0"))
    inside = [c for c in decode.comms if c.module.startswith(mixer) and c.fwd_bytes]
    out = [f"**{case}** (tp {tp}; layer 0's states as the prompt leaves them: {states}; planned in {seconds:.0f} s)", "",
           "| collective | tensor | shape | module | forward bytes per rank |", "|---|---|---|---|---|"]
    for c in inside:
        shape = "(b, " + ", ".join(str(s) for s in shapes[c.tensor][1:]) + ")"
        out.append(f"| {c.kind} {c.src} -> {c.dst} | `{c.tensor}` | {shape} | {c.module} | {c.fwd_bytes:.0f} |")
    out += ["", f"{len(inside)} collectives, {sum(c.fwd_bytes for c in inside):.0f} bytes per rank inside the mixer; "
            f"the whole step: {sum(1 for c in decode.comms if c.fwd_bytes)} collectives, "
            f"{sum(c.fwd_bytes for c in decode.comms):.0f} bytes.", ""]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("families", nargs="*", default=list(CASES))
    args = parser.parse_args()
    lines = ["# A decode step's collectives inside a hybrid's mixer (tiny models, tp 2 and 3, planned on meta)", "",
             "Command: `python benchmarks/decode_step_comms.py --out benchmarks/decode_step_comms.md`", "",
             machine(), ""]
    for case in args.families:
        lines += rows(case)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
