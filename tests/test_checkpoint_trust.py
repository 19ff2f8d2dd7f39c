"""Loading a checkpoint cannot run code: torch's restricted unpickler by default, DeepSpeed's own record
types allowed, anything else refused by name unless the user says the checkpoint is trusted."""
import argparse
import os
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine import checkpoint as ckpt
from lazytrain.engine import safe_load
from engine_models import batches, lm_loss, make_model

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")
DEEPSPEED = os.path.join(os.path.dirname(__file__), "data", "deepspeed_0_19")


class RunsACommand:
    """What a malicious checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def engine_for(**section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, "device": "cpu", **section.pop("lazytrain", {})}, **section}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    return engine


def trained(engine):
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    return engine


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_checkpoint_whose_pickle_runs_code_is_refused_and_runs_nothing(tmp_path, legacy):
    engine = trained(engine_for())
    engine.save_checkpoint(str(tmp_path), tag="t")
    model_file = tmp_path / "t" / ckpt.MODEL_FILE
    state = torch.load(model_file, weights_only=True)
    marker = tmp_path / "it-ran"
    state["client_state"] = {"epoch": RunsACommand(marker)}
    torch.save(state, model_file, _use_new_zipfile_serialization=not legacy)   # a file someone else handed over
    os.remove(tmp_path / "t" / ckpt.MANIFEST)         # (as DeepSpeed would have written it: no manifest)
    other = engine_for()
    with pytest.raises(safe_load.UntrustedCheckpointError) as e:
        other.load_checkpoint(str(tmp_path), tag="t")
    assert not marker.exists()                        # nothing ran
    assert str(e.value) == (
        f"checkpoint file {model_file} names posix.system, which a checkpoint load does not build: loading it "
        f"would run that code. Nothing of the checkpoint was loaded. If you trust where this checkpoint came from, "
        f"load it with engine.load_checkpoint(..., trust_checkpoint=True) or set 'lazytrain.trust_checkpoints': "
        f"true in the config")
    assert other.global_steps == 0
    other.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True)   # the user's own call: it runs
    assert marker.exists()


@pytest.mark.parametrize("section", [
    {},
    {"bf16": {"enabled": True}},
    {"fp16": {"enabled": True}},
    {"bf16": {"enabled": True}, "lazytrain": {"optimizer_states": "8bit", "hybrid_threshold": 16}},
    {"lazytrain": {"boundary_home": "host", "overlap_optimizer": True}},
    {"lazytrain": {"weights_home": "nvme"}},
    {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}},
    {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
     "lazytrain": {"optimizer_states": "8bit", "hybrid_threshold": 16}},
], ids=["fp32", "bf16", "fp16", "8bit-states", "host-overlap", "nvme-weights", "scheduler", "zero2-fp16",
        "zero3-8bit-states"])
def test_every_checkpoint_lazytrain_writes_loads_with_the_restricted_loader(tmp_path, section):
    section = {k: dict(v) for k, v in section.items()}
    if section.get("lazytrain", {}).get("weights_home") == "nvme":
        (tmp_path / "nvme").mkdir()
        section["lazytrain"]["nvme_path"] = str(tmp_path / "nvme")
    engine = trained(engine_for(**section))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # no warning that it would need trust
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3, "best": [0.5, 0.25]})
    tag = ckpt.resolve_tag(str(tmp_path / "ckpt"), None)
    names = sorted(f for f in os.listdir(tmp_path / "ckpt" / tag) if f.endswith(".pt"))
    assert len(names) >= 2
    for name in names:   # beyond tensors and plain values, only DeepSpeed's records (its layout names them)
        assert safe_load.unsafe_globals(str(tmp_path / "ckpt" / tag / name)) == [], name
    other = engine_for(**section)
    _, client = other.load_checkpoint(str(tmp_path / "ckpt"))
    assert client == {"epoch": 3, "best": [0.5, 0.25]} and other.global_steps == 2
    a, b = engine.module_state_dict(), other.module_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_client_state_holding_objects_saves_with_a_warning_and_needs_trust_to_load(tmp_path):
    import numpy as np
    engine = trained(engine_for())
    with pytest.warns(UserWarning, match=r"checkpoint tag 't': mp_rank_00_model_states.pt holds numpy\..*, which a "
                                         r"checkpoint load refuses unless trusted"):
        engine.save_checkpoint(str(tmp_path), tag="t", client_state={"seen": np.arange(3)})
    with pytest.raises(safe_load.UntrustedCheckpointError, match="names numpy"):
        engine_for().load_checkpoint(str(tmp_path), tag="t")
    _, client = engine_for(lazytrain={"trust_checkpoints": True}).load_checkpoint(str(tmp_path), tag="t")
    assert client["seen"].tolist() == [0, 1, 2]
    # argparse.Namespace, which DeepSpeed saves for a script's args, is allowed
    engine.save_checkpoint(str(tmp_path), tag="u", client_state={"args": argparse.Namespace(lr=0.1)})
    _, client = engine_for().load_checkpoint(str(tmp_path), tag="u")
    assert client["args"].lr == 0.1


@pytest.mark.parametrize("name", ["stage0_fp32", "stage1_fp16", "stage2_bf16"])
def test_deepspeed_checkpoints_load_with_the_restricted_loader(name):
    """DeepSpeed 0.19's checkpoints (tests/data/deepspeed_0_19/make_fixtures.py) name a loss scaler, a ZeRO
    stage and fragment addresses: they load as records, without DeepSpeed and without running its code."""
    d = os.path.join(DEEPSPEED, name)
    tag = ckpt.resolve_tag(d, None)
    path, model, _ = ckpt.load(d, tag, want_optimizer=False)
    assert model["epoch"] == 3                        # DeepSpeed keeps client state at the top level
    assert sorted(model["module"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for f in sorted(os.listdir(os.path.join(d, tag))):
        state = safe_load.load(os.path.join(d, tag, f))
        if "optimizer_state_dict" in state:
            opt = state["optimizer_state_dict"]
            assert opt["zero_stage"] == {"stage1_fp16": 1, "stage2_bf16": 2}[name]
            assert isinstance(opt["loss_scaler"], safe_load.DeepSpeedRecord)
            assert opt["loss_scaler"].cur_scale == (65536 if name == "stage1_fp16" else 1.0)


def test_a_deepspeed_checkpoint_with_a_type_nobody_allowed_is_refused_by_name(tmp_path):
    d = os.path.join(DEEPSPEED, "stage0_fp32", "global_step1")
    state = torch.load(os.path.join(d, ckpt.MODEL_FILE), weights_only=True)
    state["data_sampler"] = torch.nn.Linear(2, 2)     # a module object: its class would be imported and built
    (tmp_path / "global_step1").mkdir()
    path = tmp_path / "global_step1" / ckpt.MODEL_FILE
    torch.save(state, path)
    with pytest.raises(safe_load.UntrustedCheckpointError,
                       match=rf"checkpoint file {path} names .*torch.nn.modules.linear.Linear"):
        ckpt.load(str(tmp_path), "global_step1", want_optimizer=False)


def test_trust_checkpoints_must_be_true_or_false():
    from lazytrain.config import ConfigError
    with pytest.raises(ConfigError, match="config key 'lazytrain.trust_checkpoints' must be true or false, got 'yes'"):
        engine_for(lazytrain={"trust_checkpoints": "yes"})


def _damage_a_tensor_record(path):
    """16 bytes of a tensor record of a torch zip file set to 0xff (four fp32 NaNs), its size unchanged."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 64)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(b"\xff" * 16)
    return info.filename


@pytest.mark.parametrize("damage", ["record", "cut"])
def test_a_checkpoint_file_damaged_or_cut_short_is_refused_naming_it(tmp_path, damage):
    """torch's reader checks no CRC, and a memory-mapped load reads the bytes as they are: a damaged record of
    the right size would load as NaN weights. Each record's CRC-32 is checked first; a file cut short is named
    too, not left to torch's bare 'PytorchStreamReader failed'."""
    import os
    from lazytrain.engine import safe_load
    path = str(tmp_path / "state.pt")
    torch.save({"w": torch.arange(64, dtype=torch.float32), "step": 3}, path)
    assert safe_load.load(path)["step"] == 3
    if damage == "record":
        record = _damage_a_tensor_record(path)
        expected = (f"checkpoint file {path} cannot be read back as written: Bad CRC-32 for file '{record}'",
                    "(the file is cut short or damaged); nothing of it was loaded")
    else:   # no zip directory left: torch's reader would fail, or take it for its legacy format
        os.truncate(path, os.path.getsize(path) // 2)
        expected = (f"checkpoint file {path} cannot be read back as written: it begins as a zip file, and its zip "
                    f"directory cannot be read (File is not a zip file)", "(the file is cut short or damaged); "
                                                                           "nothing of it was loaded")
    with pytest.raises(safe_load.UnreadableCheckpointError) as e:
        safe_load.load(path)
    assert str(e.value).startswith(expected[0]) and str(e.value).endswith(expected[1]), str(e.value)


@pytest.mark.parametrize("field, offset, bit, says", [
    ("compression method", 10, 0, "cannot be read back as written: NotImplementedError: That compression method is "
                                  "not supported (the file is cut short or damaged)"),
    ("version needed", 6, 7, "cannot be read back as written: NotImplementedError: zip file version 12.8 (the file "
                             "is cut short or damaged)"),
    ("external attributes", 38, 4, "cannot be read back as written: record 'state/data.pkl' is marked as a "
                                   "directory in the zip directory (not a file torch writes) (the file is cut short "
                                   "or damaged)"),   # a directory flag: torch's reader reads no bytes for it
])
def test_one_flipped_bit_in_the_zip_directory_is_refused_as_damage_naming_the_file(tmp_path, field, offset, bit,
                                                                                   says):
    """zipfile's own errors came out raw (NotImplementedError, KeyError), and the directory flag on the pickle's
    record was refused as a file naming code to run, advising trust_checkpoint=True."""
    import zipfile
    from lazytrain.engine import safe_load
    path = str(tmp_path / "state.pt")
    torch.save({"w": torch.arange(64, dtype=torch.float32), "step": 3}, path)
    with zipfile.ZipFile(path) as z:
        directory = z.start_dir   # its first entry: the pickle's record
    data = bytearray(open(path, "rb").read())
    data[directory + offset] ^= 1 << bit
    open(path, "wb").write(data)
    with pytest.raises(safe_load.UnreadableCheckpointError) as e:
        safe_load.load(path)
    assert str(e.value).startswith(f"checkpoint file {path} {says}"), str(e.value)
    assert str(e.value).endswith("nothing of it was loaded") and "trust_checkpoint" not in str(e.value)


def test_a_fifo_named_as_a_checkpoint_file_is_refused_not_waited_on(tmp_path):
    """os.open of a FIFO blocks until a writer comes: the load waited forever."""
    import os
    from lazytrain.engine import safe_load
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    os.mkfifo(path)
    with pytest.raises(safe_load.UnreadableCheckpointError) as e:
        safe_load.load(path)
    assert str(e.value) == (f"checkpoint file {path} is not a regular file (a FIFO, a device or a directory); "
                            f"nothing of it was loaded")


def test_the_crc_check_can_be_turned_off_for_a_load_and_is_on_by_default(tmp_path):
    """'lazytrain.check_checkpoint_crcs': false skips the check (one more read of every file) for that engine's
    loads: a damaged record then loads as it is, here as NaN where the saved weight was finite."""
    from lazytrain.config import ConfigError
    trained(engine_for()).save_checkpoint(str(tmp_path), tag="t")
    model_file = str(tmp_path / "t" / "mp_rank_00_model_states.pt")
    record = _damage_a_tensor_record(model_file)
    with pytest.raises(safe_load.UnreadableCheckpointError, match=f"Bad CRC-32 for file '{record}'"):
        engine_for().load_checkpoint(str(tmp_path), tag="t")
    unchecked = engine_for(lazytrain={"check_checkpoint_crcs": False})
    unchecked.load_checkpoint(str(tmp_path), tag="t")
    assert any(torch.isnan(v).any() for v in unchecked.module_state_dict().values() if v.is_floating_point())
    assert safe_load._CHECK_RECORDS.get() is True   # the setting held for that load alone
    with pytest.raises(ConfigError, match="config key 'lazytrain.check_checkpoint_crcs' must be true or false, got 0"):
        engine_for(lazytrain={"check_checkpoint_crcs": 0})


def test_a_file_saved_without_crcs_or_in_the_legacy_format_loads():
    """torch.serialization.set_crc32_options(False) (for faster saves) writes 0 where the CRC goes: nothing to
    check, not a damaged file. A legacy-format file keeps no CRCs at all."""
    import io
    from lazytrain.engine import safe_load
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 3}
    torch.serialization.set_crc32_options(False)
    try:
        buffer = io.BytesIO()
        torch.save(state, buffer)
    finally:
        torch.serialization.set_crc32_options(True)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for name, data in (("no-crc.pt", buffer.getvalue()), ("legacy.pt", None)):
            path = os.path.join(d, name)
            if data is None:
                torch.save(state, path, _use_new_zipfile_serialization=False)
            else:
                with open(path, "wb") as f:
                    f.write(data)
            loaded = safe_load.load(path)
            assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def test_a_zero_stage_is_read_as_a_plain_number_that_no_pickle_can_rewrite(tmp_path):
    """DeepSpeed's ZeroStageEnum was an enum here, whose shared members the unpickler handed out: a BUILD after
    one rewrote ZeroStage(1) for the whole process. It is a plain int made anew; a BUILD on it is refused."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    from lazytrain.engine import safe_load

    class Rewritten:
        def __reduce__(self):
            return config.ZeroStageEnum, (1,), {"_name_": "weights", "_value_": 3}
    path = str(tmp_path / "state.pt")
    torch.save({"zero_stage": config.ZeroStageEnum(2)}, path)
    stage = safe_load.load(path)["zero_stage"]
    assert type(stage) is int and stage == 2
    torch.save({"zero_stage": Rewritten()}, path)
    with pytest.raises(safe_load.UnreadableCheckpointError, match="cannot be unpickled: Can only build"):
        safe_load.load(path)
    assert safe_load.zero_stage(1) == 1
