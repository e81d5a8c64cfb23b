"""The model zoo: every family autotp is tested on, planned at real size and checked on a tiny one.

    .venv/bin/python benchmarks/model_zoo.py                  # writes docs/models.md
    .venv/bin/python benchmarks/model_zoo.py llama gpt-j      # only these families (prints, no file)
    .venv/bin/python benchmarks/model_zoo.py --update mixtral olmoe   # these rows rerun in docs/models.md,
                                                                      # the other rows kept as they are

For each family (``autotp.zoo.FAMILIES``), one published configuration is built on the meta
device in bfloat16 (no weights exist) and planned with ``autotp.plan(model, tp=8)`` under the
default profile and workload. The table reports:

* **plan**: ok, or the error that stopped it;
* **layout**: the role of each weight matrix of one layer (column, row, vocab, replicate, or a
  composite of parts) and of the embeddings and the output layer;
* **collectives per layer**: the collectives the plan puts in one layer (layer 1, away from the
  embedding), forward all-reduces (g) first;
* **bytes per rank at tp=8**: the largest rank's parameter bytes (bfloat16) against serial;
* **equivalence**: the worst relative error (loss, logits, every gradient) of the parallel model
  against serial on a tiny float64 configuration of the family at tp=2 and tp=3, on local gloo
  ranks, planner's choice under a layout-forcing workload (a gradient that is zero in exact
  arithmetic, like a key bias's, is measured against the largest gradient's norm: see
  ``rescale_zero_gradients`` in ``tests/e2e/test_families.py``);
* **capture+plan s**: wall seconds of ``autotp.plan`` for the full-size model (this machine).

The mixtures of experts (``autotp.zoo.EXPERT_FAMILIES``) get a table of their own, which adds
the layout each MoE layer got (expert-parallel, expert-TP or replicated: the plan's notes,
``autotp/planner/experts.py``, with what the other layout would cost) and the experts'
bytes per rank against serial; DeepSeek-V3 is planned with 4 layers of its published shape (3
dense, 1 MoE). Their tiny float64 models run the ``batched_mm`` experts path (torch's grouped
product takes no float64 on CPU), 4 experts of 2 per token (tp=3 does not divide them).
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: the published configuration shown for each family
SHOWN = {"gpt2": "gpt2-xl", "llama": "llama-3-8b", "mistral": "mistral-7b", "qwen2": "qwen2-7b",
         "gpt-neox": "gpt-neox-20b", "gpt-j": "gpt-j-6b", "falcon": "falcon-7b", "falcon-new": "falcon-40b",
         "gpt-bigcode": "starcoder-15b", "opt": "opt-6.7b", "bert": "bert-large", "t5": "t5-large"}
# the families whose attention is not Llama's (whole-width q/k norms, a fused q|k|v read back with
# slices), kept as a block of their own beside the mixture-of-experts families
SHOWN.update({"olmo2": "olmo-2-7b", "phi3": "phi-3-mini", "modernbert": "modernbert-large"})
# sliding-window attention in all layers or some (autotp.zoo.WINDOW_FAMILIES)
SHOWN.update({"ministral": "ministral-8b", "gemma2": "gemma-2-9b", "gemma3": "gemma-3-27b", "cohere2": "command-r7b"})
# not a transformer: Mamba's program holds one sequence length on CPU (autotp.capture.export.fixed_dims)
SHOWN.update({"mamba": "mamba-130m"})
#: the mixtures of experts, in a table of their own
SHOWN_EXPERTS = {"mixtral": "mixtral-8x7b", "qwen3-moe": "qwen3-30b-a3b", "qwen2-moe": "qwen1.5-moe-a2.7b",
                 "olmoe": "olmoe-1b-7b", "deepseek-v3": "deepseek-v3", "gpt-oss": "gpt-oss-20b",
                 "llama4": "llama-4-scout"}
#: the hybrids (state-space and linear-attention mixers beside attention), in a table of their own
SHOWN_HYBRIDS = {"jamba": "jamba-v0.1", "bamba": "bamba-9b", "falcon-h1": "falcon-h1-0.5b",
                 "granitemoehybrid": "granite-4.0-h-tiny", "qwen3-next": "qwen3-next-80b-a3b",
                 "qwen3.5-moe": "qwen3.5-35b-a3b", "minimax": "minimax-text-01"}
#: layers planned where the published depth would only repeat what these show (DeepSeek-V3: its 3
#: dense layers and one MoE layer)
LAYERS = {"deepseek-v3": 4}
TP = 8


def layer_of(name: str) -> int | None:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def summarize_layout(plan, cap, vocab: int) -> str:
    """Roles of layer 1's weight matrices and of the matrices outside the layers, read off the
    graph: column/row by the product that reads the matrix, vocab where a vocabulary-sized dim is
    split (tests/passes/test_families_plan.py checks the same way)."""
    from autotp.placements import Shard
    from tests.passes.test_families_plan import matrix_role

    parts = []
    for name in plan.roles:
        if len(plan.shapes[name]) != 2:   # a stack of experts (its own column), a convolution's kernel
            continue
        placement = plan.params[name]
        if isinstance(placement, Shard) and plan.shapes[name][placement.dim] == vocab:
            role = "vocab"
        else:
            role = matrix_role(cap, plan, name) if name in cap.param_names.values() else plan.roles[name]
        layer = layer_of(name)
        if layer not in (None, 1):
            continue
        if isinstance(placement, Shard) and placement.tail:
            role += f" (query heads split, k and v whole: {placement!r})"
        short = re.sub(r"^.*?\.1\.", "", name) if layer == 1 else name
        parts.append(f"`{short.removesuffix('.weight')}` {role}")
    return "; ".join(parts)


def collectives_in_layer(plan, layer: int = 1) -> str:
    counts: dict[str, int] = {}
    for c in plan.comms:
        if layer_of(c.module + ".") == layer:   # the first index in the module path: block 1 of each stack
            counts[c.kind] = counts.get(c.kind, 0) + 1
    order = sorted(counts, key=lambda k: (k != "g", k != "f", k))
    return ", ".join(f"{k}={counts[k]}" for k in order) or "none"


def plan_row(family: str, size: str) -> dict:
    import autotp
    from autotp import zoo
    from autotp.capture import cache as capture_cache

    config = zoo.published_config(size, layers=LAYERS.get(family))
    model = zoo.build(family, config, device="meta", dtype=torch.bfloat16)
    start = time.perf_counter()
    cap = capture_cache.capture(model)     # plan() below reuses it: the time is one capture + plan
    status = "ok"
    try:
        plan = autotp.plan(model, tp=TP)
    except autotp.PlanError as exc:
        if "memory limit" not in str(exc):
            raise
        # tp alone cannot hold this model's training state in the profile's memory: show the
        # layout it would have, and what it needs (pipeline or ZeRO stages must make up the rest);
        # the plan memory_limit=inf gives, from the search that failed (nothing solved again)
        plan = (exc.plan_without_limit() if getattr(exc, "plan_without_limit", None) is not None
                else autotp.plan(model, tp=TP, memory_limit=float("inf")))
        state = plan.memory_bytes - plan.activation_bytes
        status = (f"needs {plan.memory_bytes / 2**30:.0f} GiB per rank at tp={TP} (training state "
                  f"{state / 2**30:.0f} GiB) > the profile's 80 GiB: PlanError; shown planned without the limit")
    seconds = time.perf_counter() - start
    per_rank = plan.param_bytes_per_rank()
    row = {"plan": status, "layout": summarize_layout(plan, cap, config.vocab_size), "layer": collectives_in_layer(plan),
           "bytes": f"{max(per_rank) / 1e9:.2f} GB of {plan.serial_param_bytes() / 1e9:.2f} GB",
           "seconds": f"{seconds:.1f}"}
    if family in SHOWN_EXPERTS:
        rank, serial = expert_bytes(plan)
        row["experts"] = "<br>".join(n for n in plan.notes if n.startswith("experts ")) or "(no note)"
        row["expert_bytes"] = f"{rank / 1e9:.2f} GB of {serial / 1e9:.2f} GB ({serial / rank:.1f}x less)"
    return row


def expert_bytes(plan) -> tuple[int, int]:
    """The routed experts' parameter bytes (every 3-D stack of experts) on the largest rank, and serial."""
    from autotp.placements import Shard, local_size

    rank = serial = 0
    for name, shape in plan.shapes.items():
        if len(shape) != 3 or ".experts." not in name:
            continue
        n = 2   # bfloat16
        for d in shape:
            n *= d
        serial += n
        p = plan.params[name]
        if isinstance(p, Shard):
            n = n // shape[p.dim] * max(local_size(shape[p.dim], p, plan.tp, r) for r in range(plan.tp))
        rank += n
    return rank, serial


def equivalence_task(family: str, tp: int) -> tuple[float, float]:
    """On each rank: a tiny float64 model of ``family`` at ``tp``; the worst relative error and the
    share of the serial parameters the rank holds (1.0: nothing split, the check says nothing)."""
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors

    heads = 2 * tp
    # kv heads (where the family has them) fewer than the ranks: multi-query at tp 2, two groups
    # of three query heads at tp 3 (replicated k and v, or a fused layout's k and v whole per rank)
    config = zoo.tiny_config(family, layers=2, heads=heads, kv_heads=tp - 1, head_dim=8,
                             vocab=16 * tp + 5)
    if hasattr(config, "_experts_implementation"):   # the batched experts path: float64 on CPU (grouped: not)
        config._experts_implementation = "batched_mm"
    model = zoo.build(family, config, dtype=torch.float64)
    if hasattr(type(model), "loss_function") and zoo.family(family).task == "causal":
        from autotp.testing import keep_loss_precision

        keep_loss_precision(model)
    inputs = zoo.example_batch(family, config, batch=2, seq=7)
    # a large planning workload, so the cost model splits even this tiny model
    # a program fixed to one length (Mamba's) is captured at the checked call's
    example = inputs if family in zoo.RECURRENT_FAMILIES else None
    pm = autotp.parallelize(model, tp, batch=64, seq=4096, profile="h100-dgx", example_kwargs=example)
    errors = equivalence_errors(model, pm, inputs)
    from tests.e2e.test_families import rescale_zero_gradients

    held = sum(p.numel() for p in pm.local_parameters().values()) / sum(p.numel() for p in model.parameters())
    return max(rescale_zero_gradients(model, pm, errors).values()), held


def equivalence_row(family: str) -> str:
    from autotp.testing import launch

    worst = []
    for tp in (2, 3):
        results = launch(equivalence_task, tp, family, tp, timeout=600)
        held = max(r[1] for r in results)
        split = "nothing split" if held > 0.999 else f"{held:.0%} of the parameters per rank"
        worst.append(f"tp={tp}: {max(r[0] for r in results):.1e} ({split})")
    return ", ".join(worst)


def _row_line(family: str, size: str, r: dict) -> str:
    if family in SHOWN_EXPERTS:
        return (f"| {family} | {size}{' (%d layers)' % LAYERS[family] if family in LAYERS else ''} | {r['plan']} | "
                f"{r.get('experts', '')} | {r.get('expert_bytes', '')} | {r['bytes']} | {r['layout']} | "
                f"{r['layer']} | {r['equivalence']} | {r['seconds']} |")
    return (f"| {family} | {size} | {r['plan']} | {r['layout']} | {r['layer']} | {r['bytes']} | "
            f"{r['equivalence']} | {r['seconds']} |")


def _kept_rows(path: Path) -> dict[str, str]:
    """The table rows of an earlier docs/models.md, by family (``--update`` keeps those not rerun)."""
    if not path.exists():
        return {}
    known = {**SHOWN, **SHOWN_EXPERTS, **SHOWN_HYBRIDS}
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if line.startswith("| ") and len(cells) > 2 and cells[1] in known:
            rows[cells[1]] = line
    return rows


def main(argv: list[str]) -> None:
    update = "--update" in argv
    argv = [a for a in argv if a != "--update"]
    shown = {**SHOWN, **SHOWN_EXPERTS, **SHOWN_HYBRIDS}
    families = argv or list(shown)
    out = ROOT / "docs" / "models.md"
    lines_by_family = _kept_rows(out) if update else {}
    for family in families:
        size = shown[family]
        print(f"... {family} ({size})", flush=True)
        try:
            row = plan_row(family, size)
        except Exception as exc:   # the page reports what failed, with the error
            traceback.print_exc()
            row = {"plan": f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", "layout": "",
                   "layer": "", "bytes": "", "seconds": ""}
        try:
            row["equivalence"] = equivalence_row(family)
        except Exception as exc:
            traceback.print_exc()
            row["equivalence"] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        lines_by_family[family] = _row_line(family, size, row)
        if update:   # each row kept as soon as it is measured: a run cut short keeps the rows it made
            publish(_page(lines_by_family), out)
    publish(_page(lines_by_family), out if (update or not argv) else None)


def _page(lines_by_family: dict[str, str]) -> list[str]:
    lines = [
        "# Model zoo",
        "",
        "Every model family autotp is tested on: planned at its published size on the meta device at",
        f"tp={TP} (default profile and workload, bfloat16), and checked against the serial model on a tiny",
        "float64 configuration of the same family on local gloo ranks (2·tp query heads and, where the family",
        "has them, tp - 1 key/value heads: fewer than the ranks). Written by",
        "`benchmarks/model_zoo.py`; regenerate with `.venv/bin/python benchmarks/model_zoo.py` (the whole page),",
        "or `.venv/bin/python benchmarks/model_zoo.py --update FAMILY ...` (those rows rerun, the rest kept:",
        "the whole run takes longer than the few minutes a run on this machine is given, so the rows were",
        "written by several such runs, on the same machine).",
        "",
        machine() + " Load average at the end: {:.1f}, {:.1f}, {:.1f} (other jobs share the cores: the "
                     "seconds are wall-clock).".format(*os.getloadavg()),
        "",
        "| family | model | plan | layout (layer 1 and outside the layers) | collectives per layer | "
        f"parameters per rank at tp={TP} | equivalence (float64, tiny) | capture+plan s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [lines_by_family[f] for f in SHOWN if f in lines_by_family]
    lines += [
        "",
        "Mamba is not a transformer: on CPU transformers runs its slow path, a Python loop over the sequence, which",
        "torch.export unrolls, so its program holds the captured length only (a call at another length gets a",
        "program of its own, and `generate` carries its conv and SSM states from step to step: see docs/errors.md);",
        "its equivalence is checked at the captured length. At that length (11 tokens) the cost model finds the",
        "split selective scan dearer (each step's slice of C is read by split compute: an all-reduce of its",
        "gradient per step), so the scan runs whole: the solver takes dt_proj column and keeps x_proj and out_proj",
        "whole (0.435 of the mixers' bytes per rank at tp 8, 2 layers); Megatron's channel layout pinned (0.133) is",
        "predicted 0.03 ms slower of 103.5 ms and equals serial (docs/architecture.md, section 3;",
        "benchmarks/mixer_layouts.md).",
        "",
        "## Mixtures of experts",
        "",
        f"The same, at tp={TP}, with the layout each MoE layer got (the plan's note: the solver's choice and by how much",
        "the other layout would lose) and the routed experts' bytes on the largest rank against serial (bfloat16).",
        "The tiny float64 models run transformers' `batched_mm` experts path, 4 experts of 2 per token. Errors of",
        "1e-8 to 1e-7 are float32's rounding in the model itself: transformers' routers take their softmax in",
        "float32 (`router_logits.float()`, `dtype=torch.float`; DeepSeek-V3's router runs wholly in float32) and",
        "eager attention its softmax (`dtype=torch.float32`), so a router or score input summed over ranks in",
        "another order differs there at float32's rounding (tests/e2e/test_experts.py checks float64 1e-9 on",
        "plans where those inputs arrive whole).",
        "Llama-4's router (`feed_forward.router`) reads the post-attention norm's output, which the plan leaves split",
        "along the hidden size: the solver makes it row-parallel, its [tokens, experts] logits made whole by one",
        "all-reduce before the top-k. Pinned replicated (`layout={'*.router.weight': 'replicate'}`) it is predicted",
        "0.54 ms slower of 92.4 ms (Llama-4-Scout, 2 layers, 2 x 4096, h200 profile); both are exact",
        "(tests/e2e/test_llama4.py).",
        "",
        "| family | model | plan | experts layout per MoE layer | expert bytes per rank | "
        f"parameters per rank at tp={TP} | layout (layer 1 and outside the layers) | collectives per layer | "
        "equivalence (float64, tiny) | capture+plan s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [lines_by_family[f] for f in SHOWN_EXPERTS if f in lines_by_family]
    lines += [
        "",
        "## Hybrids",
        "",
        f"State-space (Mamba in Jamba; Mamba2 in Bamba, Falcon-H1, Granite-4.0-H) and linear-attention (Gated",
        "DeltaNet in Qwen3-Next and Qwen3.5-MoE, lightning attention in MiniMax) mixers beside attention, at",
        f"tp={TP}. Mamba2's chunked scan (Bamba, Falcon-H1, Granite-4.0-H), Gated DeltaNet's (Qwen3-Next,",
        "Qwen3.5-MoE) and lightning attention's (MiniMax) are captured at a dynamic length with export's guards:",
        "one program serves every length of the example's residue class (Mamba2: not a multiple of the chunk,",
        "over one chunk) or of its chunk count (Gated DeltaNet: one count of its 64-token chunks, a multiple of",
        "64 aside; lightning attention: one block count, a last block of 1 or a full one aside), and a call elsewhere gets its own",
        "program. Jamba's Mamba loops over the sequence and holds one length per program (a call at another length",
        "gets its own; benchmarks/hybrid_capture.md). The tiny float64 check calls at 7 tokens: Jamba's and",
        "MiniMax's on another program than the capture's. The mixers compute in float32 inside a",
        "float64 model (transformers' torch paths cast to it), so errors of 1e-8 to 1e-7 are float32's rounding.",
        "The layout column shows what each mixer got: a Mamba2 mixer of the published configurations (Bamba,",
        "Falcon-H1, Granite-4.0-H; one group of B and C, `ngroups=1`) is split by head, Megatron's and vLLM's layout:",
        "in_proj column with each rank its heads' z, x and dt rows and B's and C's rows whole on every rank, the",
        "convolution by channel, the scan by head, out_proj row, nothing gathered between them (docs/architecture.md,",
        "section 3, \"The hybrids' mixers\"; benchmarks/mixer_layouts.md). Where tp deals the groups (`ngroups` a",
        "multiple of tp: tiny Bamba and Granite-4.0-H at 2 groups and tp 2) the solver splits the mixer by head group, in_proj",
        "column per group (each rank its heads' z, x, dt and its own B and C) and out_proj row, with nothing gathered",
        "between them (tests/e2e/test_mamba_layouts.py). Jamba's Mamba mixers take Megatron's channel layout: in_proj",
        "column, x_proj row, dt_proj column, out_proj row. MiniMax's lightning attention its fused qkv column and",
        "out_proj row (its generate runs with its model's own cache class); attention, MLPs and experts as in the",
        "tables above.",
        "These rows were measured on the machine named above under a load average of 8 to 50 from other jobs:",
        "their seconds are not comparable with the other tables'.",
        "",
        "| family | model | plan | layout (layer 1 and outside the layers) | collectives per layer | "
        f"parameters per rank at tp={TP} | equivalence (float64, tiny) | capture+plan s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [lines_by_family[f] for f in SHOWN_HYBRIDS if f in lines_by_family]
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
