"""Issue 44's review of the plans the reshard all-to-all changed: each plan test it broke, planned
as now (a reshard nothing reads whole is one all-to-all) and as before (every reshard an
all-gather then a cut: ``gather_parts`` told no layout moves by one all-to-all), their predicted
step by part, what changed between them, and the layout the test named before pinned and priced
as now (is the solver's plan the cheapest the cost model knows?). Planning only, meta device.

    PYTHONPATH=$PWD python benchmarks/reshard_review.py [case ...]   # writes benchmarks/reshard_review.md

``even_row`` (a case of its own, run last) reviews the plans the even row split changed: a free
weight split evenly on its inputs where they arrive split unevenly (heads tp does not deal evenly),
the input moved there by one all-to-all (``passes/rules/matrix._even_row``), planned with it and
without.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from pathlib import Path

import torch

import autotp
from autotp import zoo
from autotp.passes import propagate

try:
    from benchmarks.common import machine, publish
except ImportError:   # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import machine, publish


def _llama4():
    config = zoo.published_config("llama-4-scout", layers=4)
    return zoo.build("llama4", config, device="meta", dtype=torch.bfloat16), dict(tp=8)


def _phi3():
    model = zoo.build("phi3", zoo.published_config("phi-3-medium", layers=2), device="meta", dtype=torch.bfloat16)
    return model, dict(tp=8)


def _qwen2():
    config = zoo.tiny_config("qwen2", heads=28, kv_heads=4, head_dim=128, positions=1024, vocab=1000)
    return zoo.build("qwen2", config, device="meta"), dict(tp=8, seq=1024)


def _mamba2():
    config = zoo.tiny_config("bamba", layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64, mamba_n_groups=1)
    return zoo.build("bamba", config, device="meta"), dict(tp=2, batch=64, seq=4096, profile="h100-dgx")


#: name -> (the test, the model and its planning arguments, the layout the test named before, pinned)
CASES = {
    "llama4": ("tests/passes/test_llama4_plan.py::test_llama4_scout_shared_expert_is_a_dense_mlp_and_attention_"
               "splits_by_head", _llama4, {"*.self_attn.o_proj.weight": "row"}),
    "phi3": ("tests/passes/test_families_plan.py::test_a_fused_qkv_with_grouped_kv_heads_splits_by_head_as_"
             "megatron_would[phi-3-medium-tp8]", _phi3, {"*.qkv_proj.weight": "column", "*.o_proj.weight": "row"}),
    "qwen2": ("tests/passes/test_row_plan.py::test_no_pinned_row_split_beats_the_solvers_choice", _qwen2,
              {"*.k_proj.weight": "row", "*.v_proj.weight": "row"}),
    "mamba2": ("tests/passes/test_recurrent_plan.py::test_mamba2_with_one_group_splits_by_head_with_b_and_c_whole",
               _mamba2, {"*mamba.out_proj.weight": "row"}),
}


@contextlib.contextmanager
def gathered_and_cut():
    """Plans as before the reshard all-to-all: no layout moves by one (listing, price, solver, rewrite)."""
    moves = propagate.resharded_by_all_to_all
    propagate.resharded_by_all_to_all = lambda have, want: False
    try:
        yield
    finally:
        propagate.resharded_by_all_to_all = moves


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def by_part(plan, label: str) -> list[str]:
    kinds: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.comms:
        kinds[c.kind][0] += 1
        kinds[c.kind][1] += c.fwd_bytes + c.bwd_bytes
        kinds[c.kind][2] += c.seconds
    lines = [f"{label}: step {_ms(plan.compute_s + plan.comm_s)} ms = compute {_ms(plan.compute_s)} "
             f"(optimizer {_ms(plan.optimizer_s)}) + communication {_ms(plan.comm_s)}; memory "
             f"{plan.memory_bytes / 2**30:.2f} GiB a rank"]
    for kind, (n, sent, seconds) in sorted(kinds.items()):
        lines.append(f"    {kind:15s} x{n:3d} {sent / 1e6:10.1f} MB {_ms(seconds):>9s} ms")
    return lines


def changed(before, now) -> list[str]:
    def key(c):
        return (c.kind, c.module, c.tensor, c.consumer, c.src, c.dst)

    old, new = {key(c): c for c in before.comms}, {key(c): c for c in now.comms}
    lines = []
    for sign, side, other in (("-", old, new), ("+", new, old)):
        for k in sorted(set(side) - set(other)):
            c = side[k]
            lines.append(f"  {sign} {c.kind:14s} {c.module or '(outside)':42s} {c.tensor} -> {c.consumer} "
                         f"{c.src}->{c.dst}  {(c.fwd_bytes + c.bwd_bytes) / 1e6:.1f} MB {c.seconds * 1e6:.1f} us")
    return lines


def review(name: str) -> list[str]:
    test, build, pins = CASES[name]
    model, kwargs = build()
    now = autotp.plan(model, **kwargs)
    with gathered_and_cut():
        before = autotp.plan(model, **kwargs)
    pinned = autotp.plan(model, **kwargs, layout=pins)
    lines = [f"## {name}", "", f"`{test}`, planned with `{kwargs}` (profile `{now.profile}`, batch {now.batch}, "
             f"seq {now.seq})", "", "```"]
    lines += by_part(before, "before (every reshard gathered and cut)")
    lines += by_part(now, "now (a lone reshard one all-to-all)   ")
    lines += by_part(pinned, f"now, pinned {pins}")
    lines += ["", "layouts changed, before -> now:"]
    lines += [f"  {n}: {before.roles.get(n)} {before.params.get(n)!r} -> {now.roles[n]} {now.params[n]!r}"
              for n in now.params if now.params[n] != before.params.get(n)]
    lines += ["collectives changed, before (-) -> now (+):"] + changed(before, now) + ["```", ""]
    return lines


#: the even row split (a free weight split evenly on its inputs where they arrive split unevenly, moved
#: there by one all-to-all): every plan it may change, those fed by a split of heads tp does not deal
#: evenly (published configurations, 2 layers, default profile, batch 8)
EVEN_ROW_CASES = [("gpt2", 8), ("gpt2-large", 8), ("gpt2-xl", 8), ("falcon-7b", 8), ("qwen2-7b", 8),
                  ("llama-4-scout", 8), ("phi-3-medium", 4), ("phi-3-medium", 8), ("phi-3-mini", 3),
                  ("gemma-2-9b", 3), ("gemma-3-27b", 3), ("t5-large", 3)]


#: the e2e families' tiny structures (tests/e2e/test_families.py: layers, heads, kv heads, head dim,
#: vocabulary, rotary) at tp 2-4 and their planning workload, and the tiny Phi-3 and Gemma
TINY_FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "gpt-neox", "gpt-j", "falcon", "falcon-new", "gpt-bigcode",
                 "opt", "bert", "t5", "phi3", "gemma2", "gemma3"]
TINY_STRUCTURES = [(2, 6, 2, 4, 53, 1.0), (1, 4, 1, 8, 40, 0.5)]


@contextlib.contextmanager
def without_even_row():
    """Plans as before the even row split: a free weight's row split only along its input's own split."""
    from autotp.passes.rules import matrix

    offer = matrix._even_row
    matrix._even_row = lambda info, px, k: None
    try:
        yield
    finally:
        matrix._even_row = offer


def even_row_review() -> list[str]:
    lines = ["## The even row split", "",
             "Each plan a row split over an even split of an unevenly split input may change, planned with "
             "it offered (`now`) and without (`before`: the row split along the input's own split only). "
             "`changed`: the parameters whose placement differs.", "", "```"]
    for size, tp in EVEN_ROW_CASES:
        family = zoo.family_of(size).name
        model = zoo.build(family, zoo.published_config(size, layers=2), device="meta", dtype=torch.bfloat16)
        now = autotp.plan(model, tp)
        with without_even_row():
            before = autotp.plan(model, tp)
        step_now, step_before = now.compute_s + now.comm_s, before.compute_s + before.comm_s
        moved = [n for n in now.params if now.params[n] != before.params.get(n)]
        lines.append(f"{size:14s} tp {tp}: before {_ms(step_before)} ms, now {_ms(step_now)} ms "
                     f"({(step_now - step_before) * 1e6:+.1f} us); {len(moved)} changed")
        lines += [f"    {n}: {before.roles.get(n)} {before.params.get(n)!r} -> {now.roles[n]} {now.params[n]!r}"
                  for n in moved]
        if moved:
            lines += [line.replace("  ", "    ", 1) for line in changed(before, now)]
    lines += ["```", "", "The e2e families' tiny structures (`tests/e2e/test_families.py`), float64, tp 2-4, planned "
              "as those tests plan (batch 64, seq 4096, `h100-dgx`), with the even row split and without:", "",
              "```"]
    for family in TINY_FAMILIES:
        same, differ = 0, []
        for layers, heads, kv, head_dim, vocab, rotary in TINY_STRUCTURES:
            config = zoo.tiny_config(family, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
                                     vocab=vocab, rotary=rotary)
            model = zoo.build(family, config, device="meta", dtype=torch.float64)
            for tp in (2, 3, 4):
                now = autotp.plan(model, tp, batch=64, seq=4096, profile="h100-dgx")
                with without_even_row():
                    before = autotp.plan(model, tp, batch=64, seq=4096, profile="h100-dgx")
                if now.params == before.params and now.comms == before.comms:
                    same += 1
                else:
                    differ.append(f"{heads} heads tp {tp}")
        lines.append(f"{family:12s} {same} of {same + len(differ)} plans the same" +
                     (f"; changed: {', '.join(differ)}" if differ else ""))
    return lines + ["```", ""]


def main(names: list[str]) -> None:
    import logging

    logging.getLogger("autotp").setLevel(logging.ERROR)
    lines = ["# The plans the reshard all-to-all changed (issue 44's review)", "",
             "`benchmarks/reshard_review.py`: each plan test the reshard all-to-all broke, planned now and "
             "as before it (every reshard an all-gather then a cut), with the layout the test named before "
             "pinned and priced now. Predicted seconds per training step on the largest rank; `sent`: "
             "bytes a rank sends per step, forward and backward. Planning only (meta device).", "",
             machine(), "", "Command: `PYTHONPATH=$PWD python benchmarks/reshard_review.py`", ""]
    for name in names or list(CASES) + ["even_row"]:
        lines += even_row_review() if name == "even_row" else review(name)
    publish(lines, Path(__file__).with_suffix(".md") if not names else None)


if __name__ == "__main__":
    main(sys.argv[1:])
