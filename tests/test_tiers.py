"""Memory tiers, the slab pool, the registry and create_tiers."""
import asyncio
import time

import pytest
import torch

from cuda_standins import StandInCudart, StandInDevices

from lazytrain.tiers import (DeviceTier, HostTier, NVMeTier, SlabPool, Tier, TierBudgetError, TierError,
                             TransferHandle, create_tiers, format_bytes, parse_bytes, register_tier)
from lazytrain.tiers.pool import size_class

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 40).to(dtype)


@pytest.mark.parametrize("tier_cls", [DeviceTier, HostTier])
@pytest.mark.parametrize("dtype", DTYPES)
def test_memory_round_trip(tier_cls, dtype):
    tier = tier_cls("t", device="cpu")
    x = sample((33, 7), dtype)
    nc = sample((7, 33), dtype).t()
    assert not nc.is_contiguous()
    tier.write("x", x).wait()
    tier.write("nc", nc).wait()
    x_orig, nc_orig = x.clone(), nc.clone()
    x.zero_()
    nc.zero_()  # writes took snapshots
    assert torch.equal(tier.read("x").wait(), x_orig)
    out = torch.empty_like(nc_orig)
    assert tier.read("nc", out=out).wait() is out
    assert torch.equal(out, nc_orig)
    # the host tier counts the aligned slab each copy fills (4 KiB pages here), the device tier the tensors
    assert tier.used_bytes == (2 * 4096 if tier_cls is HostTier else 2 * 33 * 7 * x.element_size())


def test_budget_error_names_tier_budget_and_request():
    tier = DeviceTier("host", capacity="10KB", device="cpu")
    tier.write("a", torch.zeros(2000)).wait()  # 8000 bytes
    with pytest.raises(TierBudgetError) as e:
        tier.write("b", torch.zeros(1000))
    assert str(e.value) == ("tier 'host' is over its budget: writing 'b' (3.9 KiB) would bring its use to 11.7 KiB, "
                            "but its capacity is 9.8 KiB (7.8 KiB in use). Raise the tier's capacity in the config "
                            "or place fewer tensors on it.")
    assert "b" not in tier and tier.used_bytes == 8000
    tier.write("a", torch.zeros(2500)).wait()  # overwriting frees the old value first
    assert tier.used_bytes == 10000 and tier.peak_bytes == 10000
    tier.free("a")
    assert tier.used_bytes == 0 and tier.peak_bytes == 10000
    tier.reset_peak()
    assert tier.peak_bytes == 0


def test_budget_error_gives_exact_counts_where_the_rounded_sizes_look_equal():
    """1,056,768 bytes against 1 MiB both read "1.0 MiB": the message then says the bytes."""
    tier = DeviceTier("host", capacity="1MiB", device="cpu")
    tier.write("a", torch.zeros(516 * 1024, dtype=torch.uint8)).wait()
    with pytest.raises(TierBudgetError) as e:
        tier.write("b", torch.zeros(516 * 1024, dtype=torch.uint8))
    assert str(e.value) == ("tier 'host' is over its budget: writing 'b' (516.0 KiB) would bring its use to 1.0 MiB "
                            "(1,056,768 bytes), but its capacity is 1.0 MiB (1,048,576 bytes) (516.0 KiB in use). "
                            "Raise the tier's capacity in the config or place fewer tensors on it.")


def test_read_missing_key_and_bad_out():
    tier = HostTier()
    with pytest.raises(TierError, match="^tier 'host' holds no tensor under key 'nope'$"):
        tier.read("nope")
    tier.write("a", torch.zeros(3, 4)).wait()
    with pytest.raises(ValueError) as e:
        tier.read("a", out=torch.zeros(4, 3))
    assert str(e.value) == ("tier 'host': read of 'a' into a buffer of (4, 3) torch.float32, but it holds (3, 4) "
                            "torch.float32")
    with pytest.raises(TypeError, match="^tier 'host': write of 'b' needs a torch.Tensor, got list$"):
        tier.write("b", [1, 2])


@pytest.mark.parametrize("tier_cls", [DeviceTier, HostTier])
def test_a_read_racing_a_free_of_its_key_raises_the_tiers_error(tier_cls):
    """The key is freed by another thread between the read's check and its lookup (widened here: the check
    frees it): the reader gets the tier's error, not a bare KeyError."""
    tier = tier_cls("t")
    tier.write("k", torch.zeros(3)).wait()
    armed = [True]

    class FreedWhileChecked(dict):
        def __contains__(self, key):
            held = dict.__contains__(self, key)
            if held and armed and armed.pop():   # once: the free itself asks too
                tier.free(key)
            return held
    tier._sizes = FreedWhileChecked(tier._sizes)
    with pytest.raises(TierError, match=f"^tier '{tier.name}' holds no tensor under key 'k'$"):
        tier.read("k")


def test_a_failed_read_adds_no_time_to_the_tiers_bandwidth(monkeypatch):
    import time as time_module
    tier = DeviceTier("d", device="cpu")
    tier.write("k", torch.ones(1 << 16)).wait()
    tier.read("k", out=torch.empty(1 << 16)).wait()
    seconds, nbytes = tier._meters["read"].seconds, tier._meters["read"].nbytes
    real = tier._read

    def slow_then_wrong(key, out, device):
        time_module.sleep(0.2)
        return real(key, out, device)
    monkeypatch.setattr(tier, "_read", slow_then_wrong)
    with pytest.raises(ValueError):
        tier.read("k", out=torch.empty(3)).wait()
    assert (tier._meters["read"].seconds, tier._meters["read"].nbytes) == (seconds, nbytes)


def test_a_read_that_failed_on_a_copy_thread_does_not_fail_the_reads_after_it():
    """A read fails (the stored buffer changed before its copy ran) and leaves its source as it was: the
    next read of the key copies it, as on CUDA, instead of failing again with the old error forever."""
    import threading
    from lazytrain.tiers import streams
    streams.configure(copy_threads=True)
    try:
        tier, gate = HostTier("host"), threading.Event()
        tier.write("k", torch.arange(6.0)).wait()
        stored = tier.read("k").wait()                  # the buffer itself (a read on the host moves nothing)
        streams.host_stream("h2d").submit(gate.wait)    # the read's copy runs once the gate opens
        failed = tier.read("k", out=torch.empty(6))
        stored.add_(10)
        gate.set()
        with pytest.raises(TierError, match="modified in place before its asynchronous copy"):
            failed.wait()
        out = torch.empty(6)
        assert tier.read("k", out=out).wait() is out and out.tolist() == [10.0, 11, 12, 13, 14, 15]
        tier.free("k")
        tier.close()
        assert tier.pool.stats()["reserved_bytes"] == 0
    finally:
        streams.configure()


def test_a_read_racing_an_overwrite_keeps_the_read_after_ordered_after_the_new_write(monkeypatch):
    """A read of the old buffer issued while another thread rewrites the key must not leave its own event
    as the key's: the next read waits for the new write's copy, never hands out its unfilled buffer."""
    import threading
    from lazytrain.tiers import memory, streams
    streams.configure(copy_threads=True)
    try:
        tier, gate = HostTier("host"), threading.Event()
        tier.write("k", torch.zeros(1000)).wait()
        real_copy, first = memory.async_copy, [True]

        def read_then_overwrite(dst, src, *args, **kwargs):
            handle = real_copy(dst, src, *args, **kwargs)
            if kwargs.get("direction") == "h2d" and first[0]:   # the read's copy is queued, not yet recorded
                first[0] = False
                streams.host_stream("d2h").submit(gate.wait)    # the overwrite's copy waits for the gate
                writers.append(threading.Thread(target=tier.write, args=("k", torch.ones(1000))))
                writers[0].start()   # the overwrite runs now, or (the read holding the tier) once it is recorded
                writers[0].join(0.2)
                handle._future.exception()
            return handle
        writers = []
        monkeypatch.setattr(memory, "async_copy", read_then_overwrite)
        tier.read("k", out=torch.empty(1000)).wait()
        monkeypatch.setattr(memory, "async_copy", real_copy)
        writers[0].join()
        threading.Timer(0.2, gate.set).start()
        assert torch.equal(tier.read("k").wait(), torch.ones(1000))
        tier.close()
    finally:
        streams.configure()


def test_a_read_waiting_on_a_host_event_does_not_hold_the_tier_while_a_failed_write_cleans_up():
    """Issuing a copy may wait on a write's host event (CUDA with copy threads; the CPU without them): that
    wait is outside the tier's lock, which the copy thread takes to give up a write that failed before it."""
    import threading
    from lazytrain.tiers import streams
    streams.configure(copy_threads=True)
    try:
        tier, gate, done = HostTier("host"), threading.Event(), threading.Event()
        streams.host_stream("d2h").submit(gate.wait)   # the writes' copies wait for the gate
        a = torch.ones(1000)
        tier.write("a", a)
        a.add_(1)                                      # a's copy fails: its source changed before it ran
        tier.write("b", torch.full((1000,), 2.0))
        streams.configure(copy_threads=False)          # the read's copy waits on b's event in the caller
        got = []
        reader = threading.Thread(target=lambda: (got.append(tier.read("b", out=torch.empty(1000)).wait()),
                                                  done.set()), daemon=True)
        reader.start()
        threading.Timer(0.2, gate.set).start()
        assert done.wait(30), "the read and the failed write's clean-up deadlocked"
        assert torch.equal(got[0], torch.full((1000,), 2.0)) and "a" not in tier
        tier.close()
    finally:
        streams.configure()


def test_closing_a_host_tier_whose_copies_fail_returns_and_the_handles_say_why():
    """Each write's copy fails (its source changed before the copy thread read it); close() waits for the
    copies outside the tier's lock, which a failed write's clean-up takes on the copy thread."""
    import threading
    from lazytrain.tiers import streams
    streams.configure(copy_threads=True, chaos=streams.Chaos(0, 0.3))
    try:
        tier = HostTier("host")
        sources = [torch.ones(1024) for _ in range(3)]
        handles = [tier.write(f"k{i}", t) for i, t in enumerate(sources)]
        for t in sources:
            t.add_(1)
        closer = threading.Thread(target=tier.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung"
        for h in handles:
            with pytest.raises(Exception):
                h.wait()
    finally:
        streams.configure()


def test_handles_await_and_stats():
    tier = HostTier()
    x = torch.arange(10.0)

    async def go():
        await tier.write("x", x)
        return await tier.read("x")
    assert torch.equal(asyncio.run(go()), x)
    handle = tier.read("x")
    assert isinstance(handle, TransferHandle) and handle.done()
    assert torch.equal(handle.synchronize(), x)
    stats = tier.stats()
    # both reads handed out the stored tensor: no bytes moved, so none are counted
    assert stats["bytes_written"] == 40 and stats["bytes_read"] == 0 and stats["read_bandwidth"] is None
    assert stats["write_bandwidth"] > 0
    assert stats["used_bytes"] == 4096 and stats["pool"]["misses"] == 1   # one page-aligned slab
    out = torch.empty(10)
    tier.read("x", out=out).wait()             # a copy into the caller's buffer is counted
    assert torch.equal(out, x) and tier.stats()["bytes_read"] == 40 and tier.read_bandwidth() > 0


class _FakeCopyEvent:
    """Stands in for a CUDA timing event: complete once ``ran`` is set, at ``at_ms`` on the device clock."""

    def __init__(self, at_ms):
        self.at_ms, self.ran = at_ms, False

    def query(self):
        return self.ran

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


class _QueuedCopyTier(Tier):
    """A tier whose copies are only queued when write returns, like a copy on a CUDA side stream."""

    def __init__(self):
        super().__init__("queued")
        self.events = []

    def _write(self, key, tensor, owned):
        start, end = _FakeCopyEvent(1000.0 * len(self.events)), _FakeCopyEvent(1000.0 * len(self.events) + 250.0)
        self.events.append(end)
        return TransferHandle(event=end, timing=(start, end))

    def _read(self, key, out, device):
        return TransferHandle(value=out)

    def _free(self, key):
        pass


def test_bandwidth_of_queued_copies_is_timed_by_their_device_events():
    tier = _QueuedCopyTier()
    tier.write("a", torch.zeros(250_000))  # 1 MB, queued
    time.sleep(0.01)  # host time between queueing and asking must not count
    assert tier.write_bandwidth() is None  # nothing has run yet
    tier.write("b", torch.zeros(250_000))
    tier.events[0].ran = True
    assert tier.write_bandwidth() == pytest.approx(1e6 / 0.25)  # only a's 250 ms on the device
    tier.events[1].ran = True
    assert tier.write_bandwidth() == pytest.approx(2e6 / 0.5)
    assert tier.stats()["bytes_written"] == 2_000_000


class _FakeDeviceEvent:
    """Stands in for a CUDA event of a copy into device memory."""
    device = torch.device("cuda", 0)

    def __init__(self):
        self.synchronized = False

    def query(self):
        return self.synchronized

    def synchronize(self):
        self.synchronized = True


def test_synchronize_blocks_the_host_without_queuing_a_stream_wait(monkeypatch):
    """A worker thread (an NVMe read's) that waits for a device copy on the host must not make its current
    stream, the default stream, which is the compute stream, wait for that copy as well."""
    def no_stream(*args, **kwargs):
        raise AssertionError("synchronize() queued a wait on a CUDA stream")
    monkeypatch.setattr(torch.cuda, "current_stream", no_stream)
    value, event = torch.ones(3), _FakeDeviceEvent()
    handle = TransferHandle(value=value, event=event, keepalive=torch.zeros(3))
    assert handle.synchronize() is value and event.synchronized and handle.done()
    assert handle.synchronize() is value   # a second call has nothing left to wait for
    with pytest.raises(AssertionError, match="queued a wait"):   # wait(): the compute side follows the copy
        TransferHandle(value=value, event=_FakeDeviceEvent()).wait()


@pytest.mark.parametrize("kind", ["host", "nvme"])
def test_a_refused_overwrite_keeps_the_old_value(kind, tmp_path):
    tier = HostTier("t", capacity=8000) if kind == "host" else NVMeTier("t", capacity=8000, path=str(tmp_path))
    tier.write("a", torch.ones(1000)).wait()
    with pytest.raises(TierBudgetError, match="writing 'a' \\(11.7 KiB(, held in 12.0 KiB)?\\) would bring its use to 1"):
        tier.write("a", torch.ones(3000))
    assert "a" in tier and tier.used_bytes == 4096   # a host slab, a file of whole 4 KiB blocks
    assert torch.equal(tier.read("a").wait(), torch.ones(1000))
    tier.close()


@pytest.mark.parametrize("tier_cls", [DeviceTier, HostTier])
def test_writing_a_parameter_stores_its_values_without_autograd_history(tier_cls):
    tier = tier_cls("t")
    p = torch.nn.Parameter(torch.randn(300))
    for owned in (False, True):
        tier.write(f"p{owned}", p, owned=owned).wait()
        got = tier.read(f"p{owned}").wait()
        assert torch.equal(got, p.detach()) and not got.requires_grad and got.grad_fn is None


@pytest.mark.parametrize("tier_cls", [DeviceTier, HostTier])
def test_threads_reading_freeing_and_overwriting_keys_on_a_memory_tier(tier_cls):
    """A read racing a free is a TierError, never a KeyError; a write racing a free or another write of
    its key never leaves a buffer behind: the tier holds what its accounting says, and no more."""
    from tier_stress import race_reads_frees_and_writes
    tier = tier_cls("t", device="cpu")
    errors, reads = race_reads_frees_and_writes(tier, numel=20000)
    assert errors == [] and reads > 0
    assert sorted(tier._store) == sorted(tier.keys())
    if tier_cls is HostTier:
        assert sorted(tier._slabs) == sorted(tier.keys())
        tier.close()
        assert tier.pool.stats()["reserved_bytes"] == 0


def test_host_tier_counts_the_slabs_it_fills_so_its_memory_stays_within_capacity():
    tier = HostTier("host", capacity="1MB")
    n = 0
    with pytest.raises(TierBudgetError, match=r"writing 'k14' \(64.0 KiB, held in 68.0 KiB\)"):
        for n in range(20):                         # 65540-byte tensors fill 68 KiB slabs
            tier.write(f"k{n}", torch.zeros(65540, dtype=torch.uint8)).wait()
    assert n == 14 and tier.used_bytes == 14 * 68 * 1024
    assert tier.pool.stats()["reserved_bytes"] == tier.used_bytes <= tier.capacity
    owned = torch.zeros(1000)                        # kept as it is: its own bytes
    tier.write("owned", owned, owned=True).wait()
    assert tier.used_bytes == 14 * 68 * 1024 + 4000


def test_host_tier_reuses_slabs_but_never_one_still_viewed():
    tier = HostTier()
    tier.write("a", torch.full((1000,), 1.0)).wait()
    held = tier.read("a").wait()  # a view of a's slab
    tier.free("a")
    tier.write("b", torch.full((1000,), 2.0)).wait()  # must not reuse a's slab
    assert torch.equal(held, torch.full((1000,), 1.0))
    assert tier.pool.stats()["hits"] == 0
    tier.free("b")  # b's slab is not viewed outside: back in the pool
    tier.write("c", torch.full((900,), 3.0)).wait()
    assert tier.pool.stats()["hits"] == 1
    assert torch.equal(tier.read("c").wait(), torch.full((900,), 3.0))


def test_slab_pool_alignment_classes_and_limit():
    assert size_class(1) == 4096
    assert size_class(64 * 1024) == 64 * 1024
    assert size_class(64 * 1024 + 1) == 68 * 1024  # sixteenth steps above 64 KiB
    assert size_class(100 << 20) == 100 << 20
    assert size_class((100 << 20) + 1) == 104 << 20
    assert all(size_class(n) <= max(n * 17 / 16, 64 * 1024) for n in range(1, 1 << 30, 9_999_991))
    assert size_class(64 << 20) == 64 << 20
    pool = SlabPool(pinned=False, limit_bytes=3 * 4096)
    slabs = [pool.acquire(100) for _ in range(3)]
    assert all(s.data_ptr() % 4096 == 0 and s.numel() == 4096 for s in slabs)
    for s in slabs:
        pool.release(s)
    assert pool.stats()["cached_bytes"] == 3 * 4096
    big = pool.acquire(8192)  # over the limit: idle slabs are dropped first
    assert pool.stats()["reserved_bytes"] == 8192 + 4096 and big.numel() == 8192
    pool.trim()
    assert pool.stats()["cached_bytes"] == 0


@pytest.mark.parametrize("shift", [0, 64])
def test_a_pinned_slab_asks_for_its_own_size_when_the_block_is_aligned(monkeypatch, shift):
    """torch's pinned allocator rounds each request up to a power of two: a slab of 512 KiB asked as 512 KiB
    plus the alignment would pin 1 MiB. Its blocks start on a page; where one does not (``shift``), the slab
    is cut from a larger block as for pageable memory. (From 1 MiB on, slabs are registered memory, below.)"""
    from lazytrain.tiers.pool import aligned_empty
    real_empty, asked = torch.empty, []

    def pinned_empty(n, dtype=None, pin_memory=False):   # blocks at a page boundary plus ``shift``
        asked.append((n, pin_memory))
        raw = real_empty(n + 2 * 4096, dtype=dtype)
        start = (-raw.data_ptr()) % 4096 + shift
        return raw[start:start + n]
    monkeypatch.setattr(torch, "empty", pinned_empty)
    slab = aligned_empty(1 << 19, pinned=True)
    assert slab.numel() == 1 << 19 and slab.data_ptr() % 4096 == 0
    assert asked == ([(1 << 19, True)] if shift == 0 else [(1 << 19, True), ((1 << 19) + 4096, True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_pinned_buffers_are_registered_memory_of_their_own_size(monkeypatch, dtype):
    """From 1 MiB on a pinned host buffer is page-aligned memory of exactly its size, registered with
    CUDA (torch's pinned allocator would round it up to a power of two) and unregistered once the last
    tensor over it is gone; smaller ones, and any CUDA refuses to register, come from torch's allocator."""
    import gc

    from lazytrain.tiers import memory
    cudart = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    StandInDevices(monkeypatch, cudart)
    monkeypatch.setattr(memory, "pinned_memory_available", lambda: True)
    real_empty, from_torch = torch.empty, []
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: from_torch.append(a) or real_empty(*a, **k))
    numel = 300_001                                          # 1.2 MB in fp32, 600 kB in bf16
    buf = memory.empty_host(numel, dtype)
    if numel * dtype.itemsize < memory.REGISTER_FROM_BYTES:
        assert cudart.registered == [] and from_torch == [(numel,)]
        return
    assert buf.shape == (numel,) and buf.dtype == dtype and bool((buf == 0).all())
    assert cudart.registered == [(buf.data_ptr(), numel * dtype.itemsize, 0)] and buf.data_ptr() % 4096 == 0
    assert from_torch == []
    view = buf[10:20]
    del buf
    gc.collect()
    assert cudart.unregistered == []                         # a view still holds it
    view.fill_(1)
    ptr = view.data_ptr() - 10 * dtype.itemsize
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]
    from lazytrain.tiers.pool import aligned_empty
    slab = aligned_empty(1 << 21, pinned=True)               # the tiers' slabs too
    assert slab.numel() == 1 << 21 and cudart.registered[-1] == (slab.data_ptr(), 1 << 21, 0)
    cudart.fail = True                                       # refused: torch's allocator instead
    assert memory.empty_host((numel,), dtype).shape == (numel,) and from_torch == [((numel,),)]


def test_host_memory_is_registered_in_a_cuda_context_the_process_already_has(monkeypatch):
    """A thread that set no device (an NVMe tier's I/O thread, whichever thread drops a buffer's last view)
    has GPU 0 current: registering or unregistering there would create a CUDA context on GPU 0 in every rank
    of a node. Both run on a device that already has one, the current device first, as torch's pinned
    allocator does; in a forked child, which cannot use its parent's CUDA, nothing is unregistered."""
    import gc

    from lazytrain.tiers import memory
    from lazytrain.tiers.pool import aligned_empty
    cudart = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    devices = StandInDevices(monkeypatch, cudart, with_context=(1,))   # rank 1: its GPU is 1
    monkeypatch.setattr(memory, "pinned_memory_available", lambda: True)
    buf = memory.empty_host(1 << 20, torch.float32)
    slab = aligned_empty(1 << 21, pinned=True)
    del buf, slab
    gc.collect()
    # each unregistered after the device's queued copies are over
    assert devices.calls == [("cudaHostRegister", 1), ("cudaHostRegister", 1), ("synchronize", 1),
                             ("cudaHostUnregister", 1), ("synchronize", 1), ("cudaHostUnregister", 1)]
    assert devices.current == 0
    devices.current = 1                                    # the thread's own device when it has a context
    del devices.calls[:]
    buf = memory.empty_host(1 << 20, torch.float32)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    del buf
    gc.collect()
    assert devices.calls == [("cudaHostRegister", 1)] and len(cudart.unregistered) == 2


def test_a_refused_registration_leaves_no_cuda_error_behind(monkeypatch):
    """CUDA keeps the error of a runtime call it refused as the thread's last error, and torch's next
    kernel-launch check (cudaGetLastError) raises it as that kernel's own: a registration CUDA refuses, whose
    buffer then comes from torch's allocator, takes its error back from the runtime torch loaded."""
    import ctypes
    import os

    from lazytrain.tiers import memory
    cudart = StandInCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    StandInDevices(monkeypatch, cudart)
    monkeypatch.setattr(memory, "pinned_memory_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    taken = []

    class Runtime:   # the CUDA runtime torch loaded, under its name; another would not be loaded
        def __init__(self, name, mode=0):
            if name != "libcudart.so.12" or not mode & os.RTLD_NOLOAD:
                raise OSError(f"{name}: not loaded")

        def cudaGetLastError(self):
            taken.append(True)
            return 1
    monkeypatch.setattr(ctypes, "CDLL", Runtime)
    buf = memory.empty_host(1 << 20, torch.float32)
    assert buf.numel() == 1 << 20 and len(cudart.registered) == 1 and taken == [True]


def test_pinned_memory_let_go_of_is_handed_back_to_the_system(monkeypatch):
    """torch keeps freed pinned blocks cached (pinned) until its host cache is emptied."""
    from lazytrain.tiers import memory
    emptied = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: emptied.append(True), raising=False)
    monkeypatch.setattr(memory, "pinned_memory_available", lambda: False)
    memory.release_cached_pinned_memory()   # no accelerator: nothing was pinned
    assert emptied == []
    monkeypatch.setattr(memory, "pinned_memory_available", lambda: True)
    memory.release_cached_pinned_memory()
    assert emptied == [True]


def test_parse_and_format_bytes():
    assert parse_bytes("64GB") == 64 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(1e9) == 10**9
    assert parse_bytes(None) is None
    with pytest.raises(ValueError, match=r"^x: cannot read 'lots' as a size"):
        parse_bytes("lots", "x")
    assert format_bytes(3 * 2**30) == "3.0 GiB"


# ---- create_tiers -----------------------------------------------------------------------------
class RecordingTier(HostTier):
    """A user tier with an extra constructor argument, registered under a name."""

    def __init__(self, name, capacity=None, label="none"):
        super().__init__(name, capacity)
        self.label = label


register_tier("recording", RecordingTier)


def test_create_tiers_builtins_and_user_specs(tmp_path):
    tiers = create_tiers([{"name": "ram", "class": "recording", "capacity": "1MB", "label": "fast"},
                          {"name": "ram2", "class": "lazytrain.tiers.memory:HostTier"}],
                         torch.device("cpu"), nvme_path=str(tmp_path), aio={"thread_count": 2},
                         capacities={"hbm": "1GB", "host": 4096, "ram2": "2MiB"})
    try:
        assert list(tiers) == ["hbm", "host", "nvme", "ram", "ram2"]
        assert isinstance(tiers["hbm"], DeviceTier) and tiers["hbm"].device == torch.device("cpu")
        assert tiers["hbm"].capacity == 10**9 and tiers["host"].capacity == 4096
        assert isinstance(tiers["nvme"], NVMeTier) and tiers["nvme"].settings.intra_op_parallelism == 2
        assert tiers["ram"].label == "fast" and tiers["ram"].capacity == 10**6
        assert type(tiers["ram2"]) is HostTier and tiers["ram2"].capacity == 2 * 2**20
        assert all(t.name == n for n, t in tiers.items())
    finally:
        for t in tiers.values():
            t.close()
    assert list(tmp_path.iterdir()) == []  # the NVMe run directory is gone


def test_create_tiers_without_nvme():
    tiers = create_tiers([], "cpu")
    assert list(tiers) == ["hbm", "host"] and tiers["host"].capacity is None


@pytest.mark.parametrize("specs,kwargs,error,message", [
    ([{"name": "x"}], {}, ValueError,
     "lazytrain.tiers[0]: missing key 'class' (a tier spec needs 'name' and 'class')"),
    ([{"class": "host"}], {}, ValueError,
     "lazytrain.tiers[0]: missing key 'name' (a tier spec needs 'name' and 'class')"),
    (["ramdisk"], {}, TypeError,
     "lazytrain.tiers[0]: a tier spec is an object like {'name': 'ramdisk', 'class': "
     "'my_pkg.tiers:RamDiskTier', 'capacity': '64GB'}, got str"),
    ([{"name": "x", "class": "recording", "colour": "red"}], {}, ValueError,
     "lazytrain.tiers[0] ('x'): unknown key 'colour' for tier class RecordingTier (it accepts: name, class, "
     "capacity, label)"),
    ([{"name": "host", "class": "recording"}], {}, ValueError,
     "lazytrain.tiers[0] ('host').name: 'host' is built in; give your tier another name (reserved: hbm, host, "
     "nvme, recompute)"),
    ([{"name": "a", "class": "recording"}, {"name": "a", "class": "recording"}], {}, ValueError,
     "lazytrain.tiers[1] ('a').name: a tier named 'a' is already defined"),
    ([{"name": "", "class": "recording"}], {}, ValueError,
     "lazytrain.tiers[0].name: a tier name is a non-empty string, got ''"),
    ([{"name": "x", "class": "no_such_pkg.tiers:Tier"}], {}, ValueError,
     "lazytrain.tiers[0] ('x').class: tier class 'no_such_pkg.tiers:Tier' cannot be imported: "
     "ModuleNotFoundError: No module named 'no_such_pkg'"),
    ([{"name": "x", "class": "torch:Tensor"}], {}, TypeError,
     "lazytrain.tiers[0] ('x').class: tier 'torch:Tensor' resolves to <class 'torch.Tensor'>, which is not a "
     "subclass of lazytrain.tiers.Tier"),
    ([{"name": "x", "class": "recording", "capacity": "lots"}], {}, ValueError,
     "lazytrain.tiers[0] ('x').capacity: cannot read 'lots' as a size (examples: 1073741824, '64GB', '512MiB')"),
    ([{"name": "x", "class": "recording", "capacity": "1MB"}], {"capacities": {"x": "2MB"}}, ValueError,
     "lazytrain.tiers[0] ('x').capacity is 1000000 bytes but capacities['x'] is 2000000 bytes; give the budget "
     "in one place"),
    ([], {"capacities": {"nvme": "1GB"}}, ValueError,
     "capacities: no tier named 'nvme' (nvme exists only when an nvme_path is given); tiers: hbm, host"),
    ([], {"capacities": {"host": "many"}}, ValueError,
     "capacities['host']: cannot read 'many' as a size (examples: 1073741824, '64GB', '512MiB')"),
    ([], {"aio": {"block_size": 4096}}, ValueError,
     "aio: these settings tune the NVMe tier, but no nvme_path was given"),
])
def test_create_tiers_errors_name_the_key(specs, kwargs, error, message):
    with pytest.raises(error) as e:
        create_tiers(specs, "cpu", **kwargs)
    assert str(e.value) == message


def test_create_tiers_unknown_registered_name():
    with pytest.raises(ValueError) as e:
        create_tiers([{"name": "x", "class": "ramdisk_not_registered"}], "cpu")
    assert str(e.value).startswith("lazytrain.tiers[0] ('x').class: unknown tier 'ramdisk_not_registered': "
                                   "not registered, not an entry point in group 'lazytrain.tiers', and not "
                                   "'package.module:Class' (known: ")


def test_create_tiers_closes_what_it_built_on_error(tmp_path):
    with pytest.raises(ValueError):
        create_tiers([{"name": "x", "class": "recording", "bad": 1}], "cpu", nvme_path=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_register_tier_needs_a_tier_subclass():
    with pytest.raises(TypeError) as e:
        register_tier("bad", dict)
    assert str(e.value) == "register_tier('bad', ...) needs a subclass of lazytrain.tiers.Tier, got <class 'dict'>"
    assert issubclass(RecordingTier, Tier)


def test_slab_pool_takes_lent_slabs_back_once_unused():
    pool = SlabPool(pinned=False)
    first = pool.lend(5000)
    assert first.numel() == 5000 and first.data_ptr() % 4096 == 0
    view = first.view(torch.int8)
    ptr = first.data_ptr()
    del first
    second = pool.lend(5000)  # the first is still viewed: a new slab
    assert second.data_ptr() != ptr and pool.stats()["lent"] == 2
    del view
    third = pool.lend(5000)  # the first came back; the second is still held
    assert third.data_ptr() == ptr and pool.stats()["hits"] == 1 and second.data_ptr() != ptr
    pool.trim()
    assert pool.stats()["lent"] == 0 and pool.stats()["reserved_bytes"] == 0


def test_a_host_write_whose_copy_fails_on_a_copy_thread_is_never_read_back():
    """Copy threads on (the CPU standing in for a device): a tensor changed before its write's copy ran
    fails that write, which gives its key up; a read issued after that names the failure, never hands out
    the buffer the copy never filled."""
    import threading
    from lazytrain.tiers import streams
    streams.configure(copy_threads=True)
    try:
        tier, gate = HostTier("host"), threading.Event()
        streams.host_stream("d2h").submit(gate.wait)   # the write's copy runs once the gate opens
        t = torch.arange(6.0)
        handle = tier.write("k", t)
        t.mul_(-1)
        gate.set()
        with pytest.raises(TierError, match="modified in place before its asynchronous copy"):
            handle.wait()
        assert "k" not in tier and tier.used_bytes == 0
        with pytest.raises(TierError, match="holds no tensor under key 'k': its write failed"):
            tier.read("k", device="cpu").wait()
        gate.clear()   # freed while its copy is in flight, which then fails: closing the tier does not raise
        streams.host_stream("d2h").submit(gate.wait)
        t = torch.arange(6.0)
        tier.write("k2", t)
        t.mul_(-1)
        tier.free("k2")
        gate.set()
        tier.close()
    finally:
        streams.configure()


def test_a_failed_transfer_raises_each_waiter_its_own_copy_of_the_error():
    """The stored error is shared (other waiters, a tier's record of a failed key): each waiter raises a copy,
    so the frames it passes through (an executor's backward holding its pass) are not kept alive by the
    future; type, message, attributes and cause are the error's."""
    import errno
    import gc
    import weakref
    from concurrent.futures import Future

    from lazytrain.tiers.base import TransferHandle

    class Pass:   # what a caller's frame holds while the error passes through it
        pass

    cause = ValueError("the disk")
    stored = OSError(errno.EIO, "Input/output error")
    stored.__cause__ = cause
    future = Future()
    future.set_exception(stored)

    def caller(handle, wait, held):   # its frame holds ``held``, as the backward's frames hold its pass
        getattr(handle, wait)()

    refs = []
    for wait in ("wait", "synchronize"):
        handle = TransferHandle(future=future)
        try:
            held = Pass()
            refs.append(weakref.ref(held))
            caller(handle, wait, held)
        except OSError as e:
            assert e is not stored and type(e) is OSError and e.errno == errno.EIO and str(e) == str(stored)
            assert e.__cause__ is cause
        del held
    gc.collect()
    assert stored.__traceback__ is None   # it never passed through a caller
    assert all(r() is None for r in refs)


def test_each_waiters_copy_keeps_an_os_errors_fields_and_notes_and_await_raises_a_copy_too():
    """Fields an OSError set after it was made (NVMeIOError's errno), and notes, reach the waiter's copy;
    a note a waiter adds stays its own; ``await`` raises a copy as wait() does."""
    import errno
    from concurrent.futures import Future

    from lazytrain.tiers.base import TransferHandle
    from lazytrain.tiers.nvme import NVMeIOError

    stored = NVMeIOError("tier 'nvme': writing 'x' failed: no space", errno.ENOSPC)
    stored.filename = "/nvme/x"
    stored.add_note("first")
    future = Future()
    future.set_exception(stored)
    with pytest.raises(NVMeIOError) as e:
        TransferHandle(future=future).wait()
    assert e.value is not stored and e.value.errno == errno.ENOSPC and e.value.filename == "/nvme/x"
    assert e.value.__notes__ == ["first"]
    e.value.add_note("the waiter's")
    assert stored.__notes__ == ["first"]

    async def awaited():
        return await TransferHandle(future=future)
    with pytest.raises(NVMeIOError) as e:
        asyncio.run(awaited())
    assert e.value is not stored and e.value.errno == errno.ENOSPC
    assert stored.__traceback__ is None   # never raised itself


def test_a_copy_into_memory_allocated_inside_issued_after_follows_the_current_stream_again():
    """streams.following_current undoes an enclosing issued_after for the copies issued inside it, and
    restores it after."""
    from lazytrain.tiers import streams
    marker = object()
    assert streams.ordering() == (True, None)
    with streams.issued_after(marker):
        assert streams.ordering() == (False, marker)
        with streams.following_current():
            assert streams.ordering() == (True, None)
        assert streams.ordering() == (False, marker)
    with streams.following_current():
        assert streams.ordering() == (True, None)
    assert streams.ordering() == (True, None)


def test_the_host_pool_keeps_idle_no_more_than_the_tier_held_at_its_peak():
    """Buffers of sizes that vary from step to step (sequence lengths): with no capacity set, the pool keeps
    idle at most what the tier held at its peak since the last reset, not a slab of every size ever seen."""
    host = HostTier()
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        host.reset_peak()
        keys = [f"b{k}" for k in range(4)]
        for key in keys:
            n = int(torch.randint(25_000, 1_000_000, (1,), generator=g))
            host.write(key, torch.ones(n)).wait()
        for key in keys:
            host.read(key).wait()
            host.free(key)
        assert host.used_bytes == 0
        assert host.pool.cached_bytes <= host.peak_bytes, step
    host.close()


def test_the_host_pools_idle_bound_keeps_a_steps_buffers_for_the_next_step():
    """The idle bound applies as buffers are freed, not as they are taken: after the engine's reset of the peak
    (a step's end) the next step's writes of the same sizes all come from the pool."""
    host = HostTier()
    misses = []
    for step in range(4):
        for k in range(4):
            host.write(f"b{k}", torch.ones(100_000)).wait()
        for k in range(4):
            host.read(f"b{k}").wait()
            host.free(f"b{k}")
        host.reset_peak()
        misses.append(host.pool.misses)
    assert misses == [4, 4, 4, 4]
    host.close()


def test_a_tier_module_that_fails_to_import_or_a_class_that_skips_tier_init_is_named(tmp_path, monkeypatch):
    """Only ImportError and AttributeError were named with the config key: a module's SyntaxError or its own
    error at import came out raw, and a class whose __init__ skipped Tier.__init__ failed on 'tier.name'."""
    (tmp_path / "raising_tier.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "noinit_tier.py").write_text(
        "from lazytrain.tiers.memory import HostTier\n"
        "class NoSuper(HostTier):\n"
        "    def __init__(self, name, capacity=None):\n"
        "        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        create_tiers([{"name": "x", "class": "raising_tier:X"}], torch.device("cpu"))
    assert str(e.value) == ("lazytrain.tiers[0] ('x').class: tier class 'raising_tier:X' cannot be imported: "
                            "RuntimeError: boom at import")
    with pytest.raises(TypeError) as e:
        create_tiers([{"name": "x", "class": "noinit_tier:NoSuper"}], torch.device("cpu"))
    assert str(e.value) == ("lazytrain.tiers[0] ('x'): NoSuper.__init__ did not call Tier.__init__(self, name, "
                            "capacity) (the Tier contract), so the tier has no name, capacity or accounting")
