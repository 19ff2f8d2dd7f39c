"""DeepSpeed's checkpoints resume in LazyTrain: every ZeRO stage, one rank or several, fp32 and 16-bit.

The checkpoints are DeepSpeed 0.19.8's own (tests/data/deepspeed_0_19/make_fixtures.py): a two-layer MLP
after one AdamW step. Every fp32 one holds the same weights and moments (the ranks saw the same input). The
``_frozen`` ones leave ``0.bias`` frozen and hold the group settings ``make_fixtures.SETTINGS``;
``stage2_fp32_step0`` was saved before any step, ``stage0_fp16_scaled`` after three from a loss scale of 2**12."""
import copy
import importlib.util
import os
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine import deepspeed_checkpoint as ds_ckpt
from lazytrain.engine.checkpoint import CheckpointMismatchError

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")
HERE = os.path.join(os.path.dirname(__file__), "data", "deepspeed_0_19")


def _fixture_optimizers() -> dict:
    """make_fixtures' OTHER_OPTIMIZERS: the optimizers the other-optimizer checkpoints were trained with (the
    script read under a name of its own: another fixtures directory has a make_fixtures too)."""
    spec = importlib.util.spec_from_file_location("deepspeed_0_19_make_fixtures", os.path.join(HERE, "make_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OTHER_OPTIMIZERS


OTHER_OPTIMIZERS = _fixture_optimizers()
FP32 = ["stage0_fp32", "stage3_fp32", "stage2_fp32_2ranks", "stage3_fp32_2ranks"]


def mlp():
    torch.manual_seed(1)                         # other weights than the checkpoint's: the load must replace them
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))


def engine_for(precision=None, frozen=False, scheduler=True, weight_decay=0.01, optimizer=None, **lazy):
    """``frozen``: 0.bias frozen (as in the ``_frozen`` checkpoints); ``optimizer``: the config's, other than
    AdamW; ``lazy``: LazyTrain's own settings."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": weight_decay}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, "lazytrain": {"device": "cpu", **lazy}}
    if not scheduler:
        del cfg["scheduler"]
    if precision:
        cfg[precision] = {"enabled": True}
    model = mlp()
    if frozen:
        model[0].bias.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def moments_of(engine):
    names = [n for n, _ in engine.module.named_parameters()]
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    return {n: engine.optimizer.state[p] for n, p in zip(names, params)}


@pytest.mark.parametrize("name", FP32)
def test_an_fp32_deepspeed_checkpoint_resumes_with_its_weights_moments_schedule_and_client_state(name):
    engine = engine_for()
    path, client = engine.load_checkpoint(os.path.join(HERE, name))
    assert client == {"epoch": 3}
    assert path.startswith(os.path.join(HERE, name, "global_step1"))
    assert (engine.global_steps, engine.global_samples) == (1, 2 if "2ranks" not in name else 4)
    expected = ds_ckpt.read(os.path.join(HERE, "stage3_fp32", "global_step1"), True)   # by name
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, expected.module[n]), n
    for n, st in moments_of(engine).items():
        assert torch.equal(st["exp_avg"], expected.moments[n]["exp_avg"]), n
        assert torch.equal(st["exp_avg_sq"], expected.moments[n]["exp_avg_sq"]), n
    assert engine.lr_scheduler.last_batch_iteration == 0


def _continue_side_by_side(engine, ref, opt, **settings):
    """Two more steps of the engine and of plain PyTorch (``ref`` and its optimizer ``opt``, given the engine's
    learning rate and ``settings``): the weights then agree to 1e-6 of each tensor's largest."""
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(2, 8, generator=g)
        lr = engine.get_lr()[0]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        for group in opt.param_groups:
            group.update(lr=lr, **settings)
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for (n, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        assert (p - q).abs().max() <= 1e-6 * q.abs().max(), n


def test_resuming_a_deepspeed_checkpoint_continues_as_plain_pytorch_would():
    """Stage 0 holds torch's own AdamW state: plain PyTorch resumes from it directly."""
    engine = engine_for()
    engine.load_checkpoint(os.path.join(HERE, "stage0_fp32"))
    from lazytrain.engine import safe_load
    saved = safe_load.load(os.path.join(HERE, "stage0_fp32", "global_step1", "mp_rank_00_model_states.pt"))
    ref = mlp()
    ref.load_state_dict(saved["module"])
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(saved["optimizer"])
    _continue_side_by_side(engine, ref, opt, weight_decay=0.01)


@pytest.mark.parametrize("name", ["stage2_fp32_sgd", "stage3_fp32_rmsprop", "stage1_fp32_adagrad", "stage1_fp32_nadam",
                                  "stage2_fp32_asgd", "stage0_fp32_adafactor"])
def test_a_checkpoint_of_another_optimizer_resumes_with_its_state_and_continues_as_plain_pytorch_would(name):
    """DeepSpeed's files hold whatever its optimizer keeps (an SGD's momentum buffers, a centered RMSprop's three
    averages, an Adagrad's sums, NAdam's and ASGD's scalars, Adafactor's row and column variances), not only an
    Adam's moments: the load raised KeyError 'exp_avg' (or, of a scalar, 'mu_product'). Each state loads by
    name, and two more steps equal torch's optimizer stepping from the same state."""
    config = OTHER_OPTIMIZERS[name.rsplit("_", 1)[-1]]
    engine = engine_for(optimizer=config)
    path = os.path.join(HERE, name)
    engine.load_checkpoint(path)
    # (stage 0 keeps the optimizer's state by position: named here as the engine names it, by its one group)
    saved = ds_ckpt.read(os.path.join(path, "global_step1"), True,
                         stage0_names=[[n for n, _ in mlp().named_parameters()]])
    ref = mlp()
    ref.load_state_dict(saved.module)
    opt = getattr(torch.optim, config["type"])(ref.parameters(), **config["params"])
    for (n, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
        assert moments_of(engine)[n].keys() == saved.moments[n].keys(), n
        for key, value in saved.moments[n].items():
            assert torch.equal(moments_of(engine)[n][key], value.float() if value.dim() else value), (n, key)
        opt.state[q] = {k: v.clone() for k, v in saved.moments[n].items()}
    _continue_side_by_side(engine, ref, opt)


def test_an_adafactor_state_kept_over_deepspeeds_flat_partitions_is_refused_naming_what_it_lacks():
    """DeepSpeed's ZeRO-2 runs Adafactor over its flat partitions (one variance per element); torch's Adafactor of
    a matrix keeps its row and column variances. The state is refused by name before anything loads (it loaded,
    and the first step failed half-way through the update)."""
    engine = engine_for(optimizer=OTHER_OPTIMIZERS["adafactor"])
    path = os.path.join(HERE, "stage2_fp32_adafactor")
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError, match=re.escape(
            "holds ['step', 'variance'] as '0.weight''s optimizer state, without ['col_var', 'row_var'], which this "
            "optimizer steps with")):
        engine.load_checkpoint(path)
    assert engine.global_steps == 0


def test_an_adam_engine_refuses_a_state_without_its_moments_naming_what_it_holds(tmp_path):
    """The settings of an SGD's groups written as an Adam's (a hand-edited config): the kind check passes, and
    the state, a momentum buffer, is refused by name rather than with a bare KeyError."""
    engine = engine_for()
    path = os.path.join(HERE, "stage2_fp32_sgd", "global_step1")
    saved = ds_ckpt.read(path, True)
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError, match=re.escape(
            f"the DeepSpeed checkpoint {path} holds ['momentum_buffer'] as '0.weight''s optimizer state, without "
            f"['exp_avg', 'exp_avg_sq', 'step'], which this optimizer steps with (another optimizer's state?); load it with "
            f"load_optimizer_states=False to take the weights alone")):
        engine._optimizer_state_from(saved.moments, path)


@pytest.mark.parametrize("name,precision,scale", [("stage1_fp16", "fp16", 65536.0), ("stage2_bf16", "bf16", None)])
def test_a_16bit_deepspeed_checkpoint_resumes_from_its_fp32_masters(name, precision, scale):
    engine = engine_for(precision)
    _, client = engine.load_checkpoint(os.path.join(HERE, name))
    assert client == {"epoch": 3}
    expected = ds_ckpt.read(os.path.join(HERE, name, "global_step1"), True)
    masters = engine.module_state_dict()                  # the fp32 masters, not the 16-bit module copy
    for n, t in masters.items():
        assert torch.equal(t, expected.module[n]), n
    if scale is not None:
        assert engine.loss_scaler.scale == scale
    x = torch.randn(2, 8)
    engine.backward(engine(x.to(engine.compute_dtype)).float().pow(2).mean())
    engine.step()
    assert engine.global_steps == 2


def test_a_deepspeed_checkpoint_for_another_model_is_refused_by_name():
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"device": "cpu"}}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    with pytest.raises(CheckpointMismatchError, match=r"is of another model: tensors 2 of another shape \(2.weight "
                                                      r"\(8, 8\) there, \(4, 8\) here, 2.bias \(8,\) there, \(4,\) "
                                                      r"here\); nothing was loaded"):
        engine.load_checkpoint(os.path.join(HERE, "stage2_fp32_2ranks"))
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError, match=r"holds 'exp_avg' of shape \(8, 8\) for '2.weight', "
                                                               r"whose shape here is \(4, 8\)"):
        engine._optimizer_state_from(ds_ckpt.read(os.path.join(HERE, "stage3_fp32", "global_step1"), True).moments,
                                     "stage3_fp32")


@pytest.mark.parametrize("name", ["stage2_bf16_tied", "stage0_bf16_tied"])
def test_a_tied_weight_loads_its_fp32_master_under_both_names(name):
    """DeepSpeed lists a tied weight once in its partitions and names the alias in shared_params (stage 0:
    its master once in the optimizer's fp32 groups, and no shared_params): both names get the fp32 master,
    not the alias's 16-bit module copy (which, loaded last, replaced the shared weight at stage 0)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    model = mlp()
    model[2].weight = model[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.load_checkpoint(os.path.join(HERE, name))
    state = ds_ckpt.read(os.path.join(HERE, name, "global_step1"), True,   # stage 0's masters go by position
                         stage0_names=[["0.weight", "0.bias", "2.bias"]] if name.startswith("stage0") else None)
    master = state.module["0.weight"]
    assert master.dtype == torch.float32
    masters = engine.module_state_dict()
    assert torch.equal(masters["0.weight"], master) and torch.equal(masters["2.weight"], master)


def test_a_stage3_checkpoint_leaving_out_a_frozen_tied_weight_loads_it_as_missing():
    """ZeRO-3 with ``exclude_frozen_parameters`` (HF Trainer's save of a PEFT run of a tied-embedding model):
    the frozen weight's tied name keeps only ZeRO-3's empty placeholder, which was refused as "of another
    shape". It now counts as missing, as DeepSpeed's own load takes it: the model keeps its value, and the
    rest is the file's."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    model = mlp()
    model[2].weight = model[0].weight
    model[0].weight.requires_grad_(False)
    kept = model[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                              if p.requires_grad], config=cfg)
    with pytest.raises(CheckpointMismatchError, match=r"tensors 2 missing \(0.weight, 2.weight\) \(saved with "
                                                      r"exclude_frozen_parameters=True: load with "
                                                      r"load_module_strict=False\); nothing was loaded$"):
        engine.load_checkpoint(os.path.join(HERE, "stage3_bf16_tied_excluded"))
    engine.load_checkpoint(os.path.join(HERE, "stage3_bf16_tied_excluded"), load_module_strict=False)
    state = ds_ckpt.read(os.path.join(HERE, "stage3_bf16_tied_excluded", "global_step1"), True)
    assert sorted(state.module) == ["0.bias", "2.bias"]
    loaded = engine.module_state_dict()
    kept = kept.to(torch.bfloat16)   # frozen in bf16: no fp32 master
    assert torch.equal(loaded["0.weight"], kept) and torch.equal(loaded["2.weight"], kept)
    for name in ("0.bias", "2.bias"):
        assert torch.equal(loaded[name], state.module[name])
    assert engine.global_steps == 1
    engine.destroy()


def test_a_deepspeed_stage0_fp16_checkpoint_resumes_with_its_fp32_masters_and_moments():
    """Stage 0 in fp16 keeps FP16_Optimizer's state in the model file, by position: the fp32 masters in
    fp32_groups and the moments in the inner optimizer's state. They load by the names those positions have
    in the script's parameter order (the module entry holds only the fp16 rounding of each weight)."""
    engine = engine_for("fp16")
    _, client = engine.load_checkpoint(os.path.join(HERE, "stage0_fp16"))
    assert client == {"epoch": 3}
    raw = torch.load(os.path.join(HERE, "stage0_fp16", "global_step1", "mp_rank_00_model_states.pt"),
                     weights_only=False)   # DeepSpeed's own file, read here to state the expectation
    names = [n for n, _ in mlp().named_parameters()]
    fp32 = raw["optimizer"]["fp32_groups"][0]
    inner = raw["optimizer"]["optimizer_state_dict"]["state"]
    masters, moments = engine.module_state_dict(), moments_of(engine)
    for i, name in enumerate(names):
        assert torch.equal(masters[name], fp32[i]), name
        assert torch.equal(moments[name]["exp_avg"], inner[i]["exp_avg"]), name
        assert torch.equal(moments[name]["exp_avg_sq"], inner[i]["exp_avg_sq"]), name
    assert engine.loss_scaler.scale == raw["optimizer"]["cur_scale"]
    assert engine.global_steps == 1


def raw_model_file(name):
    """DeepSpeed's own model file, read here to state the expectations."""
    return torch.load(os.path.join(HERE, name, "global_step1", "mp_rank_00_model_states.pt"), weights_only=False)


def layout(state):
    """A state's keys with their tensors' dtypes and shapes (other values' types)."""
    return {k: (v.dtype, tuple(v.shape)) if torch.is_tensor(v) else type(v) for k, v in state.items()}


def state_of(engine):
    """Each parameter's optimizer state by name ({} where it has none)."""
    return {engine._param_names[id(p)]: engine.optimizer.state.get(p, {})
            for g in engine.optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("name,precision", [("stage0_fp32_frozen", None), ("stage0_bf16_frozen", "bf16"),
                                            ("stage2_bf16_frozen", "bf16")])
def test_a_frozen_parameter_loads_with_no_optimizer_state_and_the_others_with_theirs(name, precision):
    """DeepSpeed keeps no moments for a frozen parameter (and its 16-bit stage-0 wrappers leave it out of
    their groups, so the others' positions skip it): it starts fresh, the others resume."""
    engine = engine_for(precision, frozen=True)
    engine.load_checkpoint(os.path.join(HERE, name))
    trained = ["0.weight", "2.weight", "2.bias"]
    opt = raw_model_file(name)["optimizer"]
    if name == "stage0_fp32_frozen":      # torch's own state dict: every parameter's position, 0.bias's empty
        assert sorted(opt["state"]) == [0, 2, 3]
        expected = {n: opt["state"][i] for n, i in zip(trained, [0, 2, 3])}
    elif name == "stage0_bf16_frozen":    # FP16_UnfusedOptimizer: the three trainable ones alone
        assert [t.shape for t in opt["fp32_groups"][0]] == [(8, 8), (8, 8), (8,)]
        expected = {n: opt["optimizer_state_dict"]["state"][i] for i, n in enumerate(trained)}
        masters = engine.module_state_dict()
        for i, n in enumerate(trained):
            assert torch.equal(masters[n], opt["fp32_groups"][0][i]), n
    else:
        expected = ds_ckpt.read(os.path.join(HERE, name, "global_step1"), True).moments
        assert sorted(expected) == sorted(trained)
    state = state_of(engine)
    assert state["0.bias"] == {}
    for n in trained:
        assert float(state[n]["step"]) == float(expected[n]["step"]), n   # FP16_UnfusedOptimizer's set-up adds one
        assert torch.equal(state[n]["exp_avg"], expected[n]["exp_avg"]), n
        assert torch.equal(state[n]["exp_avg_sq"], expected[n]["exp_avg_sq"]), n
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))
    engine.backward(engine(x.to(engine.compute_dtype)).float().pow(2).mean())
    engine.step()
    assert engine.global_steps == 2 and state_of(engine)["0.bias"] == {}


def test_a_trainable_parameter_without_moments_beside_others_with_them_is_refused():
    """0.bias is trainable here, frozen in the checkpoint's run: its moments are missing, not fresh."""
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError,
                       match=r"has no optimizer state for parameter '0.bias' \(it has 3 parameters\); load it with "
                             r"load_optimizer_states=False"):
        engine_for("bf16").load_checkpoint(os.path.join(HERE, "stage2_bf16_frozen"))
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError,
                       match=r"the stage-0 fp32 masters hold \[3\] parameters per group, this model's optimizer "
                             r"\[4\] trainable ones"):
        engine_for("bf16").load_checkpoint(os.path.join(HERE, "stage0_bf16_frozen"))


def test_a_checkpoint_saved_before_the_first_step_loads_with_no_optimizer_state():
    engine = engine_for()
    engine.load_checkpoint(os.path.join(HERE, "stage2_fp32_step0"))
    assert engine.global_steps == 0 and not engine.optimizer.state
    expected = ds_ckpt.read(os.path.join(HERE, "stage2_fp32_step0", "global_step1"), False).module
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, expected[n]), n
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    assert sorted(float(st["step"]) for st in state_of(engine).values()) == [1.0] * 4


@pytest.mark.parametrize("name,precision,settings", [
    ("stage0_fp32_frozen", None, {"lr": 1e-4, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("stage0_bf16_frozen", "bf16", {"lr": 1e-4, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("stage2_bf16_frozen", "bf16", {"lr": 1e-4, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    # one group over three ZeRO-3 sub-groups: its settings once, its partitions three times
    ("stage3_fp32_subgroups_frozen", None, {"lr": 1e-4, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("stage3_fp32", None, {"lr": 0.0, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}),
    ("stage2_fp32_2ranks", None, {"lr": 0.0, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8})])
def test_the_optimizer_groups_settings_are_restored_as_deepspeed_restores_them(name, precision, settings):
    """DeepSpeed loads its optimizer's groups with its state: a script's own lr (no scheduler), its
    weight decay, betas and eps resume as saved, not as the config starts them."""
    engine = engine_for(precision, frozen="frozen" in name, scheduler=False, weight_decay=0.1)
    before = {k: engine.optimizer.param_groups[0][k] for k in settings}
    assert before == {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}
    engine.load_checkpoint(os.path.join(HERE, name))
    assert [{k: g[k] for k in settings} for g in engine.optimizer.param_groups] == [settings]
    assert engine.get_lr() == [settings["lr"]]


@pytest.mark.parametrize("name", ["stage0_fp32", "stage1_fp16", "stage2_fp32_2ranks", "stage3_fp32_2ranks"])
@pytest.mark.parametrize("config", ["ds_config.json", {"zero_optimization": True}], ids=["path", "bool"])
def test_a_checkpoint_whose_config_deepspeed_saved_as_a_path_reads_as_the_one_saved_with_it(tmp_path, name, config):
    """DeepSpeed saves ``ds_config`` as given: the path of the JSON file where the run was configured by one
    (``--deepspeed_config``). The stage then comes from the optimizer files' own record."""
    import shutil
    tag = tmp_path / "global_step1"
    shutil.copytree(os.path.join(HERE, name, "global_step1"), tag)
    for model_file in tag.glob("*model_states.pt"):   # every rank's (stage 3 saves one a rank)
        raw = torch.load(model_file, weights_only=False)
        raw["ds_config"] = config
        torch.save(raw, model_file)
    got = ds_ckpt.read(str(tag), want_optimizer=True)
    want = ds_ckpt.read(os.path.join(HERE, name, "global_step1"), want_optimizer=True)
    assert got.stage == want.stage
    assert sorted(got.module) == sorted(want.module) and sorted(got.moments or {}) == sorted(want.moments or {})
    for n, t in want.module.items():
        assert torch.equal(got.module[n], t), n
    for n, m in (want.moments or {}).items():
        assert all(torch.equal(got.moments[n][k], v) for k, v in m.items()), n


@pytest.mark.parametrize("name,gone", [("stage2_fp32_2ranks", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                       ("stage3_fp32_2ranks", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_a_checkpoint_missing_a_ranks_file_is_refused_naming_it(tmp_path, name, gone):
    import shutil
    tag = tmp_path / "global_step1"
    shutil.copytree(os.path.join(HERE, name, "global_step1"), tag)
    os.remove(tag / gone)
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError, match=f"^{tag} was saved by 2 ranks but holds 1 "
                                                              f"(optim|model) state file\\(s\\): {gone} missing$"):
        ds_ckpt.read(str(tag), want_optimizer=True)


def test_a_stage0_fp16_checkpoint_resumes_with_its_loss_scale():
    """Stage 0 keeps the loss scale in FP16_Optimizer's state in the model file (ZeRO in its optim
    files): saved after three steps from 2**12, it is not the config's initial 2**16."""
    engine = engine_for("fp16")
    assert engine.loss_scaler.scale == 2.0 ** 16
    engine.load_checkpoint(os.path.join(HERE, "stage0_fp16_scaled"))
    # no hysteresis at stage 0, as in FP16_Optimizer
    assert engine.loss_scaler.state_dict() == {"scale": 4096.0, "cur_hysteresis": 1, "cur_iter": 3,
                                               "last_overflow_iter": -1, "hysteresis": 1, "dynamic": True}
    assert engine.global_steps == 3
    assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == 4096.0   # as DeepSpeed's optimizer says


def test_an_8bit_moment_engine_quantizes_the_fp32_moments_it_loads():
    """fp32 moments loaded into an engine configured for 8-bit ones take the layout a fresh one has
    (uint8 codes and per-block absmax, each block scaled to both ends of the map), not fp32 for good."""
    from lazytrain.optim import hybrid_adamw as H
    from lazytrain.optim.quantization import get_qmap
    engine = engine_for(optimizer_states="8bit", hybrid_threshold=16)
    engine.load_checkpoint(os.path.join(HERE, "stage3_fp32"))
    fresh = engine_for(optimizer_states="8bit", hybrid_threshold=16)
    fresh.backward(fresh(torch.randn(2, 8)).pow(2).mean())
    fresh.step()
    loaded, made = state_of(engine), state_of(fresh)
    assert {n: layout(st) for n, st in loaded.items()} == {n: layout(st) for n, st in made.items()}
    assert sorted(loaded["0.weight"]) == ["absmax1", "absmax2", "block_size", "state1", "state2", "step"]
    assert sorted(loaded["0.bias"]) == ["exp_avg", "exp_avg_sq", "step"]   # biases keep fp32 moments
    expected = ds_ckpt.read(os.path.join(HERE, "stage3_fp32", "global_step1"), True).moments
    for n in ("0.weight", "2.weight"):
        for key, which, qmap in (("exp_avg", "1", "dynamic"), ("exp_avg_sq", "2", "udynamic")):
            codes, absmax = H._fitted(expected[n][key].reshape(-1), get_qmap(qmap, torch.device("cpu")), 256)
            assert torch.equal(loaded[n]["state" + which].reshape(-1), codes), (n, key)
            assert torch.equal(loaded[n]["absmax" + which], absmax), (n, key)
    for n in ("0.bias", "2.bias"):
        assert torch.equal(loaded[n]["exp_avg"], expected[n]["exp_avg"]), n


def test_group_settings_that_do_not_map_onto_the_partitions_warn_and_are_not_guessed():
    groups = [{"lr": 1.0, "params": [0]}, {"lr": 2.0, "params": [2]}]   # index 1 is nobody's
    with pytest.warns(UserWarning, match=r"the optimizer groups of f.pt \(2\) do not map onto its 3 flat partitions; "
                                         r"their settings \(lr, betas, eps, weight_decay\) are not restored"):
        assert ds_ckpt._zero_group_settings(groups, [["a"], ["b"], ["c"]], "f.pt") is None
    groups[1]["params"] = [1, 2]
    assert ds_ckpt._zero_group_settings(groups, [["a"], ["b"], ["c"]], "f.pt") == {"a": {"lr": 1.0}, "b": {"lr": 2.0},
                                                                                 "c": {"lr": 2.0}}


def _lazytrain_save_at_stage_3(save_dir):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, "lazytrain": {"device": "cpu"}}
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(str(save_dir), tag="global_step1", client_state={"epoch": 9})
    return cfg


def test_a_deepspeed_save_over_a_lazytrain_tag_of_the_same_name_loads_as_deepspeeds(tmp_path):
    """A script that moved to DeepSpeed and saved the tag again: DeepSpeed rewrote its state files and left
    LazyTrain's manifest and lazytrain_state.pt, which are stale. The tag loads as DeepSpeed's checkpoint;
    a tag holding files of both saves is refused; a copy of a LazyTrain tag (new file times) is still
    LazyTrain's."""
    import shutil
    _lazytrain_save_at_stage_3(tmp_path / "lt")
    copied = tmp_path / "copied" / "global_step1"
    os.makedirs(copied)
    for name in sorted(os.listdir(tmp_path / "lt" / "global_step1"), reverse=True):   # state files last
        shutil.copy(tmp_path / "lt" / "global_step1" / name, copied / name)
    engine = engine_for()
    assert engine.load_checkpoint(str(tmp_path / "copied"), tag="global_step1")[1] == {"epoch": 9}
    tag = tmp_path / "lt" / "global_step1"
    source = os.path.join(HERE, "stage3_fp32", "global_step1")
    shutil.copy(os.path.join(source, "zero_pp_rank_0_mp_rank_00_model_states.pt"), tag)   # half of a save
    with pytest.raises(lazytrain.engine.checkpoint.CheckpointError,
                       match=r"holds state files written after LazyTrain saved it \(zero_pp_rank_0_mp_rank_00_model_"
                             r"states.pt: a DeepSpeed save of the same tag\?\) beside files of that save "
                             r"\(zero_pp_rank_0_mp_rank_00_optim_states.pt\): they are not one checkpoint"):
        engine_for().load_checkpoint(str(tmp_path / "lt"))
    shutil.copy(os.path.join(source, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), tag)   # the whole save
    engine = engine_for()
    with pytest.warns(UserWarning, match="its DeepSpeed files were written after LazyTrain saved it"):
        path, client = engine.load_checkpoint(str(tmp_path / "lt"))
    assert client == {"epoch": 3}   # DeepSpeed's, not LazyTrain's 9
    expected = ds_ckpt.read(source, True)
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, expected.module[n]), n


@pytest.mark.parametrize("damaged", ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_lazytrain_tag_with_a_file_cut_short_is_incomplete_not_a_deepspeed_save(tmp_path, damaged):
    """A state file cut short (a copy that stopped, a full disk) changed size as a DeepSpeed save over the
    tag would: it is no whole file, so the tag is refused as incomplete, naming it."""
    _lazytrain_save_at_stage_3(tmp_path)
    path = tmp_path / "global_step1" / damaged
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(lazytrain.engine.checkpoint.IncompleteCheckpointError,
                       match=f"{damaged} has {size // 2} bytes, the manifest says {size}"):
        engine_for().load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("name", ["stage2_fp32_2ranks", "stage3_fp32_2ranks"])
def test_a_model_file_whose_param_shapes_its_partitions_cannot_hold_is_refused_naming_the_files(tmp_path, name):
    """A model file beside optimizer files of another save (here: its param_shapes edited to a wider first
    layer): read on, a parameter would take another's values or fail in a bare reshape."""
    import shutil
    from collections import OrderedDict
    from lazytrain.engine import safe_load
    tag = tmp_path / "global_step1"
    shutil.copytree(os.path.join(HERE, name, "global_step1"), tag)
    model_file = str(tag / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if name.startswith("stage3") else
                            "mp_rank_00_model_states.pt"))
    model = safe_load.load(model_file, trust=True)
    model["param_shapes"] = [OrderedDict((n, torch.Size((64, 8)) if n == "0.weight" else s) for n, s in g.items())
                             for g in model["param_shapes"]]
    torch.save(model, model_file)   # DeepSpeed's records saved as LazyTrain's: read back trusted
    if name.startswith("stage3"):
        held = "72 elements in the smallest rank's partition, 296 needed there"   # ceil(n / 2) of each
    else:
        held = "144 elements over 2 rank\\(s\\), 592 needed"   # 64 + 8 + 64 + 8 saved
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError,
                       match=f"^{model_file} and its 2 optimizer state file\\(s\\) do not match: group 0's param_shapes "
                             f"\\(4 parameters, 592 elements\\) does not fit its fp32 partitions \\({held}; files of "
                             f"different saves\\?\\); nothing was loaded$"):
        ds_ckpt.read(str(tag), want_optimizer=True, trust=True)


def test_a_ranks_count_a_file_makes_up_costs_nothing_to_check():
    """dp_world_size is a number in the file: the check listed every rank it names (10**7 took 781 MiB, a
    value of 2**31 would take some 170 GB). It names the first few ranks missing, whatever the count."""
    files = [f"/t/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 2)]
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError) as e:
        ds_ckpt._check_every_rank("/t", {"dp_world_size": 10**12}, [], files, 2)
    assert str(e.value) == ("/t was saved by 1000000000000 ranks but holds 2 optim state file(s): "
                            "zero_pp_rank_1_mp_rank_00_optim_states.pt, zero_pp_rank_3_mp_rank_00_optim_states.pt, "
                            "zero_pp_rank_4_mp_rank_00_optim_states.pt, zero_pp_rank_5_mp_rank_00_optim_states.pt ... "
                            "missing")
    ds_ckpt._check_every_rank("/t", {"dp_world_size": 10**12}, files, [], 2)   # no optim files: nothing to count


def test_a_flat_partition_whose_strides_repeat_elements_is_refused_before_it_is_copied():
    """One value expanded to 2**27 elements passed the element counts, and the moments' copy took the 512 MiB
    it claims (from a 4 KB file) before the checkpoint was refused for another reason."""
    fine = {"single_partition_of_fp32_groups": [torch.zeros(8)],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8)}}}}
    ds_ckpt._refuse_sparse_partitions(fine, "single_partition_of_fp32_groups", "f.pt")
    for where in ("master", "moment"):
        state = copy.deepcopy(fine)
        expanded = torch.zeros(1).expand(1 << 27)
        if where == "master":
            state["single_partition_of_fp32_groups"][0] = expanded
        else:
            state["base_optimizer_state"]["state"][0]["exp_avg"] = expanded
        with pytest.raises(ds_ckpt.DeepSpeedCheckpointError) as e:
            ds_ckpt._refuse_sparse_partitions(state, "single_partition_of_fp32_groups", "f.pt")
        assert str(e.value) == ("f.pt holds a flat partition that is not a 1-D tensor over its own bytes (shape "
                                "(134217728,), strides (0,)): not what DeepSpeed writes (damaged or crafted); "
                                "nothing was loaded")


def test_the_probe_of_what_an_optimizer_steps_with_is_no_step_of_the_run():
    """To see the state an optimizer steps with, the load steps a fresh one of its kind on a tiny tensor: torch's
    global step hooks (a logger's) saw those steps, and an optimizer drawing random numbers moved the global
    generator, so a run seeded before its load did not replay."""
    engine = engine_for(optimizer=OTHER_OPTIMIZERS["sgd"])
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(opt))
    real_step = torch.optim.SGD.step

    def drawing_step(self, *args, **kwargs):   # an optimizer that draws random numbers (noise, dropout of updates)
        torch.rand(1)
        return real_step(self, *args, **kwargs)
    try:
        torch.optim.SGD.step = drawing_step
        before = torch.get_rng_state()
        engine.load_checkpoint(os.path.join(HERE, "stage2_fp32_sgd"))
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        torch.optim.SGD.step = real_step
        handle.remove()
    assert seen == [] and engine.global_steps == 1
