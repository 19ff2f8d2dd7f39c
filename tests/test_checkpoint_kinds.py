"""A checkpoint's optimizer or learning-rate schedule state of another kind than the engine's
(lazytrain/engine/state_kinds.py) is refused before anything of it loads. Before, torch's load took it: SGD's
state into AdamW failed half-way through the load (KeyError 'step', the engine fenced), AdamW's into SGD at the
next step (KeyError 'momentum', mid-update), AdamW's 8-bit moments into SGD trained on silently unused, and a
StepLR's state into a CosineAnnealingLR merged into it (the rate followed neither)."""
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine.checkpoint import CheckpointError, CheckpointMismatchError
from engine_models import VOCAB, batches, lm_loss, make_model

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    "SGD": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
    "SGD without momentum": {"type": "SGD", "params": {"lr": 1e-2}},
    "RMSprop": {"type": "RMSprop", "params": {"lr": 1e-3}},
    "Adagrad": {"type": "Adagrad", "params": {"lr": 1e-2}},
    "AdamW8bit": {"type": "AdamW8bit", "params": {"lr": 1e-2, "weight_decay": 0.1}},
}
FENCE = ": load it with load_optimizer_states=False to take the weights alone; nothing was loaded"


def _engine(optimizer="AdamW", steps=2, scheduler=None, client_scheduler=None):
    """An engine on the same tiny model, trained ``steps`` steps (8-bit moments from 64 elements up)."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": OPTIMIZERS[optimizer], "lazytrain": {"hybrid_threshold": 64}}
    if scheduler is not None:
        config["scheduler"] = scheduler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=make_model("modulelist"), config=config)[0]
        if client_scheduler is not None:
            engine.lr_scheduler = client_scheduler(engine.optimizer)
    _train(engine, steps)
    return engine


def _train(engine, steps):
    _steps(engine, batches(steps))


def _steps(engine, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in data:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.wait_for_update()


def _resumed_differs(engine, data, path) -> list[str]:
    """The weights that differ between a run of ``engine()`` trained on ``data`` straight, and one trained on its
    first half, saved to ``path``, loaded into a new engine and trained on the rest (none where it resumes bit
    for bit)."""
    half = len(data) // 2
    whole, saver = engine(), engine()
    _steps(whole, data)
    _steps(saver, data[:half])
    saver.save_checkpoint(str(path))
    resumed = engine()
    resumed.load_checkpoint(str(path))
    _steps(resumed, data[half:])
    mine, theirs = resumed.module_state_dict(), whole.module_state_dict()
    return sorted(k for k in theirs if not torch.equal(mine[k], theirs[k]))


def _refused_and_unchanged(engine, path, message, **kwargs):
    """Refused with exactly ``message`` after the checkpoint's name, nothing loaded: the engine trains on."""
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    steps = engine.global_steps
    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint .* " + re.escape(message) + "$"):
        engine.load_checkpoint(str(path), **kwargs)
    assert engine.global_steps == steps
    assert all(torch.equal(before[k], v) for k, v in engine.module_state_dict().items())
    _train(engine, 1)


REFUSED = {   # (saved by, loaded into): what the refusal says after the checkpoint's name
    ("SGD", "AdamW"): "holds the state of another kind of optimizer: its parameter groups have no 'betas', 'eps', "
                      "which this engine's AdamW keeps; it has 'dampening', 'momentum', 'nesterov'",
    ("AdamW", "SGD"): "holds the state of another kind of optimizer: its parameter groups have no 'dampening', "
                      "'momentum', which this engine's SGD keeps; it has 'amsgrad', 'betas', "
                      "'decoupled_weight_decay', 'eps'",
    ("AdamW", "RMSprop"): "holds the state of another kind of optimizer: its parameter groups have no 'alpha', "
                          "which this engine's RMSprop keeps; it has 'amsgrad', 'betas', 'decoupled_weight_decay'",
    ("RMSprop", "AdamW"): "holds the state of another kind of optimizer: its parameter groups have no 'betas', "
                          "which this engine's AdamW keeps; it has 'alpha', 'centered', 'momentum'",
    ("Adagrad", "AdamW"): "holds the state of another kind of optimizer: its parameter groups have no 'betas', "
                          "which this engine's AdamW keeps; it has 'initial_accumulator_value', 'lr_decay'",
    # 8-bit moments into an optimizer other than HybridAdamW: the fp32 moments of the DeepSpeed files, by name
    ("AdamW8bit", "SGD"): "holds the state of another kind of optimizer: its parameter groups have no "
                          "'dampening', 'momentum', which this engine's SGD keeps; it has 'amsgrad', 'betas', "
                          "'decoupled_weight_decay', 'eps'",
    ("SGD", "AdamW8bit"): "holds the state of another kind of optimizer: its parameter groups have no 'betas', "
                          "which this engine's HybridAdamW keeps; it has 'dampening', 'maximize', 'momentum', "
                          "'nesterov'",
    # no state at all (SGD without momentum keeps none), yet no Adam's settings either
    ("SGD without momentum", "AdamW8bit"): "holds the state of another kind of optimizer: its parameter groups have "
                                           "no 'betas', which this engine's HybridAdamW keeps; it has 'dampening', "
                                           "'maximize', 'momentum', 'nesterov'",
}


@pytest.mark.parametrize("saved_by, loaded_into", sorted(REFUSED))
def test_an_optimizer_state_of_another_kind_is_refused_before_anything_loads(tmp_path, saved_by, loaded_into):
    _engine(saved_by).save_checkpoint(str(tmp_path))
    engine = _engine(loaded_into, steps=1)
    assert type(engine.basic_optimizer).__name__ == ("HybridAdamW" if loaded_into == "AdamW8bit" else loaded_into)
    _refused_and_unchanged(engine, tmp_path, REFUSED[saved_by, loaded_into] + FENCE)
    engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)   # the weights alone, as it says
    assert engine.global_steps == 2
    _train(engine, 1)


@pytest.mark.parametrize("saved_by, loaded_into", [("AdamW", "AdamW8bit"), ("AdamW8bit", "AdamW"),
                                                   ("AdamW8bit", "AdamW8bit"), ("SGD", "SGD")])
def test_an_optimizer_state_of_the_same_kind_loads_and_trains_on_as_the_run_that_saved_it(tmp_path, saved_by,
                                                                                          loaded_into):
    """Adam's moments go between torch's AdamW and HybridAdamW (8-bit), both ways; a run resumed into its own
    kind trains on exactly as the run that saved it."""
    saver = _engine(saved_by)
    saver.save_checkpoint(str(tmp_path))
    engine = _engine(loaded_into, steps=1)
    engine.load_checkpoint(str(tmp_path))
    assert engine.global_steps == 2
    _train(saver, 1)
    _train(engine, 1)
    if saved_by == loaded_into:
        assert all(torch.equal(saver.module_state_dict()[k], v) for k, v in engine.module_state_dict().items())


def test_a_torch_schedule_added_on_resume_is_no_other_optimizer(tmp_path):
    """torch's schedulers add 'initial_lr' to the optimizer's groups: a key of the schedule, not a setting of the
    optimizer that a checkpoint saved without that schedule lacks."""
    _engine("AdamW").save_checkpoint(str(tmp_path))
    engine = _engine("AdamW", steps=0, client_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5))
    assert all("initial_lr" in g for g in engine.optimizer.param_groups)
    engine.load_checkpoint(str(tmp_path), load_lr_scheduler_states=False)
    assert engine.global_steps == 2
    _train(engine, 1)


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)


SCHEDULES = {   # (saved, loaded into): what the refusal says after the checkpoint's name
    ("StepLR", "CosineAnnealingLR"): "holds a learning-rate schedule's state without 'T_max', 'eta_min', which this "
                                     "engine's CosineAnnealingLR keeps and with 'gamma', 'step_size', which this "
                                     "engine's CosineAnnealingLR does not keep",
    ("CosineAnnealingLR", "StepLR"): "holds a learning-rate schedule's state without 'gamma', 'step_size', which "
                                     "this engine's StepLR keeps and with 'T_max', 'eta_min', which this engine's "
                                     "StepLR does not keep",
    ("WarmupLR", "StepLR"): "holds a learning-rate schedule's state without 'gamma', 'last_epoch', 'step_size', "
                            "which this engine's StepLR keeps and with 'last_batch_iteration', which this engine's "
                            "StepLR does not keep",
    ("StepLR", "WarmupLR"): "holds a learning-rate schedule's state without 'last_batch_iteration', which this "
                            "engine's WarmupLR keeps",
}
_CLIENT = {"StepLR": _step_lr, "CosineAnnealingLR": _cosine}


def _with_schedule(kind, steps):
    if kind in _CLIENT:
        return _engine("AdamW", steps=steps, client_scheduler=_CLIENT[kind])
    return _engine("AdamW", steps=steps, scheduler={"type": kind, "params": {"warmup_num_steps": 4}})


@pytest.mark.parametrize("saved, loaded_into", sorted(SCHEDULES))
def test_a_schedule_state_of_another_kind_is_refused_before_anything_loads(tmp_path, saved, loaded_into):
    _with_schedule(saved, 3).save_checkpoint(str(tmp_path))
    engine = _with_schedule(loaded_into, 1)
    _refused_and_unchanged(engine, tmp_path, SCHEDULES[saved, loaded_into] + " (a schedule of another kind): load "
                           "it with load_lr_scheduler_states=False to keep this one; nothing was loaded",
                           load_optimizer_states=False)
    engine = _with_schedule(loaded_into, 1)
    own = engine.lr_scheduler.state_dict()
    engine.load_checkpoint(str(tmp_path), load_lr_scheduler_states=False)
    assert engine.lr_scheduler.state_dict() == own   # its own schedule, where it was
    _train(engine, 1)


def test_deepspeeds_schedules_take_each_others_iteration_as_deepspeeds_load_does(tmp_path):
    """DeepSpeed's schedules keep their iteration alone: a run switched from warm-up to warm-up-and-decay goes on
    at the same iteration, as under DeepSpeed."""
    decay = {"warmup_num_steps": 4, "total_num_steps": 20}
    _engine("AdamW", steps=3, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}}).save_checkpoint(
        str(tmp_path))
    engine = _engine("AdamW", steps=0, scheduler={"type": "WarmupDecayLR", "params": decay})
    engine.load_checkpoint(str(tmp_path))
    fresh = _engine("AdamW", steps=3, scheduler={"type": "WarmupDecayLR", "params": decay})
    assert engine.lr_scheduler.state_dict() == fresh.lr_scheduler.state_dict() == {"last_batch_iteration": 2}
    assert engine.get_lr() == fresh.get_lr()


def test_a_save_directory_that_is_a_file_is_named(tmp_path):
    engine = _engine("AdamW", steps=1)
    path = tmp_path / "afile"
    path.write_text("not a directory")
    expected = f"{path} is a file, not a directory, so nothing was saved. Give a directory (it is made if it does " \
               f"not exist)"
    with pytest.raises(CheckpointError, match=re.escape(f"saving checkpoint tag 'global_step1' to {path}: "
                                                        f"{expected}") + "$"):
        engine.save_checkpoint(str(path))
    with pytest.raises(CheckpointError, match=re.escape(f"save_16bit_model({str(path)!r}): {expected}") + "$"):
        engine.save_16bit_model(str(path))
    assert path.read_text() == "not a directory"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_optimizer_whose_state_is_not_shaped_like_its_parameters_saves_and_resumes_exactly(tmp_path, stage):
    """Adafactor keeps a weight matrix's second moment as row and column factors. DeepSpeed's flat groups (the
    files of stages 1-3) lay out only per-element states: the factors were sliced as if they were, and the save
    failed ("got 3456 bytes from its pieces, its record holds 98944"). LazyTrain's own file keeps them."""
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}}}
    made = []   # the engines, in order: the straight run's, the saver's, the resumed one's

    def engine():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            made.append(lazytrain.initialize(model=make_model("modulelist"), config=config)[0])
        return made[-1]
    assert _resumed_differs(engine, batches(4), tmp_path) == []
    assert any(st["row_var"].dim() == 2 and st["row_var"].shape[-1] == 1 for st in made[1].optimizer.state.values()
               if "row_var" in st)   # the saver's: a factor, not a per-element state


def _adafactor_resumed(rank, world, out_dir, stage):
    """Two ranks: Adafactor trained 4 steps straight, and 2 steps saved, loaded into a new engine, 2 more."""
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}}}
    data = [(x[rank::world], y[rank::world]) for x, y in batches(4)]
    return _resumed_differs(lambda: lazytrain.initialize(model=make_model("modulelist"), config=config)[0], data,
                            out_dir)


def test_two_ranks_save_and_resume_an_optimizer_whose_state_is_not_shaped_like_its_parameters(tmp_path):
    from dist_helpers import reports, spawn_cases
    outcomes = spawn_cases(2, tmp_path, {f"stage{s}": (_adafactor_resumed, {"stage": s}) for s in (1, 2, 3)})
    for stage in (1, 2, 3):
        assert reports(outcomes, f"stage{stage}") == [[], []]


class _WithHeadAndTemperature(torch.nn.Module):
    """The test model with a learnable temperature (a 0-dim parameter, as a logit scale) and a one-row head
    (a value head's nn.Linear(d, 1), whose Adafactor column factor has the weight's element count)."""

    def __init__(self):
        super().__init__()
        self.lm = make_model("modulelist")
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))
        self.value = torch.nn.Linear(VOCAB, 1)

    def forward(self, x):
        logits = self.lm(x) * self.temperature
        return logits + self.value(logits).mean()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["torch AdamW", "AdamW8bit", "transformers Adafactor"])
def test_a_scalar_parameter_and_a_one_row_weight_save_and_resume_exactly(tmp_path, stage, optimizer):
    """A 0-dim parameter's 0-dim step was taken for a moment (its element count is the parameter's), and the
    save failed; a one-row weight's Adafactor column factor (its element count too, not its shape) was saved
    as a moment and read back in the weight's shape, and the resumed step failed."""
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "lazytrain": {"hybrid_threshold": 64}}
    if optimizer == "AdamW8bit":
        config["optimizer"] = OPTIMIZERS["AdamW8bit"]

    def engine():
        torch.manual_seed(0)
        model = _WithHeadAndTemperature()
        client = None
        if optimizer == "torch AdamW":
            client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        elif optimizer == "transformers Adafactor":
            from transformers.optimization import Adafactor
            client = Adafactor(model.parameters(), lr=1e-2, relative_step=False, scale_parameter=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lazytrain.initialize(model=model, optimizer=client, config=config)[0]
    assert _resumed_differs(engine, batches(4), tmp_path) == []


def test_a_chained_schedule_resumes_into_its_own_kind(tmp_path):
    """ChainedScheduler keeps its schedules' states and no step counter of its own: not another kind."""
    def chained(optimizer):
        return torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.ConstantLR(optimizer, 0.5, 2),
                                                          torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)])
    saver = _engine("AdamW", steps=3, client_scheduler=chained)
    saver.save_checkpoint(str(tmp_path))
    engine = _engine("AdamW", steps=0, client_scheduler=chained)
    engine.load_checkpoint(str(tmp_path))
    assert engine.get_lr() == saver.get_lr()


class _NewerAdamW(torch.optim.AdamW):
    """An optimizer that gained a setting in a later version and reads it with a default (bitsandbytes'
    optimizers read AdEMAMix's alpha, t_alpha and t_beta3 so): states of its older versions lack it."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, lr=lr)
        self.defaults["new_setting"] = 0.0
        for group in self.param_groups:
            group.setdefault("new_setting", 0.0)


def test_an_older_version_of_the_same_optimizer_lacking_a_setting_added_since_loads(tmp_path):
    model = make_model("modulelist")
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        older = lazytrain.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     config=config)[0]
    _steps(older, batches(2))
    older.save_checkpoint(str(tmp_path))
    model = make_model("modulelist")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newer = lazytrain.initialize(model=model, optimizer=_NewerAdamW(model.parameters()), config=config)[0]
    newer.load_checkpoint(str(tmp_path))
    assert newer.global_steps == 2
    _steps(newer, batches(1))


ADAM_L2 = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.5, "adam_w_mode": False}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.5}}


def _adam_engine(optimizer: dict, overlap: bool):
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "optimizer": optimizer,
              "lazytrain": {"device": "cpu", "overlap_optimizer": overlap}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=make_model("modulelist", n_layers=2), config=config)[0]


@pytest.mark.parametrize("saved,config", [(ADAM_L2, ADAMW), (ADAMW, ADAM_L2)])
def test_a_resume_decays_the_weights_by_the_configs_rule_whatever_the_overlap(tmp_path, saved, config):
    """Adam with L2 decay and AdamW keep the same state; the rule a resumed run decayed by was the checkpoint's or
    the config's depending on overlap_optimizer at the save and at the load (HybridAdamW took the saved
    adamw_mode, torch's Adam the saved decoupled_weight_decay, torch's AdamW its own), without a word. It is the
    config's, as DeepSpeed's Adam keeps adam_w_mode on the optimizer, with a warning: every combination resumes
    alike, and unlike a run that went on by the checkpoint's rule."""
    data = batches(3)
    resumed = []
    for save_overlap in (False, True):
        saver = _adam_engine(saved, save_overlap)
        _steps(saver, data[:2])
        saver.save_checkpoint(str(tmp_path / str(save_overlap)), tag="t")
        _steps(saver, data[2:])
        by_checkpoints_rule = saver.module_state_dict()
        for load_overlap in (False, True):
            engine = _adam_engine(config, load_overlap)
            with pytest.warns(UserWarning, match=re.escape("the checkpoint's optimizer decayed the weights with ")):
                engine.load_checkpoint(str(tmp_path / str(save_overlap)), tag="t")
            rule = config is ADAMW
            assert [g.get("adamw_mode", g.get("decoupled_weight_decay")) for g in engine.optimizer.param_groups] == \
                [rule] * len(engine.optimizer.param_groups)
            _steps(engine, data[2:])
            resumed.append(engine.module_state_dict())
            assert max((resumed[-1][k] - by_checkpoints_rule[k]).abs().max() for k in by_checkpoints_rule) > 1e-3
    for other in resumed[1:]:
        for k, v in resumed[0].items():   # HybridAdamW's arithmetic (overlap) and torch's agree to rounding
            assert (other[k] - v).abs().max() <= 1e-6 * max(v.abs().max(), 1.0), k


@pytest.mark.parametrize("scheduler", [{"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}},
                                       {"type": "ExponentialLR", "params": {"gamma": 0.8}}])
def test_a_torch_schedule_loaded_without_the_optimizer_state_trains_on_at_its_own_rate(tmp_path, scheduler):
    """A torch schedule scales the rate the optimizer holds: after a load without the optimizer's state that was
    the config's, and every later step ran at a rate the schedule never gave (StepLR: the first rate again)."""
    def rates(engine, steps):
        seen = []
        for x, y in batches(steps):
            seen.append(engine.get_lr()[0])
            _steps(engine, [(x, y)])
        return seen
    straight = rates(_engine("SGD", steps=0, scheduler=scheduler), 8)
    saver = _engine("SGD", steps=0, scheduler=scheduler)
    first = rates(saver, 4)
    saver.save_checkpoint(str(tmp_path))
    resumed = _engine("SGD", steps=0, scheduler=scheduler)
    resumed.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    assert first + rates(resumed, 4) == straight and len(set(straight)) > 2
