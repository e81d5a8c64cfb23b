"""A sort priced as the GPU runs it, and the collectives and index work of the experts' routing
priced as what they are.

``torch.sort`` on a GPU is CUB's radix sort: a histogram of the keys, its exclusive sum, then one
pass per 8 bits of the key type, each reading and writing every key and its position
(``routing.sort_bytes``). The ``h200`` profile's ``sort`` share is read off the measured radix
kernels of ``embedding_dense_backward``'s sort (8192 int64 indices, two steps,
``benchmarks/measurements/h200-2026-11-28/ops-and-sequence-parallel.json``, a copy of the shared
measurement)."""
import json
from pathlib import Path

import pytest
import sympy
import torch

from autotp.cost_model import PROFILES
from autotp.cost_model.kernels import op_work
from autotp.cost_model.symbolic import compute_time
from autotp.passes.propagate import internal_copy_seconds
from autotp.passes.rules import OpInfo, Strategy, TensorMeta
from autotp.placements import REPLICATE

aten = torch.ops.aten
H200 = PROFILES["h200"]
WHOLE = Strategy((REPLICATE,), (REPLICATE, REPLICATE))
MEASURED = "h200-2026-11-28/ops-and-sequence-parallel.json"
HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "measurements" / MEASURED
SHARED = Path(__file__).resolve().parents[3] / "shared" / "measurements" / MEASURED


def radix_bytes(n: int, key_bytes: int) -> int:
    """A histogram pass over the keys, then 8-bit passes each reading and writing every key and
    its int64 position."""
    return n * key_bytes + key_bytes * 2 * n * (key_bytes + 8)


def sort_info(n: int, dtype=torch.long) -> OpInfo:
    keys = TensorMeta((sympy.Integer(n),), dtype)
    out = (keys, TensorMeta((sympy.Integer(n),), torch.long))
    return OpInfo(aten.sort.stable, (keys,), {"stable": True}, (keys,), out, 1)


def sort_seconds(n: int, dtype=torch.long) -> float:
    return compute_time(sort_info(n, dtype), WHOLE, {}, H200, 1)


def test_the_repo_copy_is_the_shared_measurement():
    if not SHARED.exists():   # a checkout without the shared folder: the copy is what there is
        return
    assert json.loads(SHARED.read_text()) == json.loads(HERE.read_text())


def test_a_sort_moves_its_keys_and_positions_once_per_radix_pass():
    work = op_work(sort_info(8192), WHOLE, 1, 2)
    # int64 keys: 8 passes of 8 bits, each reading and writing 8192 keys and 8192 positions,
    # after a histogram pass over the keys; 10 kernels
    assert work.moved == (("sort", 8192 * 8 + 8 * 2 * 8192 * 16),)
    assert work.launches == 10
    half = op_work(sort_info(8192, torch.int32), WHOLE, 1, 2)   # 4 passes of int32 keys, int64 positions
    assert half.moved == (("sort", 8192 * 4 + 4 * 2 * 8192 * 12),) and half.launches == 6


def test_a_sorts_time_beyond_its_kernels_waits_scales_as_its_bytes():
    fixed = 10 * H200.launch_s + 8 * H200.sort_pass_s   # 10 launches, 8 passes' waits
    small, large = sort_seconds(16384) - fixed, sort_seconds(262144) - fixed
    assert large == pytest.approx(16 * small)
    assert small == pytest.approx(radix_bytes(16384, 8) / H200.bandwidth("sort"))
    # several passes over keys and positions: far dearer than one elementwise pass over them
    assert sort_seconds(262144) > 4 * (3 * 262144 * 8 / H200.bandwidth("elementwise") + H200.launch_s)


def test_a_sort_of_8192_ids_is_priced_as_the_h200_ran_it():
    kernels = json.loads(HERE.read_text())
    measured = []
    for model in ("ops:llama-3-8b", "ops:gpt2-xl"):   # one radix sort of 8 x 1024 token ids each
        radix = [(ms, calls) for name, (ms, calls) in kernels[model]["kernels"] if "radix_sort" in name]
        assert sum(calls for _, calls in radix) == 10   # histogram, exclusive sum, 8 onesweep passes
        measured.append(sum(ms for ms, _ in radix) * 1e-3)
    assert sort_seconds(8192) == pytest.approx(sum(measured) / 2, rel=0.15)


def test_the_gathered_rows_price_their_holders_counting_pass_on_every_rank():
    # distributed/gathered_rows.GatherRowsTP: every rank lays out the T*k gathered rows rank by
    # rank by a counting pass over their holders (routing.holders_order_work), not a radix sort:
    # beyond laying out the rows, less than a sort's passes' waits alone
    full = 16384 * 4096 * 2
    few, many = (internal_copy_seconds("all_gather_rows", full, H200, rows, 8) for rows in (16384, 65536))
    layout = 2 * (2 * full / H200.bandwidth("elementwise") + H200.launch_s)
    assert many > few > layout
    assert few - layout < 8 * H200.sort_pass_s
