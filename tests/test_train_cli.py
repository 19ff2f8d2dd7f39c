"""`lazytrain train`: a bad job file or setting is one line naming it (exit 2), before any training."""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from lazytrain.cli import main
from lazytrain.train import DEFAULT_CONFIG


def job_file(tmp_path, change):
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    change(cfg)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def kept_engines(monkeypatch) -> list:
    """The engines the runs in this test build, in order."""
    import lazytrain
    engines, initialize = [], lazytrain.initialize

    def kept(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engines.append(out[0])
        return out
    monkeypatch.setattr(lazytrain, "initialize", kept)
    return engines


def set_in(section, **kw):
    def change(cfg):
        target = cfg
        for key in section:
            target = target[key]
        target.update(kw)
    return change


@pytest.mark.parametrize("change,message", [
    (set_in(("job", "model"), hidden_size=130),
     "'job.model': hidden_size (130) must be a multiple of num_attention_heads (4), and num_attention_heads a "
     "multiple of num_key_value_heads (4)"),
    (set_in(("job", "model"), hiden_size=3), "unknown key(s) in 'job.model': hiden_size (known: "),
    (set_in(("job", "model"), num_hidden_layers=0), "'job.model.num_hidden_layers' must be a positive integer, got 0"),
    (set_in(("job", "task"), max_oprand=9), "unknown key(s) in 'job.task': max_oprand (known: "),
    (lambda cfg: cfg.pop("optimizer"), "the config has no 'optimizer' section: lazytrain train trains the job's "
                                        "model with it"),
    (set_in(("job", "task"), max_operand=10**30),
     "'job.task.max_operand' must be at most 999 (the task holds every pair of operands in memory), got "
     "1000000000000000000000000000000"),
    (set_in(("job", "task"), held_out_fraction=1.0),
     "'job.task.held_out_fraction' must lie strictly between 0 and 1, got 1.0"),
    (set_in(("job",), steps="2"), "'job.steps' must be a positive integer, got '2'"),
    (lambda cfg: cfg.update(job="x"), "'job' must be an object with model, task and steps, got 'x'"),
    (set_in(("lazytrain",), polcy="x"), "unknown key 'polcy' in config section 'lazytrain'"),
    (lambda cfg: cfg.update(train_batch_size=7), "Check batch related parameters."),
    (set_in(("job", "model"), hidden_size=12, num_attention_heads=4, num_key_value_heads=4),
     "'job.model': hidden_size / num_attention_heads (12 / 4 = 3) must be even"),
    # the engine's and the planner's refusals of the config: one line too, not a traceback
    (set_in(("lazytrain",), policy="milp", seq_len=16, hardware="h800", gpu_memory="1MB"),
     "GPU budget 1.00 MB is too small at micro-batch 64 x seq 16: "),
    (set_in(("lazytrain",), policy="milp", seq_len=16, hardware="h800", host_memory="1MB"),
     "host memory budget 1.00 MB cannot hold the optimizer state: 852.99k layer parameters x 16.00 bytes"),
    (set_in(("lazytrain",), policy="milp", seq_len=16, hardware="no-such-card"), "config 'lazytrain.hardware': unknown hardware 'no-such-card'"),
    (set_in(("lazytrain",), gpu_memory="1KB"), "tier 'hbm' is over its budget: writing 'weights.slot0'"),
    (set_in(("lazytrain",), gpu_memory="0"), "config key 'lazytrain.gpu_memory' must be above 0"),
    (set_in(("job",), out_dir=5), "'job.out_dir' must be a directory path, got 5"),
    (set_in(("job", "task"), seed=[1]), "'job.task.seed' must be a non-negative integer, got [1]"),
    # torch.manual_seed's range: was a traceback ("Overflow when unpacking long long")
    (set_in(("job",), seed=2**64), "'job.seed' must be a non-negative integer below 2**64, got 18446744073709551616"),
    # a negative epsilon trained to NaN, saved it and exited 0
    (set_in(("job", "model"), rms_norm_eps=-1.0), "'job.model.rms_norm_eps' must be a finite number > 0, got -1.0"),
    (set_in(("job", "model"), rope_theta="1e4"), "'job.model.rope_theta' must be a finite number > 0, got '1e4'"),
    (set_in(("job", "model"), tie_word_embeddings="no"),
     "'job.model.tie_word_embeddings' must be true or false, got 'no'"),
    # a blocks path the model lacks, and a tier spec that cannot be built: one line too
    (set_in(("lazytrain",), blocks="model.nope"), "config 'lazytrain.blocks' is 'model.nope', but the model has no "
                                                  "attribute"),
    (set_in(("lazytrain",), tiers=[{"name": "x", "class": "nope_mod:Cls"}]),
     "lazytrain.tiers[0] ('x').class: tier class 'nope_mod:Cls' cannot be imported"),
    (set_in(("lazytrain",), tiers=[{"name": "host", "class": "x:y"}]), "lazytrain.tiers[0] ('host').name: 'host' is "
                                                                      "built in"),
    (set_in(("lazytrain",), weights_home="nvme", nvme_path="/nonexistent/lazytrain-nvme"),
     "tier 'nvme': nvme_path /nonexistent/lazytrain-nvme does not exist; create it or point nvme_path at an existing "
     "directory on a fast disk"),
])
def test_a_bad_job_setting_is_one_line(tmp_path, capsys, change, message):
    assert main(["train", job_file(tmp_path, change), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lazytrain train: " + message) and err.count("\n") == 1


def test_bad_job_files_and_paths_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, message in ((str(tmp_path / "missing.json"), "cannot read {}: No such file or directory"),
                          (str(tmp_path), "cannot read {}: Is a directory"),
                          (str(bad), "{} is not valid JSON: Expecting property name")):
        assert main(["train", path]) == 2
        assert capsys.readouterr().err.startswith("lazytrain train: " + message.format(path))
    utf16 = tmp_path / "utf16.json"
    utf16.write_bytes(json.dumps(DEFAULT_CONFIG).encode("utf-16"))   # PowerShell 5's ">": was a traceback
    assert main(["train", str(utf16)]) == 2
    assert capsys.readouterr().err.startswith(f"lazytrain train: {utf16} is not UTF-8 JSON: 'utf-8' codec can't "
                                              f"decode byte 0xff")
    job = tmp_path / "job.json"
    job.write_text(json.dumps(DEFAULT_CONFIG))
    link = tmp_path / "trace-link.json"
    link.symlink_to(job)
    for trace in (job, link):   # the trace replaced the config it was read from, and the run ended with 0
        assert main(["train", str(job), "--steps", "1", "--trace", str(trace), "--out", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err == (f"lazytrain train: trace path {trace} is the config file this run reads: "
                                           f"the trace would replace it; give another file name\n")
    assert json.loads(job.read_text()) == DEFAULT_CONFIG
    out = tmp_path / "out"
    for name in ("final", "latest", "t.json"):   # 'latest' replaced the trace; 'final' stopped the save
        trace = out / name
        assert main(["train", str(job), "--steps", "1", "--trace", str(trace), "--out", str(out)]) == 2
        assert capsys.readouterr().err == (f"lazytrain train: trace path {trace} is in the output directory {out}, "
                                           f"where the checkpoint is written: give a file outside it\n")
        assert not os.path.exists(trace)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert main(["train", "--out", str(blocker / "sub")]) == 2          # refused before training, not after
    assert capsys.readouterr().err == f"lazytrain train: cannot create the output directory {blocker / 'sub'}: " \
                                      f"Not a directory\n"
    with pytest.raises(SystemExit):
        main(["train", "--steps", "0"])
    assert "argument --steps: must be a positive integer, got '0'" in capsys.readouterr().err


def _refuses_a_file(directory) -> bool:
    import tempfile
    try:
        fd, path = tempfile.mkstemp(dir=directory)
    except PermissionError:
        return True
    os.close(fd)
    os.remove(path)
    return False


def test_a_checkpoint_an_earlier_run_left_is_not_replaced_unasked_and_the_output_must_take_a_file(tmp_path, capsys):
    """The trained weights are saved under tag 'final' at the end: an earlier run's is refused before any
    training, unless --overwrite; an output directory that cannot take a file is refused then too, not after
    the run."""
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    refusal = (f"lazytrain train: {out / 'final'} holds the checkpoint of an earlier run (or what its interrupted "
               f"save left), which this run's would replace: pass --overwrite, or another --out\n")
    assert main(["train", "--steps", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == refusal
    (out / "final").rename(out / ".final.staging")   # a save cut short between its renames: a load takes this up
    assert main(["train", "--steps", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == refusal
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    os.chmod(read_only, 0o500)
    try:
        if not _refuses_a_file(read_only):   # root writes to it: sysfs refuses root a file
            read_only = "/sys/kernel"
            if not os.path.isdir(read_only) or not _refuses_a_file(read_only):
                pytest.skip("no directory here refuses this user a file")
        assert main(["train", "--steps", "1", "--out", str(read_only)]) == 2
        assert capsys.readouterr().err == (f"lazytrain train: cannot write to the output directory {read_only}: "
                                           f"Permission denied\n")
    finally:
        os.chmod(tmp_path / "read-only", 0o700)


def test_unset_key_value_heads_are_one_per_attention_head_as_transformers_reads_it():
    from lazytrain.train import _job_settings
    job = copy.deepcopy(DEFAULT_CONFIG["job"])
    job["model"] = {k: v for k, v in job["model"].items() if k != "num_key_value_heads"}
    job["model"]["num_attention_heads"] = 8
    job["model"]["hidden_size"] = 128
    _, _, model = _job_settings(job, None)
    assert model["num_key_value_heads"] == 8


def test_steps_given_with_a_null_scheduler_section_trains(tmp_path, capsys, monkeypatch):
    path = job_file(tmp_path, lambda cfg: cfg.update(scheduler=None))
    monkeypatch.setenv("LOCAL_RANK", "0")   # what --local_rank sets is undone after the test
    assert main(["train", path, "--steps", "1", "--out", str(tmp_path / "out")]) == 0
    # again into the same directory: its checkpoint replaced, as asked; DeepSpeed's launcher's --local_rank taken
    assert main(["--local_rank=0", "train", path, "--steps", "2", "--out", str(tmp_path / "out"), "--overwrite"]) == 0
    assert "trained 2 steps" in capsys.readouterr().out


def _train_as_rank(rank, world, out_dir, job):
    """One rank of `lazytrain train` under a launcher: the seed its batches are drawn from, and what it printed."""
    import contextlib
    import io

    from lazytrain.data.arithmetic import ArithmeticTask
    seeds, original = [], ArithmeticTask.train_batches

    def recorded(self, micro, n, seed=0):
        seeds.append(seed)
        return original(self, micro, n, seed=seed)
    ArithmeticTask.train_batches = recorded
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):   # every rank is given the same trace path, as a launcher gives it
        code = main(["train", job, "--steps", "2", "--no-progress", "--out", os.path.join(out_dir, "out"),
                     "--trace", os.path.join(os.path.dirname(out_dir), "step.json")])
    return {"code": code, "seeds": seeds, "printed": printed.getvalue(),
            "group_left": not torch.distributed.is_initialized()}


def _refused_on_every_rank(rank, world, out_dir, job):
    """Each rank's output directory a disk of its own node's: rank 0's alone holds an earlier run's checkpoint."""
    import contextlib
    import io
    own = os.path.join(out_dir, f"node{rank}")
    if rank == 0:
        os.makedirs(os.path.join(own, "final"))
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = main(["train", job, "--steps", "1", "--no-progress", "--out", own])
    return {"code": code, "error": errors.getvalue(), "group_left": not torch.distributed.is_initialized()}


def test_under_a_launcher_each_rank_trains_on_batches_of_its_own_and_rank_0_alone_reports(tmp_path):
    from dist_helpers import spawn_cases
    def small(cfg):
        cfg.update(train_micro_batch_size_per_gpu=4)
        cfg["job"].update(eval_examples=8)
    job = job_file(tmp_path, small)
    r0, r1 = spawn_cases(2, tmp_path, {"train": (_train_as_rank, {"job": job})})["train"]
    assert r0["code"] == r1["code"] == 0
    assert len(r0["seeds"]) == len(r1["seeds"]) == 1 and r0["seeds"] != r1["seeds"]
    assert "trained 2 steps in" in r0["printed"] and r1["printed"] == ""
    # the run's throughput, every rank's tokens (it was rank 0's alone), and the ranks' mean last loss
    assert re.search(r"tokens/s over 2 ranks\), final loss \d", r0["printed"])
    # rank 0 alone checks, records and writes the trace (both ranks doing so raced on the file)
    assert f"trace of step 2 written to {tmp_path / 'step.json'}" in r0["printed"]
    assert json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert r0["group_left"] and r1["group_left"]   # the command's own process group torn down at its end


def test_under_a_launcher_one_ranks_problem_with_its_output_directory_stops_every_rank(tmp_path):
    """Each rank looks at its own output directory (a disk of its node's) before training; the first problem
    any rank found stops them all, not that rank alone while the others wait for it. (Processes of their own:
    a second process group made on the same port in the processes of the test above can meet its stale store.)"""
    from dist_helpers import spawn_cases
    job = job_file(tmp_path, lambda cfg: cfg.update(train_micro_batch_size_per_gpu=4))
    refused = spawn_cases(2, tmp_path, {"refused": (_refused_on_every_rank, {"job": job})})["refused"]
    assert isinstance(refused, list), refused
    assert [r["code"] for r in refused] == [2, 2], refused
    assert refused[1]["error"].startswith("lazytrain train: rank 0: ") and refused[0]["error"].startswith(
        f"lazytrain train: {tmp_path / 'refused' / 'node0' / 'final'} holds the checkpoint of an earlier run"), refused
    assert all(r["group_left"] for r in refused)   # the group the command made, torn down on its way out


def test_a_world_size_left_set_without_a_launcher_is_one_line(tmp_path, capsys, monkeypatch):
    """WORLD_SIZE=2 in the environment with no rendezvous address: was the same message as a traceback, exit 1."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("lazytrain train: WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT is not set: launch "
                                       "with torchrun, or unset WORLD_SIZE for a single process\n")


def test_unmanaged_accumulation_takes_one_optimizer_step_per_training_step(tmp_path, monkeypatch):
    """With 'managed_gradient_accumulation' false every step() is a boundary: the loop's step() after each
    micro-batch ran --steps x gradient_accumulation_steps updates of one micro-batch each, on a schedule fitted
    to --steps (spent half-way)."""
    engines = kept_engines(monkeypatch)
    for managed in (True, False):
        path = job_file(tmp_path, set_in((), gradient_accumulation_steps=2, managed_gradient_accumulation=managed))
        assert main(["train", path, "--steps", "3", "--no-progress", "--out", str(tmp_path / f"out{managed}")]) == 0
    managed_run, unmanaged_run = engines
    assert managed_run.global_steps == unmanaged_run.global_steps == 3
    assert managed_run.global_samples == unmanaged_run.global_samples == 3 * 2 * 64
    assert managed_run.get_lr() == unmanaged_run.get_lr()
    for a, b in zip(managed_run.module.parameters(), unmanaged_run.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def one_cycle(**params):
    def change(cfg):
        cfg["scheduler"] = {"type": "OneCycleLR", "params": {"max_lr": 3e-3, **params}}
    return change


@pytest.mark.parametrize("params,where", [({"total_steps": 2}, "2 steps ('scheduler.params' total_steps)"),
                                          ({"total_steps": True}, "1 steps ('scheduler.params' total_steps)"),
                                          ({"epochs": 1, "steps_per_epoch": 2},
                                           "2 steps ('scheduler.params' epochs x steps_per_epoch)")])
def test_torch_one_cycle_shorter_than_the_job_is_refused_before_training(tmp_path, capsys, params, where):
    """torch's OneCycleLR raises once stepped past its end: a job longer than it stopped there with a traceback
    and nothing saved. Refused before the model is built."""
    def change(cfg):
        one_cycle(**params)(cfg)
        cfg["job"]["steps"] = 3
    out = tmp_path / "out"
    assert main(["train", job_file(tmp_path, change), "--no-progress", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"lazytrain train: the scheduler OneCycleLR runs {where}, fewer than job.steps (3): torch's OneCycleLR "
        f"raises when stepped past its end; give it 3 steps, or run with --steps, which fits it to the steps run\n")
    assert not out.exists()


def test_steps_option_fits_a_torch_one_cycle_to_the_steps_run(tmp_path, monkeypatch):
    """--steps sets OneCycleLR's total_steps as it sets DeepSpeed schedules' total_num_steps: the run ends on
    the schedule's last step."""
    engines = kept_engines(monkeypatch)
    path = job_file(tmp_path, one_cycle(total_steps=2))
    assert main(["train", path, "--steps", "3", "--no-progress", "--out", str(tmp_path / "out")]) == 0
    schedule = engines[0].lr_scheduler
    assert schedule.total_steps == 3 and schedule.last_epoch == 3


def test_the_loss_reported_is_the_mean_of_each_steps_micro_batches(tmp_path, capsys, monkeypatch):
    """With gradient accumulation the progress and the final loss were the last micro-batch's alone."""
    import lazytrain
    losses, initialize = [], lazytrain.initialize

    def recording(*args, **kwargs):
        out = initialize(*args, **kwargs)
        backward = out[0].backward
        out[0].backward = lambda loss, *a, **k: (losses.append(loss.detach()), backward(loss, *a, **k))[1]
        return out
    monkeypatch.setattr(lazytrain, "initialize", recording)
    path = job_file(tmp_path, set_in((), train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4))
    assert main(["train", path, "--steps", "2", "--no-progress", "--out", str(tmp_path / "out")]) == 0
    assert len(losses) == 8
    mean = (sum(losses[4:]) / 4).item()
    assert abs(losses[-1].item() - mean) > 1e-3   # the last micro-batch's is another number
    assert f"final loss {mean:.4f}\n" in capsys.readouterr().out


@pytest.mark.parametrize("kind,params,past", [
    ("WarmupDecayLR", {"total_num_steps": 2, "warmup_num_steps": 1}, "learning rate 0"),
    ("WarmupCosineLR", {"total_num_steps": 2, "warmup_num_steps": 1},
     "the schedule's floor (cos_min_ratio of the learning rate)"),
    ("CosineAnnealingLR", {"T_max": 2}, "a learning rate rising again (torch's cosine goes on past T_max)"),
    ("PolynomialLR", {"total_iters": 2}, "learning rate 0"),
    ("PolynomialLR", {}, "learning rate 0")])
def test_a_schedule_shorter_than_the_job_is_refused_and_steps_fits_it(tmp_path, capsys, monkeypatch, kind, params,
                                                                      past):
    """A DeepSpeed WarmupDecayLR shorter than job.steps trained the steps past its end at learning rate 0, and
    --steps left a torch CosineAnnealingLR's T_max as it was (its rate climbed back to the peak), without a word."""
    def change(cfg):
        cfg["scheduler"] = {"type": kind, "params": params}
        cfg["job"]["steps"] = 3 if params else 7   # PolynomialLR's total_iters left out: torch's 5
    path, out = job_file(tmp_path, change), tmp_path / "out"
    assert main(["train", path, "--no-progress", "--out", str(out)]) == 2
    key, length, steps = (next(iter(params)), 2, 3) if params else ("total_iters, torch's default", 5, 7)
    assert capsys.readouterr().err == (
        f"lazytrain train: the scheduler {kind} runs {length} steps ('scheduler.params' {key}), fewer than job.steps "
        f"({steps}): the last {steps - length} would train at {past}; give it {steps} steps, or run with --steps, which fits it to "
        f"the steps run\n")
    assert not out.exists()
    engines = kept_engines(monkeypatch)
    assert main(["train", path, "--steps", "4", "--no-progress", "--out", str(out)]) == 0
    schedule = engines[0].lr_scheduler
    assert getattr(schedule, {"T_max": "T_max"}.get(key, "total_iters" if kind == "PolynomialLR" else
                                                "total_num_steps")) == 4


def test_an_empty_out_option_and_a_latest_naming_another_tag_are_refused_before_training(tmp_path, capsys,
                                                                                         monkeypatch):
    """--out "" trained into job.out_dir; a checkpoint directory's 'latest' was pointed at this run's 'final', so a
    load without a tag took the toy model instead of the checkpoint it named."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", "--no-progress", "--out", ""]) == 2
    assert capsys.readouterr().err == "lazytrain train: '--out' must be a directory path, got ''\n"
    assert not (tmp_path / "lazytrain-out").exists()
    out = tmp_path / "ckpts"
    (out / "global_step100").mkdir(parents=True)
    (out / "latest").write_text("global_step100")
    assert main(["train", "--steps", "1", "--no-progress", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"lazytrain train: {out / 'latest'} names checkpoint tag 'global_step100', "
                                       f"which this run's save would point at its own 'final' instead: pass "
                                       f"--overwrite, or another --out\n")
    assert (out / "latest").read_text() == "global_step100" and not (out / "final").exists()
    assert main(["train", "--steps", "1", "--no-progress", "--out", str(out), "--overwrite"]) == 0
    assert (out / "latest").read_text() == "final"


@pytest.mark.parametrize("name,value,says", [("WORLD_SIZE", "", "positive"), ("WORLD_SIZE", "0", "positive"),
                                             ("RANK", "x", "non-negative"), ("LOCAL_RANK", "-2", "non-negative")])
def test_a_launcher_variable_that_is_not_a_number_is_one_line(tmp_path, capsys, monkeypatch, name, value, says):
    """WORLD_SIZE= or RANK=x was a traceback: ValueError: invalid literal for int() with base 10."""
    monkeypatch.setenv(name, value)
    assert main(["train", "--steps", "1", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"lazytrain train: the environment variable {name} must be a {says} whole "
                                       f"number, got {value!r} (a launcher sets it; unset it for a single process)\n")


def test_a_local_rank_of_minus_one_is_hugging_faces_not_distributed():
    from lazytrain.comm import get_local_rank
    from lazytrain.launcher_env import launcher_int
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LOCAL_RANK", "-1")
        assert launcher_int("LOCAL_RANK", 0) == get_local_rank() == 0
