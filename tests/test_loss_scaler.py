"""fp16 dynamic loss scaling as DeepSpeed 0.19 does it: window, hysteresis, the stop at the minimum scale under
ZeRO; without ZeRO (stage 0) its FP16_Optimizer's rule."""
import random
import types

import pytest
import torch

from lazytrain.engine.precision import LossScaleAtMinimumError, LossScaler


def _scales(scaler, overflows):
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_the_scale_doubles_after_a_window_of_overflow_free_steps_not_one_step_earlier():
    # DeepSpeed 0.19: the step that completes the window does not double yet; the next one does
    assert _scales(LossScaler(0.0, 4, scale_window=4), [False] * 10) == [16] * 4 + [32] * 4 + [64] * 2
    assert _scales(LossScaler(0.0, 4, scale_window=1, hysteresis=1), [False] * 3) == [16, 32, 64]
    assert _scales(LossScaler(0.0, 4, scale_window=3, hysteresis=1), [True] + [False] * 5) == [8] * 4 + [16] * 2


def test_an_overflow_at_the_minimum_scale_stops_the_run_as_deepspeed_does():
    scaler = LossScaler(0.0, 1, hysteresis=1, min_scale=1.0)
    assert _scales(scaler, [True]) == [1.0]
    with pytest.raises(LossScaleAtMinimumError, match=r"^Current loss scale already at minimum - cannot decrease "
                                                      r"scale anymore\. Exiting run\. \(fp16: the gradients overflow "
                                                      r"even at fp16\.min_loss_scale = 1;"):
        scaler.update(True)


def test_a_static_scale_never_moves():
    assert _scales(LossScaler(128.0), [True, False, True]) == [128.0] * 3


@pytest.mark.parametrize("seed", range(40))
def test_every_overflow_sequence_gives_deepspeeds_scales(seed, monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)   # its log line asks for the rank
    rng = random.Random(seed)
    window, hysteresis, consecutive = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3]), rng.random() < 0.5
    power, minimum = rng.choice([2, 4, 6]), rng.choice([1.0, 2.0, 4.0])
    ours = LossScaler(0.0, power, window, hysteresis, consecutive, minimum)
    theirs = loss_scaler.DynamicLossScaler(init_scale=2.0 ** power, scale_window=window, min_scale=minimum,
                                           delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    p = rng.choice([0.1, 0.3, 0.6])
    for step in range(60):
        overflow = rng.random() < p
        try:
            theirs.update_scale(overflow)
        except Exception as e:   # noqa: BLE001 - DeepSpeed raises a bare Exception at the minimum
            with pytest.raises(LossScaleAtMinimumError) as stopped:
                ours.update(overflow)
            assert str(stopped.value).startswith(str(e))
            return
        ours.update(overflow)
        assert (ours.scale, ours.cur_hysteresis) == (theirs.cur_scale, theirs.cur_hysteresis), f"step {step}"


def test_without_zero_every_overflow_halves_the_scale_and_the_minimum_only_stops_it_falling():
    # DeepSpeed 0.19's FP16_Optimizer (ZeRO stage 0): no hysteresis, no stop at the minimum
    scaler = LossScaler(0.0, 3, scale_window=2, hysteresis=2, min_scale=2.0, zero=False)
    assert _scales(scaler, [True, True, True, True, False, False, False]) == [4, 2, 2, 2, 2, 2, 4]


@pytest.mark.parametrize("seed", range(40))
def test_every_overflow_sequence_gives_deepspeeds_stage_0_scales(seed):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    unfused = pytest.importorskip("deepspeed.runtime.fp16.unfused_optimizer")
    rng = random.Random(seed)
    window, hysteresis, power, minimum = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3]), rng.choice([2, 4, 6]), \
        rng.choice([1.0, 2.0, 4.0])
    ours = LossScaler(0.0, power, window, hysteresis, rng.random() < 0.5, minimum, zero=False)
    config = loss_scaler.LossScaleConfig(
        torch.float16, True, 0.0, {loss_scaler.INITIAL_LOSS_SCALE: 2.0 ** power, loss_scaler.SCALE_WINDOW: window,
                                   loss_scaler.MIN_LOSS_SCALE: minimum}, profile=loss_scaler.LossScaleProfile.UNFUSED)
    theirs = types.SimpleNamespace(loss_scale_config=config, verbose=False)   # what its _update_scale reads
    p = rng.choice([0.1, 0.3, 0.6])
    for step in range(60):
        overflow = rng.random() < p
        unfused.FP16_UnfusedOptimizer._update_scale(theirs, overflow)
        ours.update(overflow)
        assert ours.scale == config.cur_scale, f"step {step}"


def test_a_scaler_saved_with_another_hysteresis_starts_this_ones_afresh():
    """A stage-0 scaler (no hysteresis) resumed under ZeRO: the overflows it absorbs are not used up."""
    stage0 = LossScaler(0.0, 4, hysteresis=2, zero=False)
    _scales(stage0, [True, False])
    zero = LossScaler(0.0, 4, hysteresis=2)
    zero.load_state_dict(stage0.state_dict())
    assert (zero.scale, zero.cur_hysteresis, zero.cur_iter) == (8.0, 2, 2)
    assert _scales(zero, [True]) == [8.0]   # absorbed, as a fresh ZeRO scaler absorbs it
    resumed = LossScaler(0.0, 4, hysteresis=2)
    resumed.load_state_dict(zero.state_dict())
    assert resumed.cur_hysteresis == 1      # the same hysteresis: its count goes on


def test_a_saved_scale_of_the_other_mode_is_not_taken_and_the_reason_is_returned():
    """The config's mode decides: a static scaler keeps its value, a dynamic one does not take a static
    scaler's (a bf16 DeepSpeed checkpoint's 1.0); a state saved before ``dynamic`` was kept is this mode's."""
    dynamic, static = LossScaler(0.0, 11), LossScaler(512.0)
    _scales(dynamic, [False, True])
    assert dynamic.state_dict()["dynamic"] and not static.state_dict()["dynamic"]
    assert static.load_state_dict(dynamic.state_dict()) == (
        "the configured static fp16.loss_scale 512 is kept; the checkpoint's dynamic loss scale 2048 is not restored")
    assert static.load_state_dict(LossScaler(512.0).state_dict()) is None and static.scale == 512.0
    fresh = LossScaler(0.0, 16)
    assert fresh.load_state_dict({"scale": 1.0, "cur_iter": 7, "dynamic": False}) == (
        "the checkpoint's static loss scale 1 is not restored: this run's fp16 scale is dynamic (fp16.loss_scale 0) "
        "and starts at 65536")
    assert (fresh.scale, fresh.cur_iter) == (65536.0, 0)
    old = {k: v for k, v in dynamic.state_dict().items() if k != "dynamic"}
    assert fresh.load_state_dict(old) is None and (fresh.scale, fresh.cur_iter) == (2048.0, 2)
