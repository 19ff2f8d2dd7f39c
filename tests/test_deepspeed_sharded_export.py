"""A sharded LazyTrain run's checkpoint is DeepSpeed 0.19's of as many ranks: each rank writes its own part.

Two LazyTrain ranks (zero_optimization.stage >= 1, so each keeps the optimizer state of the layers it owns)
train the model of tests/deepspeed_runs.py two steps and save. Every rank writes the files DeepSpeed's rank
of the same number writes: its equal share of each flat group (stages 1, 2) or of every parameter (stage 3),
gathered from the owners. Then DeepSpeed itself, two ranks on the CPU (the same two processes, once
LazyTrain's runs are done), loads the directory: it must hold
exactly LazyTrain's fp32 weights, Adam moments and step counts; its next step must match LazyTrain's next
step; ``zero_to_fp32`` must give LazyTrain's weights; and the files must be laid out as those DeepSpeed's
own two-rank run writes."""
import json
import os
import sys

import pytest
import torch

from lazytrain.engine import checkpoint as ckpt
from lazytrain.engine import deepspeed_layout as ds_layout
from lazytrain.engine import safe_load

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_runs as runs  # noqa: E402
from dist_helpers import free_port, join_as, leave_group, spawn  # noqa: E402
import test_deepspeed_export as single  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:lazytrain"),
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]
RANKS = 2
# each group ends padded (runs.Net.gain); in bf16/fp16 at stages 1-2 the fp32 masters of the parameters outside
# the streamed blocks live on their owners alone, so each rank's part of them comes from its owner
# "_client": the script's own optimizer passed to initialize, which LazyTrain does not shard (every rank holds
# its state whole): rank 0 cuts each rank's partition of DeepSpeed's layout from it
NAMES = ["stage1_fp32", "stage1_fp16", "stage2_bf16", "stage2_bf16_8bit_moments", "stage3_bf16",
         "stage2_bf16_client", "stage3_bf16_client"]


def base(name: str) -> str:
    """The case of tests/test_deepspeed_export.py whose config ``name`` trains with."""
    return name.removesuffix("_client")


def shard_files(name: str) -> set:
    """LazyTrain's files of each rank's own optimizer state (a sharded save's)."""
    return set() if name.endswith("_client") else {ds_layout.optimizer_shard_file(r) for r in range(RANKS)}


def _rank(rank, port, root, job_file):
    """One rank: LazyTrain's side of every case (trained, saved, recorded), then, once every rank's part
    is saved, DeepSpeed's side in this same process (tests/deepspeed_runs.py, on this process group)."""
    join_as(rank, RANKS, port)
    torch.set_num_threads(1)
    data = runs.batches()
    for name in NAMES:
        client = name.endswith("_client")
        engine = single.lazytrain_engine(single.config_of(base(name)), client=client)
        assert (engine.shards is None) == client   # every rank the same batch: the mean gradient is one process's
        record = single.trained_and_saved(engine, os.path.join(root, name, "lazytrain"), data)
        torch.save(record, os.path.join(root, f"{name}.rank{rank}.pt"))
    torch.distributed.barrier()
    runs.main(job_file)
    leave_group()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """LazyTrain's side of every case on two spawned ranks, then DeepSpeed's on the same two processes
    (they start, import torch and join a process group once; DeepSpeed is imported after LazyTrain's runs,
    and only there)."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("sharded_export")
    job = {"cases": {name: {"config": single.config_of(base(name)), "dir": str(root / name / "lazytrain"),
                            "own_dir": str(root / name / "deepspeed")} for name in NAMES},
           "out": str(root / "results.pt")}
    with open(root / "job.json", "w") as f:
        json.dump(job, f)
    spawn(_rank, args=(free_port(), str(root), str(root / "job.json")), nprocs=RANKS)
    lazy = {}
    for name in NAMES:
        parts = [torch.load(root / f"{name}.rank{r}.pt") for r in range(RANKS)]
        for a, b in zip(parts, parts[1:]):
            assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        moments = {}
        for part in parts:   # each rank's own tensors' moments (with the script's optimizer: every rank's all)
            if name.endswith("_client"):
                assert part["moments"].keys() == parts[0]["moments"].keys()
                moments = part["moments"]
                continue
            assert not moments.keys() & part["moments"].keys()
            moments.update(part["moments"])
        lazy[name] = {**parts[0], "moments": moments}
    results = [torch.load(job["out"] + (f".rank{r}" if r else ""), weights_only=False) for r in range(RANKS)]
    return {name: (lazy[name], [r[name] for r in results], job["cases"][name]) for name in NAMES}


def case(exported, name, deepspeeds_side: bool = True):
    """LazyTrain's side, DeepSpeed's ranks' results and the paths; skipped where DeepSpeed could not run the
    case here and the test reads its side."""
    lt, ds, paths = exported[name]
    for r in ds:
        assert "error" not in r, r.get("error")
        if "unsupported" in r and deepspeeds_side:   # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels
            pytest.skip(r["unsupported"])
    return lt, ds, paths


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_writes_its_share_in_deepspeeds_layout(exported, name):
    _, _, paths = case(exported, name, deepspeeds_side=False)
    stage = single.CASES[base(name)][0]["stage"]
    tag = os.path.join(paths["dir"], "global_step2")
    bf16 = "bf16" in name
    expected = {ds_layout.optim_file(bf16, r) for r in range(RANKS)} | \
        shard_files(name) | {ds_layout.LAZYTRAIN_FILE, ckpt.MANIFEST}
    expected |= {ds_layout.model_file(3, r) for r in range(RANKS)} if stage == 3 else {ds_layout.model_file(stage)}
    assert set(os.listdir(tag)) == expected
    model = safe_load.load(os.path.join(tag, ds_layout.model_file(stage)))
    assert model["dp_world_size"] == RANKS
    shares = [safe_load.load(os.path.join(tag, ds_layout.optim_file(bf16, r)))["optimizer_state_dict"]
              for r in range(RANKS)]
    if stage < 3:
        assert all(s["partition_count"] == [RANKS] * len(s["single_partition_of_fp32_groups"]) for s in shares)
        # an equal share of every group, each rank's fp32 partition saved without the padding at its end
        shares_padded = [[t.numel() + pad for t, pad in zip(s["single_partition_of_fp32_groups"], s["group_paddings"])]
                         for s in shares]
        assert shares_padded[0] == shares_padded[1]
        for g, shapes in enumerate(model["param_shapes"]):
            numel = sum(torch.Size(v).numel() for v in shapes.values()) + sum(shares[0]["param_alignment_paddings"][g])
            assert sum(s["single_partition_of_fp32_groups"][g].numel() for s in shares) == numel
            assert sum(s["group_paddings"][g] for s in shares) == shares_padded[0][g] * RANKS - numel


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_on_as_many_ranks_loads_exactly_what_lazytrain_saved(exported, name):
    lt, ds, paths = case(exported, name)
    for r in ds:   # each of DeepSpeed's ranks
        assert r["client"]["epoch"] == 3 and r["client"]["seen"] == [1, 2]
        assert (r["global_steps"], r["global_samples"]) == (lt["global_steps"], lt["global_samples"])
        single.assert_deepspeed_holds_lazytrains_state(r, lt)


@pytest.mark.parametrize("name", NAMES)
def test_one_more_step_on_deepspeeds_ranks_matches_lazytrains(exported, name):
    lt, ds, _ = case(exported, name)
    frozen = {n for n, p in runs.Net().named_parameters() if not p.requires_grad}
    worst = 0.0
    for n, w in ds[0]["after_step"].items():
        ref = lt["after_step"][n]
        assert torch.equal(w, lt["weights"][n]) == (n in frozen), n
        worst = max(worst, ((w - ref).abs().max() / ref.abs().max()).item())
    assert worst < single.tolerance_of(base(name)), worst


@pytest.mark.parametrize("name", NAMES)
def test_zero_to_fp32_joins_the_ranks_files_into_lazytrains_weights(exported, name):
    lt, ds, _ = case(exported, name)
    expected = dict(lt["weights"])
    if single.CASES[base(name)][0]["stage"] == 1:
        del expected["norm.bias"]     # DeepSpeed keeps frozen parameters for zero_to_fp32 from stage 2 on
    converted = ds[0]["zero_to_fp32"]
    assert converted.keys() == expected.keys()
    frozen = {n for n, p in runs.Net().named_parameters() if not p.requires_grad}   # in the training precision
    for n, w in expected.items():
        assert converted[n].dtype == (w.dtype if n in frozen else torch.float32) and torch.equal(converted[n], w), n


@pytest.mark.parametrize("name", NAMES)
def test_the_files_are_those_deepspeeds_ranks_write(exported, name):
    _, _, paths = case(exported, name)
    ours, theirs = os.path.join(paths["dir"], "global_step2"), os.path.join(paths["own_dir"], "global_step2")
    ds_files = sorted(os.listdir(theirs))
    own = {ds_layout.LAZYTRAIN_FILE, ckpt.MANIFEST} | shard_files(name)
    assert sorted(set(os.listdir(ours)) - own) == ds_files
    differences = []
    for f in ds_files:
        differences += single.layout_differences(base(name), safe_load.load(os.path.join(ours, f)),
                                                 safe_load.load(os.path.join(theirs, f)), (f,))
    assert differences == []
