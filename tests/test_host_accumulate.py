"""host_accumulate.add_into: a compute-dtype gradient added into an fp32 host buffer a piece at a time through
a reused scratch gives the sums torch's own mixed-dtype add gives, bit for bit, without its whole-size
temporary; and the buffer's sum of squares taken in the same pass. Each test runs both ways a process may
use: LazyTrain's compiled host kernels, and torch's ops a piece at a time where they do not load."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lazytrain.engine import host_accumulate
from lazytrain.engine.host_accumulate import PIECE, ROW, add_into, scratch_for, sum_of_squares
from lazytrain.optim.kernels import cpu_kernels


@pytest.fixture(autouse=True, params=["kernels", "torch"])
def way(request, monkeypatch):
    """Every test once through the compiled kernels and once through torch's ops."""
    if request.param == "kernels":
        if cpu_kernels() is None:
            pytest.skip("LazyTrain's host kernels did not build here")
    else:
        monkeypatch.setattr(host_accumulate, "_kernels_for", lambda dst: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 1000, 3 * PIECE + 17])
def test_add_into_is_torchs_mixed_add_bit_for_bit(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    dst = torch.randn(numel, generator=g)
    src = (torch.randn(numel, generator=g) * 1e-3).to(dtype)
    expected = dst.clone().add_(src)
    scratch = scratch_for(numel)
    assert scratch.numel() == min(PIECE, numel) and scratch.dtype == torch.float32
    add_into(dst, src, scratch)
    assert torch.equal(dst, expected)


def test_a_scratch_smaller_than_the_gradient_is_reused_piece_by_piece():
    dst, src = torch.zeros(10), torch.arange(10, dtype=torch.bfloat16)
    add_into(dst, src, torch.empty(3))
    assert torch.equal(dst, torch.arange(10, dtype=torch.float32))


def test_a_gradient_of_another_size_is_refused():
    """The pieces would add into a part of the buffer, where add_ broadcasts or raises."""
    with pytest.raises(ValueError, match=r"^add_into: a gradient of 4 elements into a buffer of 10$"):
        add_into(torch.zeros(10), torch.ones(4, dtype=torch.bfloat16), torch.empty(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 1000, 3 * PIECE + 17])
def test_the_square_sum_taken_in_the_add_is_the_buffers_bit_for_bit(dtype, numel):
    """What the sinks take as each piece is added is what the step would read from the buffer afterwards,
    on any thread and thread count (ATen's reduction: BLAS's dot differs between threads); and both are
    the buffer's sum of squares to fp32's rounding."""
    g = torch.Generator().manual_seed(numel)
    dst = torch.randn(numel, generator=g)
    src = torch.randn(numel, generator=g).to(dtype)
    expected = dst.clone().add_(src)
    taken = add_into(dst, src, scratch_for(numel), square_sum=True)
    assert torch.equal(dst, expected)
    assert taken == sum_of_squares(dst)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with ThreadPoolExecutor(1) as pool:
                assert pool.submit(sum_of_squares, dst).result() == sum_of_squares(dst) == taken, n
    finally:
        torch.set_num_threads(threads)
    assert taken == pytest.approx(float(expected.double().square().sum()), rel=1e-5)


def test_a_scratch_that_cuts_other_pieces_cannot_take_the_square_sum():
    with pytest.raises(ValueError, match=r"^add_into: a scratch of 3 elements cuts a buffer of 10 into other "
                                         rf"pieces than sum_of_squares' \({PIECE}\)$"):
        add_into(torch.zeros(10), torch.ones(10, dtype=torch.bfloat16), torch.empty(3), square_sum=True)
    assert add_into(torch.zeros(10), torch.ones(10), torch.empty(10), square_sum=True) == 10.0
    big = 3 * PIECE + 7   # a scratch above a piece would cut pieces of its own size
    with pytest.raises(ValueError, match="cuts a buffer"):
        add_into(torch.zeros(big), torch.ones(big), torch.empty(PIECE + 1000), square_sum=True)


def test_both_ways_add_alike_and_take_the_square_sum_to_fp32s_rounding(way):
    """Each way makes torch's sums bit for bit, and a square sum within fp32's rounding of the exact value
    (the two ways sum in other orders; a process uses one way for both values)."""
    g = torch.Generator().manual_seed(7)
    dst = torch.randn(2 * PIECE + 5 * ROW + 3, generator=g)
    src = torch.randn(dst.numel(), generator=g).to(torch.bfloat16)
    added, pieces = dst.clone(), dst.clone()
    exact = float((dst.double() + src.double()).square().sum())
    taken = add_into(added, src, scratch_for(dst.numel()), square_sum=True)
    for start in range(0, dst.numel(), PIECE):
        pieces[start:start + PIECE].add_(src[start:start + PIECE].float())
    assert torch.equal(added, pieces)
    assert taken == pytest.approx(exact, rel=1e-6)


def test_the_add_counts_as_an_in_place_write(way):
    """A square sum cached against the buffer's version (weights.py) must see every add, the compiled
    kernel's too (it writes past autograd's counter, and counts itself)."""
    buf = torch.zeros(100)
    view = buf[10:60]
    before = buf._version
    add_into(view, torch.ones(50, dtype=torch.bfloat16), scratch_for(50))
    assert buf._version > before and float(buf.sum()) == 50.0


def test_a_negated_view_and_a_source_sharing_the_buffer_add_as_torch_adds_them(way):
    """A view with its negation bit set adds its negated values; a source in the buffer's own memory goes
    torch's way (which sees the overlap), not the compiled pass's."""
    dst = torch.ones(40)
    add_into(dst, torch._neg_view(torch.ones(40, dtype=torch.bfloat16)), scratch_for(40))
    assert torch.equal(dst, torch.zeros(40))
    buf = torch.arange(8, dtype=torch.float32)
    expected = buf[:4].clone().add_(buf[4:])
    assert add_into(buf[:4], buf[4:], scratch_for(4), square_sum=True) == sum_of_squares(buf[:4])
    assert torch.equal(buf[:4], expected)


def test_the_square_sum_of_a_source_the_compiled_pass_does_not_take_is_sum_of_squares(way):
    """An fp64 source is added a piece at a time (each rounded to fp32 first); the square sum returned is still
    the buffer's sum_of_squares, bit for bit."""
    dst = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    src = torch.randn(5000, dtype=torch.float64)
    expected = dst.clone().add_(src)
    taken = add_into(dst, src, scratch_for(5000), square_sum=True)
    assert torch.allclose(dst, expected, rtol=1e-6, atol=1e-6) and taken == sum_of_squares(dst)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("square_sum", [False, True])
@pytest.mark.parametrize("layout", ["aligned", "offset", "scalar"])
def test_into_a_buffer_known_zero_the_add_writes_the_same_bits_without_reading_it(dtype, square_sum, layout, way):
    """dst_is_zero: the compiled pass writes 0 + src (a -0 of src becomes +0, as the add makes it) and its
    square sum as the add takes them, bit for bit, whether it streams its stores (a 32-byte aligned buffer),
    stores them as the add does (a buffer one element off alignment) or runs its scalar loop; torch's pieces
    add as always. The compiled pass does not read dst: over a buffer that is not zero it still writes
    0 + src (the caller's promise is what it uses; checked with the square sum, which every source dtype
    takes through the compiled pass)."""
    numel = 2 * PIECE + 33
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(numel, generator=g) * 1e-3).to(dtype)
    src[::97] = -0.0
    scratch = scratch_for(numel)
    start = 1 if layout == "offset" else 0
    added, from_zero = torch.zeros(numel), torch.zeros(numel + start)[start:]
    assert (from_zero.data_ptr() % 32 == 0) == (layout != "offset")
    kernels = cpu_kernels()
    if layout == "scalar" and kernels is not None:
        kernels.set_force_scalar(True)
    try:
        _check_known_zero_add(added, from_zero, src, scratch, square_sum, way)
    finally:
        if kernels is not None:
            kernels.set_force_scalar(False)


def _check_known_zero_add(added, from_zero, src, scratch, square_sum, way):
    numel = src.numel()
    sums = (add_into(added, src, scratch, square_sum=square_sum),
            add_into(from_zero, src, scratch, square_sum=square_sum, dst_is_zero=True))
    assert torch.equal(added.view(torch.int32), from_zero.view(torch.int32)) and sums[0] == sums[1]
    assert not torch.signbit(from_zero[::97]).any()
    stale = torch.ones(numel)
    add_into(stale, src, scratch, square_sum=True, dst_is_zero=True)
    assert torch.equal(stale, added if way == "kernels" else added + 1)
