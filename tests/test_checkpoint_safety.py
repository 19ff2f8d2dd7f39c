"""Checkpoints that survive a process dying at any moment and a disk that fills up, and an engine that
stays consistent (or says it is not) when a step fails half-way."""
import copy
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine import checkpoint as ckpt
from engine_models import batches, lm_loss, make_model
from fs_helpers import tmpfs

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")


class Killed(BaseException):
    """The process dying at this point: nothing after it runs, no clean-up either."""


def files_of(step: int) -> dict:
    """A checkpoint whose two files say which save wrote them."""
    return {ckpt.MODEL_FILE: {"step": step, "w": torch.full((1000,), float(step))},
            ckpt.OPTIM_FILE: {"step": step, "m": torch.full((2000,), float(step))}}


def loaded_step(d, tag=None):
    tag = ckpt.resolve_tag(str(d), tag)
    _, model, optim = ckpt.load(str(d), tag, want_optimizer=True)
    assert model["step"] == optim["step"], "model and optimizer files from different saves"
    assert torch.equal(model["w"], torch.full((1000,), float(model["step"])))
    assert torch.equal(optim["m"], torch.full((2000,), float(model["step"])))
    return model["step"]


def crash_points(monkeypatch, crash_at: int | None):
    """Count every file-system step of a save (write, fsync, rename, remove); raise Killed at the
    ``crash_at``-th."""
    count = [0]

    def wrap(fn):
        def step(*args, **kwargs):
            count[0] += 1
            if count[0] == crash_at:
                raise Killed()
            return fn(*args, **kwargs)
        return step
    for name in ("rename", "replace", "fsync", "mkdir"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    monkeypatch.setattr(shutil, "rmtree", wrap(shutil.rmtree))
    monkeypatch.setattr(torch, "save", wrap(torch.save))
    return count


@pytest.mark.parametrize("reused_tag", [True, False])
def test_a_save_killed_at_any_step_leaves_a_whole_checkpoint(tmp_path, monkeypatch, reused_tag):
    """Every point at which a save can die: the tag loads as the old save or the new one, whole; 'latest'
    names a whole checkpoint; the next save completes and leaves nothing behind."""
    with monkeypatch.context() as m:
        total = crash_points(m, None)
        ckpt.save(str(tmp_path / "probe"), "ckpt", files_of(1), True)
        ckpt.save(str(tmp_path / "probe"), "ckpt", files_of(2), True)
        steps = total[0] // 2 + 4                       # a save's own steps, with margin
    for k in range(1, steps + 1):
        d = tmp_path / f"kill{k}"
        ckpt.save(str(d), "ckpt", files_of(1), True)
        new_tag = "ckpt" if reused_tag else "other"
        with monkeypatch.context() as m:
            crash_points(m, k)
            try:
                ckpt.save(str(d), new_tag, files_of(2), True)
            except Killed:
                pass
        assert loaded_step(d, "ckpt") in ((1, 2) if reused_tag else (1,)), k
        assert loaded_step(d) in (1, 2), k              # whatever 'latest' names is whole
        if not reused_tag and os.path.isdir(d / "other"):
            assert loaded_step(d, "other") == 2
        ckpt.save(str(d), "ckpt", files_of(3), True)    # the next save settles what the killed one left
        assert loaded_step(d) == 3 and loaded_step(d, "ckpt") == 3
        assert [e for e in os.listdir(d) if e.startswith(".") or e.endswith(".tmp")] == [], k


def test_killed_saves_in_a_real_process_never_tear_a_checkpoint(tmp_path):
    """A process saving to a reused tag and to new tags, killed (SIGKILL) at many moments. Each saver is
    forked by one subprocess that imported torch and LazyTrain once (a fresh interpreter per kill spent most
    of the test's time importing)."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint_safety import files_of
        from lazytrain.engine import checkpoint as ckpt
        d = sys.argv[1]
        for line in sys.stdin:                  # one saver per line: the step it starts after
            step = int(line)
            pid = os.fork()
            if pid == 0:
                print("ready", os.getpid(), flush=True)
                while True:
                    step += 1
                    ckpt.save(d, "ckpt", files_of(step), True)
                    ckpt.save(d, f"s{{step}}", files_of(step), False)
            _, status = os.waitpid(pid, 0)
            print("reaped", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    """)
    d = tmp_path / "ckpts"
    ckpt.save(str(d), "ckpt", files_of(1), True)
    delays = [0.002 * i for i in range(10)]
    forker = subprocess.Popen([sys.executable, "-c", script, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for i, delay in enumerate(delays):
            forker.stdin.write(f"{100 * (i + 1)}\n".encode())
            forker.stdin.flush()
            ready, pid = forker.stdout.readline().split()
            assert ready == b"ready"
            time.sleep(0.05 + delay)
            os.kill(int(pid), signal.SIGKILL)
            assert forker.stdout.readline().split() == [b"reaped", str(int(signal.SIGKILL)).encode()]
            step = loaded_step(d, "ckpt")
            assert loaded_step(d) == step or ckpt.resolve_tag(str(d), None) != "ckpt"
            for entry in os.listdir(d):
                if entry.startswith("s"):
                    loaded_step(d, entry)                   # every new tag that exists is whole
    finally:
        forker.stdin.close()
        forker.wait(timeout=60)
    assert forker.returncode == 0
    ckpt.save(str(d), "ckpt", files_of(10_000), True)
    assert loaded_step(d) == 10_000
    assert [e for e in os.listdir(d) if e.startswith(".")] == []


# ---- incomplete and foreign tags ---------------------------------------------------------------------
def test_a_tag_with_a_file_missing_is_refused_by_name(tmp_path):
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    os.remove(tmp_path / "t" / ckpt.OPTIM_FILE)
    with pytest.raises(ckpt.IncompleteCheckpointError,
                       match=f"checkpoint tag 't' in {tmp_path} is incomplete: .*{ckpt.OPTIM_FILE} is missing"):
        ckpt.load(str(tmp_path), "t", want_optimizer=True)


def test_a_save_never_replaces_a_directory_of_the_users_that_is_not_a_checkpoint(tmp_path):
    """A save replaces its tag's directory whole: where that directory holds what no save writes (a user's
    own files), the save is refused before it writes anything, and the files stay; a tag saved before is
    replaced as always."""
    own = tmp_path / "final"
    own.mkdir()
    (own / "thesis.txt").write_text("precious")
    with pytest.raises(ckpt.CheckpointError, match=rf"saving checkpoint tag 'final' to {tmp_path}: {own} exists and "
                                                   r"holds what a save does not write \(thesis.txt\): .*nothing was saved"):
        ckpt.save(str(tmp_path), "final", files_of(1), True)
    assert (own / "thesis.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["final"]
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    ckpt.save(str(tmp_path), "t", files_of(2), True)   # a checkpoint's own directory: replaced
    assert loaded_step(tmp_path, "t") == 2


def test_a_save_over_a_tag_that_holds_a_users_own_files_is_refused_and_keeps_them(tmp_path):
    """A tokenizer config or training arguments the user put in a tag's directory are not the checkpoint's,
    though they end as its files do: saving the tag again removed them without a word. It is refused, naming
    them, and the tag loads as it was; without them, the tag is replaced as always."""
    ckpt.save(str(tmp_path), "best", files_of(1), True)
    (tmp_path / "best" / "tokenizer_config.json").write_text('{"model_max_length": 2048}')
    torch.save({"epoch": 7}, tmp_path / "best" / "training_args.pt")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            f"saving checkpoint tag 'best' to {tmp_path}: {tmp_path / 'best'} exists and holds what a save does not "
            f"write (tokenizer_config.json, training_args.pt): a save replaces its tag's directory whole, so nothing "
            f"was saved")):
        ckpt.save(str(tmp_path), "best", files_of(2), True)
    assert sorted(os.listdir(tmp_path / "best")) == sorted([ckpt.MODEL_FILE, ckpt.OPTIM_FILE, ckpt.MANIFEST,
                                                            "tokenizer_config.json", "training_args.pt"])
    assert loaded_step(tmp_path, "best") == 1
    os.remove(tmp_path / "best" / "tokenizer_config.json")
    os.remove(tmp_path / "best" / "training_args.pt")
    ckpt.save(str(tmp_path), "best", files_of(2), True)
    assert loaded_step(tmp_path, "best") == 2


_SAVING_ELSEWHERE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from test_checkpoint_safety import files_of
    from lazytrain.engine import checkpoint as ckpt
    d, tag = sys.argv[1], sys.argv[2]
    staging = ckpt.begin(d, tag, 0)
    sizes = ckpt.write_files(d, tag, staging, files_of(7))
    print("written", flush=True)
    if sys.stdin.readline().strip() == "finish":
        ckpt.finish(d, tag, staging, sizes, False)
        print("finished", flush=True)
""")


def _saving_elsewhere(d, tag):
    """Another process, stopped in its save of ``tag`` (its files written, its tag not yet in place)."""
    other = subprocess.Popen([sys.executable, "-c", _SAVING_ELSEWHERE, str(d), tag, os.path.dirname(__file__)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "written"
    return other


def test_a_save_leaves_another_processs_save_in_progress_alone(tmp_path):
    """Two processes saving into one directory: the second's start-up took the first's staging directory for
    a left-over and removed it (the first then failed, blaming the file system). A save in progress holds a
    lock on its staging directory; a save of another tag leaves it, a save of the same tag is refused."""
    ckpt.save(str(tmp_path), "a", files_of(1), True)
    other = _saving_elsewhere(tmp_path, "a")
    try:
        ckpt.save(str(tmp_path), "b", files_of(2), True)
        assert (tmp_path / ".a.staging").is_dir()
        with pytest.raises(ckpt.CheckpointError, match=re.escape(
                f"saving checkpoint tag 'a' to {tmp_path}: another process is saving that tag there now "
                f"({tmp_path / '.a.staging'} is its save in progress); nothing was saved")):
            ckpt.save(str(tmp_path), "a", files_of(3), True)
        other.stdin.write("finish\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "finished"
        assert other.wait(timeout=60) == 0
    finally:
        other.kill()
    assert (loaded_step(tmp_path, "a"), loaded_step(tmp_path, "b"), loaded_step(tmp_path)) == (7, 2, 2)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "latest"]


def test_the_save_of_a_process_that_died_is_a_left_over_the_next_save_rolls_back(tmp_path):
    ckpt.save(str(tmp_path), "a", files_of(1), True)
    other = _saving_elsewhere(tmp_path, "a")
    other.kill()
    other.wait(timeout=60)
    assert (tmp_path / ".a.staging").is_dir()
    ckpt.save(str(tmp_path), "b", files_of(2), True)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "latest"]
    assert loaded_step(tmp_path, "a") == 1


def test_a_save_that_never_completed_is_refused_and_never_half_loaded(tmp_path):
    staging = tmp_path / ".t.staging"
    staging.mkdir(parents=True)
    torch.save({"step": 1}, staging / ckpt.MODEL_FILE)   # died before the optimizer file and the manifest
    with pytest.raises(ckpt.IncompleteCheckpointError, match="no lazytrain_manifest.json"):
        ckpt.load(str(tmp_path), "t", want_optimizer=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint tag 'u'"):
        ckpt.load(str(tmp_path), "u", want_optimizer=True)


def test_a_checkpoint_without_a_manifest_loads_as_deepspeed_writes_them(tmp_path):
    (tmp_path / "global_step3").mkdir()
    for name, obj in files_of(3).items():
        torch.save(obj, tmp_path / "global_step3" / name)
    (tmp_path / "latest").write_text("global_step3")
    assert loaded_step(tmp_path) == 3


def test_an_empty_latest_file_is_named_as_the_problem(tmp_path):
    """A 'latest' truncated (a full disk, another tool) names no tag: the error says so, not that the
    directory itself is an incomplete checkpoint."""
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    (tmp_path / "latest").write_text(" \n")
    latest = tmp_path / "latest"
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"the 'latest' file in {tmp_path} ({latest}) is empty: "
                                                             f"it names no checkpoint tag")):
        ckpt.resolve_tag(str(tmp_path), None)
    assert ckpt.resolve_tag(str(tmp_path), "t") == "t"


@pytest.mark.parametrize("named", ["../elsewhere/t", "ABSOLUTE", "..", ".", "t\x00x", "t\nsecond"])
def test_a_latest_file_naming_a_path_outside_its_directory_is_refused(tmp_path, named):
    """'latest' is a file's content: a path in it would load (with trust_checkpoints, unpickle without
    restriction) a checkpoint outside the directory the caller named."""
    ckpt.save(str(tmp_path / "elsewhere"), "t", files_of(1), True)
    run = tmp_path / "run"
    run.mkdir()
    named = str(tmp_path / "elsewhere" / "t") if named == "ABSOLUTE" else named
    (run / "latest").write_text(named)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"the 'latest' file in {run} ({run / 'latest'}) names "
                                                             f"{named[:80]!r}, which is not a checkpoint tag in that "
                                                             f"directory")):
        ckpt.resolve_tag(str(run), None)


def test_a_latest_file_longer_than_a_tag_is_refused_without_reading_it_whole(tmp_path):
    """A 'latest' of 64 MiB (sparse: a few disk blocks) was read whole and repeated whole in the error."""
    latest = tmp_path / "latest"
    with open(latest, "wb") as f:
        f.write(b"t")
        f.truncate(64 << 20)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.resolve_tag(str(tmp_path), None)
    assert str(e.value) == (f"the 'latest' file in {tmp_path} ({latest}) holds more than a checkpoint tag (a tag is "
                            f"at most {ckpt.MAX_TAG_BYTES} bytes); pass tag= to load a specific checkpoint")
    (tmp_path / "latest").write_text("t" * ckpt.MAX_TAG_BYTES + "\n")   # the longest tag a save writes
    assert ckpt.resolve_tag(str(tmp_path), None) == "t" * ckpt.MAX_TAG_BYTES


@pytest.mark.parametrize("aside", [".t.staging", ".t.previous"])
def test_a_users_own_directory_named_as_a_save_sets_aside_is_never_removed(tmp_path, aside):
    own = tmp_path / aside
    own.mkdir()
    (own / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"saving checkpoint tag 't' to {tmp_path}: {own} exists "
                                                             f"and holds what a save does not write (notes.txt), unlike what a save "
                                                             f"sets aside")):
        ckpt.save(str(tmp_path), "t", files_of(1), True)
    assert (own / "notes.txt").read_text() == "mine" and not (tmp_path / "t").exists()


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "latest", "..", "latest.tmp", " spaced ", "run\t1"])
def test_tags_that_cannot_be_a_directory_are_refused(tmp_path, tag):
    with pytest.raises(ckpt.CheckpointError, match="cannot name a directory of its own"):
        ckpt.save(str(tmp_path), tag, files_of(1), True)


# ---- a full disk -----------------------------------------------------------------------------------
def test_a_save_bigger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=5000))
    with pytest.raises(ckpt.CheckpointSpaceError,
                       match=rf"not enough space to save checkpoint tag 't' in {tmp_path}: it needs about 11.7 KiB, "
                             r"4.9 KiB are free"):
        ckpt.save(str(tmp_path), "t", files_of(2), True)
    monkeypatch.undo()
    assert loaded_step(tmp_path, "t") == 1
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


class _FillsUp:
    """A file that refuses bytes past ``room``, as a full disk does."""

    def __init__(self, path, room):
        self.f, self.room = open(path, "wb"), room

    def write(self, b):
        if self.room < len(b):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_disk_that_fills_during_the_save_is_named_and_the_old_checkpoint_kept(tmp_path, monkeypatch):
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    monkeypatch.setattr(ckpt, "_open_for_write", lambda path: _FillsUp(path, 6000))
    with pytest.raises(ckpt.CheckpointSpaceError, match=rf"not enough space to save checkpoint tag 't' in {tmp_path}"):
        ckpt.save(str(tmp_path), "t", files_of(2), True)
    monkeypatch.undo()
    assert loaded_step(tmp_path, "t") == 1 and loaded_step(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


class Record(ckpt.PickledByName):
    pickle_as = "deepspeed.utils.tensor_fragment.fragment_address"


def streamed_files(step: int) -> dict:
    """Files with tensors written piece by piece (a flat concatenation, a 16-bit cast), a record written
    under DeepSpeed's class name, and views of one storage."""
    w = torch.arange(12.0).view(3, 4) + step
    flat = ckpt.Streamed((7,), torch.float32, lambda: [torch.full((3,), float(step)), torch.arange(4.0)])
    half = ckpt.Streamed((12,), torch.bfloat16, lambda: (w.reshape(-1)[i:i + 5].bfloat16() for i in range(0, 12, 5)))
    return {ckpt.MODEL_FILE: {"step": step, "w": w, "tied": w, "wt": w.t(), "flat": [flat, flat], "half": half,
                              "where": Record(numel=7, start=0), "n": torch.tensor(float(step))},
            ckpt.OPTIM_FILE: {"step": step, "m": torch.full((2000,), float(step))}}


def test_streamed_tensors_are_written_in_place_piece_by_piece(tmp_path, monkeypatch):
    import zipfile
    from lazytrain.engine import safe_load
    ckpt.save(str(tmp_path), "t", streamed_files(1), True)
    path = os.path.join(tmp_path, "t", ckpt.MODEL_FILE)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None                    # every record's CRC matches its bytes
    state = safe_load.load(path)
    w = torch.arange(12.0).view(3, 4) + 1
    assert torch.equal(state["w"], w) and torch.equal(state["wt"], w.t()) and torch.equal(state["n"], torch.tensor(1.0))
    assert state["w"].data_ptr() == state["tied"].data_ptr()              # one storage, as torch.save keeps it
    assert torch.equal(state["flat"][0], torch.tensor([1.0, 1, 1, 0, 1, 2, 3]))
    assert state["flat"][0].data_ptr() == state["flat"][1].data_ptr()
    assert state["half"].dtype == torch.bfloat16 and torch.equal(state["half"], w.reshape(-1).bfloat16())
    assert isinstance(state["where"], safe_load.DeepSpeedRecord) and vars(state["where"]) == {"numel": 7, "start": 0}
    assert safe_load.load(path, trust=True)["where"].numel == 7           # a trusted load needs no DeepSpeed
    # a disk that fills while the file's skeleton or its pieces go in: named, and the previous checkpoint kept
    def full(source):
        raise OSError(errno.ENOSPC, "No space left on device")
    cases = {"skeleton": ("_open_for_write", lambda p: _FillsUp(p, 2000)), "pieces": ("_pieces", full)}
    for where, (name, value) in cases.items():
        monkeypatch.setattr(ckpt, name, value)
        with pytest.raises(ckpt.CheckpointSpaceError, match=f"not enough space to save checkpoint tag 't' in {tmp_path}:"
                                                           f" it needs"):
            ckpt.save(str(tmp_path), "t", streamed_files(2), True)
        monkeypatch.undo()
        assert safe_load.load(path)["step"] == 1 and sorted(os.listdir(tmp_path)) == ["latest", "t"], where


@pytest.fixture
def small_filesystem(tmp_path):
    """A 3 MB file system."""
    with tmpfs(tmp_path / "small", "size=3m") as mnt:
        yield mnt


def test_an_engine_checkpoint_on_a_full_file_system(small_filesystem):
    engine = _engine(n_layers=6)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(small_filesystem), tag="ckpt")
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    ballast = small_filesystem / "ballast"
    free = shutil.disk_usage(small_filesystem).free
    with open(ballast, "wb") as f:                     # leave less room than the checkpoint takes
        f.write(b"\0" * (free - 200_000))
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(ckpt.CheckpointSpaceError, match=rf"checkpoint tag 'ckpt' in {small_filesystem}: it needs"):
        engine.save_checkpoint(str(small_filesystem), tag="ckpt")
    other = _engine(n_layers=6)
    other.load_checkpoint(str(small_filesystem))
    assert all(torch.equal(v, before[k]) for k, v in other.module_state_dict().items())
    assert sorted(os.listdir(small_filesystem)) == ["ballast", "ckpt", "latest"]
    engine.destroy()
    other.destroy()


# ---- a step that fails half-way ----------------------------------------------------------------------
def _engine(n_layers=6, _gas=1, **section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": _gas, "gradient_clipping": 1.0,
           "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, "device": "cpu", **section}}
    if cfg["lazytrain"]["checkpoint_interval"] is None:   # a plan file's boundaries instead
        del cfg["lazytrain"]["checkpoint_interval"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama", n_layers), config=cfg)
    return engine


@pytest.mark.parametrize("gas,overlap", [(1, False), (2, False), (2, True)])
def test_a_full_disk_under_the_streamed_weights_inside_step_completes_the_step_and_says_so(tmp_path, monkeypatch, gas,
                                                                                           overlap):
    """The issue's case: the compute copies cannot be written after the update. The step completes on every
    part that matters (fp32 weights, optimizer states, counters, schedule, gradients); the copies are
    written again before their next use, and training goes on exactly as a run where the disk never
    filled. With the update overlapped (step() has returned by then) a warning says so; that path counted
    the failed copy as a failed update, and every later forward found no copy ("holds no tensor under key")
    until a checkpoint was loaded."""
    for d in ("nvme", "nvme2"):
        (tmp_path / d).mkdir()
    engine = _engine(weights_home="nvme", nvme_path=str(tmp_path / "nvme"), overlap_optimizer=overlap, _gas=gas)
    twin = _engine(weights_home="nvme", nvme_path=str(tmp_path / "nvme2"), overlap_optimizer=overlap, _gas=gas)
    data = batches(4 * gas)
    fail_at = 2 * gas - 1                              # the micro-batch whose step() is step 2's boundary
    tier = engine.weights.weights_tier
    real_write, calls, full = tier.write, [0], [False]

    def filling(key, tensor, owned=False):
        calls[0] += 1
        if full[0] and calls[0] > 2:
            raise OSError(errno.ENOSPC, "No space left on device", key)
        return real_write(key, tensor, owned)
    monkeypatch.setattr(tier, "write", filling)
    for n, (x, y) in enumerate(data):
        for e in (engine, twin):
            e.backward(lm_loss(e(x), y))
        if n == fail_at:
            engine.wait_for_update()   # the last step's copies written before the disk fills
            full[0], calls[0] = True, 0
            said = (r"step 2 completed \(weights, optimizer states, counters, schedule and gradients all advanced\), "
                    r"but the compute copies of layers 2..5 could not be stored \(OSError: .*No space left on "
                    r"device.*\)")
            if overlap:
                with pytest.warns(UserWarning, match="lazytrain: " + said):
                    engine.step()
                    engine.wait_for_update()
            else:
                with pytest.raises(lazytrain.StepFailedError, match=said):
                    engine.step()
            x2, _ = data[fail_at + 1]
            with pytest.raises(OSError, match="No space left on device"):
                engine(x2)                           # still full: the forward says so
            full[0] = False
        else:
            engine.step()
        twin.step()
    assert (engine.global_steps, engine.micro_steps) == (twin.global_steps, twin.micro_steps) == (4, 4 * gas)
    a, b = engine.module_state_dict(), twin.module_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine.save_checkpoint(str(tmp_path / "ckpt"))   # consistent: saving is allowed
    engine.destroy()
    twin.destroy()


def _full_disk_after(engine, stored: int) -> list:
    """ENOSPC from the NVMe tier's writes once ``stored`` more have gone through, while the returned flag
    [True] holds: raised inside the tier's write, after it freed the old file, as a full disk does."""
    tier = engine.weights.weights_tier
    real, state = tier._write, {"left": stored}
    full = [True]

    def write(key, tensor, owned):
        if full[0]:
            if state["left"] == 0:
                raise OSError(errno.ENOSPC, "No space left on device", key)
            state["left"] -= 1
        return real(key, tensor, owned)
    tier._write = write
    return full


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_full_disk_under_an_overlapped_update_fails_no_update_with_a_resident_layer_or_warnings_as_errors(
        tmp_path, seed):
    """Two ways the copy that could not be stored still failed the overlapped update (every later forward and
    step refused until a checkpoint was loaded): a forward already waiting at a resident layer had the update
    thread refresh its device copy from the copy that was not stored (that raised there); and the warning,
    issued on the update thread, became its failure under a warnings filter of "error". Now the forward says
    the disk is full, the warning comes on the training thread, and once there is room training goes on as
    a run whose disk never filled, whatever the copies' timing (chaos delays)."""
    from lazytrain.planner.plan import every_k_plan
    plan = str(tmp_path / "plan.json")
    every_k_plan(6, 2, home="host", resident_layers=(3,)).to_json(plan)
    testing = {"copy_threads": True, "chaos_seed": seed, "chaos_max_delay_ms": 2.0}
    engines = []
    for d in ("nvme", "nvme2"):
        (tmp_path / d).mkdir()
        engines.append(_engine(weights_home="nvme", nvme_path=str(tmp_path / d), overlap_optimizer=True,
                               policy="plan", plan=plan, checkpoint_interval=None, testing=testing))
    engine, twin = engines
    data = batches(6)

    def train(k: int, step: bool = True) -> None:   # both engines, on micro-batch k
        x, y = data[k]
        for e in engines:
            e.backward(lm_loss(e(x), y))
            if step:
                e.step()
    train(0)
    train(1)
    said = r"lazytrain: step 3 completed .* but the compute copies of layers 3\.\.5 could not be stored"
    engine.wait_for_update()
    train(2, step=False)
    # the disk full from layer 3's copy on; the next forward starts at once, meeting the update thread
    full = _full_disk_after(engine, stored=3)
    with pytest.warns(UserWarning, match=said):   # given by the first wait after the update's last layer
        engine.step()
        with pytest.raises(OSError, match="No space left on device"):
            engine(data[3][0])
        engine.wait_for_update()
    twin.step()
    full[0] = False
    train(3)
    # a warnings filter of "error": the warning raised on the training thread, the update whole
    train(4, step=False)
    engine.wait_for_update()
    full = _full_disk_after(engine, stored=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.step()
        with pytest.raises(UserWarning, match=said.replace("step 3", "step 5")):
            engine.wait_for_update()
    twin.step()
    full[0] = False
    train(5)
    a, b = engine.module_state_dict(), twin.module_state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    for e in engines:
        e.destroy()


def test_an_update_failing_half_way_stops_training_and_saving_until_a_load(tmp_path, monkeypatch):
    engine = _engine()
    data = batches(4)
    x, y = data[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="good")
    x, y = data[1]
    engine.backward(lm_loss(engine(x), y))
    real_step = engine.optimizer.step

    def half_then_fail(*args, **kwargs):
        with torch.no_grad():
            engine.weights.master[0].add_(1.0)         # some weights already written
        raise MemoryError("cannot allocate")
    monkeypatch.setattr(engine.optimizer, "step", half_then_fail)
    with pytest.raises(lazytrain.StepFailedError,
                       match=r"step 2 failed during the optimizer update \(MemoryError: cannot allocate\): some "
                             r"weights and optimizer states hold the update and some do not"):
        engine.step()
    monkeypatch.setattr(engine.optimizer, "step", real_step)
    assert engine.global_steps == 1
    with pytest.raises(lazytrain.CheckpointError, match=r"save_checkpoint refused: step 2 failed during the "
                                                        r"optimizer update"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="bad")
    with pytest.raises(lazytrain.StepFailedError, match=r"a training forward refused: step 2 failed"):
        engine(x)
    with pytest.raises(lazytrain.StepFailedError, match=r"step\(\) refused: step 2 failed"):
        engine.step()
    for export in (lambda: engine.save_16bit_model(str(tmp_path / "hub")), engine.module_state_dict):
        with pytest.raises(lazytrain.StepFailedError, match=r"refused: step 2 failed during the optimizer update"):
            export()
    with torch.no_grad(), pytest.raises(lazytrain.StepFailedError, match=r"a forward refused: step 2 failed"):
        engine(x)
    assert not os.path.exists(tmp_path / "ckpt" / "bad")
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="good")   # consistent again
    twin = _engine()
    twin.load_checkpoint(str(tmp_path / "ckpt"), tag="good")
    for e in (engine, twin):
        for x, y in data[1:]:
            e.backward(lm_loss(e(x), y))
            e.step()
    a, b = engine.module_state_dict(), twin.module_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine.destroy()
    twin.destroy()


def test_a_step_failing_before_the_update_changes_nothing_and_can_be_retried(monkeypatch):
    engine = _engine()
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    grads = [g.clone() for g in engine.weights.grad]
    monkeypatch.setattr(engine.weights, "flush_grads", lambda: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(lazytrain.StepFailedError,
                       match=r"step 1 failed before the optimizer changed anything \(OSError: \[Errno 5\] I/O error\)"):
        engine.step()
    monkeypatch.undo()
    assert engine.global_steps == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(engine.weights.grad, grads))
    engine.step()                                     # retried: the step goes through
    assert engine.global_steps == 1
    engine.destroy()


def test_a_save_writes_the_weights_from_where_they_live(tmp_path, monkeypatch):
    """No second copy of the model in memory: the state handed to torch.save holds the masters themselves,
    or (a view into a layer's flat buffer) pieces that are views of them, written one after the other."""
    engine = _engine()
    handed = {}
    real = ckpt.save

    def spy(save_dir, tag, files, save_latest):
        handed.update(files[ckpt.MODEL_FILE]["module"])
        return real(save_dir, tag, files, save_latest)
    monkeypatch.setattr(ckpt, "save", spy)
    engine.save_checkpoint(str(tmp_path))
    params = dict(engine.module.named_parameters())
    for k, p in params.items():
        if isinstance(handed[k], ckpt.Streamed):
            pieces = list(handed[k].pieces())
            assert pieces[0].data_ptr() == p.data_ptr() and sum(c.numel() for c in pieces) == p.numel(), k
        else:
            assert handed[k].data_ptr() == p.data_ptr(), k
    assert any(isinstance(t, ckpt.Streamed) for t in handed.values())   # the blocks' views
    engine.destroy()


def test_a_load_that_fails_half_way_leaves_the_engine_refusing(tmp_path, monkeypatch):
    engine = _engine()
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path))

    def broken(state):
        raise ValueError("loaded state dict contains a parameter group that doesn't match")
    monkeypatch.setattr(engine.optimizer, "load_state_dict", broken)
    with pytest.raises(ValueError, match="doesn't match"):
        engine.load_checkpoint(str(tmp_path))         # the weights were loaded, the optimizer state was not
    monkeypatch.undo()
    with pytest.raises(lazytrain.StepFailedError,
                       match=rf"step\(\) refused: load_checkpoint of tag 'global_step1' from {tmp_path} failed "
                             rf"half-way \(ValueError: .*\)"):
        engine.step()
    engine.load_checkpoint(str(tmp_path))             # a load that completes is the way out
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 2
    engine.destroy()


def test_a_schedule_that_fails_after_the_update_is_named_and_fenced(tmp_path):
    """A client scheduler that raises once past its steps (OneCycleLR) after the weights were updated."""
    model = make_model("llama")
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"checkpoint_interval": 2,
                                                                                "device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = lazytrain.initialize(model=model, config=cfg)
    engine.lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=1)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()                                      # its one step
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(lazytrain.StepFailedError, match=r"step 2 updated the weights, then advancing the "
                                                        r"learning-rate schedule failed \(ValueError: Tried to step 2 times"):
        engine.step()
    with pytest.raises(lazytrain.CheckpointError, match="save_checkpoint refused: step 2 updated the weights"):
        engine.save_checkpoint(str(tmp_path))
    engine.destroy()


def test_the_next_save_leaves_files_of_the_users_own_alone(tmp_path):
    (tmp_path / ".notes.staging").write_text("mine")     # a file, not a directory a save staged
    (tmp_path / ".venv.previous").mkdir()                # a directory of the user's, not one a save set aside
    (tmp_path / ".venv.previous" / "pyvenv.cfg").write_text("home = /usr")
    (tmp_path / ".t2.staging").mkdir()                   # what a save killed while writing left
    (tmp_path / ".t2.staging" / ckpt.MODEL_FILE).write_bytes(b"partial")
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    assert (tmp_path / ".notes.staging").read_text() == "mine"
    assert (tmp_path / ".venv.previous" / "pyvenv.cfg").read_text() == "home = /usr"
    assert not (tmp_path / ".t2.staging").exists()


def test_an_optimizer_tensor_outside_the_model_is_saved_and_restored(tmp_path):
    """A loss's learnable temperature in a group added to the optimizer: DeepSpeed's files cannot name it,
    so its value and Adam state travel in LazyTrain's file; a resumed run continues exactly."""
    import lazytrain
    from engine_models import batches, lm_loss, make_model

    def engine_with_temperature():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config={
                "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}})
        temperature = torch.nn.Parameter(torch.ones(()))
        engine.optimizer.add_param_group({"params": [temperature]})
        return engine, temperature

    def train(engine, temperature, data):
        for x, y in data:
            engine.backward(lm_loss(engine(x), y) * temperature)
            engine.step()

    data = batches(4)
    straight, t_straight = engine_with_temperature()
    train(straight, t_straight, data)
    first, t_first = engine_with_temperature()
    train(first, t_first, data[:2])
    first.save_checkpoint(str(tmp_path))
    resumed, t_resumed = engine_with_temperature()
    resumed.load_checkpoint(str(tmp_path))
    assert torch.equal(t_resumed, t_first)
    train(resumed, t_resumed, data[2:])
    assert torch.equal(t_resumed, t_straight)
    for k, v in straight.module_state_dict().items():
        assert torch.equal(resumed.module_state_dict()[k], v), k


# ---- what a load leaves behind ----------------------------------------------------------------------
def _adamw_engine(**lazytrain_section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"checkpoint_interval": 2, **lazytrain_section}}
    return lazytrain.initialize(model=make_model("modulelist"), config=cfg)[0]


def _train_steps(engine, data):
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def test_8bit_optimizer_states_load_into_an_engine_with_fp32_states(tmp_path):
    """The saved optimizer's 8-bit codes were handed to torch AdamW as its state: the load said nothing and
    the first step failed half-way (KeyError 'exp_avg'). It takes the DeepSpeed files' fp32 moments."""
    data = batches(3)
    saved = _adamw_engine(optimizer_states="8bit", hybrid_threshold=0)
    _train_steps(saved, data[:2])
    for group in saved.optimizer.param_groups:   # the group settings the load restores with the moments
        group.update(lr=0.123, weight_decay=0.5, betas=(0.5, 0.6))
    saved.save_checkpoint(str(tmp_path), tag="t")
    engine = _adamw_engine()
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert type(engine.optimizer) is torch.optim.AdamW and engine.global_steps == 2
    assert all((g["lr"], g["weight_decay"], tuple(g["betas"])) == (0.123, 0.5, (0.5, 0.6))
               for g in engine.optimizer.param_groups)
    hybrid = _adamw_engine(overlap_optimizer=True)   # HybridAdamW with fp32 states: it dequantizes the codes itself
    hybrid.load_checkpoint(str(tmp_path), tag="t")

    def moments(e):
        return {e._param_names[id(p)]: st["exp_avg"].reshape(-1) for p, st in e.optimizer.state.items()}
    ours, theirs = moments(engine), moments(hybrid)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(engine.module.parameters()))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    _train_steps(engine, data[2:])
    assert engine.was_step_applied()


def test_a_load_drops_the_gradients_accumulated_before_it(tmp_path):
    """A rollback (a loss spike after backward, then the last checkpoint) trained its first step on the
    gradients from before the load, unless overlap_optimizer happened to clear them."""
    data = batches(3)
    engine = _adamw_engine()
    _train_steps(engine, data[:1])
    engine.save_checkpoint(str(tmp_path), tag="t")
    x, y = data[1]
    engine.backward(lm_loss(engine(x), y) * 1e3)
    held = [p.grad.clone() for p in engine.module.parameters() if p.grad is not None]
    (tmp_path / "t" / "mp_rank_00_model_states.pt").rename(tmp_path / "moved.pt")
    with pytest.raises(ckpt.CheckpointError):   # a load that fails reading its files changes nothing
        engine.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(a, p.grad) for a, p in zip(held, [p for p in engine.module.parameters()
                                                              if p.grad is not None]))
    (tmp_path / "moved.pt").rename(tmp_path / "t" / "mp_rank_00_model_states.pt")
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
    fresh = _adamw_engine()
    fresh.load_checkpoint(str(tmp_path), tag="t")
    _train_steps(engine, data[2:])
    _train_steps(fresh, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(engine.module_state_dict().values(),
                                                  fresh.module_state_dict().values()))


def test_a_load_without_the_optimizer_states_keeps_refusing_after_a_failed_update(tmp_path):
    data = batches(3)
    engine = _adamw_engine()
    _train_steps(engine, data[:1])
    engine.save_checkpoint(str(tmp_path), tag="t")
    x, y = data[1]
    engine.backward(lm_loss(engine(x), y))
    real = engine.optimizer.step

    def fails(*args, **kwargs):
        raise MemoryError("cannot allocate")

    engine.optimizer.step = fails
    with pytest.raises(lazytrain.StepFailedError):
        engine.step()
    engine.optimizer.step = real
    for flags in (dict(load_optimizer_states=False), dict(load_module_only=True)):
        engine.load_checkpoint(str(tmp_path), tag="t", **flags)
        with pytest.raises(lazytrain.StepFailedError, match=r"a load_checkpoint without the optimizer states "
                                                            r"\(load_optimizer_states=False or load_module_only=True\) "
                                                            r"kept that optimizer state, and the engine holds"):
            engine(x)
    engine.load_checkpoint(str(tmp_path), tag="t")
    _train_steps(engine, data[2:])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's memory maps")
def test_a_loaded_optimizer_state_does_not_keep_the_checkpoint_files_mapped(tmp_path):
    """torch keeps a tensor of the right dtype as it is, and the files are loaded memory-mapped: deleting the
    checkpoint freed no space until the engine went, and rewriting it in place killed training (SIGBUS)."""
    engine = _adamw_engine()
    _train_steps(engine, batches(1))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    other = _adamw_engine()
    other.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    shutil.rmtree(tmp_path / "ckpt")
    import gc
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if str(tmp_path) in line]
    assert mapped == []
    _train_steps(other, batches(1))


def test_a_tag_too_long_for_its_staging_directory_is_refused_by_name(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"is 250 bytes long: at most 245 \(a file name holds 255, and a "
                                                   r"save names '.<tag>.previous' too\)"):
        ckpt.check_tag("x" * 250)
    assert ckpt.check_tag("x" * 245) == "x" * 245


def test_a_zero_checkpoint_gets_deepspeeds_recovery_script_beside_it_as_deepspeed_saves_it(tmp_path):
    """DeepSpeed copies zero_to_fp32.py into save_dir with every ZeRO save, and its docs run it from there."""
    pytest.importorskip("deepspeed.utils.zero_to_fp32")
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = lazytrain.initialize(model=make_model("modulelist"), config=cfg)[0]
    _train_steps(engine, batches(1))
    engine.save_checkpoint(str(tmp_path), tag="t")
    script = tmp_path / "zero_to_fp32.py"
    assert script.is_file() and os.access(script, os.X_OK)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t", "zero_to_fp32.py", "zero_to_torch.py"]


def test_the_clipping_a_checkpoint_records_is_the_one_the_engine_trained_with(tmp_path):
    """With no gradient_clipping key the engine clips at DeepSpeed's 1.0; the checkpoint said 0.0, and
    DeepSpeed, which restores clip_grad from it, would have resumed unclipped."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "fp16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}   # fp16 at stage 0: DeepSpeed's FP16_Optimizer
    engine = lazytrain.initialize(model=make_model("modulelist"), config=cfg)[0]
    _train_steps(engine, batches(1))
    engine.save_checkpoint(str(tmp_path), tag="t")
    model_states = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert engine.gradient_clipping() == 1.0 and model_states["optimizer"]["clip_grad"] == 1.0


def _lm(layers=6, hidden=32, tied=False):
    from lazytrain.models.decoder import DecoderConfig, build_causal_lm
    torch.manual_seed(0)
    return build_causal_lm(DecoderConfig(vocab_size=32, hidden_size=hidden, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=tied), prefer_transformers=True)


def _trained(model, steps=1, **section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, "device": "cpu", **section}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    for x, y in batches(steps):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    return engine


OTHER_MODELS = {   # (layers, hidden, tied) of the checkpoint's model -> the start of what the load says
    "one-layer-more": ((7, 32, False), "is of another model: tensors 9 not in this model (model.layers.6."),
    "one-layer-fewer": ((5, 32, False), "is of another model: tensors 9 missing (model.layers.5."),
    "another-hidden-size": ((6, 48, False), "is of another model: tensors 57 of another shape (model.embed_tokens"
                                            ".weight (32, 48) there, (32, 32) here"),
    "tied-head": ((6, 32, True), "holds optimizer state for parameter groups of [56] tensors; this engine's "
                                 "optimizer has groups of [57]"),
}


@pytest.mark.parametrize("other", sorted(OTHER_MODELS))
def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(tmp_path, other):
    """torch's load_state_dict copies every tensor that fits before it reports the rest: the engine checks
    names, shapes and optimizer groups first, so a wrong directory costs nothing (it used to leave the engine
    half-loaded and refusing to train or save)."""
    (layers, hidden, tied), says = OTHER_MODELS[other]
    _trained(_lm(layers, hidden, tied)).save_checkpoint(str(tmp_path / "other"), tag="t")
    engine = _trained(_lm(), steps=2)
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(lazytrain.CheckpointMismatchError) as refused:
        engine.load_checkpoint(str(tmp_path / "other"), tag="t")
    assert str(refused.value).startswith(f"checkpoint tag 't' in {tmp_path / 'other'} {says}"), str(refused.value)
    assert str(refused.value).endswith("nothing was loaded")
    after = engine.module_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.save_checkpoint(str(tmp_path / "mine"), tag="kept")   # the engine trains and saves on as it was
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 3


def _mlp_trains(model):
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    return model


def test_a_checkpoint_without_its_frozen_weights_names_the_strict_load_as_the_cause(tmp_path):
    first = _trained(_mlp_trains(_lm()))
    first.save_checkpoint(str(tmp_path), tag="t", exclude_frozen_parameters=True)
    saved = {k: v.clone() for k, v in first.module_state_dict().items()}
    second = _trained(_mlp_trains(_lm()), steps=0)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"tensors \d+ missing \(model.embed_tokens.weight, .*\) "
                                                           r"\(saved with exclude_frozen_parameters=True: load with "
                                                           r"load_module_strict=False\); nothing was loaded"):
        second.load_checkpoint(str(tmp_path), tag="t")
    second.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False)
    loaded = second.module_state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_save_between_the_micro_batches_of_a_step_warns_that_their_gradients_are_not_in_it(tmp_path):
    engine = _engine(_gas=2)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()   # the first of 2 micro-batches
    with pytest.warns(UserWarning, match=r"save_checkpoint 'mid' between the micro-batches of a step \(1 of 2 "
                                         r"done\): their accumulated gradients are not saved \(as in DeepSpeed\), "
                                         r"and a run resumed from it starts that step afresh"):
        engine.save_checkpoint(str(tmp_path), tag="mid")
    engine.backward(lm_loss(engine(x), y))
    engine.step()   # the step's last
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.save_checkpoint(str(tmp_path), tag="whole")
    assert engine.global_steps == 1


def _8bit_saved_and_loader(tmp_path, model, groups):
    """An AdamW8bit engine over ``groups`` of ``model`` trained a step and saved (tag "t" in ``tmp_path``), and
    an engine of a fresh model with a script's own torch AdamW over all its parameters, to load it into."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-2}},
           "lazytrain": {"device": "cpu", "hybrid_threshold": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver, _, _, _ = lazytrain.initialize(model=model, config=cfg, model_parameters=groups)
        x, y = batches(1)[0]
        saver.backward(lm_loss(saver(x), y))
        saver.step()
        saver.save_checkpoint(str(tmp_path), tag="t")
        other = _lm()
        loader, _, _, _ = lazytrain.initialize(model=other, optimizer=torch.optim.AdamW(other.parameters(), lr=1e-2),
                                               config={k: v for k, v in cfg.items() if k != "optimizer"})
    return saver, loader, other


def test_8bit_moments_load_by_name_into_an_optimizer_grouped_otherwise(tmp_path):
    """A checkpoint of the 8-bit HybridAdamW (decay and no-decay groups) loaded into a script's own AdamW over
    one group: its moments go by parameter name, dequantized, so the groups need not line up (the check of
    the groups' sizes applies where the state goes by position)."""
    model = _lm()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    plain = [p for n, p in model.named_parameters() if "norm" in n]
    saver, loader, other = _8bit_saved_and_loader(tmp_path, model, [{"params": decay, "weight_decay": 0.1},
                                                                    {"params": plain, "weight_decay": 0.0}])
    assert [len(g["params"]) for g in saver.optimizer.param_groups] != [len(g["params"])
                                                                        for g in loader.optimizer.param_groups]
    loader.load_checkpoint(str(tmp_path), tag="t")
    assert len(loader.optimizer.state_dict()["state"]) == sum(1 for _ in other.parameters())


def test_a_module_that_renames_what_it_loads_is_left_to_load_as_torch_lets_it(tmp_path):
    """The check of names and shapes before a load stands aside where a module decides what it loads (a load
    pre-hook renaming a legacy key): the checkpoint loads as torch's load_state_dict takes it."""
    first = _trained(_lm())
    first.save_checkpoint(str(tmp_path), tag="t")
    saved = first.module_state_dict()
    second = _trained(_lm(), steps=0, overlap_optimizer=True)   # the engine's own load hooks do not count

    def legacy_name(module, state, prefix, *args):
        if prefix + "old_norm.weight" in state:
            state[prefix + "norm.weight"] = state.pop(prefix + "old_norm.weight")
    second.module.model.register_load_state_dict_pre_hook(legacy_name)
    path = tmp_path / "t" / "mp_rank_00_model_states.pt"
    files = torch.load(path, weights_only=False)
    files["module"]["model.old_norm.weight"] = files["module"].pop("model.norm.weight")
    torch.save(files, path)
    second.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True)
    assert torch.equal(second.module_state_dict()["model.norm.weight"], saved["model.norm.weight"])


def _batch_norm_lm(n_layers: int):
    """A model with a BatchNorm outside its blocks (torch's norms load their own way: an old checkpoint may
    lack num_batches_tracked)."""
    from engine_models import ModuleListLM

    class BatchNormLM(ModuleListLM):
        def __init__(self):
            super().__init__(n_layers=n_layers)
            self.bn = torch.nn.BatchNorm1d(32)

        def forward(self, ids):
            x = self.emb(ids)
            for blk in self.stack:
                x = blk(x)
            return self.head(self.extra[0](self.bn(x.transpose(1, 2)).transpose(1, 2)))
    torch.manual_seed(n_layers)
    return BatchNormLM()


def test_a_batch_norm_in_the_model_keeps_the_check_and_an_old_checkpoint_without_its_counter_loads(tmp_path):
    _trained(_batch_norm_lm(7)).save_checkpoint(str(tmp_path / "other"), tag="t")
    engine = _trained(_batch_norm_lm(6))
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(lazytrain.CheckpointMismatchError, match=r"tensors 6 not in this model \(stack.6.norm.weight"):
        engine.load_checkpoint(str(tmp_path / "other"), tag="t", load_optimizer_states=False)
    assert all(torch.equal(before[k], v) for k, v in engine.module_state_dict().items())
    engine.save_checkpoint(str(tmp_path / "mine"), tag="t")
    path = tmp_path / "mine" / "t" / "mp_rank_00_model_states.pt"
    files = torch.load(path, weights_only=False)
    del files["module"]["bn.num_batches_tracked"]   # as a checkpoint of an old torch holds it
    torch.save(files, path)
    engine.load_checkpoint(str(tmp_path / "mine"), tag="t", trust_checkpoint=True, load_optimizer_states=False)


def test_8bit_moments_that_do_not_fit_an_optimizer_grouped_otherwise_are_refused_before_anything_loads(tmp_path):
    """The moments that go by name are each checked as the files are read: a parameter that trains here and
    had none there is named, and nothing of the checkpoint is loaded."""
    model = _lm()
    model.model.norm.weight.requires_grad_(False)
    _, loader, _ = _8bit_saved_and_loader(tmp_path, model, [p for p in model.parameters() if p.requires_grad])
    x, y = batches(1)[0]
    before = {k: v.clone() for k, v in loader.module_state_dict().items()}
    with pytest.raises(Exception, match=r"has no optimizer state for parameter 'model.norm.weight'"):
        loader.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(before[k], v) for k, v in loader.module_state_dict().items())
    loader.backward(lm_loss(loader(x), y))   # not refused: nothing was loaded
    loader.step()


def test_a_one_element_tensor_loads_into_a_0_dim_parameter_in_bf16_as_torch_takes_it(tmp_path):
    from engine_models import ModuleListLM

    class ScaledLM(ModuleListLM):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, ids):
            return super().forward(ids) * self.scale
    torch.manual_seed(0)
    engine = _trained(ScaledLM(), steps=0)
    engine.save_checkpoint(str(tmp_path), tag="t")
    path = tmp_path / "t" / "mp_rank_00_model_states.pt"
    files = torch.load(path, weights_only=False)
    files["module"]["scale"] = torch.tensor([2.5])   # as an old torch saved a scalar
    torch.save(files, path)
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16, _, _, _ = lazytrain.initialize(model=ScaledLM(), config=cfg)
    bf16.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True, load_optimizer_states=False)
    assert bf16.module_state_dict()["scale"].item() == 2.5


def _engine_of(model, client_optimizer=None, client_scheduler=None, **top):
    """An engine trained one step: with the script's own optimizer (and scheduler) when given, else the config's
    (``top``: top-level config sections)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "lazytrain": {"device": "cpu"}, **top}
    if client_optimizer is None and "optimizer" not in cfg:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, optimizer=client_optimizer, lr_scheduler=client_scheduler,
                                               config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    return engine


def _refused_and_unchanged(engine, path, says, **kwargs):
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(Exception, match=says):
        engine.load_checkpoint(str(path), tag="t", **kwargs)
    assert all(torch.equal(before[k], v) for k, v in engine.module_state_dict().items())
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))   # not refused: nothing was loaded
    engine.step()


def test_optimizer_and_schedule_states_another_engine_cannot_take_are_refused_before_anything_loads(tmp_path):
    model = _lm()
    amsgrad = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    _engine_of(model, amsgrad, torch.optim.lr_scheduler.StepLR(amsgrad, 5)).save_checkpoint(str(tmp_path), tag="t")
    hybrid = _engine_of(_lm(), lazytrain={"device": "cpu", "overlap_optimizer": True}, scheduler={"type": "WarmupLR"})
    assert type(hybrid.optimizer).__name__ == "HybridAdamW"
    _refused_and_unchanged(hybrid, tmp_path, r"holds the state of an optimizer with amsgrad=True, which this engine's "
                                             r"HybridAdamW does not run")
    _refused_and_unchanged(hybrid, tmp_path, r"holds a learning-rate schedule's state without 'last_batch_iteration', "
                                             r"which this engine's WarmupLR keeps", load_optimizer_states=False)
    hybrid.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)


def test_8bit_moments_of_a_tensor_outside_the_model_are_refused_by_name_before_anything_loads(tmp_path):
    model, temperature = _lm(), torch.nn.Parameter(torch.tensor(1.0))
    saver = _engine_of(model, optimizer={"type": "AdamW8bit", "params": {"lr": 1e-2}},
                       lazytrain={"device": "cpu", "hybrid_threshold": 0})
    saver.optimizer.add_param_group({"params": [temperature]})
    saver.save_checkpoint(str(tmp_path), tag="t")
    other, mine = _lm(), torch.nn.Parameter(torch.tensor(1.0))
    loader = _engine_of(other, torch.optim.AdamW(other.parameters(), lr=1e-2))
    loader.optimizer.add_param_group({"params": [mine]})
    _refused_and_unchanged(loader, tmp_path, r"this optimizer holds a tensor of shape \(\) outside the model, which "
                                             r"no name matches")


def test_a_users_load_hooks_decide_their_modules_names_as_torch_lets_them(tmp_path):
    """A BatchNorm's own pre-hook renaming a legacy key, and a post-hook forgiving a missing key: torch's
    strict load takes both, and so does the engine's check."""
    _trained(_batch_norm_lm(6)).save_checkpoint(str(tmp_path), tag="t")
    path = tmp_path / "t" / "mp_rank_00_model_states.pt"
    files = torch.load(path, weights_only=False)
    files["module"]["bn.old_weight"] = files["module"].pop("bn.weight")
    del files["module"]["extra.0.bias"]
    torch.save(files, path)
    engine = _trained(_batch_norm_lm(6), steps=0)

    def rename(module, state, prefix, *args):
        if prefix + "old_weight" in state:
            state[prefix + "weight"] = state.pop(prefix + "old_weight")

    def forgive(module, incompatible):
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k != "extra.0.bias"]
    engine.module.bn.register_load_state_dict_pre_hook(rename)
    engine.module.register_load_state_dict_post_hook(forgive)
    engine.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True, load_optimizer_states=False)


def test_a_users_post_hook_leaves_the_shapes_checked(tmp_path):
    """A post-hook may forgive missing or unexpected keys, never a tensor of another shape (torch's strict load
    reports those whatever the hooks say, after copying the rest): the check of shapes stays."""
    _trained(_lm(hidden=48)).save_checkpoint(str(tmp_path), tag="t")
    engine = _trained(_lm())
    engine.module.register_load_state_dict_post_hook(lambda module, incompatible: None)
    _refused_and_unchanged(engine, tmp_path, r"is of another model: tensors 57 of another shape")


def test_a_torch_schedule_that_reads_its_own_keys_is_refused_another_kinds_state_before_anything_loads(tmp_path):
    _engine_of(_lm(), scheduler={"type": "WarmupLR"}).save_checkpoint(str(tmp_path), tag="t")
    model = _lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine_of(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    _refused_and_unchanged(engine, tmp_path, re.escape(
        "holds a learning-rate schedule's state without 'last_epoch', 'lr_lambdas', which this engine's LambdaLR keeps "
        "and with 'last_batch_iteration', which this engine's LambdaLR does not keep (a schedule of another kind): "
        "load it with load_lr_scheduler_states=False to keep this one; nothing was loaded") + "$")


def test_a_checkpoint_in_deepspeeds_layout_loads_with_its_moments_after_a_failed_overlapped_update(tmp_path):
    """The way out of a failed overlapped update is a load; reading DeepSpeed's moments by name reads the
    optimizer's state, whose hook raised the stored failure and refused the very load it asks for."""
    engine = _engine_of(_lm(), lazytrain={"device": "cpu", "overlap_optimizer": True})
    engine.save_checkpoint(str(tmp_path), tag="t")
    for name in ("lazytrain_state.pt", "lazytrain_manifest.json"):   # as DeepSpeed writes it
        os.remove(tmp_path / "t" / name)
    update, layer3 = engine.optimizer.update, {id(p) for p in engine.weights.params[3]}

    def fail(params, **kwargs):
        if {id(p) for p in params} <= layer3:
            raise RuntimeError("host out of memory")
        return update(params, **kwargs)
    engine.optimizer.update = fail
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(Exception, match="host out of memory"):
        engine.wait_for_update()
    engine.optimizer.update = update
    engine.load_checkpoint(str(tmp_path), tag="t")
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.wait_for_update()


def test_deepspeeds_files_of_an_amsgrad_run_are_refused_by_hybrid_adamw_before_anything_loads(tmp_path):
    """DeepSpeed's ZeRO files keep each group's settings beside the moments; HybridAdamW's groups have no
    amsgrad key, and the setting was dropped without a word."""
    model = _lm()
    zero = {"zero_optimization": {"stage": 1}}
    _engine_of(model, torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True), **zero).save_checkpoint(
        str(tmp_path), tag="t")
    for name in ("lazytrain_state.pt", "lazytrain_manifest.json"):   # as DeepSpeed writes it
        os.remove(tmp_path / "t" / name)
    hybrid = _engine_of(_lm(), lazytrain={"device": "cpu", "overlap_optimizer": True}, **zero)
    _refused_and_unchanged(hybrid, tmp_path, r"holds the state of an optimizer with amsgrad=True, which this "
                                             r"engine's HybridAdamW does not run")


def test_a_backward_whose_boundary_read_fails_leaves_partial_gradients_the_step_refuses(tmp_path):
    """A kept boundary that cannot be read back in the backward (EIO): its pass is freed with the loss, the step
    refuses the accumulation the layers after it had sent; zero_grad() and the micro-batch again train as
    plain PyTorch."""
    import errno
    import gc
    from engine_models import max_rel_diff, reference_train
    model, data = _lm(), batches(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config={
            "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "lazytrain": {"device": "cpu", "boundary_home": "nvme", "nvme_path": str(tmp_path), "policy": "keep_all"}})
    backend, fired = engine.tiers["nvme"].backend, []
    read = backend.preadv

    def failing_once(fd, buffers, offset):
        if not fired:
            fired.append(1)
            raise OSError(errno.EIO, "Input/output error")
        return read(fd, buffers, offset)
    x, y = data[0]
    loss = lm_loss(engine(x), y)
    backend.preadv = failing_once
    with pytest.raises(Exception, match="EIO"):
        engine.backward(loss)
    backend.preadv = read
    del loss
    gc.collect()
    # the pass is gone with the loss: its boundary files too (the failed read's error, which the tier's request
    # keeps, did not take the backward's frames along: each waiter raises its own copy)
    assert engine.tiers["nvme"].keys() == []
    with pytest.raises(lazytrain.StepFailedError, match=r"a backward through the streamed layers failed \(NVMeIOError"):
        engine.step()
    engine.zero_grad()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, reference_train(model, data)) < 1e-5
    engine.destroy()


@pytest.mark.parametrize("flags", [dict(load_optimizer_states=False), dict(load_module_only=True)])
def test_a_bf16_load_without_the_optimizer_states_restores_the_exact_fp32_weights(tmp_path, flags):
    """The fp32 masters the files hold come back, not the module's bf16 copies (DeepSpeed takes those)."""
    def engine():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lazytrain.initialize(model=make_model("modulelist"), config={
                "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "lazytrain": {"device": "cpu"}})[0]
    trained = engine()
    for x, y in batches(2):
        trained.backward(lm_loss(trained(x), y))
        trained.step()
    trained.save_checkpoint(str(tmp_path), tag="t")
    want = trained.module_state_dict()
    trained.destroy()
    fresh = engine()
    fresh.load_checkpoint(str(tmp_path), tag="t", **flags)
    got = fresh.module_state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert v.dtype == torch.float32 and torch.equal(got[k], v), k
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in want.values())   # below bf16's resolution
    fresh.destroy()


# ---- a checkpoint directory from elsewhere ---------------------------------------------------------
@pytest.mark.parametrize("target", ["dangling", "existing"])
def test_a_link_a_checkpoint_directory_came_with_never_leads_a_save_outside_it(tmp_path, target):
    """A downloaded directory shipping 'latest.tmp' as a link: settling left-overs kept a dangling one (it
    "did not exist"), and the save then wrote through it, created the file outside and made 'latest' the link.
    Files a save makes are made anew, never written through what stands in their place."""
    outside = tmp_path / "outside"
    if target == "existing":
        outside.write_text("the user's own")
    save_dir = tmp_path / "ckpt"
    engine = _engine(n_layers=2)
    _train_steps(engine, batches(1))
    engine.save_checkpoint(str(save_dir), tag="t")
    os.symlink(outside, save_dir / "latest.tmp")
    _train_steps(engine, batches(1))
    engine.save_checkpoint(str(save_dir), tag="t2")
    assert (outside.read_text() == "the user's own") if target == "existing" else not os.path.lexists(outside)
    assert not os.path.islink(save_dir / "latest") and (save_dir / "latest").read_text() == "t2"
    assert not os.path.lexists(save_dir / "latest.tmp")
    os.symlink(outside, save_dir / "latest.tmp")   # planted after the left-overs were settled: not followed
    with ckpt._create(str(save_dir / "latest.tmp")) as f:
        f.write(b"x")
    assert not os.path.islink(save_dir / "latest.tmp") and (save_dir / "latest.tmp").read_bytes() == b"x"
    assert (outside.read_text() == "the user's own") if target == "existing" else not os.path.lexists(outside)
    engine.destroy()


def test_a_save_cut_short_by_ctrl_c_removes_its_staging_and_the_next_save_of_its_tag_completes(tmp_path,
                                                                                                monkeypatch):
    """A KeyboardInterrupt while a file was written left the staging directory and its lock held for the rest
    of the process: the next save of the tag, with the directory spelled otherwise, blamed another process."""
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    saves = [0]

    def interrupted_on_the_second_file(*args, **kwargs):
        saves[0] += 1
        if saves[0] == 2:
            raise KeyboardInterrupt
        return torch_save(*args, **kwargs)
    torch_save = torch.save
    with monkeypatch.context() as m:
        m.setattr(torch, "save", interrupted_on_the_second_file)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(str(tmp_path), "t", files_of(2), True)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"] and loaded_step(tmp_path) == 1
    ckpt.save(str(tmp_path / "."), "t", files_of(3), True)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"] and loaded_step(tmp_path) == 3


def test_this_processs_own_left_over_staging_is_its_own_however_the_directory_is_spelled(tmp_path):
    """A staging directory this process still holds (a save that ended before cleaning up) is a left-over
    to a later save that names the save directory another way, not another process's save in progress."""
    ckpt.save(str(tmp_path), "t", files_of(1), True)
    ckpt.begin(str(tmp_path), "t", 0)
    assert (tmp_path / ".t.staging").is_dir()
    (tmp_path.parent / "link").symlink_to(tmp_path)
    ckpt.save(str(tmp_path.parent / "link"), "t", files_of(2), True)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"] and loaded_step(tmp_path) == 2


@pytest.mark.parametrize("missing", [False, True])
def test_a_save_directory_that_cannot_be_written_is_a_checkpoint_error(tmp_path, monkeypatch, missing):
    """os.makedirs / os.mkdir failing (a read-only file system) came out as a bare OSError, which a script's
    ``except CheckpointError`` missed."""
    d = tmp_path / "sub" if missing else tmp_path

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(os, "mkdir", read_only)
    made = str(d) if missing else str(d / ".t.staging")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            f"saving checkpoint tag 't' to {d} failed: [Errno 30] Read-only file system: '{made}'; nothing was "
            f"saved, and the previous checkpoint is left as it was")):
        ckpt.save(str(d), "t", files_of(1), True)


class _SparseBufferLM(torch.nn.Module):
    """A tiny LM with a sparse buffer beside its blocks (a graph's adjacency, say)."""

    def __init__(self):
        super().__init__()
        self.lm = make_model("llama", 4)
        self.register_buffer("adjacency", (2 * torch.eye(3)).to_sparse())

    def forward(self, x):
        return self.lm(x)


def test_sparse_tensors_in_the_model_and_the_client_state_save_and_load_as_torch_save_keeps_them(tmp_path):
    """A sparse buffer or client_state tensor made the save fail with "Cannot access storage of
    SparseTensorImpl" (the space estimate and the writer asked for its storage); torch.save keeps them."""
    model = _SparseBufferLM()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=cfg)[0]
    for x, y in batches(1):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's "Sparse CSR tensor support is in beta state"
        csr = torch.tensor([[0.0, 1.5], [2.0, 0.0]]).to_sparse_csr()
    engine.save_checkpoint(str(tmp_path), tag="s", client_state={"coo": torch.eye(4).to_sparse(), "csr": csr})
    model.adjacency = torch.zeros(3, 3).to_sparse()
    _, client = engine.load_checkpoint(str(tmp_path), "s")
    assert model.adjacency.layout == torch.sparse_coo and torch.equal(model.adjacency.to_dense(), 2 * torch.eye(3))
    assert client["coo"].layout == torch.sparse_coo and torch.equal(client["coo"].to_dense(), torch.eye(4))
    assert client["csr"].layout == torch.sparse_csr and torch.equal(client["csr"].to_dense(), csr.to_dense())


@pytest.mark.parametrize("stage", [0, 3])
def test_client_state_parameters_load_as_parameters_as_torch_save_keeps_them(tmp_path, stage):
    """A client_state nn.Parameter (an EMA copy of the weights, say) loaded as a plain tensor, without its
    requires_grad: the model file writes each tensor as a placeholder of its shape."""
    engine = _engine_of(make_model("llama", 4), zero_optimization={"stage": stage})
    ema = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(2, 3))
    state = {"ema": {"w": ema, "again": ema}, "trained": trained, "plain": torch.zeros(2)}
    engine.save_checkpoint(str(tmp_path), tag="t", client_state=state)
    _, client = engine.load_checkpoint(str(tmp_path), "t")
    w, again = client["ema"]["w"], client["ema"]["again"]
    assert type(w) is torch.nn.Parameter and not w.requires_grad and torch.equal(w, torch.arange(4.0))
    assert again is w   # one parameter saved twice is one object again, as torch.save keeps it
    assert type(client["trained"]) is torch.nn.Parameter and client["trained"].requires_grad
    assert torch.equal(client["trained"], torch.ones(2, 3))
    assert type(client["plain"]) is torch.Tensor


def test_a_quantized_tensor_in_the_client_state_is_refused_by_name_and_the_previous_checkpoint_kept(tmp_path):
    """It failed inside torch with "Could not run 'aten::empty_strided' ... 'QuantizedMeta' backend"."""
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's deprecation of quantized tensors
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            f"saving checkpoint tag 't' to {tmp_path}: a quantized tensor (shape (3,), torch.qint8) cannot be saved "
            f"in a checkpoint: LazyTrain saves dense and sparse tensors; convert it first (a quantized tensor's "
            f"int_repr(), q_scale() and q_zero_point(), or dequantize()); nothing was saved")):
        engine.save_checkpoint(str(tmp_path), tag="t", client_state={"q": quantized})
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    engine.load_checkpoint(str(tmp_path), "t")
