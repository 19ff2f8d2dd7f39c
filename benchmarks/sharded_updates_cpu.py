"""Overlapped layer updates with the optimizer state sharded: the update thread's busy time per step on
1, 2 and 4 ranks (gloo, this CPU), each layer's host update made 50 ms longer (as a large layer's is), on the
six-layer test model. Each rank updates only the layers it owns, running ahead of the broadcasts it waits
for, so the ranks' updates run side by side.

    python benchmarks/sharded_updates_cpu.py
"""
import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import warnings

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

def worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    import lazytrain
    from engine_models import batches, lm_loss, make_model   # the tests' six-layer model
    torch.set_num_threads(1)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
           "lazytrain": {"checkpoint_interval": 2, "overlap_optimizer": True}}
    engine, *_ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    import time
    real = engine.optimizer.update
    def slow(*a, **k):   # a layer's host update taking 50 ms, as a large layer's does
        time.sleep(0.05)
        return real(*a, **k)
    engine.optimizer.update = slow
    per = 4 // world; busy = []
    for x, y in batches(4, batch=4):
        engine.backward(lm_loss(engine(x[per*rank:per*rank+per]), y[per*rank:per*rank+per])); engine.step(); engine.wait_for_update()
        busy.append(engine.layer_updates.busy_seconds)
    if rank == 0:
        json.dump({"busy": statistics.median(busy[1:]), "layers": engine.weights.num_layers}, open(out, "w"))
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for world in (1, 2, 4):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        out = tempfile.mktemp()
        mp.spawn(worker, args=(world, port, out), nprocs=world, join=True)
        r = json.load(open(out)); print(f"ranks {world}: update thread busy {r['busy']:.3f} s per step ({r['layers']} layers)", flush=True)
