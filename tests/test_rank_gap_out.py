"""``benchmarks/rank_gap.py --out FILE`` rewrites the run in FILE and keeps what is written by hand
after it (every line from the marker ``common.KEPT`` on, as ``common.publish`` does for every
script's ``--out``): before, each run overwrote the file's "Reading" and its re-run notes, which were
put back by hand."""
import sys

import pytest

from benchmarks import rank_gap
from benchmarks.common import KEPT


def _run(monkeypatch, path, figure: str) -> str:
    # the run itself (the cost model on a meta model, tens of seconds) is not what is tested: a
    # section of the run stands for it, its figure changing between runs
    monkeypatch.setattr(rank_gap, "gap", lambda *args: ["## a model, tp=8", "", f"busiest rank {figure} ms", ""])
    monkeypatch.setattr(sys, "argv", ["rank_gap.py", "--models", "m:1:1:8", "--out", str(path)])
    rank_gap.main()
    return path.read_text()


# the marker as publish writes it, and as rank_gap.md's older one names its script
@pytest.mark.parametrize("marker", [KEPT, "<!-- written by hand from here on: rank_gap.py --out keeps it -->"])
def test_out_rewrites_the_run_and_keeps_the_part_written_by_hand(monkeypatch, tmp_path, capsys, marker):
    path = tmp_path / "rank_gap.md"
    first = _run(monkeypatch, path, "1.000")
    assert marker not in first   # a first run writes the run alone
    hand = [marker, "", "## Reading", "", "- the busiest rank is 1.000 ms: why, by hand"]
    path.write_text(first + "\n" + "\n".join(hand) + "\n")
    again = _run(monkeypatch, path, "0.900")
    assert "busiest rank 0.900 ms" in again and "busiest rank 1.000 ms\n" not in again.split(marker)[0]
    assert again.endswith("\n".join(hand) + "\n"), again
    assert again.count(marker) == 1
    assert _run(monkeypatch, path, "0.900") == again   # a run of the same figures leaves the file as it is
