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
