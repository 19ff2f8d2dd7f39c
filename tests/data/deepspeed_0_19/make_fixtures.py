"""Writes the DeepSpeed 0.19 checkpoints the safe-loading tests read (a tiny two-layer MLP, one step of
AdamW): ZeRO stage 0 in fp32, stage 1 in fp16, stage 2 in bf16, each saved with the ``args`` namespace a
DeepSpeed script passes to ``deepspeed.initialize`` and a plain client state. Run it where DeepSpeed is
installed (it runs on the CPU): ``python tests/data/deepspeed_0_19/make_fixtures.py``."""
import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"stage0_fp32": (0, None), "stage1_fp16": (1, "fp16"), "stage2_bf16": (2, "bf16")}


def one(name: str) -> None:
    import torch
    import deepspeed
    stage, precision = CONFIGS[name]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
           "zero_optimization": {"stage": stage}}
    if precision:
        cfg[precision] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(args=argparse.Namespace(local_rank=0), model=model,
                                           model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, 8, dtype=next(engine.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    engine.save_checkpoint(out, tag="global_step1", client_state={"epoch": 3})
    for helper in ("zero_to_fp32.py", "zero_to_torch.py"):   # DeepSpeed copies its scripts beside them
        if os.path.exists(os.path.join(out, helper)):
            os.remove(os.path.join(out, helper))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
    else:
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
        for name in CONFIGS:
            subprocess.run([sys.executable, __file__, name], env=env, check=True)
