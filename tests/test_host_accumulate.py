"""host_accumulate.add_into: a compute-dtype gradient added into an fp32 host buffer a piece at a time through
a reused scratch gives the sums torch's own mixed-dtype add gives, bit for bit, without its whole-size
temporary."""
import pytest
import torch

from lazytrain.engine.host_accumulate import PIECE, add_into, scratch_for


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
