"""Tiers with CUDA tensors: side-stream copies, pinned slabs, and the NVMe tier through kvikio (when it is
installed) or through pinned staging buffers. Skipped without CUDA."""
import os

import pytest
import torch

from lazytrain.tiers import DeviceTier, HostTier, NVMeDataError, NVMeTier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 40).to(dtype).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_and_host_tiers_with_cuda_tensors(dtype):
    hbm, host = DeviceTier("hbm", device="cuda"), HostTier()
    assert host.pool.pinned
    x = sample((1000, 37), dtype)
    nc = sample((37, 1000), dtype, seed=1).t()
    for tier in (hbm, host):
        tier.write("x", x)
        tier.write("nc", nc).wait()
        tier.read("x").synchronize()
        got = tier.read("x", device="cuda").wait()
        assert got.is_cuda and torch.equal(got, x)
        out = torch.empty_like(nc)
        tier.read("nc", out=out).wait()
        assert torch.equal(out, nc)
        assert torch.equal(tier.read("x", device="cpu").synchronize(), x.cpu())
    assert host._store["x"].is_pinned()


def test_host_tier_bandwidth_times_the_copies_not_their_queueing():
    host = HostTier()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    host.write("x", x).synchronize()  # warms the slab pool
    host.free("x")
    torch.cuda._sleep(200_000_000)  # the write queues behind ~0.1 s of GPU work
    host.write("x", x).synchronize()
    write, read = host.write_bandwidth(), host.read_bandwidth()
    assert write is not None and 1e9 < write < 1e12  # a PCIe/NVLink copy rate, not bytes over queueing time
    assert read is None


@pytest.mark.parametrize("use_gds", [None, False])  # kvikio where installed / pinned staging
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1000, 37), (1 << 20,)])
def test_nvme_with_cuda_tensors(tmp_path, use_gds, dtype, shape):
    tier = NVMeTier(path=tmp_path, aio={"block_size": 65536, "use_gds": use_gds})
    try:
        x = sample(shape, dtype)
        tier.write("x", x).wait()
        got = tier.read("x", device="cuda").wait()
        assert got.is_cuda and torch.equal(got, x)
        out = torch.zeros_like(x)
        assert tier.read("x", out=out).wait() is out and torch.equal(out, x)
        assert torch.equal(tier.read("x", device="cpu").wait(), x.cpu())
        if use_gds is False:
            assert tier.kvikio_backend is None
    finally:
        tier.close()


@pytest.mark.parametrize("use_gds", [None, False])
def test_nvme_reads_into_a_one_element_cuda_view_with_another_stride(tmp_path, use_gds):
    """``x[:, 1]`` of a one-row ``x``: contiguous, one element, stride 3; it has no ``view(-1)`` byte view."""
    tier = NVMeTier(path=tmp_path, aio={"block_size": 4096, "use_gds": use_gds})
    try:
        tier.write("x", torch.tensor([7.5], device="cuda")).wait()
        whole = torch.zeros(1, 3, device="cuda")
        out = whole[:, 1]
        assert out.is_contiguous() and out.stride() == (3,)
        tier.read("x", out=out).wait()
        assert whole.tolist() == [[0.0, 7.5, 0.0]]
    finally:
        tier.close()


def test_nvme_catches_corruption_of_a_cuda_tensor(tmp_path):
    tier = NVMeTier(path=tmp_path, aio={"block_size": 4096})
    try:
        x = sample((5000,), torch.float32)
        tier.write("x", x).wait()
        path = tier.file_of("x")
        with open(path, "r+b") as f:
            f.seek(5000)
            b = f.read(1)[0]
            f.seek(5000)
            f.write(bytes([b ^ 1]))
        with pytest.raises(NVMeDataError) as e:
            tier.read("x", device="cuda").wait()
        assert str(e.value).startswith(f"tier 'nvme': key 'x': file {path} is corrupted: checksum mismatch in block 1")
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_host_buffers_are_registered_pinned_memory_that_copies_asynchronously(dtype):
    """A host buffer of 1 MiB or more is registered memory of its own size: CUDA sees it as pinned, and
    copies both ways through it, queued without waiting, arrive whole."""
    from lazytrain.tiers.memory import REGISTER_FROM_BYTES, empty_host
    numel = 3 * REGISTER_FROM_BYTES // dtype.itemsize + 7
    host = empty_host(numel, dtype)
    assert host.is_pinned() and host.numel() == numel and host.data_ptr() % 4096 == 0
    x = sample((numel,), dtype)
    host.copy_(x, non_blocking=True)
    back = torch.empty_like(x).copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x)
    del host, back
    import gc
    gc.collect()
    again = empty_host(numel, dtype)                 # the pages were unregistered and can be registered anew
    assert again.is_pinned()


def test_on_a_gpu_an_nvme_read_to_the_device_is_not_overwritten_by_kernels_queued_after_it(tmp_path):
    """A read into new device memory gets its destination when it is issued, on the caller's stream. Were it
    allocated when the file read ends (on an I/O thread), it could be the block of a tensor the caller freed
    meanwhile whose kernels have not run yet: the copy, which follows only what was queued before the
    read, would land first and those kernels would overwrite it."""
    tier = NVMeTier("nvme", path=tmp_path)
    n = 1 << 20
    data = sample((n,), torch.float32).cpu()
    tier.write("k", data).wait()
    try:
        for _ in range(10):
            handle = tier.read("k", device="cuda")
            t = torch.empty(n, device="cuda")   # the size of the read's destination
            torch.cuda._sleep(50_000_000)        # the kernels queued after the read run late
            t.fill_(7.0)
            del t                                # its block is free for this stream before fill_ has run
            got = handle.wait()
            assert torch.equal(got.cpu(), data)
    finally:
        tier.close()


def test_on_a_gpu_a_host_tier_write_from_the_device_waited_for_is_on_the_host():
    """``write(key, cuda_tensor).wait()`` returns once the bytes are in the host buffer (the host may read them
    next), also when the copy runs late behind the caller's queued kernels."""
    host = HostTier()
    try:
        for seed in range(5):
            x = sample((1 << 20,), torch.float32, seed=seed)
            expected = x.cpu()
            torch.cuda._sleep(50_000_000)   # the copy follows this on the device
            host.write("x", x).wait()
            got = host._store["x"].clone()   # read by the host at once, nothing synchronised in between
            assert torch.equal(got, expected)
            host.free("x")
    finally:
        host.close()
