"""Writes the DeepSpeed 0.19 checkpoints the safe-loading tests read (a tiny two-layer MLP, one step of
AdamW): ZeRO stage 0 in fp32, stage 1 in fp16, stage 2 in bf16, stage 3 in fp32, and stages 2 and 3 over two
ranks (each rank on the same input, so every fp32 run ends with the same weights and moments), and stage 2 in
bf16 and stage 0 in bf16 with the two layers sharing their weight, and stage 0 in fp16 (its FP16_Optimizer state in the model
file, by position), each saved
with the ``args`` namespace a DeepSpeed script passes to ``deepspeed.initialize`` and a plain client state. The
``_frozen`` ones (stage 0 in fp32 and bf16, stage 2 in bf16) leave ``0.bias`` frozen and change the group's
settings before the save, as a script that sets its own learning rate does; ``stage2_fp32_step0`` is saved before
any step (no moments at all); ``stage0_fp16_scaled`` starts from another loss scale and saves after three steps;
``stage3_fp32_subgroups_frozen`` splits its one group into sub-groups of at most 40 elements (ZeRO-3's
``sub_group_size``: its files keep one flat partition per sub-group, the settings once per group);
``stage3_bf16_tied_excluded`` ties the two weights, freezes them and saves with ``exclude_frozen_parameters``
(as HF Trainer saves a PEFT run of a tied-embedding model). ``stage2_fp32_sgd``, ``stage3_fp32_rmsprop`` and
``stage1_fp32_adagrad`` train with those optimizers (``OTHER_OPTIMIZERS``): states other than Adam's moments, and
``stage1_fp32_nadam`` and ``stage2_fp32_asgd`` with scalars among them; ``stage0_fp32_adafactor`` keeps torch's
Adafactor state (a matrix's row and column variances), ``stage2_fp32_adafactor`` the state of an Adafactor run over
DeepSpeed's flat partitions (one variance per element: not torch's Adafactor of the parameters).
Run it where DeepSpeed is installed (it runs on the CPU): ``python tests/data/deepspeed_0_19/make_fixtures.py``
(all of them) or ``... make_fixtures.py NAME...`` (those alone)."""
import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (ZeRO stage, precision, ranks); "tied": the two linear layers share their weight; "frozen": 0.bias is
# frozen and the group's settings are SETTINGS at the save; "step0": saved before any step
CONFIGS = {"stage0_fp32": (0, None, 1), "stage0_fp16": (0, "fp16", 1), "stage1_fp16": (1, "fp16", 1),
           "stage2_bf16": (2, "bf16", 1),
           "stage3_fp32": (3, None, 1), "stage2_fp32_2ranks": (2, None, 2), "stage3_fp32_2ranks": (3, None, 2),
           "stage2_bf16_tied": (2, "bf16", 1), "stage0_bf16_tied": (0, "bf16", 1),
           "stage0_fp32_frozen": (0, None, 1), "stage0_bf16_frozen": (0, "bf16", 1),
           "stage2_bf16_frozen": (2, "bf16", 1),
           "stage2_fp32_step0": (2, None, 1), "stage0_fp16_scaled": (0, "fp16", 1),
           "stage3_fp32_subgroups_frozen": (3, None, 1), "stage3_bf16_tied_excluded": (3, "bf16", 1),
           "stage2_fp32_sgd": (2, None, 1), "stage3_fp32_rmsprop": (3, None, 1), "stage1_fp32_adagrad": (1, None, 1),
           "stage1_fp32_nadam": (1, None, 1), "stage2_fp32_asgd": (2, None, 1), "stage0_fp32_adafactor": (0, None, 1),
           "stage2_fp32_adafactor": (2, None, 1)}
# the optimizers other than AdamW, named by the checkpoint's last part: their state holds other keys than Adam's
OTHER_OPTIMIZERS = {"sgd": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
                    "rmsprop": {"type": "RMSprop", "params": {"lr": 1e-2, "momentum": 0.5, "centered": True}},
                    "adagrad": {"type": "Adagrad", "params": {"lr": 1e-2}},
                    "nadam": {"type": "NAdam", "params": {"lr": 1e-2}}, "asgd": {"type": "ASGD", "params": {"lr": 1e-2}},
                    "adafactor": {"type": "Adafactor", "params": {"lr": 1e-2}}}
SETTINGS = {"lr": 1e-4, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}
SCALED_POWER, SCALED_STEPS = 12, 3   # stage0_fp16_scaled: its initial loss scale 2**12, its steps


def one(name: str) -> None:
    import torch
    import deepspeed
    stage, precision, _ = CONFIGS[name]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    if "_tied" in name:
        model[2].weight = model[0].weight
    if name.endswith("_excluded"):   # the tied weight frozen, and left out of the save
        model[0].weight.requires_grad_(False)
    if name.endswith("_frozen"):
        model[0].bias.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
           "zero_optimization": {"stage": stage}}
    if name.rsplit("_", 1)[-1] in OTHER_OPTIMIZERS:
        cfg["optimizer"] = OTHER_OPTIMIZERS[name.rsplit("_", 1)[-1]]
        cfg["zero_allow_untested_optimizer"] = True
    if precision:
        cfg[precision] = {"enabled": True}
    if "_subgroups" in name:
        cfg["zero_optimization"]["sub_group_size"] = 40
    steps = 0 if name.endswith("_step0") else SCALED_STEPS if name.endswith("_scaled") else 1
    if name.endswith("_scaled"):
        cfg[precision]["initial_scale_power"] = SCALED_POWER
    if precision == "fp16":   # the CPU accelerator refuses fp16 where oneDNN has no fp16 kernels; torch runs it
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    args = argparse.Namespace(local_rank=int(os.environ["LOCAL_RANK"]))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters() if not name.endswith("_excluded")
                                           else [p for p in model.parameters() if p.requires_grad], config=cfg)
    for _ in range(steps):
        x = torch.randn(2, 8, dtype=next(engine.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    if name.endswith("_frozen"):
        for group in engine.optimizer.param_groups:   # DeepSpeed's wrappers share the inner optimizer's groups
            group.update(SETTINGS)
    out = os.path.join(HERE, name)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()
    engine.save_checkpoint(out, tag="global_step1", client_state={"epoch": 3},
                           exclude_frozen_parameters=name.endswith("_excluded"))
    torch.distributed.barrier()
    for helper in ("zero_to_fp32.py", "zero_to_torch.py"):   # DeepSpeed copies its scripts beside them
        if torch.distributed.get_rank() == 0 and os.path.exists(os.path.join(out, helper)):
            os.remove(os.path.join(out, helper))


if __name__ == "__main__":
    if "RANK" in os.environ:   # one rank of one checkpoint, started below
        one(sys.argv[1])
    else:
        for port, (name, (_, _, ranks)) in enumerate(CONFIGS.items(), start=29541):
            if sys.argv[1:] and name not in sys.argv[1:]:
                continue
            procs = [subprocess.Popen([sys.executable, __file__, name],
                                      env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                     for r in range(ranks)]
            if any(p.wait() for p in procs):
                raise SystemExit(f"{name} failed")
