"""A data-parallel LazyTrain script as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* from the
launcher), with the optimizer state sharded (ZeRO stage 2, or the STAGE given). Writes OUT/rank<N>.pt: the
trained weights, whether the rank shared its node's copy of the streamed weights, and which parameters it
does not hold between steps (stage 3 partitions the non-block ones).

    torchrun --nnodes 2 --nproc_per_node N --node_rank K --master_addr 127.0.0.1 --master_port P \\
        train_sharded.py OUT [STAGE]"""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dist_helpers import leave_group  # noqa: E402
from engine_models import batches, lm_loss, make_model  # noqa: E402

import lazytrain  # noqa: E402

warnings.simplefilter("ignore")
torch.set_num_threads(1)
lazytrain.init_distributed()
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "gradient_clipping": 1.0,
       "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
       "zero_optimization": {"stage": int(sys.argv[2]) if len(sys.argv) > 2 else 2}, "lazytrain": {"checkpoint_interval": 2, "device": "cpu"}}
engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
assert engine.shards is not None and engine.world_size == world
per = 4 // world
for x, y in batches(3, batch=4):
    part = slice(per * rank, per * rank + per)
    engine.backward(lm_loss(engine(x[part]), y[part]))
    engine.step()
torch.save({"weights": engine.module_state_dict(), "node_shared": engine.node_shared_weights,
            "signals_only": engine._one_shared_node,
            "empty_here": [n for n, p in engine.module.named_parameters() if p.numel() == 0]},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
leave_group()
