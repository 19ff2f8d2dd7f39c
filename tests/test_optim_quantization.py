"""Blockwise 8-bit quantization: exact encoder, error bounds, bitsandbytes format compatibility."""
import numpy as np
import pytest
import torch

from lazytrain.optim.quantization import (build_encoder_table, create_dynamic_map, dequantize_blockwise, encode,
                                          get_qmap, quantize_blockwise)

MAPS = ("dynamic", "udynamic")


def _hard_values(qm, n=200_000, seed=0):
    """Heavy-tailed values in [-1, 1] plus every decision boundary and its fp32 neighbours."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)).clamp(-1, 1)
    v = qm.values.double()
    mids = ((v[1:] + v[:-1]) / 2).float()
    up, down = torch.full_like(mids, 2.0), torch.full_like(mids, -2.0)
    edge = torch.cat([mids, torch.nextafter(mids, up), torch.nextafter(mids, down), qm.values,
                      torch.nextafter(qm.values, torch.full_like(qm.values, 2.0)),
                      torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, 3e-7, 1.6e-7, 2.7e-7])])
    x = torch.cat([x, edge, -edge])
    if qm.name == "udynamic":
        x = x.abs()
    return x


def test_dynamic_maps_equal_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        assert torch.equal(create_dynamic_map(signed=signed), F.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("name", MAPS)
def test_torch_encoder_is_exact_nearest(name):
    qm = get_qmap(name)
    x = _hard_values(qm)
    codes = encode(x, qm).numpy().astype(np.int64)
    np.testing.assert_array_equal(codes, qm.reference(x))


def _blockwise_reference(A, absmax, qm, block_size):
    nb = absmax.numel()
    pad = nb * block_size - A.numel()
    x = torch.nn.functional.pad(A.float(), (0, pad)).view(nb, block_size) * (1.0 / absmax)[:, None]
    return qm.reference(x.reshape(-1)[: A.numel()])


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("scalar", [False, True])
def test_kernel_encoder_is_exact_nearest(k, name, scalar):
    qm = get_qmap(name)
    # a leading 1.0 makes the first block's scale exactly 1: its codes are the encoder's codes of x itself
    x = torch.cat([torch.ones(1), _hard_values(qm, n=100_000)])
    k.set_force_scalar(scalar)
    try:
        codes, absmax = quantize_blockwise(x, qm, block_size=16384)
    finally:
        k.set_force_scalar(False)
    assert absmax[0] == 1.0
    np.testing.assert_array_equal(codes.numpy().astype(np.int64), _blockwise_reference(x, absmax, qm, 16384))


def test_positive_floor_only_for_second_moment():
    tiny = torch.tensor([0.0, 1e-12, 1e-9, 1e-45, 1.5e-7])
    qs, qu = get_qmap("dynamic"), get_qmap("udynamic")
    assert encode(tiny, qs).tolist() == [qs.zero_code] * 5  # nearest: all round to 0
    assert encode(-tiny, qs).tolist() == [qs.zero_code] * 5
    assert qu.positive_floor == 1 and qu.values[1] > 0 and qu.values[0] == 0
    assert encode(tiny, qu).tolist() == [0, 1, 1, 1, 1]  # a positive second moment never decodes to 0
    with pytest.raises(ValueError, match="non-negative"):
        quantize_blockwise(-tiny, qu)


def test_encoder_table_rejects_too_fine_map():
    fine = create_dynamic_map(signed=True)
    fine[200], fine[201] = fine[199] + 1e-6, fine[199] + 2e-6  # two boundaries inside one table bucket
    with pytest.raises(ValueError, match="too fine"):
        build_encoder_table(fine)


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("block_size", [64, 256, 2048])
def test_error_bound(name, block_size):
    qm = get_qmap(name)
    g = torch.Generator().manual_seed(1)
    A = torch.randn(50_001, generator=g) * torch.exp(torch.randn(50_001, generator=g))
    if name == "udynamic":
        A = A.abs()
    codes, absmax = quantize_blockwise(A, qm, block_size)
    D = dequantize_blockwise(codes, absmax, qm, block_size)
    nb = absmax.numel()
    scale = torch.repeat_interleave(absmax, block_size)[: A.numel()]
    # every error is at most half the largest gap of the map, or the distance from -1 to the most negative
    # value (0.00703 signed, 0.00352 unsigned), times absmax, plus fp32 rounding of the product
    v = qm.values.double()
    bound = max(float((v[1:] - v[:-1]).max() / 2), float(1 + v[0]) if name == "dynamic" else 0.0)
    assert bound < (0.00704 if name == "dynamic" else 0.00352)
    err = (D - A).abs()
    assert torch.all(err <= scale * (bound + 2 ** -22))
    # and it is the distance to the nearest code (the encoder is exact)
    np.testing.assert_array_equal(codes.numpy().astype(np.int64), _blockwise_reference(A, absmax, qm, block_size))
    # absmax is the exact block maximum
    assert torch.equal(absmax[:-1], A.abs()[: (nb - 1) * block_size].view(nb - 1, block_size).amax(1))
    assert absmax[-1] == A.abs()[(nb - 1) * block_size:].max()


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("block_size", [96, 256, 4096])
def test_kernel_matches_torch_path(k, name, block_size):
    g = torch.Generator().manual_seed(2)
    A = torch.randn(100_003, generator=g) * torch.exp(torch.randn(100_003, generator=g) * 3)
    if name == "udynamic":
        A = A.abs()
    c1, a1 = quantize_blockwise(A, name, block_size, use_kernel=True)
    c2, a2 = quantize_blockwise(A, name, block_size, use_kernel=False)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    out = torch.empty(A.numel())
    k.dequantize_blockwise(c1, a1, get_qmap(name), block_size, out)
    assert torch.equal(out, dequantize_blockwise(c1, a1, name, block_size))


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("block_size", [256, 2048])
def test_format_round_trips_with_bitsandbytes(name, block_size):
    F = pytest.importorskip("bitsandbytes.functional")
    from bitsandbytes.functional import QuantState
    qm = get_qmap(name)
    g = torch.Generator().manual_seed(3)
    A = torch.randn(64 * block_size + 77, generator=g) * torch.exp(torch.randn(64 * block_size + 77, generator=g))
    if name == "udynamic":
        A = A.abs()
    ours, absmax = quantize_blockwise(A, qm, block_size)
    theirs, st = F.quantize_blockwise(A, code=qm.values, blocksize=block_size)
    # same layout: codes shaped like A, one fp32 absmax per block, identical absmax
    assert theirs.shape == ours.shape and theirs.dtype == ours.dtype == torch.uint8
    assert torch.equal(st.absmax, absmax)
    # their decoder reads our codes exactly as ours does, and vice versa
    qs = QuantState(absmax=absmax, code=qm.values, blocksize=block_size, dtype=torch.float32)
    assert torch.equal(F.dequantize_blockwise(ours, qs), dequantize_blockwise(ours, absmax, qm, block_size))
    assert torch.equal(F.dequantize_blockwise(theirs, st), dequantize_blockwise(theirs, absmax, qm, block_size))
    # codes agree except where bitsandbytes' CPU encoder is not nearest; ours is never farther from A
    d_ours = (dequantize_blockwise(ours, absmax, qm, block_size) - A).abs()
    d_theirs = (F.dequantize_blockwise(theirs, st) - A).abs()
    scale = torch.repeat_interleave(absmax, block_size)[: A.numel()]
    assert torch.all(d_ours <= d_theirs + scale * 1e-6)
    same = (ours == theirs).float().mean().item()
    assert same > 0.5, same
