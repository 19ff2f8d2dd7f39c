"""A user-defined tier (the one in docs/custom-tiers.md): registered, named by "module:Class", found as an
entry point, and used by the engine as the home of kept boundaries; the engine also trains with
boundaries on the NVMe tier."""
import os
import re
import shutil
import tempfile
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import lazytrain
from lazytrain.tiers import Tier, TierBudgetError, TransferHandle, create_tiers, resolve_tier_class

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")


class RamDiskTier(Tier):
    """Tensors as files in a RAM-backed directory, written and read on a small thread pool."""

    kind = "ramdisk"

    def __init__(self, name, capacity=None, path="/dev/shm", threads=2):
        super().__init__(name, capacity)
        self.dir = tempfile.mkdtemp(prefix=f"lazytrain-{name}-", dir=path)
        self.pool = ThreadPoolExecutor(threads)
        self.meta = {}      # key -> (shape, dtype, file)
        self.pending = {}   # key -> Future of its write

    def _write(self, key, tensor, owned):
        snapshot = tensor.detach().to("cpu").contiguous()
        if snapshot.data_ptr() == tensor.data_ptr() and not owned:
            snapshot = snapshot.clone()  # the caller may reuse its tensor as soon as write() returns
        path = os.path.join(self.dir, f"{len(self.meta)}-{abs(hash(key))}.bin")
        self.meta[key] = (snapshot.shape, snapshot.dtype, path)

        def job():
            with open(path, "wb") as f:
                f.write(snapshot.view(torch.uint8).reshape(-1).numpy())
        self.pending[key] = future = self.pool.submit(job)
        return TransferHandle(future=future)

    def _read(self, key, out, device):
        shape, dtype, path = self.meta[key]
        written = self.pending[key]

        def job():
            written.result()  # submitted earlier, so it is running or done: no deadlock
            t = torch.empty(shape, dtype=dtype)
            with open(path, "rb") as f:
                f.readinto(t.view(torch.uint8).reshape(-1).numpy())
            if out is not None:
                return out.copy_(t)
            return t.to(device) if device is not None else t
        return TransferHandle(future=self.pool.submit(job))

    def _free(self, key):
        shape, dtype, path = self.meta.pop(key)
        self.pending.pop(key).exception()  # wait for the write, failed or not
        if os.path.exists(path):
            os.unlink(path)

    def close(self):
        super().close()  # frees every key
        self.pool.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)  # any directory works; /dev/shm is the point in real use


def test_user_tier_registered_by_name(shm):
    lazytrain.register_tier("ramdisk", RamDiskTier)
    tiers = create_tiers([{"name": "ram", "class": "ramdisk", "capacity": "1MB", "path": shm, "threads": 3}], "cpu")
    ram = tiers["ram"]
    assert ram.capacity == 10**6 and ram.pool._max_workers == 3
    x = torch.randn(100, 7).to(torch.bfloat16)
    nc = torch.randn(7, 100).t()
    hs = [ram.write("x", x), ram.write("nc", nc)]
    assert torch.equal(ram.read("x").wait(), x)  # reads wait for their write
    out = torch.zeros(100, 7)
    ram.read("nc", out=out).wait()
    assert torch.equal(out, nc) and all(h.done() for h in hs)
    assert ram.used_bytes == 1400 + 2800
    with pytest.raises(TierBudgetError, match="^tier 'ram' is over its budget: writing 'big' "):
        ram.write("big", torch.zeros(300_000))
    ram.close()
    assert os.listdir(shm) == []


def test_user_tier_by_module_path(shm):
    spec = f"{RamDiskTier.__module__}:RamDiskTier"
    tiers = create_tiers([{"name": "ram", "class": spec, "path": shm}], "cpu")
    assert type(tiers["ram"]).__name__ == "RamDiskTier"
    with pytest.raises(ValueError) as e:
        create_tiers([{"name": "ram", "class": spec, "paht": shm}], "cpu")
    assert str(e.value) == ("lazytrain.tiers[0] ('ram'): unknown key 'paht' for tier class RamDiskTier "
                            "(it accepts: name, class, capacity, path, threads)")
    tiers["ram"].close()


def test_user_tier_from_an_entry_point(tmp_path, monkeypatch, shm):
    dist = tmp_path / "ramdisk_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ramdisk-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [lazytrain.tiers]
        ramdisk-ep = {RamDiskTier.__module__}:RamDiskTier
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_tier_class("ramdisk-ep").__name__ == "RamDiskTier"
    tiers = create_tiers([{"name": "ram", "class": "ramdisk-ep", "path": shm}], "cpu")
    tiers["ram"].write("k", torch.arange(5)).wait()
    assert torch.equal(tiers["ram"].read("k").wait(), torch.arange(5))
    tiers["ram"].close()


# ---- training with boundaries on the user's tier and on NVMe ---------------------------------
def _train(lazytrain_section):
    engine_models = pytest.importorskip("engine_models")
    model = engine_models.make_model("modulelist")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": float("inf"),
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "lazytrain": lazytrain_section}
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in engine_models.batches(2):
        engine.backward(engine_models.lm_loss(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()
    engine.wait_for_update()
    home = lazytrain_section["boundary_home"]
    assert engine.last_step_peak_bytes[home] > 0  # boundaries really went there
    params = [p.detach().cpu().clone() for p in engine.module.parameters()]
    tier = engine.tiers[home]
    engine.destroy()
    return tier, params


def _same_training_as_on_hbm(section):
    """Where boundaries are kept must not change a single bit of training; on the CPU the result also
    matches plain PyTorch training."""
    tier, params = _train(section)
    _, on_hbm = _train({k: v for k, v in section.items() if k not in ("tiers", "nvme_path")} | {"boundary_home": "hbm"})
    assert all(torch.equal(a, b) for a, b in zip(params, on_hbm))
    if not torch.cuda.is_available():
        engine_models = pytest.importorskip("engine_models")
        model = engine_models.make_model("modulelist")
        ref = engine_models.reference_train(model, engine_models.batches(2))
        for p, q in zip(params, ref.parameters()):
            assert (p - q.detach()).abs().max() <= 1e-5 * q.detach().abs().max().clamp_min(1e-12)
    return tier


def test_engine_trains_with_boundaries_on_a_user_tier(tmp_path):
    lazytrain.register_tier("ramdisk", RamDiskTier)
    tier = _same_training_as_on_hbm({"checkpoint_interval": 2, "boundary_home": "ram",
                                     "tiers": [{"name": "ram", "class": "ramdisk", "path": str(tmp_path)}]})
    assert isinstance(tier, RamDiskTier)
    assert os.listdir(tmp_path) == []


def test_engine_trains_with_boundaries_on_nvme(tmp_path):
    tier = _same_training_as_on_hbm({"checkpoint_interval": 2, "boundary_home": "nvme", "nvme_path": str(tmp_path)})
    assert tier.stats()["bytes_read"] > 0
    assert os.listdir(tmp_path) == []  # the run directory is removed when the engine is destroyed


def test_the_documented_example_runs(shm):
    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "custom-tiers.md")
    with open(doc) as f:
        text = f.read()
    code = text.split("```python\n")[1].split("```")[0]
    namespace = {}
    exec(compile(code, doc, "exec"), namespace)
    tier = namespace["RamDiskTier"]("doc", capacity="1MB", path=shm)
    x = torch.arange(10, dtype=torch.int8)
    tier.write("x", x)
    assert torch.equal(tier.read("x").wait(), x)
    tier.close()
    assert os.listdir(shm) == []


def test_a_failed_asynchronous_write_of_a_user_tier(shm):
    tier = RamDiskTier("ram", path=shm)
    shutil.rmtree(tier.dir)  # every write job now fails
    handle = tier.write("x", torch.ones(3))
    with pytest.raises(FileNotFoundError):
        handle.wait()
    assert "x" not in tier and tier.used_bytes == 0
    with pytest.raises(lazytrain.tiers.TierError) as e:
        tier.read("x")
    assert str(e.value).startswith("tier 'ram' holds no tensor under key 'x': its write failed: [Errno 2]")
    os.makedirs(tier.dir)
    tier.write("x", torch.ones(3)).wait()  # the key is usable again
    assert torch.equal(tier.read("x").wait(), torch.ones(3))
    tier.close()


class HalfPrecisionTier(RamDiskTier):
    """A faulty tier: it keeps floating tensors in fp16 and gives them back so (a compressing tier that
    forgot to convert back)."""

    kind = "half"

    def _write(self, key, tensor, owned):
        return super()._write(key, tensor.half() if tensor.is_floating_point() else tensor, owned=True)


def test_a_user_tier_that_gives_back_another_dtype_or_shape_fails_naming_itself_and_the_key(shm):
    tier = HalfPrecisionTier("half", path=shm)
    tier.write("x", torch.ones(3)).wait()
    message = ("tier 'half' (HalfPrecisionTier) gave back a torch.float16 tensor of shape (3,) for 'x', which was "
               "written as a torch.float32 tensor of shape (3,): a tier's read must return the tensor as written")
    for wait in ("wait", "synchronize"):
        with pytest.raises(lazytrain.tiers.TierError) as e:
            getattr(tier.read("x"), wait)()
        assert str(e.value) == message

    async def awaited():
        return await tier.read("x")
    import asyncio
    with pytest.raises(lazytrain.tiers.TierError, match="gave back a torch.float16 tensor"):
        asyncio.run(awaited())
    tier.write("i", torch.arange(4, dtype=torch.int64)).wait()   # kept as written: read back as written
    assert torch.equal(tier.read("i").wait(), torch.arange(4))
    tier.meta["i"] = (torch.Size([2]), torch.int64, tier.meta["i"][2])   # now it reads back half of it
    with pytest.raises(lazytrain.tiers.TierError, match=r"gave back a torch.int64 tensor of shape \(2,\) for 'i', "
                                                        r"which was written as a torch.int64 tensor of shape \(4,\)"):
        tier.read("i").wait()
    tier.close()


def test_an_engine_whose_boundary_tier_gives_back_fp16_fails_the_backward_naming_the_tier(tmp_path):
    """Boundaries kept on that tier: the backward fails naming it, rather than training on rounded values."""
    engine_models = pytest.importorskip("engine_models")
    lazytrain.register_tier("half", HalfPrecisionTier)
    engine, _, _, _ = lazytrain.initialize(model=engine_models.make_model("modulelist"), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "lazytrain": {"device": "cpu", "checkpoint_interval": 2, "boundary_home": "half",
                      "tiers": [{"name": "half", "class": "half", "path": str(tmp_path)}]}})
    (x, y), = engine_models.batches(1)
    with pytest.raises(lazytrain.tiers.TierError, match=r"tier 'half' \(HalfPrecisionTier\) gave back a "
                                                        r"torch.float16 tensor"):
        engine.backward(engine_models.lm_loss(engine(x), y))
    engine.destroy()


class RaisingTier(RamDiskTier):
    """A tier whose own calls raise as they are made."""

    kind = "raising"

    def _read(self, key, out, device):
        raise KeyError(key)

    def _write(self, key, tensor, owned):
        if key == "bad":
            raise ValueError("no room in the ram disk")
        return super()._write(key, tensor, owned)


def test_a_user_tiers_own_error_is_raised_naming_the_tier_and_the_key(shm):
    tier = RaisingTier("r", path=shm)
    with pytest.raises(lazytrain.tiers.TierError) as e:
        tier.write("bad", torch.ones(2))
    assert str(e.value) == "tier 'r' (RaisingTier) failed writing 'bad': ValueError: no room in the ram disk"
    assert isinstance(e.value.__cause__, ValueError) and "bad" not in tier and tier.used_bytes == 0
    tier.write("x", torch.ones(2)).wait()
    with pytest.raises(lazytrain.tiers.TierError) as e:
        tier.read("x")
    assert str(e.value) == "tier 'r' (RaisingTier) failed reading 'x': KeyError: 'x'"
    assert isinstance(e.value.__cause__, KeyError)
    tier.close()


def test_a_read_into_a_buffer_of_another_dtype_is_the_callers_mistake_and_a_bad_device_is_not_the_tiers(shm):
    tier = RamDiskTier("ram", path=shm)
    tier.write("x", torch.ones(4)).wait()
    with pytest.raises(lazytrain.tiers.TierError) as e:
        tier.read("x", out=torch.empty(4, dtype=torch.float16))
    assert str(e.value) == "tier 'ram': read of 'x' into a buffer of (4,) torch.float16, but it holds (4,) torch.float32"
    with pytest.raises(RuntimeError) as e:
        tier.read("x", device="cdua")
    assert not isinstance(e.value, lazytrain.tiers.TierError)
    out = torch.empty(4)
    assert tier.read("x", out=out).wait() is out and torch.equal(out, torch.ones(4))
    tier.close()


class CountingHandle(TransferHandle):
    """A user's own handle class: its wait() counts the waits."""

    __slots__ = ("waits",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.waits = 0

    def wait(self):
        self.waits += 1
        return super().wait()


class OwnHandleTier(RamDiskTier):
    kind = "ownhandle"

    def _read(self, key, out, device):
        self.last = CountingHandle(future=super()._read(key, out, device)._future)
        return self.last


def test_a_user_tiers_own_handle_class_is_what_its_reads_wait_on(shm):
    tier = OwnHandleTier("own", path=shm)
    tier.write("x", torch.ones(3)).wait()
    handle = tier.read("x")
    assert torch.equal(handle.wait(), torch.ones(3)) and tier.last.waits == 1
    tier.close()


class NotAHandleTier(RamDiskTier):
    """Returns what it moved instead of a TransferHandle (the tensor, or nothing)."""

    kind = "not-a-handle"
    handle_for_writes = False

    def _write(self, key, tensor, owned):
        handle = super()._write(key, tensor, owned)
        return handle if self.handle_for_writes else handle.wait()

    def _read(self, key, out, device):
        return super()._read(key, out, device).wait()


def test_a_user_tier_that_returns_no_transfer_handle_is_named_and_keeps_nothing_reserved(shm):
    """It failed on a bare "AttributeError: 'NoneType' object has no attribute '_future'", with the key still
    holding its budget (the next write overran it) and the write's meter in flight for good."""
    tier = NotAHandleTier("odd", capacity=100, path=shm)
    with pytest.raises(lazytrain.tiers.TierError) as e:
        tier.write("k", torch.ones(10))
    assert str(e.value) == ("tier 'odd' (NotAHandleTier): _write of 'k' returned NoneType, not a TransferHandle "
                            "(TransferHandle(value=tensor) for work done, TransferHandle(future=f) for work on a "
                            "thread pool)")
    assert "k" not in tier and tier.used_bytes == 0 and tier.stats()["bytes_written"] == 0
    tier.handle_for_writes = True
    tier.write("k", torch.ones(10)).wait()   # within the budget: nothing was left reserved
    with pytest.raises(lazytrain.tiers.TierError, match=r"^tier 'odd' \(NotAHandleTier\): _read of 'k' returned "
                                                        r"Tensor, not a TransferHandle"):
        tier.read("k")
    tier.close()


class FailsToFreeTier(RamDiskTier):
    """Drops the key, then raises (a file it could not unlink), or fails to close."""

    kind = "fails-to-free"

    def __init__(self, name, capacity=None, path="/dev/shm", fail="free"):
        super().__init__(name, capacity, path)
        self.fail = fail

    def _free(self, key):
        super()._free(key)
        if self.fail == "free":
            raise OSError(5, "could not unlink")

    def close(self):
        RamDiskTier.close(self)
        if self.fail == "close":
            raise OSError(5, "Input/output error")


def test_a_user_tier_that_fails_to_free_or_close_is_warned_of_or_raised_last_and_everything_is_let_go(tmp_path):
    """A _free raising failed the backward with a bare OSError and left the pass's other keys on the tier for the
    rest of the run; a close() raising stopped destroy() half-way (the other tiers open, the model's optimizer
    and devices not handed back)."""
    engine_models = pytest.importorskip("engine_models")
    lazytrain.register_tier("fails-to-free", FailsToFreeTier)
    dirs = {name: tmp_path / name for name in ("a", "b")}
    for d in dirs.values():
        d.mkdir()
    model = engine_models.make_model("modulelist")
    engine, _, _, _ = lazytrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "lazytrain": {"device": "cpu", "checkpoint_interval": 1, "boundary_home": "a",
                      "tiers": [{"name": "a", "class": "fails-to-free", "path": str(dirs["a"])},
                                {"name": "b", "class": "fails-to-free", "path": str(dirs["b"]), "fail": "close"}]}})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y in engine_models.batches(3):
            engine.backward(engine_models.lm_loss(engine(x), y))
            engine.step()
    told = [str(w.message) for w in seen if "failed freeing" in str(w.message)]
    assert len(told) == 1   # one a tier: the keys are numbered by pass, each would be a warning of its own
    assert re.fullmatch(r"lazytrain: tier 'a' \(FailsToFreeTier\) failed freeing 'pass0\.boundary\d': OSError: \[Errno "
                        r"5\] could not unlink; the key's budget is given back and training goes on \(what it held "
                        r"may remain in the tier's storage; further failures of tier 'a' to free a key are not "
                        r"warned of\)", told[0])
    assert engine.tiers["a"].keys() == [] and engine.tiers["a"].used_bytes == 0
    engine.tiers["b"].write("left", torch.ones(3)).wait()
    tier_b = engine.tiers["b"]
    with pytest.raises(lazytrain.tiers.TierError) as e:
        engine.destroy()
    assert str(e.value) == "tier 'b' (FailsToFreeTier) failed to close: OSError: [Errno 5] Input/output error"
    assert tier_b.keys() == [] and os.listdir(dirs["b"]) == [] and tier_b.pool._shutdown
    # the rest handed back: the blocks called directly, the optimizer on the model's own parameters
    assert lazytrain.engine_of(model) is None and all("forward" not in b.__dict__ for b in model.stack)
    assert {id(p) for g in engine.basic_optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters()}
    engine.destroy()   # destroyed all the same: a second call does nothing


def test_a_destroy_cut_short_before_the_tiers_closed_is_done_by_the_next_call(tmp_path, monkeypatch):
    """A destroy() that raised for any reason was marked done, so the next call did nothing and the tiers kept
    their keys (an NVMe run directory its files); only a tier's failure to close, raised once all else is done,
    marks it so."""
    engine_models = pytest.importorskip("engine_models")
    engine, _, _, _ = lazytrain.initialize(model=engine_models.make_model("modulelist"), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "lazytrain": {"device": "cpu", "weights_home": "nvme", "nvme_path": str(tmp_path)}})
    (x, y), = engine_models.batches(1)
    engine.backward(engine_models.lm_loss(engine(x), y))
    engine.step()
    settle = engine.stream.settle_all

    def interrupted():
        monkeypatch.setattr(engine.stream, "settle_all", settle)
        raise KeyboardInterrupt
    monkeypatch.setattr(engine.stream, "settle_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.destroy()
    assert os.listdir(tmp_path) != []   # the NVMe tier's run directory, still open
    engine.destroy()
    assert os.listdir(tmp_path) == [] and all(t.keys() == [] for t in engine.tiers.values())
