"""The device round of issues 44 and 47 (``benchmarks/gpu_round.py``, ``gpu_parts.py``,
``gpu_summary.py``): its parts call their children as written, a part the budget leaves is listed
as not run, and the summary reads the figures against the issues' goals. (The parts themselves run in the CPU
rehearsal, ``--device cpu --quick``: minutes, not a test.)"""
from __future__ import annotations

import inspect
import json
import math

from benchmarks.gpu_parts import CHILDREN
from benchmarks.gpu_round import ROUNDS, file_stem, run_round
from benchmarks.gpu_summary import summary


def test_every_part_names_a_child_that_takes_its_options():
    for parts in ROUNDS.values():
        for part in parts:
            inspect.signature(CHILDREN[part.child]).bind("cuda", False, "part.md", **part.options)


def test_parts_have_distinct_plain_file_names():
    stems = [file_stem(p.name) for p in ROUNDS["issues-44-47"]]
    assert len(set(stems)) == len(stems)
    assert all(s.replace("_", "").replace("-", "").replace(".", "").isalnum() for s in stems)


def test_parts_past_the_budget_are_listed_as_not_run(tmp_path):
    results = run_round("issues-44-47", str(tmp_path), "cpu", quick=False, budget=-1.0)
    assert list(results["parts"]) == [p.name for p in ROUNDS["issues-44-47"]]
    assert all("not run" in row["skipped"] for row in results["parts"].values())
    assert json.loads((tmp_path / "round.json").read_text())["parts"].keys() == results["parts"].keys()
    text = (tmp_path / "summary.md").read_text()
    assert text.count("not run: the budget of -1 s was spent") >= len(results["parts"])


def test_a_round_hands_back_three_files_its_parts_packed_into_one(tmp_path):
    # a device run hands back at most eight files; a round writes a .md and a .log a part
    import tarfile

    out = tmp_path / "out"
    results = run_round("issues-44-47", str(out), "cpu", quick=True, budget=600.0, only=["nccl:collectives"])
    assert "figures" in results["parts"]["nccl:collectives"]
    assert sorted(p.name for p in out.iterdir()) == ["parts.tgz", "round.json", "summary.md"]
    with tarfile.open(out / "parts.tgz") as tar:
        assert sorted(tar.getnames()) == ["nccl_collectives.log", "nccl_collectives.md"]


def _version(clock: float, predicted: float = 0.01, roles=(), compiled=None) -> dict:
    return {"clock": clock, "thread": math.nan, "busy": 0.5, "compiled": compiled, "predicted": predicted,
            "predicted_share": 0.01, "expert_roles": list(roles), "dispatch": False, "notes": []}


def _round(parts: dict) -> dict:
    return {"round": "issues-44-47", "device": "cuda", "command": "c", "machine": "m", "gpu": "g",
            "budget_s": 480, "total_s": 1, "parts": parts}


def test_summary_reads_a_dense_rank_against_its_eighth():
    serial = {"clock": 8.0, "thread": math.nan, "busy": 0.9, "compiled": {"clock": 4.0, "thread": math.nan}}
    at_goal = {"serial": serial, "default": _version(1.0, compiled={"clock": 1.0, "thread": math.nan})}
    short = {"serial": serial, "default": _version(1.25)}
    fig = dict(model="llama-3-8b", layers=4, batch=2, seq=4096, dtype="bfloat16")
    text = "\n".join(summary(_round({
        "rank:a": {"point": "44.3", "estimate_s": 1, "s": 1, "figures": {**fig, "versions": at_goal}},
        "rank:b": {"point": "44.3", "estimate_s": 1, "s": 1, "figures": {**fig, "versions": short}}})))
    row_a = next(line for line in text.splitlines() if "part rank:a" in line)
    row_b = next(line for line in text.splitlines() if "part rank:b" in line)
    assert "**1.00**" in row_a and "| 0.50 |" in row_a and "meets the goal" in row_a   # compiled 4/8 ÷ 1
    assert "**0.80**" in row_b and "short of the goal by 0.05" in row_b


def test_summary_says_when_the_solvers_experts_pick_is_over_ten_percent_slower():
    versions = {"serial": {"clock": 8.0, "thread": math.nan, "busy": 0.9, "compiled": None},
                "default": _version(1.25, roles=["expert_column", "expert_row"]),
                "expert-parallel": _version(1.0, predicted=0.02, roles=["expert"]),
                "expert-TP": _version(1.25, roles=["expert_column", "expert_row"])}
    fig = {"model": "mixtral-8x7b", "versions": versions}
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "measured 1.25x the fastest (expert-parallel): **more than 10% slower**" in text
    assert "best efficiency 1.00" in text
    versions["default"] = _version(1.05, roles=["expert"])
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "measured 1.05x the fastest (expert-parallel): within 10%" in text


def test_summary_holds_compiled_moe_to_hf_compiled_and_no_break():
    fig = {"median_s": {"HF eager": 2.0, "autotp eager": 2.1, "HF compiled": 1.0, "autotp compiled": 1.1},
           "graphs": {"autotp compiled": 2}, "breaks": {"autotp compiled": {"a reason": 1}}}
    text = "\n".join(summary(_round({"moe:compile": {"point": "47.3", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "**1.100x** (slower: short of the goal)" in text and "graph breaks 1: a reason" in text


def test_the_round_probes_where_the_host_time_of_a_gpt2_xl_rank_goes():
    part = next(p for p in ROUNDS["issues-44-47"] if p.name == "host:gpt2-xl")
    assert (part.child, part.point) == ("host_profile", "44.4")
    assert part.options == dict(model="gpt2-xl", layers=12, batch=8, seq=1024)
    assert part.estimate_s <= 40 < part.cap_s


def test_largest_gaps_merge_the_streams_and_name_what_the_host_was_inside_of():
    from benchmarks.host_profile import largest_gaps

    # µs: two streams overlapping (0-12), then the device idle 12-20 and 30-100
    busy = [(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (100, 110, "d")]
    host = [(30, 100, "aten::copy_", 1, 7), (35, 99, "cudaMalloc", 2, 7), (13, 14, "aten::view", 1, 1),
            (15, 16, "aten::view", 1, 1), (16, 17, "aten::view", 2, 1)]
    gaps = largest_gaps(busy, host)
    assert [(round(g["ms"], 3), g["before"], g["after"]) for g in gaps] == [(0.07, "c", "d"), (0.008, "b", "c")]
    assert gaps[0]["host"] == "cudaMalloc (thread 7)"   # the deepest event covering half the gap
    assert gaps[1]["host"] == "begun: aten::view x2"    # none covers half: the outermost begun in it


def test_a_profiled_cpu_step_names_its_halves_threads_and_runtime_calls():
    import torch

    from benchmarks.host_profile import RUNTIME, clocks, profiled, training_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x, labels):
            return type("Out", (), {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)})()

    step = training_step(Tiny(), {"x": torch.randn(4, 8), "labels": torch.randn(4, 8)})
    clock = clocks(step, lambda: None, 2)
    assert set(clock) == {"wall", "thread", "process"}
    prof = profiled(step, lambda: None, "cpu")
    # on CPU the calling thread runs the backward too: one thread holds both halves
    assert list(prof["threads"]) == [k for k in prof["threads"] if k.endswith("(calling)")]
    assert {"forward", "backward"} <= set(next(iter(prof["threads"].values())))
    assert set(RUNTIME) <= set(prof["runtime"]) and all(n == 0 for n, _ in prof["runtime"].values())
    assert any(name == "aten::addmm" and calls == 1 for name, _, calls in prof["top_ops"])
    assert prof["busy"] > 0 and prof["gaps"]
    # the step's idle device time: before its first op, between, after its last (the "device"
    # on CPU is the calling thread's outermost ATen ops)
    assert set(prof["idle"]) == {"before the first", "between", "after the last"}
    assert all(v >= 0 for v in prof["idle"].values())
    assert prof["idle"]["between"] >= sum(g["ms"] for g in prof["gaps"]) - 1e-9


def test_summary_folds_the_host_probe_under_noticed():
    from benchmarks.host_profile import verdict

    def side(wall, thread, process, mallocs):
        runtime = {"cudaLaunchKernel": (1200, 6.0), "cudaMalloc": (mallocs, 3.0), "cudaStreamSynchronize": (1, 0.1),
                   "cudaDeviceSynchronize": (1, 40.0)}   # the step's end
        return {"clock": {"wall": wall, "thread": thread, "process": process},
                "profile": {"wall": wall, "busy": 0.2 * wall, "runtime": runtime,
                            "gaps": [{"ms": 2.5, "before": "k1", "after": "k2", "host": "cudaMalloc (thread 7)"}]}}

    fig = {"model": "gpt2-xl", "layers": 12, "batch": 8, "seq": 1024, "sequence_parallel": True,
           "rank": side(60.0, 14.0, 55.0, 4), "serial": side(97.0, 9.0, 30.0, 0)}
    fig["verdict"] = verdict(fig)
    assert "rank: wall 60.0 ms, calling thread 14.0 ms, process CPU 55.0 ms" in fig["verdict"]
    assert "1200 launches, 1 synchronizations besides the step's end, 4 cudaMalloc/cudaFree" in fig["verdict"]
    assert "the rank is **host-bound**" in fig["verdict"]
    text = "\n".join(summary(_round({"host:gpt2-xl": {"point": "44.4", "estimate_s": 40, "s": 30, "figures": fig}})))
    assert "sequence parallelism chosen: " + fig["verdict"] in text
    assert "host:gpt2-xl: not in this round" not in text
    fig["rank"] = side(60.0, 14.0, 20.0, 0)
    assert "not host-bound by CPU time" in verdict(fig)


def test_stalls_count_the_garbage_collections_of_a_step_and_one_thread_keeps_the_backward_home():
    import gc

    import torch

    from benchmarks.host_profile import one_thread, stalls

    seen = []

    def step():
        seen.append(torch._C._is_multithreading_enabled())
        gc.collect()   # a full collection, as Python makes one when its long-lived objects grow

    counted = stalls(step, "cpu")
    assert counted["gc"]["generation 2"][0] == 1 and counted["syncs"] == {}
    one_thread(step)()
    assert seen == [True, True, False]   # the warm-up and counted step as given, then on the calling thread


def test_rank_hosts_clock_holds_the_backward_on_every_device():
    """On CUDA the autograd engine runs a backward on a device thread of its own: the calling
    thread's CPU time of a training step held the forward alone (the 2026-11-30 round's host:cuda
    part read 13.7 ms for a gpt2 rank's step). The timed steps run their backward at home."""
    import torch

    from benchmarks.rank_host import least_times

    seen = []
    least_times({"step": lambda: seen.append(torch._C._is_multithreading_enabled())}, repeats=2)
    assert seen[2:] == [False, False]


def test_the_host_probe_times_the_step_with_attention_off_cudnn():
    """cuDNN's attention builds an execution graph per layout (host milliseconds where its cache
    misses): the probe times the step with it excluded and every other attention kernel allowed."""
    import torch

    from benchmarks.host_profile import verdict, without_cudnn_attention

    seen = []
    without_cudnn_attention(lambda: seen.append((torch.backends.cuda.cudnn_sdp_enabled(),
                                                 torch.backends.cuda.flash_sdp_enabled(),
                                                 torch.backends.cuda.mem_efficient_sdp_enabled(),
                                                 torch.backends.cuda.math_sdp_enabled())))()
    assert seen == [(False, True, True, True)] and torch.backends.cuda.cudnn_sdp_enabled()
    side = {"clock": {"wall": 60.0, "thread": 14.0, "process": 20.0}, "no_cudnn_attention": {"wall": 21.0},
            "profile": {"wall": 60.0, "busy": 12.0, "runtime": {}, "gaps": []}}
    assert "attention off cuDNN: wall **21.0 ms**" in verdict({"rank": side})
def test_summary_reads_the_balanced_rank_for_the_goal_and_states_the_skew():
    def at(rank: int, load: float, clock: float, busiest: dict | None = None) -> dict:
        v = {**_version(clock, roles=["expert"]), "rank": rank, "load": load, "predicted_at_load": 0.01 * load}
        return {**v, "busiest": busiest} if busiest else v

    versions = {"serial": {"clock": 8.0, "thread": math.nan, "busy": 0.9, "compiled": None},
                "load": {"ranks": [30, 10, 10, 10, 10, 10, 10, 12], "max_over_mean": 2.14, "balanced_rank": 7,
                         "busiest_rank": 0},
                "default": at(7, 1.02, 1.0, busiest=at(0, 2.5, 2.0)),
                "expert-parallel": at(7, 1.02, 1.0, busiest=at(0, 2.5, 2.0)),
                "expert-TP": {**_version(1.05, roles=["expert_column", "expert_row"]), "rank": 7, "load": 1.0,
                              "predicted_at_load": 0.01}}
    fig = {"model": "mixtral-8x7b", "versions": versions}
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    # the goal reads rank 7's step (1.0 of the eighth), not the busiest rank's (0.50)
    assert "measured 1.00x the fastest (default): within 10%" in text and "best efficiency 1.00" in text
    assert "rows per rank max ÷ mean 2.14; rank 7 (nearest the mean) ran every version" in text
    assert "the most loaded, rank 0, took default 2.00x, expert-parallel 2.00x of its step" in text
    row = next(line for line in text.splitlines() if "| expert-parallel, busiest rank |" in line)
    assert "| 0 (2.50) | 10.00 (25.00) | 2000.00 | **0.50** |" in row
    assert "Not a balanced step" not in text
    versions["expert-parallel"]["load"] = 0.44   # the fake world's rank ran off a balanced share
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "**Not a balanced step**" in text and ": expert-parallel 0.44;" in text and "default 1.02" not in text


def test_summary_holds_the_pick_at_the_measured_load_to_each_versions_busiest_rank():
    def at(rank: int, load: float, clock: float, roles: list, busiest: dict | None = None) -> dict:
        v = {**_version(clock, roles=roles), "rank": rank, "load": load}
        return {**v, "busiest": busiest} if busiest else v

    ep, etp = ["expert"], ["expert_column", "expert_row"]
    versions = {"serial": {"clock": 8.0, "thread": math.nan, "busy": 0.9, "compiled": None},
                "default": at(7, 1.0, 1.0, ep, busiest=at(0, 2.5, 2.0, ep)),
                "default, measured load": at(7, 1.0, 1.3, etp),
                "expert-parallel": at(7, 1.0, 1.0, ep, busiest=at(0, 2.5, 2.0, ep)),
                "expert-TP": at(7, 1.0, 1.25, etp)}
    fig = {"model": "mixtral-8x7b", "versions": versions}
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "| solver's pick at the batch's measured load | expert_column, expert_row |" in text
    # this router's step waits for expert-parallel's busiest rank (2.0): expert-TP (1.25) is the fastest
    assert ("the solver's pick planned at the measured load (expert_column, expert_row) measured 1.04x the fastest "
            "(expert-TP): within 10%; at a balanced router's plan 1.60x.") in text
    versions["default, measured load"] = at(7, 1.0, 2.0, ep, busiest=at(0, 2.5, 2.6, ep))
    text = "\n".join(summary(_round({"rank:m": {"point": "47.2", "estimate_s": 1, "s": 1, "figures": fig}})))
    assert "measured 2.08x the fastest (expert-TP): **more than 10% slower**" in text
