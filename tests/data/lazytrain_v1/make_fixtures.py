"""Writes the checkpoints of LazyTrain's first format (until the DeepSpeed layout replaced it): the model
file holding the fp32 weights by name with LazyTrain's counters, plan and ``client_state``, and the optimizer
file holding ``{"optimizer": optimizer.state_dict()}``. A tiny model trained two steps, once in fp32 (torch's
AdamW) and once in bf16 with 8-bit moments (HybridAdamW's codes). Kept so that such checkpoints stay loadable;
it only reproduces them with a LazyTrain of that format: ``python tests/data/lazytrain_v1/make_fixtures.py``."""
import os
import shutil
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # tests/, for engine_models

CONFIGS = {"fp32": {}, "bf16_8bit": {"bf16": {"enabled": True},
                                     "lazytrain": {"optimizer_states": "8bit", "hybrid_threshold": 16}}}


def config(name: str) -> dict:
    extra = CONFIGS[name]
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
            **{k: v for k, v in extra.items() if k != "lazytrain"},
            "lazytrain": {"device": "cpu", "checkpoint_interval": 1, **extra.get("lazytrain", {})}}


def model():
    from engine_models import ModuleListLM
    torch.manual_seed(0)
    return ModuleListLM(d=8, n_layers=2)


def main() -> None:
    import lazytrain
    from engine_models import batches, lm_loss
    for name in CONFIGS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = lazytrain.initialize(model=model(), config=config(name))
        for x, y in batches(2, seq=6):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        out = os.path.join(HERE, name)
        shutil.rmtree(out, ignore_errors=True)
        engine.save_checkpoint(out, client_state={"epoch": 3, "seen": [1, 2]})


if __name__ == "__main__":
    main()
