"""Hugging Face Trainer, accelerate and TRL scripts, unchanged but for ``lazytrain.replace_deepspeed()``,
train through LazyTrain with transformers' stock ZeRO-2 and ZeRO-3 configs: as the same script without
DeepSpeed trains (fp32, 1e-6), with saved folders that ``from_pretrained`` loads to exactly the trained
weights and a ``resume_from_checkpoint`` that continues bit-identically. Each run is its own process (the
scripts in ``hf_programs``), as a user runs them, with the variables a launcher sets."""
import os
import subprocess
import sys

import pytest
import torch
from dist_helpers import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

PROGRAMS = os.path.join(os.path.dirname(__file__), "hf_programs")
TOL = dict(rtol=1e-6, atol=1e-6)


def run_program(name: str, out, *args) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-W", "ignore", os.path.join(PROGRAMS, name), str(out), *args],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(os.path.join(out, "result.pt"))


def run_with_torchrun(name: str, out, nproc: int, *args) -> dict:
    """The program started by torchrun with ``nproc`` processes on this machine (rank 0's result)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(free_port()), os.path.join(PROGRAMS, name), str(out), *args],
                       env=dict(env, TOKENIZERS_PARALLELISM="false"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(os.path.join(out, "result.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    done = {}

    def get(name: str, *args):
        if name not in done:
            done[name] = (run_program("trainer_run.py", root / name, *args), root / name)
        return done[name]
    return get


def assert_same_weights(a: dict, b: dict, exact: bool):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], **TOL, msg=k)


def from_pretrained(path) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_trainer_script_trains_as_it_does_without_deepspeed(runs, config):
    plain, _ = runs("plain", "--config", "plain")
    lazy, _ = runs(config, "--config", config)
    assert lazy["step"] == plain["step"] == 4
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert lazy["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)    # evaluate() streams
    torch.testing.assert_close(lazy["logits"], plain["logits"], **TOL)          # and so does predict()


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_saved_folders_load_with_from_pretrained_to_exactly_the_trained_weights(runs, config):
    lazy, out = runs(config, "--config", config)
    final = out / "final"     # save_model(): under ZeRO-3 through the 16-bit gather DeepSpeed's config asks for
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    assert_same_weights(from_pretrained(final), lazy["weights"], exact=True)
    last = out / "checkpoint-4"          # each checkpoint-* folder is a from_pretrained folder too
    assert_same_weights(from_pretrained(last), lazy["weights"], exact=True)
    assert (last / "latest").read_text() == "global_step4"


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_in_bf16_saved_folders_hold_the_trained_weights_in_bf16_as_deepspeed_saves_them(runs, config):
    lazy, out = runs(f"{config}_bf16", "--config", config, "--bf16")
    assert all(torch.isfinite(torch.tensor(lazy["losses"])))
    masters_in_bf16 = {k: v.bfloat16() for k, v in lazy["weights"].items()}
    for folder in ("final", "checkpoint-4"):
        loaded = from_pretrained(out / folder)
        assert {v.dtype for v in loaded.values()} == {torch.bfloat16}
        assert_same_weights(loaded, masters_in_bf16, exact=True)


def test_two_ranks_of_a_trainer_script_shard_the_state_and_train_as_plain_data_parallel(tmp_path):
    """torchrun with 2 processes: LazyTrain (ZeRO-2 config: the optimizer state sharded over the ranks)
    against the same script without DeepSpeed (torch's DistributedDataParallel)."""
    lazy = run_with_torchrun("trainer_run.py", tmp_path / "lazy", 2, "--config", "zero2")
    plain = run_with_torchrun("trainer_run.py", tmp_path / "plain", 2, "--config", "plain")
    assert lazy["sharded"] and not plain["sharded"]
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert_same_weights(from_pretrained(tmp_path / "lazy" / "final"), lazy["weights"], exact=True)


def test_resume_from_checkpoint_continues_bit_identically(runs, tmp_path):
    straight, out = runs("zero2", "--config", "zero2")
    resumed = run_program("trainer_run.py", tmp_path, "--config", "zero2", "--resume", str(out / "checkpoint-2"))
    assert resumed["step"] == 4
    assert resumed["losses"] == straight["losses"]     # steps 1-2 from the checkpoint's trainer_state.json
    assert_same_weights(resumed["weights"], straight["weights"], exact=True)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_programs")
    done = {}

    def get(program: str, config: str):
        if (program, config) not in done:
            out = root / f"{program[:-3]}_{config}"
            done[program, config] = (run_program(program, out, "--config", config), out)
        return done[program, config]
    return get


@pytest.mark.parametrize("program", ["accelerate_run.py", "sft_run.py"])
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_accelerate_and_trl_scripts_train_as_they_do_without_deepspeed(programs, program, config):
    plain, _ = programs(program, "plain")
    lazy, out = programs(program, config)
    assert len(lazy["losses"]) == len(plain["losses"]) > 0
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert_same_weights(from_pretrained(out / "final"), lazy["weights"], exact=True)


def test_replace_deepspeed_without_deepspeed_names_the_extra_to_install(monkeypatch):
    from lazytrain.integrations import deepspeed_entry
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"pip install 'lazytrain\[hf\]'"):
        deepspeed_entry.replace_deepspeed()


def test_restore_deepspeed_puts_back_what_replace_changed():
    import deepspeed
    from transformers.integrations import deepspeed as hf_ds

    import lazytrain
    from lazytrain.engine.engine import LazyTrainEngine
    before = (deepspeed.initialize, deepspeed.DeepSpeedEngine, deepspeed.zero.Init,
              deepspeed.zero.GatheredParameters, hf_ds.set_hf_deepspeed_config)
    lazytrain.replace_deepspeed()
    try:
        assert deepspeed.initialize.__doc__ == lazytrain.initialize.__doc__ and deepspeed.initialize is not before[0]
        assert issubclass(LazyTrainEngine, deepspeed.DeepSpeedEngine)
        assert issubclass(before[1], deepspeed.DeepSpeedEngine)
        model = torch.nn.Linear(2, 2)
        with deepspeed.zero.Init(config_dict_or_path={}):
            built = torch.nn.Linear(3, 3)           # whole: nothing partitioned
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            pass
        assert built.weight.shape == (3, 3)
        assert not hf_ds.is_deepspeed_zero3_enabled()
    finally:
        lazytrain.restore_deepspeed()
    assert (deepspeed.initialize, deepspeed.DeepSpeedEngine, deepspeed.zero.Init,
            deepspeed.zero.GatheredParameters, hf_ds.set_hf_deepspeed_config) == before


def test_a_gathered_write_meant_for_every_rank_is_refused_with_several_ranks(monkeypatch):
    from lazytrain.integrations import deepspeed_entry
    params = list(torch.nn.Linear(2, 2).parameters())
    with deepspeed_entry._NothingToGather(params, modifier_rank=0):   # one process: nothing to broadcast
        pass
    monkeypatch.setattr(deepspeed_entry, "_world_size", lambda: 2)
    with deepspeed_entry._NothingToGather(params):                    # a read on every rank is fine
        pass
    with pytest.raises(NotImplementedError, match=r"GatheredParameters\(\.\.\., modifier_rank=\.\.\.\) with more "
                                                  r"than one rank"):
        deepspeed_entry._NothingToGather(params, modifier_rank=0)
