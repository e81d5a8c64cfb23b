"""Which product widths run on aligned GPU kernels, and which products the rewrite pads."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from autotp.cost_model import get_profile
from autotp.cost_model.alignment import (Align, aligned, aligned_width, alignment, pads, padding_pays,
                                         padding_rows, product_aligned)


def test_alignment_is_sixteen_bytes_of_the_dtype():
    assert [alignment(b) for b in (1, 2, 4, 8)] == [16, 8, 4, 2]
    assert alignment() == 8   # bf16/fp16, what products train in


@given(n=st.integers(1, 10**6), dtype_bytes=st.sampled_from([2, 4, 8]))
def test_aligned_width_is_the_smallest_aligned_width_not_below_n(n, dtype_bytes):
    width = aligned_width(n, dtype_bytes)
    assert aligned(width, dtype_bytes) and n <= width < n + alignment(dtype_bytes)
    assert (width == n) == aligned(n, dtype_bytes)


def test_gpt2_vocabulary_split_eight_ways_is_unaligned_and_pads_to_one_width():
    """GPT-2's head at tp 8: ranks of 6283 and 6282 rows; every rank runs 6288."""
    widths = [6283] + [6282] * 7
    assert not any(aligned(n) for n in widths) and product_aligned(6288, 1600)
    assert pads(widths, [1600], rows=8192, align=Align()) == 6288
    assert pads([50257], [768], rows=8192, align=Align()) == 50264   # tp 1: the whole head


def test_nothing_is_padded_where_it_cannot_help_or_is_not_asked():
    assert pads([6283], [1600], rows=8192, align=None) is None      # not asked
    assert pads([6288], [1600], rows=8192, align=Align()) is None   # aligned already
    assert pads([6283], [1601], rows=8192, align=Align()) is None   # K unaligned: padding N mends nothing
    assert pads([6283], [1600], rows=8, align=Align(100.0)) is None  # a decode step's few rows


def test_padding_pays_from_the_profiles_roofline_ridge():
    h100 = get_profile("h100-dgx")
    assert padding_rows(h100) == h100.flops * 2 / h100.mem_bw   # 295 rows
    assert padding_pays(8192, h100) and not padding_pays(8, h100)
    assert Align.for_profile(h100) == Align(padding_rows(h100))


def test_parallelize_pads_by_default_on_cuda_only():
    from autotp.api import _align

    h100 = get_profile("h100-dgx")
    assert _align(None, torch.device("cpu"), None) is None
    assert _align(None, torch.device("cuda", 0), "h100-dgx") == Align.for_profile(h100)
    assert _align(True, torch.device("cpu"), None) == Align()
    assert _align(False, torch.device("cuda", 0), None) is None
