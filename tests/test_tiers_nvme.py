"""The NVMe tier: round trips, concurrency, budgets, checksums and injected faults."""
import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from lazytrain.tiers import (AioSettings, NVMeDataError, NVMeIOError, NVMeTier, TierBudgetError, TierError,
                             empty_aligned)
from lazytrain.tiers import nvme_io
from lazytrain.tiers.nvme_io import device_checksums, kvikio_status

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
BLOCK = 4096


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 40).to(dtype)


def data_files(tier):
    return sorted(n for n in os.listdir(tier.run_dir) if n.endswith(".bin"))


@pytest.fixture
def tier(tmp_path):
    # Small blocks and requests so that small tensors span several blocks, requests and threads.
    t = NVMeTier("nvme", path=tmp_path, aio={"block_size": BLOCK, "queue_depth": 2, "intra_op_parallelism": 3})
    yield t
    t.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (4096,), (1000, 37), (3, 5, 7), (2048, 9)])
def test_round_trip(tier, dtype, shape):
    x = sample(shape, dtype)
    nbytes = x.numel() * x.element_size()
    tier.write("x", x).wait()
    assert torch.equal(tier.read("x").wait(), x)
    out = torch.full_like(x, 0)
    assert tier.read("x", out=out).wait() is out and torch.equal(out, x)
    assert tier.used_bytes == -(-nbytes // 4096) * 4096   # the whole 4 KiB blocks its file takes
    if x.dim() >= 2:  # non-contiguous source and destination
        nc = sample(tuple(reversed(shape)), dtype, seed=1).transpose(0, -1)
        assert not nc.is_contiguous()
        tier.write("nc", nc).wait()
        dest = torch.zeros(tuple(reversed(shape)), dtype=dtype).transpose(0, -1)
        tier.read("nc", out=dest).wait()
        assert torch.equal(dest, nc)
    assert os.path.getsize(tier.file_of("x")) == -(-nbytes // 4096) * 4096


def test_write_takes_a_snapshot_and_owned_skips_the_copy(tier):
    x = sample((4096,), torch.float32)  # 16 KiB, aligned size
    expected = x.clone()
    handle = tier.write("x", x)
    x.zero_()  # the caller may reuse its tensor as soon as write() returns
    handle.wait()
    assert torch.equal(tier.read("x").wait(), expected)
    owned = tier.read("x").wait()  # aligned memory from the tier itself
    misses = tier.pool.stats()["misses"]
    tier.write("y", owned, owned=True).wait()
    assert tier.pool.stats()["misses"] == misses  # written from the tensor's own memory
    assert torch.equal(tier.read("y").wait(), expected)


@pytest.mark.parametrize("numel", [1024, 1001, 3])
def test_aligned_buffers_move_in_place(tier, numel):
    x = empty_aligned((numel,), torch.float32)
    x.copy_(sample((numel,), torch.float32))
    expected = x.clone()
    misses = tier.pool.stats()["misses"]
    tier.write("x", x, owned=True).wait()  # no staging slab: from x's memory, its tail through a bounce block
    out = empty_aligned((numel,), torch.float32)
    assert out.data_ptr() % 4096 == 0
    assert tier.read("x", out=out).wait() is out
    assert torch.equal(out, expected)
    assert tier.pool.stats()["misses"] == misses


def test_unaligned_out_buffer(tier):
    x = sample((3000,), torch.int8)
    tier.write("x", x).wait()
    backing = torch.zeros(3001, dtype=torch.int8)
    out = backing[1:]  # starts one byte past an allocation: not usable for O_DIRECT
    tier.read("x", out=out).wait()
    assert torch.equal(out, x) and backing[0] == 0


def test_many_concurrent_operations(tier):
    tensors = {f"t{i}": sample((97 * i + 5,), DTYPES[i % 4], seed=i) for i in range(48)}
    writes = [tier.write(k, v) for k, v in tensors.items()]
    reads = {k: tier.read(k) for k in tensors}  # issued while writes are in flight: they wait for them
    for h in writes:
        h.wait()
    for k, h in reads.items():
        assert torch.equal(h.wait(), tensors[k])
    # overwrite half while reading the other half
    new = {f"t{i}": sample((50 + i,), torch.float32, seed=100 + i) for i in range(0, 48, 2)}
    hs = [tier.write(k, v) for k, v in new.items()] + [tier.read(f"t{i}") for i in range(1, 48, 2)]
    for h in hs:
        h.wait()
    for k in tensors:
        assert torch.equal(tier.read(k).wait(), new.get(k, tensors[k]))
    assert len(data_files(tier)) == 48
    # each file takes whole 4 KiB blocks
    assert tier.used_bytes == sum(-(-v.numel() * v.element_size() // 4096) * 4096 for v in {**tensors, **new}.values())


def test_read_waits_for_the_write_in_flight(tier):
    gate = threading.Event()
    real = tier.backend.pwritev

    def slow(fd, buffers, offset):
        gate.wait(10)
        return real(fd, buffers, offset)
    tier.backend.pwritev = slow
    x = sample((5000,), torch.float32)
    w = tier.write("x", x)
    r = tier.read("x")
    assert not w.done() and not r.done()
    gate.set()
    assert torch.equal(r.wait(), x)
    assert w.done()


def test_awaitable(tier):
    import asyncio
    x = sample((100,), torch.bfloat16)

    async def go():
        await tier.write("x", x)
        return await tier.read("x")
    assert torch.equal(asyncio.run(go()), x)


def test_budget(tmp_path):
    t = NVMeTier("nvme", capacity="12KiB", path=tmp_path)
    try:
        t.write("a", torch.zeros(2048)).wait()  # 8 KiB
        with pytest.raises(TierBudgetError) as e:
            t.write("b", torch.zeros(2048))
        assert str(e.value) == ("tier 'nvme' is over its budget: writing 'b' (8.0 KiB) would bring its use to "
                                "16.0 KiB, but its capacity is 12.0 KiB (8.0 KiB in use). Raise the tier's capacity "
                                "in the config or place fewer tensors on it.")
        assert "b" not in t and len(data_files(t)) == 1
    finally:
        t.close()


# ---- faults ----------------------------------------------------------------------------------
def failing(err, after=0):
    calls = {"n": 0}

    def fn(real):
        def call(fd, buffers, offset):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(err, os.strerror(err))
            return real(fd, buffers, offset)
        return call
    return fn


@pytest.mark.parametrize("after", [0, 2])  # the first request fails / a later one (a half-written file)
def test_enospc_on_write(tier, after):
    tier.backend.pwritev = failing(errno.ENOSPC, after)(tier.backend.pwritev)
    tier.write("old", torch.ones(10)).wait() if after else None
    h = tier.write("w", sample((20000,), torch.float32))
    path = os.path.join(tier.run_dir, f"{2 if after else 1:08d}-w.bin")
    with pytest.raises(NVMeIOError) as e:
        h.wait()
    assert str(e.value) == (f"tier 'nvme': key 'w': writing {path} failed with ENOSPC: no space left on device; "
                            f"free disk space, lower the tier's capacity, or point nvme_path at a larger disk")
    assert e.value.errno == errno.ENOSPC
    assert "w" not in tier and not os.path.exists(path)  # nothing half-written stays
    with pytest.raises(TierError) as e2:
        tier.read("w")  # the engine may never have waited on the write: the read names the cause
    assert str(e2.value) == f"tier 'nvme' holds no tensor under key 'w': its write failed: {e.value}"
    tier.free("w")
    with pytest.raises(TierError, match="^tier 'nvme' holds no tensor under key 'w'$"):
        tier.read("w")
    assert tier.used_bytes == (4096 if after else 0)
    if after:
        assert torch.equal(tier.read("old").wait(), torch.ones(10))


def test_full_disk_when_reserving_the_file(tier):
    def full(fd, nbytes):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    tier.backend.allocate = full
    with pytest.raises(NVMeIOError) as e:
        tier.write("x", torch.zeros(3000))  # raised at once: no data moved yet
    path = os.path.join(tier.run_dir, "00000001-x.bin")
    assert str(e.value) == (f"tier 'nvme': key 'x': reserving 12.0 KiB for {path} failed with ENOSPC: no space left "
                            f"on device; free disk space, lower the tier's capacity, or point nvme_path at a larger disk")
    assert "x" not in tier and data_files(tier) == [] and tier.used_bytes == 0


def test_eio_on_read_then_recovery(tier):
    x = sample((3000,), torch.float16)
    tier.write("x", x).wait()
    real = tier.backend.preadv
    tier.backend.preadv = failing(errno.EIO)(real)
    with pytest.raises(NVMeIOError) as e:
        tier.read("x").wait()
    assert str(e.value) == (f"tier 'nvme': key 'x': reading {tier.file_of('x')} failed with EIO: I/O error "
                            f"reported by the device; check the disk (dmesg, smartctl) or use another nvme_path")
    tier.backend.preadv = real
    assert torch.equal(tier.read("x").wait(), x)


def test_read_only_at_first_write(tier):
    def refuse(path, write):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    tier.backend.open = refuse
    with pytest.raises(NVMeIOError) as e:
        tier.write("x", torch.zeros(4))
    path = os.path.join(tier.run_dir, "00000001-x.bin")
    assert str(e.value) == (f"tier 'nvme': key 'x': creating {path} failed with EROFS: the filesystem is read-only; "
                            f"point nvme_path at a writable directory")
    assert "x" not in tier and tier.used_bytes == 0


def test_truncated_file(tier):
    x = sample((5000,), torch.float32)  # 20000 bytes -> 20480 on disk
    tier.write("x", x).wait()
    path = tier.file_of("x")
    os.truncate(path, 12288)
    with pytest.raises(NVMeDataError) as e:
        tier.read("x").wait()
    assert str(e.value) == (f"tier 'nvme': key 'x': file {path} is truncated: 12288 bytes on disk, 20480 written")


def test_short_read_is_reported_as_truncation(tier):
    x = sample((5000,), torch.float32)
    tier.write("x", x).wait()
    tier.backend.preadv = lambda fd, buffers, offset: 0  # the file ends early while being read
    with pytest.raises(NVMeDataError) as e:
        tier.read("x").wait()
    assert str(e.value).startswith(f"tier 'nvme': key 'x': file {tier.file_of('x')} is truncated: it ends at byte ")


@pytest.mark.parametrize("offset,block", [(0, 0), (5000, 1), (19999, 4)])
def test_flipped_bit_is_caught(tier, offset, block):
    x = sample((5000,), torch.float32)
    tier.write("x", x).wait()
    path = tier.file_of("x")
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    out = torch.zeros_like(x)
    with pytest.raises(NVMeDataError) as e:
        tier.read("x", out=out).wait()
    last = min((block + 1) * BLOCK, 20000) - 1
    assert str(e.value) == (f"tier 'nvme': key 'x': file {path} is corrupted: checksum mismatch in block {block} "
                            f"(bytes {block * BLOCK}..{last})")


def test_flipped_padding_byte_is_harmless(tier):
    x = sample((5000,), torch.float32)  # bytes 20000..20479 are padding
    tier.write("x", x).wait()
    with open(tier.file_of("x"), "r+b") as f:
        f.seek(20100)
        f.write(b"\xff")
    assert torch.equal(tier.read("x").wait(), x)


def test_missing_file(tier):
    tier.write("x", torch.ones(3)).wait()
    path = tier.file_of("x")
    os.unlink(path)
    with pytest.raises(NVMeDataError) as e:
        tier.read("x").wait()
    assert str(e.value) == f"tier 'nvme': key 'x': its file {path} is missing"


# ---- start-up ----------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NVMeIOError) as e:
        NVMeTier(path=missing)
    assert str(e.value) == (f"tier 'nvme': nvme_path {missing} does not exist; create it or point nvme_path at an "
                            f"existing directory on a fast disk")


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NVMeIOError, match=f"^tier 'nvme': nvme_path {f} is not a directory$"):
        NVMeTier(path=f)


class FakeStatvfs:
    def __init__(self, flag, avail):
        self.f_flag, self.f_bavail, self.f_frsize = flag, avail, 4096


def test_read_only_filesystem_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "statvfs", lambda p: FakeStatvfs(os.ST_RDONLY, 10**6))
    with pytest.raises(NVMeIOError) as e:
        NVMeTier(path=tmp_path)
    assert str(e.value) == (f"tier 'nvme': nvme_path {tmp_path} is on a read-only filesystem; the filesystem is "
                            f"read-only; point nvme_path at a writable directory")
    assert list(tmp_path.iterdir()) == []


def test_capacity_larger_than_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "statvfs", lambda p: FakeStatvfs(0, 256))  # 1 MiB free
    with pytest.raises(NVMeIOError) as e:
        NVMeTier(path=tmp_path, capacity="2MiB")
    assert str(e.value) == (f"tier 'nvme': its capacity is 2.0 MiB but only 1.0 MiB is free under {tmp_path}; "
                            f"lower the capacity or free disk space")


def test_full_disk_at_start(tmp_path, monkeypatch):
    real_open = os.open

    def full(path, flags, *args, **kwargs):
        if os.path.basename(path) == ".lazytrain-probe":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(nvme_io.os, "open", full)
    with pytest.raises(NVMeIOError) as e:
        NVMeTier(path=tmp_path)
    assert str(e.value).startswith(f"tier 'nvme': writing a probe file in {tmp_path}/lazytrain-run-")
    assert str(e.value).endswith(" failed with ENOSPC: no space left on device; free disk space, lower the tier's "
                                 "capacity, or point nvme_path at a larger disk")
    assert list(tmp_path.iterdir()) == []


def test_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(nvme_io.os, "open", no_direct)
    t = NVMeTier(path=tmp_path, aio={"use_gds": False})
    try:
        assert t.backend_name == "posix-buffered"
        assert t.backend_report == ("posix-buffered: the filesystem refused O_DIRECT (EINVAL); kvikio not used: "
                                    "aio.use_gds is false")
        x = sample((1234,), torch.bfloat16)
        t.write("x", x).wait()
        assert torch.equal(t.read("x").wait(), x)
    finally:
        t.close()


def test_backend_choice_is_reported(tier):
    assert tier.backend.name == "posix-odirect"  # ext4 under the test's tmp_path accepts O_DIRECT
    module, why = kvikio_status()
    if module is None:
        assert tier.backend_name == tier.stats()["backend"] == "posix-odirect"
        assert tier.backend_report == f"posix-odirect: O_DIRECT works on this filesystem; {why}"
    else:
        assert tier.backend_name == "kvikio (CUDA tensors) + posix-odirect (host tensors)"
        assert tier.backend_report == (f"kvikio (CUDA tensors) + posix-odirect (host tensors): O_DIRECT works on "
                                       f"this filesystem; {why}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on a machine without CUDA")
def test_kvikio_is_not_chosen_without_cuda(tmp_path):
    assert kvikio_status() == (None, "kvikio not used: no CUDA device")
    with pytest.raises(TierError) as e:
        NVMeTier(path=tmp_path, aio={"use_gds": True})
    assert str(e.value) == "tier 'nvme': aio.use_gds is true but kvikio not used: no CUDA device"
    assert list(tmp_path.iterdir()) == []


def test_forced_backend(tmp_path):
    t = NVMeTier(path=tmp_path, backend="posix-buffered", aio={"use_gds": False})
    try:
        assert t.backend_report == ("posix-buffered: backend 'posix-buffered' chosen in the config; kvikio not used: "
                                    "aio.use_gds is false")
    finally:
        t.close()


# ---- aio settings ------------------------------------------------------------------------------
def test_aio_settings():
    assert AioSettings.from_config(None) == AioSettings(1 << 20, 8, 4, None)
    s = AioSettings.from_config({"block_size": 1048576, "queue_depth": 16, "thread_count": 2,
                                 "single_submit": False, "overlap_events": True, "use_gds": False})
    assert s == AioSettings(1 << 20, 16, 2, False) and s.request_bytes == 16 << 20
    assert AioSettings.from_config({"intra_op_parallelism": 3, "block_size": "64KiB"}).intra_op_parallelism == 3


@pytest.mark.parametrize("aio,message", [
    ({"blocksize": 4096}, "aio.blocksize: unknown key (known: block_size, queue_depth, intra_op_parallelism, "
                          "thread_count, single_submit, overlap_events, use_gds)"),
    ({"block_size": 1000}, "aio.block_size must be a positive multiple of 4096 bytes (O_DIRECT alignment), got 1000"),
    ({"block_size": "big"}, "aio.block_size: cannot read 'big' as a size (examples: 1073741824, '64GB', '512MiB')"),
    ({"queue_depth": 0}, "aio.queue_depth must be an integer >= 1, got 0"),
    ({"thread_count": 2.5}, "aio.thread_count must be an integer >= 1, got 2.5"),
    ({"thread_count": 1, "intra_op_parallelism": 4},
     "aio.thread_count (1) and aio.intra_op_parallelism (4) disagree; thread_count is the old name, give one"),
    ({"single_submit": "yes"}, "aio.single_submit must be true or false, got 'yes'"),
    ({"use_gds": "auto"}, "aio.use_gds must be true, false or null, got 'auto'"),
])
def test_aio_errors_name_the_key(aio, message):
    with pytest.raises(ValueError) as e:
        AioSettings.from_config(aio)
    assert str(e.value) == message


# ---- the device checksum used by the kvikio backend --------------------------------------------
def test_device_checksums_catch_flips_and_swaps():
    data = sample((3000,), torch.float32).view(torch.uint8).reshape(-1).clone()  # 12000 bytes, 3 blocks
    base = device_checksums(data, BLOCK)
    assert len(base) == 3 and device_checksums(data, BLOCK) == base
    for pos in (0, 4095, 4096, 11999):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            sums = device_checksums(flipped, BLOCK)
            assert [i for i in range(3) if sums[i] != base[i]] == [pos // BLOCK]
    swapped = data.clone()
    swapped[0:4], swapped[4:8] = data[4:8].clone(), data[0:4].clone()
    assert device_checksums(swapped, BLOCK)[0] != base[0] or torch.equal(data[0:4], data[4:8])
    assert device_checksums(data[:0], BLOCK) == []


# ---- lifecycle ---------------------------------------------------------------------------------
def test_close_removes_the_run_directory(tmp_path):
    t = NVMeTier(path=tmp_path)
    t.write("x", torch.ones(10)).wait()
    run_dir = t.run_dir
    assert os.path.isdir(run_dir) and os.path.dirname(run_dir) == str(tmp_path)
    t.close()
    t.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TierError, match="^tier 'nvme' is closed$"):
        t.write("y", torch.ones(1))


def test_run_directory_removed_at_clean_exit(tmp_path):
    code = ("import sys, torch; from lazytrain.tiers import NVMeTier; t = NVMeTier(path=sys.argv[1]); "
            "t.write('x', torch.ones(1000)).wait(); print(t.run_dir)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"{tmp_path}/lazytrain-run-")
    assert list(tmp_path.iterdir()) == []


def test_left_over_run_directories_are_removed_live_ones_kept(tmp_path, caplog):
    live = NVMeTier(path=tmp_path)
    live.write("x", torch.ones(1000)).wait()
    code = ("import os, sys, torch; from lazytrain.tiers import NVMeTier; t = NVMeTier(path=sys.argv[1]); "
            "t.write('x', torch.ones(2048)).wait(); print(t.run_dir, flush=True); os._exit(0)")  # no clean-up
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    crashed = done.stdout.strip()
    assert os.path.isdir(crashed)
    (tmp_path / "lazytrain-run-not-ours").mkdir()  # no lock file: never touched
    with caplog.at_level("WARNING", logger="lazytrain.tiers.nvme"):
        fresh = NVMeTier(path=tmp_path)
    assert not os.path.exists(crashed)
    assert caplog.messages == [f"tier 'nvme': removed {crashed} (8.0 KiB) left by a process that ended without "
                               f"closing its NVMe tier"]
    assert torch.equal(live.read("x").wait(), torch.ones(1000))  # the live tier's directory is untouched
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live.run_dir), os.path.basename(fresh.run_dir),
                                                   "lazytrain-run-not-ours"])
    live.close()
    fresh.close()


@pytest.mark.parametrize("then", ["free", "overwrite"])
def test_a_read_issued_before_a_free_or_overwrite_still_sees_the_data(tier, then):
    """The read waits for the write to land and opens the file only then; freeing or overwriting the key
    in between must not take the file from under it. The file goes once the read is done."""
    x = sample((2 << 20,), torch.float32)
    tier.write("k", x)
    pending = tier.read("k")
    if then == "free":
        tier.free("k")
    else:
        tier.write("k", torch.zeros(3)).wait()
    assert torch.equal(pending.wait(), x)
    assert len(data_files(tier)) == (0 if then == "free" else 1)


def test_threads_reading_freeing_and_overwriting_keys_lose_no_read_and_leave_no_file(tmp_path):
    """Readers race frees and overwrites of the same keys: a read that got a handle returns whole data
    (never a missing-file error), and once all is done no file is left beside the live keys."""
    from tier_stress import race_reads_frees_and_writes
    t = NVMeTier("nvme", path=tmp_path)
    errors, reads = race_reads_frees_and_writes(t)
    assert errors == [] and reads > 0
    assert sorted(data_files(t)) == sorted(os.path.basename(t.file_of(k)) for k in t.keys())
    t.close()


def test_a_read_only_mount_is_named_as_such_not_as_a_permission_problem(tmp_path):
    from fs_helpers import tmpfs
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        with pytest.raises(NVMeIOError, match=f"^tier 'nvme': nvme_path {mnt} is on a read-only filesystem"):
            NVMeTier(path=mnt)


def test_a_directory_without_write_permission_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda p, mode: False)   # as a user without write access sees it
    with pytest.raises(NVMeIOError, match=f"^tier 'nvme': nvme_path {tmp_path} is not writable by this user; "
                                          f"permission denied; point nvme_path at a directory you can write$"):
        NVMeTier(path=tmp_path)


def test_a_file_that_cannot_be_removed_is_reported_and_the_tier_goes_on(tmp_path, monkeypatch):
    from lazytrain.tiers import nvme
    tier = NVMeTier(path=tmp_path)
    tier.write("a", torch.arange(10.0)).wait()
    tier.write("b", torch.arange(5.0)).wait()
    path = tier.file_of("a")

    def refuse(p):
        raise PermissionError(errno.EACCES, "Permission denied", p)
    monkeypatch.setattr(nvme.os, "unlink", refuse)
    with pytest.warns(RuntimeWarning, match=f"could not remove {path}, which holds no tensor any more \\(EACCES: "
                                            f"permission denied"):
        tier.free("a")
    monkeypatch.undo()
    assert "a" not in tier and torch.equal(tier.read("b").wait(), torch.arange(5.0))
    tier.close()


# ---- edge shapes, budgets and close (found by review) ------------------------------------------------
def open_tier_files(run_dir):
    fds = []
    for f in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{f}"))
        except OSError:
            pass
    return [p for p in fds if p.startswith(str(run_dir)) and ".bin" in p]   # not the owner lock


def test_zero_dim_and_one_element_tensors_with_odd_strides_round_trip(tier):
    scalar = empty_aligned((), torch.float32, pinned=False)   # aligned: written in place, read in place
    scalar.fill_(3.5)
    tier.write("s", scalar, owned=True).wait()
    out = empty_aligned((), torch.float32, pinned=False)
    assert tier.read("s", out=out).wait() is out and out.item() == 3.5
    tier.write("h", torch.tensor([[1.0, 2.5]], dtype=torch.float16)[:, 1]).wait()
    strided = torch.zeros(1, 3, dtype=torch.float16)[:, 1]   # contiguous, one element, stride 3
    assert strided.is_contiguous() and strided.stride() == (3,)
    tier.read("h", out=strided).wait()
    assert strided.tolist() == [2.5]
    assert open_tier_files(tier.run_dir) == [] and data_files(tier) == sorted(os.listdir(tier.run_dir))[1:]


def test_the_budget_counts_the_4k_blocks_files_take(tmp_path):
    t = NVMeTier(path=tmp_path, capacity=8192)
    try:
        t.write("a", torch.ones(1)).wait()
        t.write("b", torch.ones(1)).wait()
        with pytest.raises(TierBudgetError, match=r"writing 'c' \(4 B, held in 4.0 KiB\) would bring its use to "
                                                  r"12.0 KiB"):
            t.write("c", torch.ones(1))
        assert t.used_bytes == 8192 == sum(os.path.getsize(t.file_of(k)) for k in "ab")
    finally:
        t.close()


def test_close_delivers_a_read_issued_before_the_write_landed(tmp_path, monkeypatch):
    for trial in range(10):
        t = NVMeTier(path=tmp_path, aio={"block_size": BLOCK, "queue_depth": 1, "intra_op_parallelism": 2})
        real = t.backend.pwritev

        def slow(fd, iov, offset, real=real):
            threading.Event().wait(0.002)   # the write lands after close() has started
            return real(fd, iov, offset)
        t.backend.pwritev = slow
        x = sample((10_000,), torch.float32, seed=trial)
        t.write("a", x)
        read = t.read("a")
        run_dir = t.run_dir
        t.close()
        assert torch.equal(read.wait(), x)
        assert open_tier_files(run_dir) == [] and not os.path.exists(run_dir)


def test_a_request_the_closing_pool_refuses_fails_its_transfer_and_leaks_nothing(tier):
    tier.write("old", torch.ones(5000)).wait()
    tier._executor.shutdown(wait=True)   # as when close() on another thread stops the pool mid-write
    h = tier.write("x", torch.ones(5000))
    with pytest.raises(TierError, match="^tier 'nvme' is closed$"):
        h.wait()
    with pytest.raises(TierError, match="^tier 'nvme' is closed$"):
        tier.read("old").wait()
    assert "x" not in tier and open_tier_files(tier.run_dir) == [] and len(data_files(tier)) == 1


def test_a_run_directory_left_under_its_staging_name_is_removed_once_old(tmp_path):
    from lazytrain.tiers.nvme import STAGING_STALE_S
    old_locked, old_bare, young = (tmp_path / ".lazytrain-new-1-a", tmp_path / ".lazytrain-new-2-b",
                                   tmp_path / ".lazytrain-new-3-c")
    for d in (old_locked, old_bare, young):
        d.mkdir()
    (old_locked / ".owner.lock").write_text("")
    (young / ".owner.lock").write_text("")
    (tmp_path / ".lazytrain-new-4-d").write_text("a file, not ours")
    past = os.path.getmtime(young) - STAGING_STALE_S - 1
    for d in (old_locked, old_bare):
        os.utime(d, (past, past))
    t = NVMeTier(path=tmp_path)   # a process killed while making its run directory left the old two
    t.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lazytrain-new-3-c", ".lazytrain-new-4-d"]


def test_a_left_over_directory_another_starting_process_removed_first_is_skipped(tmp_path, monkeypatch):
    """Ranks of a node restarted together sweep one nvme_path at once: a left-over directory another one removed
    (its lock file with it) between this one's open of the lock and its flock is skipped, and start-up goes on."""
    import fcntl
    from lazytrain.tiers import nvme
    code = ("import os, sys, torch; from lazytrain.tiers import NVMeTier; t = NVMeTier(path=sys.argv[1]); "
            "t.write('x', torch.ones(2048)).wait(); print(t.run_dir, flush=True); os._exit(0)")  # no clean-up
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    left = done.stdout.strip()
    flock = fcntl.flock

    def other_process_got_there_first(fd, op):
        shutil.rmtree(left)   # the other process: locked, removed the directory, closed its fd
        monkeypatch.setattr(fcntl, "flock", flock)
        return flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", other_process_got_there_first)
    assert nvme.remove_stale_run_dirs(str(tmp_path)) == []
    assert nvme._remove_dir(left) == (left, 0)   # gone already: no error
    t = NVMeTier(path=tmp_path)
    t.close()


def test_a_forked_child_never_removes_its_parents_run_directory(tmp_path):
    """A child forked after the tier started inherits the object, not the files: its exit (atexit) or its
    collection of the tier closes nothing of the parent's."""
    t = NVMeTier(path=tmp_path)
    try:
        t.write("x", torch.arange(4096.0)).wait()
        pid = os.fork()
        if pid == 0:   # the child: what its atexit and garbage collection do
            try:
                t.close()
                del t
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.isdir(t.run_dir)
        assert torch.equal(t.read("x").wait(), torch.arange(4096.0))
    finally:
        t.close()
    assert not os.path.exists(t.run_dir)


def test_transfers_issued_in_a_burst_wait_for_open_files_rather_than_fail(tmp_path, monkeypatch):
    """Each transfer in flight holds its file open: 3000 writes issued without waiting failed with EMFILE at
    the default limit of 1024 descriptors. Transfers now wait while the tier's bound of open files is
    reached (here 4); a read that starts on an I/O thread, behind its key's write, is parked rather than block
    that thread, and started when a place is given back."""
    from lazytrain.tiers import nvme
    monkeypatch.setattr(nvme, "_open_files_limit", lambda: 4)
    t = NVMeTier("nvme", path=tmp_path, aio={"block_size": BLOCK, "queue_depth": 2, "intra_op_parallelism": 2})
    opened, most, lock = [0], [0], threading.Lock()
    real_open, real_close = t.backend.open, t.backend.close

    def counted_open(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        with lock:
            opened[0] += 1
            most[0] = max(most[0], opened[0])
        return fd

    def counted_close(fd):
        with lock:
            opened[0] -= 1
        real_close(fd)
    monkeypatch.setattr(t.backend, "open", counted_open)
    monkeypatch.setattr(t.backend, "close", counted_close)
    try:
        xs = [sample((3000,), torch.float32, seed=i) for i in range(40)]
        writes = [t.write(f"k{i}", x) for i, x in enumerate(xs)]
        for h in writes:
            h.wait()
        assert 1 <= most[0] <= 4
        reads = [t.read(f"k{i}") for i in range(len(xs))]
        assert all(torch.equal(h.wait(), x) for h, x in zip(reads, xs))
        assert most[0] <= 4 and opened[0] == 0
        # reads queued behind their key's write start on an I/O thread when it lands: parked there, within the
        # bound too (40 reads of one key, its write held until all are queued)
        gate, real_write = threading.Event(), t.backend.pwritev
        monkeypatch.setattr(t.backend, "pwritev", lambda *a: gate.wait() and real_write(*a))
        most[0] = 0
        t.write("j", xs[0])
        queued = [t.read("j") for _ in range(40)]
        gate.set()
        assert all(torch.equal(r.wait(), xs[0]) for r in queued)
        assert 1 <= most[0] <= 4 and opened[0] == 0 and t._files_open.open == 0
    finally:
        t.close()


def test_a_write_waiting_for_an_open_file_when_the_tier_closes_is_told_it_closed(tmp_path, monkeypatch):
    from lazytrain.tiers import nvme
    monkeypatch.setattr(nvme, "_open_files_limit", lambda: 1)
    t = NVMeTier("nvme", path=tmp_path, aio={"block_size": BLOCK})
    gate, real = threading.Event(), t.backend.pwritev
    monkeypatch.setattr(t.backend, "pwritev", lambda *a: gate.wait() and real(*a))
    first = t.write("a", torch.ones(1000))   # holds the one place until the gate opens
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(_error_of(lambda: t.write("b", torch.ones(1000)))))
    waiter.start()
    time.sleep(0.2)   # the second write waits for the place
    closer = threading.Thread(target=t.close)
    closer.start()
    time.sleep(0.2)   # close() waits for the first write
    gate.set()
    closer.join(30)
    waiter.join(30)
    first.wait()
    assert outcome == ["TierError: tier 'nvme' is closed"] and t._files_open.open == 0


def _error_of(fn):
    try:
        fn().wait()
    except Exception as e:   # noqa: BLE001 - what the test reads
        return f"{type(e).__name__}: {e}"
    return "no error"



def test_the_bound_of_open_files_is_a_quarter_of_the_processs_descriptor_limit():
    code = ("import resource; from lazytrain.tiers import nvme\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "for soft in (1024, 256, 40):\n"
            "    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
            "    print(nvme._open_files_limit())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.split() == ["256", "64", "16"], done.stderr[-2000:]


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_conjugate_and_negative_views_round_trip_as_they_read(tmp_path, lazy, owned):
    """A lazy view's memory holds other values than it reads as: written by its bytes (owned and aligned) it
    raised torch's "view is not supported for conjugate view tensors"; it goes through the staging copy, which
    resolves it, and a read into such a view lands as the values it should read as."""
    from lazytrain.tiers.pool import aligned_empty
    t = NVMeTier("nvme", path=tmp_path, aio={"block_size": BLOCK})
    try:
        base = aligned_empty(8 * 1500, pinned=False).view(torch.complex64)
        base.copy_(torch.complex(sample((1500,), torch.float32), sample((1500,), torch.float32, seed=1)))
        x = base.conj() if lazy == "conj" else torch._neg_view(base)
        t.write("x", x, owned=owned).wait()
        assert torch.equal(t.read("x").wait(), x.resolve_conj().resolve_neg())
        out_base = aligned_empty(8 * 1500, pinned=False).view(torch.complex64)
        out = out_base.conj() if lazy == "conj" else torch._neg_view(out_base)
        t.read("x", out=out).wait()
        assert torch.equal(out.resolve_conj().resolve_neg(), x.resolve_conj().resolve_neg())
    finally:
        t.close()
