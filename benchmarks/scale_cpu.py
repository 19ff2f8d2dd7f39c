"""Data parallel on this CPU: 1, 2 and 4 ranks (gloo) on the same global batch, LazyTrain with its optimizer
state sharded (zero_optimization.stage 2, or 3 with ``--stage 3``: the parameters outside the streamed blocks
partitioned too) beside DeepSpeed ZeRO-2 and ZeRO-3 with CPU offload of the optimizer (when DeepSpeed is
installed and its CPU Adam op is built or can be).

Per rank it reports what the run holds in host memory for training state (fp32 master weights, optimizer
state, gradient buffers, compute-dtype copies: the tensors each system allocates for them, counted by their
sizes), the bytes the ranks send per step (measured: the loopback interface's transmitted bytes over the
timed steps, divided by steps and ranks; every rank talks over loopback here), the median step wall time,
and the process CPU time per step per rank (the ranks share this machine's two cores, so wall time grows
with the number of ranks whatever the system does).

Host bytes are counted between steps (after the last timed step). At stage 3 a rank also holds, during a
step, the parameters of other ranks that the module running needs (the embedding's from its forward to its
backward, the head's likewise): "held MB" is the most it held at once, measured by the engine.

Memory the ranks of a node share (LazyTrain's node-shared weights) is reported apart and counted once in
the total. "layers" is LazyTrain's state for the streamed layers alone: what it keeps in host memory when
it trains on a GPU, where the embeddings and the head (and their optimizer state) live on the device.

    python benchmarks/scale_cpu.py [--ranks 1 2 4] [--steps 4] [--no-deepspeed] [--dtype fp32|bf16]
                                   [--communication-data-type fp32|bf16] [--stage 1|2|3]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

GLOBAL_BATCH, SEQ = 8, 128
SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":", 1)[1].split()[8])
    return 0


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=8, max_position_embeddings=SEQ, tie_word_embeddings=False,
                                        use_cache=False, **SHAPE))


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, SHAPE["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(n)]


def _storage_key(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0:
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _lazytrain(world, rank, dtype, comm, stage):
    import lazytrain
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "lazytrain": {"checkpoint_interval": 4}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if comm:
        cfg["communication_data_type"] = comm
    engine, _, _, _ = lazytrain.initialize(model=_model(), config=cfg)
    w = engine.weights

    def step(ids):
        engine.backward(torch.nn.functional.cross_entropy(engine(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()))
        engine.step()

    def state():
        """{"layers"|"other": (bytes this rank holds alone, bytes of memory its node's ranks share)}: the
        streamed layers' fp32 weights, gradient buffers and Adam moments, and the same for the rest."""
        block = {id(p) for params in w.params for p in params}
        moments = {id(p): list(st.values()) for p, st in engine.optimizer.state.items()}
        copies = [w.stored_copy(i) for i in range(w.num_layers)]   # what the layers are computed from
        layers = [m for m in w.master if m is not None] + [g for g in w.grad if g is not None] + copies
        layers += [t for i, ts in moments.items() if i in block for t in ts]
        other = [p for p in engine.non_block_params] + [p.grad for p in engine.non_block_params]
        if engine.masters is not None:
            other += [m for _, m in engine.masters.pairs] + [m.grad for _, m in engine.masters.pairs]
        other += [t for i, ts in moments.items() if i not in block for t in ts]
        shared = copies if engine.node_shared_weights else []
        shared_keys = {_storage_key(t) for t in shared}
        split = {}
        for name, tensors in (("layers", layers), ("other", other)):
            own = [t for t in tensors if torch.is_tensor(t) and _storage_key(t) not in shared_keys]
            mine = [t for t in tensors if torch.is_tensor(t) and _storage_key(t) in shared_keys]
            split[name] = (_bytes(own), _bytes(mine))
        split["held"] = engine.partitioned.peak_held_bytes if engine.partitioned is not None else 0
        return split
    return step, state


def _deepspeed(world, rank, stage, dtype, comm):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model()
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if comm:
        cfg["communication_data_type"] = comm
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids):
        engine.backward(torch.nn.functional.cross_entropy(engine(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()))
        engine.step()

    def state():
        opt = engine.optimizer
        tensors = [p for p in engine.module.parameters()] + [getattr(p, "ds_tensor", None) for p in engine.module.parameters()]
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "averaged_gradients",
                     "bit16_groups_flat", "fp16_partitioned_groups_flat"):
            group = getattr(opt, name, None)
            if isinstance(group, dict):
                group = [t for v in group.values() for t in (v if isinstance(v, list) else [v])]
            tensors += list(group or [])
        tensors += [getattr(t, "grad", None) for t in list(tensors)]   # fp32 partitions' gradients
        inner = getattr(opt, "optimizer", opt)
        tensors += [t for st in inner.state.values() for t in st.values()]
        return {"layers": None, "other": (_bytes([t for t in tensors if t is not None]), 0), "held": None}
    return step, state


def _worker(rank, world, port, system, steps, out, dtype, comm, stage):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    step, state = _lazytrain(world, rank, dtype, comm, stage) if system == "lazytrain" else \
        _deepspeed(world, rank, int(system[-1]), dtype, comm)
    batches = _batches(steps + 1)
    per = GLOBAL_BATCH // world
    step(batches[0][per * rank:per * rank + per])           # warm-up: states allocated
    if world > 1:
        torch.distributed.barrier()
    tx0, cpu0 = _loopback_tx(), time.process_time()
    walls = []
    for ids in batches[1:]:
        t0 = time.perf_counter()
        step(ids[per * rank:per * rank + per])
        walls.append(time.perf_counter() - t0)
    if world > 1:
        torch.distributed.barrier()
    result = {"state_bytes": state(), "wall_s": statistics.median(walls), "cpu_s": (time.process_time() - cpu0) / steps,
              "tx": _loopback_tx() - tx0}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(system, world, steps, dtype="fp32", comm=None, stage=2):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), system, steps, out, dtype, comm, stage), nprocs=world, join=True)
        rows = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]
    sent = rows[0]["tx"] / steps / world if world > 1 else 0   # loopback counts every rank's traffic once

    def total(parts):   # one machine: the node-shared memory counted once
        return sum(r["state_bytes"][part][0] for r in rows for part in parts) + \
            sum(max(r["state_bytes"][part][1] for r in rows) for part in parts)
    has_layers = rows[0]["state_bytes"]["layers"] is not None
    return {"own": max(sum(r["state_bytes"][p][0] for p in ("layers", "other") if r["state_bytes"][p]) for r in rows),
            "shared": sum(max(r["state_bytes"][p][1] for r in rows) for p in ("layers", "other")
                          if rows[0]["state_bytes"][p]),
            "total": total(("layers", "other") if has_layers else ("other",)),
            "layers": total(("layers",)) if has_layers else None,
            "held": None if rows[0]["state_bytes"]["held"] is None else max(r["state_bytes"]["held"] for r in rows),
            "sent": sent, "wall": statistics.median(r["wall_s"] for r in rows),
            "cpu": statistics.median(r["cpu_s"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--communication-data-type", choices=["fp32", "bf16"], default=None,
                    help="the config key of that name, for every system (unset: each system's default)")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2, help="LazyTrain's zero_optimization.stage")
    args = ap.parse_args(argv)
    systems = ["lazytrain"]
    if not args.no_deepspeed:
        try:
            import deepspeed  # noqa: F401
            systems += ["deepspeed-zero2", "deepspeed-zero3"]
        except ImportError:
            print("DeepSpeed not installed: LazyTrain alone (pip install 'lazytrain[deepspeed]')")
    n = sum(p.numel() for p in _model().parameters())
    print(f"Llama {n / 1e6:.1f}M parameters, global batch {GLOBAL_BATCH} x seq {SEQ}, {args.dtype}, AdamW, communication_data_type "
          f"{args.communication_data_type or 'unset'}; LazyTrain at stage {args.stage}; "
          f"{args.steps} timed steps after one warm-up")
    print(f"{'system':<17} {'ranks':>5} {'own MB/rank':>11} {'node-shared MB':>14} {'total MB':>8} {'x 1 rank':>8} "
          f"{'layers MB':>9} {'x 1 rank':>8} {'held MB':>7} {'sent MB/rank/step':>17} {'wall s/step':>11} "
          f"{'cpu s/step/rank':>15}")
    for system in systems:
        base = base_layers = None
        for world in args.ranks:
            try:
                r = run(system, world, args.steps, args.dtype, args.communication_data_type, args.stage)
            except Exception as e:   # noqa: BLE001 - one system failing must not hide the others
                print(f"{system:<17} {world:>5}  failed: {type(e).__name__}: {str(e).splitlines()[-1][:120]}")
                continue
            if world == 1:
                base, base_layers = r["total"], r["layers"]
            ratio = f"{r['total'] / base:.2f}" if base else "-"
            layers = f"{r['layers'] / 1e6:.1f}" if r["layers"] is not None else "-"
            layers_ratio = f"{r['layers'] / base_layers:.2f}" if base_layers and r["layers"] is not None else "-"
            held = f"{r['held'] / 1e6:.1f}" if r["held"] is not None else "-"
            print(f"{system:<17} {world:>5} {r['own'] / 1e6:>11.1f} {r['shared'] / 1e6:>14.1f} {r['total'] / 1e6:>8.1f} "
                  f"{ratio:>8} {layers:>9} {layers_ratio:>8} {held:>7} {r['sent'] / 1e6:>17.1f} {r['wall']:>11.3f} "
                  f"{r['cpu']:>15.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
