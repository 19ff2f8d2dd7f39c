"""DeepSpeed's checkpoints resume in LazyTrain: every ZeRO stage, one rank or several, fp32 and 16-bit.

The checkpoints are DeepSpeed 0.19.8's own (tests/data/deepspeed_0_19/make_fixtures.py): a two-layer MLP
after one AdamW step. Every fp32 one holds the same weights and moments (the ranks saw the same input)."""
import copy
import os
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine import deepspeed_checkpoint as ds_ckpt

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")
HERE = os.path.join(os.path.dirname(__file__), "data", "deepspeed_0_19")
FP32 = ["stage0_fp32", "stage3_fp32", "stage2_fp32_2ranks", "stage3_fp32_2ranks"]


def mlp():
    torch.manual_seed(1)                         # other weights than the checkpoint's: the load must replace them
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))


def engine_for(precision=None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, "lazytrain": {"device": "cpu"}}
    if precision:
        cfg[precision] = {"enabled": True}
    model = mlp()
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
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(2, 8, generator=g)
        lr = engine.get_lr()[0]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        for group in opt.param_groups:
            group["lr"] = lr
            group["weight_decay"] = 0.01
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for (n, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        assert (p - q).abs().max() <= 1e-6 * q.abs().max(), n


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
    with pytest.raises(RuntimeError, match=r"size mismatch for 2.weight"):
        engine.load_checkpoint(os.path.join(HERE, "stage2_fp32_2ranks"))
    with pytest.raises(ds_ckpt.DeepSpeedCheckpointError, match=r"holds moments of shape \(8, 8\) for '2.weight', "
                                                               r"whose shape here is \(4, 8\)"):
        engine._optimizer_state_from(ds_ckpt.read(os.path.join(HERE, "stage3_fp32", "global_step1"), True).moments,
                                     "stage3_fp32")


def test_a_tied_weight_loads_its_fp32_master_under_both_names():
    """DeepSpeed lists a tied weight once in its partitions and names the alias in shared_params: both
    names get the fp32 master, not the alias's 16-bit module copy."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    model = mlp()
    model[2].weight = model[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.load_checkpoint(os.path.join(HERE, "stage2_bf16_tied"))
    state = ds_ckpt.read(os.path.join(HERE, "stage2_bf16_tied", "global_step1"), True)
    master = state.module["0.weight"]
    assert master.dtype == torch.float32 and torch.equal(state.module["2.weight"], master)
    masters = engine.module_state_dict()
    assert torch.equal(masters["0.weight"], master) and torch.equal(masters["2.weight"], master)


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
