"""Hugging Face Trainer, accelerate and TRL scripts, unchanged but for ``lazytrain.replace_deepspeed()``,
train through LazyTrain with transformers' stock ZeRO-2 and ZeRO-3 configs: as the same script without
DeepSpeed trains (fp32, 1e-6), with saved folders that ``from_pretrained`` loads to exactly the trained
weights and a ``resume_from_checkpoint`` that continues bit-identically. Each run is its own process (the
scripts in ``hf_programs``), as a user runs them, with the variables a launcher sets; two run at a time."""
import copy
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


def run_with_torchrun(name: str, out, nproc: int, *args, reference: bool = False) -> dict:
    """The program started by torchrun with ``nproc`` processes on this machine (rank 0's result).
    ``reference``: plain PyTorch's run (no LazyTrain), run once more if a rank aborted in C++ teardown (seen
    once in CI under load: "terminate called without an active exception" after its results were written)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    for attempt in range(2 if reference else 1):
        r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node",
                            str(nproc), "--master_port", str(free_port()), os.path.join(PROGRAMS, name), str(out),
                            *args], env=dict(env, TOKENIZERS_PARALLELISM="false"), capture_output=True, text=True,
                           timeout=600)
        if r.returncode == 0 or "terminate called without an active exception" not in r.stderr:
            break
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(os.path.join(out, "result.pt"))


TRAINS = "test_a_trainer_script_trains_as_it_does_without_deepspeed"
SAVES = "test_saved_folders_load_with_from_pretrained_to_exactly_the_trained_weights"
SAVES_BF16 = "test_in_bf16_saved_folders_hold_the_trained_weights_in_bf16_as_deepspeed_saves_them"
TWO_RANKS = "test_two_ranks_of_a_trainer_script_shard_the_state_and_train_as_plain_data_parallel"
TWO_RANKS_BF16 = "test_two_ranks_in_bf16_keep_the_non_block_masters_on_their_owners_and_save_the_trained_weights"
RESUMES = "test_resume_from_checkpoint_continues_bit_identically"
OTHER_SCRIPTS = "test_accelerate_and_trl_scripts_train_as_they_do_without_deepspeed"
GENERATES = "test_a_trl_trainer_that_generates_during_training_trains_as_it_does_without_deepspeed"
EVALUATES_FIRST = "test_a_generating_trainer_evaluates_before_its_first_step_under_zero3"
PRECOMPUTES = "test_dpo_precomputing_reference_log_probs_without_a_reference_model_trains_as_without_deepspeed"
PLATEAU = "test_a_plateau_schedule_the_trainer_built_is_stepped_at_each_evaluation_as_without_deepspeed"
# every run the tests read: name: (program, its arguments, the tests that read it); "torchrun" in the name:
# started by torchrun with 2 processes; "resumed" continues "zero2" from its checkpoint-2
RUNS = {
    "plain": ("trainer_run.py", ("--config", "plain"), {TRAINS}),
    "zero2": ("trainer_run.py", ("--config", "zero2"), {TRAINS, SAVES, RESUMES}),
    "zero3": ("trainer_run.py", ("--config", "zero3"), {TRAINS, SAVES}),
    "zero2_bf16": ("trainer_run.py", ("--config", "zero2", "--bf16"), {SAVES_BF16}),
    "zero3_bf16": ("trainer_run.py", ("--config", "zero3", "--bf16"), {SAVES_BF16}),
    "torchrun_zero2": ("trainer_run.py", ("--config", "zero2"), {TWO_RANKS}),
    "torchrun_plain": ("trainer_run.py", ("--config", "plain"), {TWO_RANKS}),
    "torchrun_zero2_bf16": ("trainer_run.py", ("--config", "zero2", "--bf16"), {TWO_RANKS_BF16}),
    "resumed": ("trainer_run.py", ("--config", "zero2"), {RESUMES}),
    **{f"{program[:-3]}_{config}": (program, ("--config", config), {OTHER_SCRIPTS})
       for program in ("accelerate_run.py", "sft_run.py") for config in ("plain", "zero2", "zero3")},
    **{f"grpo_run_{config}": ("grpo_run.py", ("--config", config), {GENERATES}) for config in ("plain", "zero2", "zero3")},
    **{f"grpo_evaluates_{config}": ("grpo_run.py", ("--config", config, "--evaluate-first"), {EVALUATES_FIRST})
       for config in ("plain", "zero3")},
    **{f"dpo_run_{config}": ("dpo_run.py", ("--config", config), {PRECOMPUTES}) for config in ("plain", "zero2", "zero3")},
    **{f"plateau_run_{config}": ("plateau_run.py", ("--config", config), {PLATEAU}) for config in ("plain", "zero2")},
}
AT_ONCE = 2   # runs at a time (each its own process, as a user runs it): enough to keep two cores busy


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``runs(name)``: (the result, the output folder) of the run ``name`` of RUNS. When the first test asks,
    every run a selected test reads is started, AT_ONCE at a time, in the order the tests read them; a run
    no selected test reads is started when asked for."""
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("hf")
    pool = ThreadPoolExecutor(max_workers=AT_ONCE)
    started = {}

    def launch(name: str) -> tuple[dict, object]:
        program, args, _ = RUNS[name]
        out = root / name
        if name.startswith("torchrun"):
            return run_with_torchrun(program, out, 2, *args, reference=args[-1] == "plain"), out
        if name == "resumed":   # once "zero2" has saved its checkpoints
            args = (*args, "--resume", str(get("zero2")[1] / "checkpoint-2"))
        return run_program(program, out, *args), out

    def start(name: str) -> None:
        if name not in started:
            started[name] = pool.submit(launch, name)

    def get(name: str) -> tuple[dict, object]:
        if not started:
            selected = {item.originalname for item in request.session.items if item.module is request.module}
            for other, (_, _, readers) in RUNS.items():
                if readers & selected:
                    start(other)
        start(name)
        return started[name].result()
    yield get
    pool.shutdown(wait=True, cancel_futures=True)


def assert_same_weights(a: dict, b: dict, exact: bool):
    assert a.keys() == b.keys()
    if exact:   # every differing tensor named, with its largest difference (a failure under load once named only
        # the first key, which says little of where the runs parted)
        differ = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
        assert not differ, differ
        return
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=k)


def from_pretrained(path) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_trainer_script_trains_as_it_does_without_deepspeed(runs, config):
    plain, _ = runs("plain")
    lazy, _ = runs(config)
    assert lazy["step"] == plain["step"] == 4
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert lazy["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)    # evaluate() streams
    torch.testing.assert_close(lazy["logits"], plain["logits"], **TOL)          # and so does predict()


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_saved_folders_load_with_from_pretrained_to_exactly_the_trained_weights(runs, config):
    lazy, out = runs(config)
    final = out / "final"     # save_model(): under ZeRO-3 through the 16-bit gather DeepSpeed's config asks for
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    assert_same_weights(from_pretrained(final), lazy["weights"], exact=True)
    last = out / "checkpoint-4"          # each checkpoint-* folder is a from_pretrained folder too
    assert_same_weights(from_pretrained(last), lazy["weights"], exact=True)
    assert (last / "latest").read_text() == "global_step4"


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_in_bf16_saved_folders_hold_the_trained_weights_in_bf16_as_deepspeed_saves_them(runs, config):
    lazy, out = runs(f"{config}_bf16")
    assert all(torch.isfinite(torch.tensor(lazy["losses"])))
    masters_in_bf16 = {k: v.bfloat16() for k, v in lazy["weights"].items()}
    for folder in ("final", "checkpoint-4"):
        loaded = from_pretrained(out / folder)
        assert {v.dtype for v in loaded.values()} == {torch.bfloat16}
        assert_same_weights(loaded, masters_in_bf16, exact=True)


def test_two_ranks_of_a_trainer_script_shard_the_state_and_train_as_plain_data_parallel(runs):
    """torchrun with 2 processes: LazyTrain (ZeRO-2 config: the optimizer state sharded over the ranks)
    against the same script without DeepSpeed (torch's DistributedDataParallel)."""
    lazy, lazy_out = runs("torchrun_zero2")
    plain, _ = runs("torchrun_plain")
    assert lazy["sharded"] and not plain["sharded"]
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert_same_weights(from_pretrained(lazy_out / "final"), lazy["weights"], exact=True)


def test_two_ranks_in_bf16_keep_the_non_block_masters_on_their_owners_and_save_the_trained_weights(runs):
    """torchrun with 2 processes in bf16 under the stock ZeRO-2 config: the embedding's and head's fp32 masters
    live on their owners (each on one rank); every saved folder holds the gathered fp32 weights in bf16, as
    DeepSpeed saves them."""
    lazy, out = runs("torchrun_zero2_bf16")
    assert lazy["sharded"] and sum(lazy["masters_here"]) == lazy["masters"] and min(lazy["masters_here"]) < lazy["masters"]
    masters_in_bf16 = {k: v.bfloat16() for k, v in lazy["weights"].items()}
    for folder in ("final", "checkpoint-4"):
        loaded = from_pretrained(out / folder)
        assert {v.dtype for v in loaded.values()} == {torch.bfloat16}
        assert_same_weights(loaded, masters_in_bf16, exact=True)


def test_resume_from_checkpoint_continues_bit_identically(runs):
    straight, _ = runs("zero2")
    resumed, _ = runs("resumed")     # a new process, resumed from the checkpoint-2 of "zero2"
    assert resumed["step"] == 4
    assert resumed["losses"] == straight["losses"]     # steps 1-2 from the checkpoint's trainer_state.json
    assert_same_weights(resumed["weights"], straight["weights"], exact=True)


@pytest.mark.parametrize("program", ["accelerate_run.py", "sft_run.py"])
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_accelerate_and_trl_scripts_train_as_they_do_without_deepspeed(runs, program, config):
    plain, _ = runs(f"{program[:-3]}_plain")
    lazy, out = runs(f"{program[:-3]}_{config}")
    assert len(lazy["losses"]) == len(plain["losses"]) > 0
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)
    assert_same_weights(from_pretrained(out / "final"), lazy["weights"], exact=True)


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_trl_trainer_that_generates_during_training_trains_as_it_does_without_deepspeed(runs, config):
    """TRL's GRPOTrainer generates its completions through ``unwrap_model_for_generation``, which under ZeRO-3
    takes DeepSpeed's module hooks off the model and puts them back (``optimizer.parameter_offload``): the same
    completions, rewards, losses and weights as without DeepSpeed."""
    plain, _ = runs("grpo_run_plain")
    lazy, _ = runs(f"grpo_run_{config}")
    assert len(lazy["losses"]) == len(plain["losses"]) == 3 and plain["moved"] > 1e-3
    assert lazy["rewards"] == plain["rewards"]   # the same completions sampled
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)


def test_a_generating_trainer_evaluates_before_its_first_step_under_zero3(runs):
    """A Trainer's ``evaluate()`` before ``train()`` builds the ZeRO-3 engine without an optimizer; TRL's generation
    takes the module hooks off ``engine.optimizer``, which was None ("The model optimizer is None, which is not
    yet supported") and is, as DeepSpeed's ``DeepSpeedZeRoOffload`` there, an object with ZeRO-3's (empty) hooks:
    the same sampled completions' reward and loss as without DeepSpeed."""
    plain, _ = runs("grpo_evaluates_plain")
    lazy, _ = runs("grpo_evaluates_zero3")
    assert lazy["engine"] == "LazyTrainEngine" and plain["engine"] == "GPT2LMHeadModel"
    assert lazy["eval_reward"] == plain["eval_reward"]
    torch.testing.assert_close(lazy["eval_loss"], plain["eval_loss"], **TOL)


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_dpo_precomputing_reference_log_probs_without_a_reference_model_trains_as_without_deepspeed(runs, config):
    """TRL's DPOTrainer with ``precompute_ref_log_probs`` and no reference model computes them through an
    inference engine of its own on the policy model, then the Trainer builds the training engine on the same
    model: that second engine was refused ("this model is trained by a LazyTrain engine already"). The engine
    without an optimizer is handed back and the new one takes the model: the same reference log-probabilities,
    losses and weights as without DeepSpeed."""
    plain, _ = runs("dpo_run_plain")
    lazy, _ = runs(f"dpo_run_{config}")
    assert lazy["reference"] == plain["reference"]
    assert len(lazy["losses"]) == len(plain["losses"]) == 5 and plain["losses"][-1] < plain["losses"][0] - 0.03
    torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert plain["moved"] > 1e-3
    assert_same_weights(lazy["weights"], plain["weights"], exact=False)


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
    import accelerate.accelerator
    before = (deepspeed.initialize, deepspeed.DeepSpeedEngine, deepspeed.zero.Init,
              deepspeed.zero.GatheredParameters, hf_ds.set_hf_deepspeed_config,
              accelerate.accelerator.map_pytorch_optim_to_deepspeed)
    before_get_rank = deepspeed.comm.get_rank
    had_a_group = torch.distributed.is_initialized()
    lazytrain.replace_deepspeed()
    try:
        adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
        assert accelerate.accelerator.map_pytorch_optim_to_deepspeed(adamw) is adamw   # not DeepSpeed's CPU Adam
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
        # deepspeed.comm with no DeepSpeed backend set up (LazyTrain's initialize sets none up): over
        # torch.distributed's group, where DeepSpeed's own asserted "DeepSpeed backend not set"
        assert deepspeed.comm.comm.cdb is None and before_get_rank is not deepspeed.comm.get_rank
        assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()) == (0, 1)
        t = torch.ones(2)
        deepspeed.comm.all_reduce(t)
        deepspeed.comm.barrier()
        assert t.tolist() == [1.0, 1.0]
    finally:
        lazytrain.restore_deepspeed()
        if not had_a_group and torch.distributed.is_initialized():   # the group of one made here
            torch.distributed.destroy_process_group()
    assert (deepspeed.initialize, deepspeed.DeepSpeedEngine, deepspeed.zero.Init,
            deepspeed.zero.GatheredParameters, hf_ds.set_hf_deepspeed_config,
            accelerate.accelerator.map_pytorch_optim_to_deepspeed) == before
    assert deepspeed.comm.get_rank is before_get_rank


def test_accelerate_fills_its_auto_values_and_leaves_the_lazytrain_sections_alone():
    """accelerate's pass over the config took the "lazytrain" section's own "auto" values (policy,
    overlap_optimizer...) for its placeholders and stopped every Trainer and accelerate script on them
    ("`lazytrain.policy` not found in kwargs"). Its pass now leaves that section out."""
    from accelerate.utils import DeepSpeedPlugin

    import lazytrain
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
              "lazytrain": {"policy": "auto", "overlap_optimizer": "auto"}}
    with pytest.raises(ValueError, match="`lazytrain.policy` not found in kwargs"):   # accelerate's own pass
        DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config)).deepspeed_config_process(
            must_match=False, train_micro_batch_size_per_gpu=4)
    lazytrain.replace_deepspeed()
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=config)
        plugin.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=4)
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4
        assert plugin.deepspeed_config["lazytrain"] == {"policy": "auto", "overlap_optimizer": "auto"}
    finally:
        lazytrain.restore_deepspeed()


def test_a_gathered_write_in_one_process_or_a_read_on_every_rank_broadcasts_nothing(monkeypatch):
    """(A write broadcast over several ranks, and an engine's parameters refused there: test_engine_sharded.py.)"""
    from lazytrain.integrations import deepspeed_entry
    params = list(torch.nn.Linear(2, 2).parameters())
    with deepspeed_entry._GatheredParameters(params, modifier_rank=0):   # one process: nothing to broadcast
        params[0].data.fill_(3.0)
    assert torch.equal(params[0], torch.full((2, 2), 3.0))
    monkeypatch.setattr(deepspeed_entry, "_world_size", lambda: 2)
    monkeypatch.setattr(deepspeed_entry, "_broadcast_params", lambda *a: pytest.fail("a read broadcast"))
    with deepspeed_entry._GatheredParameters(params):                    # a read on every rank is fine
        pass


def test_a_plateau_schedule_the_trainer_built_is_stepped_at_each_evaluation_as_without_deepspeed(runs):
    """A config with an optimizer and no scheduler: the Trainer builds ReduceLROnPlateau, and steps it with the
    evaluation loss only where it holds it itself. accelerate handed it the engine's schedule in a wrapper that
    steps nothing, and engine.step() leaves a plateau schedule to the script: the rate never fell (logged
    [1e-3, 1e-3, 1e-3, 1e-3]). Each evaluation halves it here, as without DeepSpeed."""
    plain, _ = runs("plateau_run_plain")
    lazy, _ = runs("plateau_run_zero2")
    assert plain["logged"] == lazy["logged"] == [1e-3, 5e-4, 2.5e-4, 1.25e-4]
    assert plain["lr"] == lazy["lr"] == 6.25e-5
