"""LazyTrain's checkpoints are DeepSpeed 0.19's: DeepSpeed loads them and zero_to_fp32 converts them.

A small model (streamed blocks, an embedding tied to the head, a frozen parameter, buffers, two parameter
groups) trains two steps in LazyTrain and is saved, for ZeRO stages 0-3 in fp32, bf16 and fp16 (and with
LazyTrain's 8-bit moments). DeepSpeed itself, in a process of its own (tests/deepspeed_runs.py), loads
each checkpoint into the same model and config: it must hold exactly LazyTrain's fp32 weights, Adam
moments, step counts, schedule and client state; one more step there must match LazyTrain's next step;
``zero_to_fp32`` must give exactly LazyTrain's fp32 weights; and the files must be laid out as those
DeepSpeed writes itself for the same training. DeepSpeed runs on the CPU: with torch's AdamW
("torch_adam"), with a CPU stand-in for its CUDA-only FusedAdam, and with DeepSpeedCPUAdam (ZeRO offload)
where its op is built already. Then LazyTrain's own side: it resumes from these checkpoints bit for bit."""
import copy
import glob
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine import checkpoint as ckpt
from lazytrain.engine import deepspeed_layout as ds_layout
from lazytrain.engine import safe_load

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_runs as runs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "lazytrain": {"device": "cpu"}}
# name: (ZeRO section, precision section, LazyTrain section, the Adam DeepSpeed builds: torch's ("torch_adam"),
# FusedAdam (run on the CPU by a stand-in, deepspeed_runs.CPUFusedAdam), DeepSpeedCPUAdam (ZeRO offload))
CASES = {
    "stage0_fp32": ({"stage": 0}, {}, {}, "torch"),
    "stage1_fp32": ({"stage": 1}, {}, {}, "torch"),
    "stage2_fp32_aligned": ({"stage": 2, "parameter_alignment": True}, {}, {}, "torch"),
    "stage3_fp32_subgroups": ({"stage": 3, "sub_group_size": 700}, {}, {}, "torch"),
    "stage0_bf16": ({"stage": 0}, {"bf16": {"enabled": True}}, {}, "torch"),
    "stage2_bf16": ({"stage": 2}, {"bf16": {"enabled": True}}, {}, "torch"),
    "stage3_bf16": ({"stage": 3}, {"bf16": {"enabled": True}}, {}, "torch"),
    "stage0_fp16": ({"stage": 0}, {"fp16": {"enabled": True, "initial_scale_power": 8}}, {}, "torch"),
    "stage1_fp16": ({"stage": 1}, {"fp16": {"enabled": True, "initial_scale_power": 8}}, {}, "torch"),
    "stage2_bf16_8bit_moments": ({"stage": 2}, {"bf16": {"enabled": True}},
                                 {"optimizer_states": "8bit", "hybrid_threshold": 64}, "torch"),
    "stage0_fp32_fusedadam": ({"stage": 0}, {}, {}, "fused"),
    "stage0_bf16_fusedadam": ({"stage": 0}, {"bf16": {"enabled": True}}, {}, "fused"),
    "stage2_fp32_fusedadam": ({"stage": 2}, {}, {}, "fused"),
    "stage2_fp32_cpuadam": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}, {}, "cpu"),
    "stage3_bf16_cpuadam": ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {"bf16": {"enabled": True}}, {},
                            "cpu"),
}


def cpu_adam_built() -> bool:
    """DeepSpeed's cpu_adam op is compiled already (in torch's extension directory): the DeepSpeedCPUAdam
    cases need no build (which takes a minute and a compiler); LAZYTRAIN_TEST_BUILD_CPU_ADAM=1 builds it."""
    if os.environ.get("LAZYTRAIN_TEST_BUILD_CPU_ADAM") == "1":
        return True
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    version = f"py{sys.version_info.major}{sys.version_info.minor}*"
    where = os.path.join(root, "cpu_adam") if root else os.path.join(get_default_build_root(), version, "cpu_adam")
    return bool(glob.glob(os.path.join(where, "cpu_adam*.so")))


# one more step in DeepSpeed against LazyTrain's, relative to each weight's largest value: the same
# arithmetic up to summation order in fp32 (measured 1e-7); forward and backward in 16 bits differ more
# (bf16 6e-3, fp16 1e-3 measured)
STEP_TOLERANCE = {"fp32": 1e-6, "bf16": 2e-2, "fp16": 5e-3}


def config_of(name: str) -> dict:
    zero, precision, lazy, adam = CASES[name]
    cfg = copy.deepcopy(BASE)
    if adam != "torch":
        del cfg["optimizer"]["params"]["torch_adam"]
    cfg["zero_optimization"] = dict(zero)
    cfg.update(copy.deepcopy(precision))
    cfg["lazytrain"].update(lazy)
    return cfg


def precision_of(name: str) -> str:
    return "bf16" if "bf16" in name else "fp16" if "fp16" in name else "fp32"


def tolerance_of(name: str) -> float:
    if CASES[name][3] == "cpu" and precision_of(name) == "fp32":
        return 1e-5   # DeepSpeedCPUAdam's own vectorized arithmetic (measured 3e-6)
    return STEP_TOLERANCE[precision_of(name)]


def lazytrain_engine(cfg: dict, client: bool = False):
    """``client``: the script's own optimizer (torch's AdamW, as the config's "torch_adam" builds it), passed to
    initialize beside the config (whose optimizer section is then ignored, as in DeepSpeed)."""
    model = runs.Net(seed=0)
    params = cfg["optimizer"]["params"]
    optimizer = torch.optim.AdamW(runs.groups(model), lr=params["lr"], weight_decay=params["weight_decay"]) \
        if client else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=runs.groups(model), config=cfg,
                                               optimizer=optimizer)
    return engine


def fp32_moments(engine) -> dict:
    """Each parameter's Adam moments in fp32 by name (HybridAdamW's 8-bit ones dequantized)."""
    opt, out = engine.optimizer, {}
    for g in opt.param_groups:
        for p in g["params"]:
            if p in opt.state:
                name = engine._param_names[id(p)]
                if type(opt).__name__ == "HybridAdamW":
                    out[name] = {k: torch.cat(list(opt.fp32_moment_chunks(p, k))).view(p.shape)
                                 for k in ("exp_avg", "exp_avg_sq")}
                else:
                    out[name] = {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """LazyTrain's side of every case, and DeepSpeed's (one process for all). DeepSpeed's process starts
    first and takes each case once LazyTrain has saved it: its start, its imports and its cases run while
    LazyTrain trains the next ones."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("export")
    data = runs.batches()
    names = [name for name in CASES if CASES[name][3] != "cpu" or cpu_adam_built()]
    job = {"cases": {name: {"config": config_of(name), "dir": str(root / name / "lazytrain"),
                            "own_dir": str(root / name / "deepspeed"), "ready": str(root / f"{name}.saved")}
                     for name in names}, "out": str(root / "results.pt")}
    with open(root / "job.json", "w") as f:
        json.dump(job, f)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000), PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(os.path.dirname(lazytrain.__file__)), os.environ.get("PYTHONPATH", "")]))
    lazy = {}
    with open(root / "deepspeed.log", "w") as log:
        deepspeed = subprocess.Popen([sys.executable, runs.__file__, str(root / "job.json")], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        try:
            for name in names:
                lazy[name] = trained_and_saved(lazytrain_engine(config_of(name)), job["cases"][name]["dir"], data)
                open(job["cases"][name]["ready"], "w").close()
            deepspeed.wait(timeout=600)
        finally:
            if deepspeed.poll() is None:   # LazyTrain's side failed, or DeepSpeed's ran out of time
                deepspeed.kill()
                deepspeed.wait()
    assert deepspeed.returncode == 0, (root / "deepspeed.log").read_text()[-4000:]
    results = torch.load(job["out"], weights_only=False)
    return {name: (lazy[name], results[name], job["cases"][name]) for name in lazy}


def trained_and_saved(engine, save_dir: str, data) -> dict:
    """Two steps, a save (with client state), one more step: what LazyTrain held at the save and after."""
    for x, y in data[:2]:
        engine.backward(runs.loss_of(engine(x), y))
        engine.step()
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "seen": [1, 2]})
    record = {"weights": engine.module_state_dict(), "moments": fp32_moments(engine),
              "lr_scheduler": engine.lr_scheduler.state_dict(), "lr": engine.get_lr(),
              "global_steps": engine.global_steps, "global_samples": engine.global_samples}
    x, y = data[2]
    engine.backward(runs.loss_of(engine(x), y))
    engine.step()
    record["after_step"] = engine.module_state_dict()
    engine.destroy()
    return record


def case(exported, name):
    if name not in exported:
        pytest.skip("DeepSpeed's cpu_adam op is not built here (LAZYTRAIN_TEST_BUILD_CPU_ADAM=1 builds it)")
    lt, ds, paths = exported[name]
    if "unsupported" in ds:
        pytest.skip(ds["unsupported"])
    assert "error" not in ds, ds.get("error")
    return lt, ds, paths


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_loads_exactly_what_lazytrain_saved(exported, name):
    lt, ds, paths = case(exported, name)
    stage = CASES[name][0]["stage"]
    tag_dir = os.path.join(paths["dir"], "global_step2")
    assert ds["path"] == os.path.join(tag_dir, ds_layout.model_file(stage))
    assert ds["client"]["epoch"] == 3 and ds["client"]["seen"] == [1, 2]
    assert (ds["global_steps"], ds["global_samples"]) == (lt["global_steps"], lt["global_samples"]) == (2, 4)
    assert ds["lr_scheduler"] == lt["lr_scheduler"] and ds["lr"] == lt["lr"]
    assert_deepspeed_holds_lazytrains_state(ds, lt)


def assert_deepspeed_holds_lazytrains_state(ds: dict, lt: dict) -> None:
    """DeepSpeed's loaded engine holds exactly LazyTrain's fp32 weights, Adam moments and step count."""
    assert ds["steps"] == [2.0]                       # the optimizer's step count, every group
    trainable = {n for n, p in runs.Net().named_parameters() if p.requires_grad}
    assert trainable <= ds["masters"].keys()
    for n in ds["masters"]:
        assert torch.equal(ds["masters"][n], lt["weights"][n]), n
    assert ds["moments"].keys() == lt["moments"].keys() == trainable
    for n, m in ds["moments"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(m[k], lt["moments"][n][k]), (n, k)


# DeepSpeed 0.19's FP16_UnfusedOptimizer (stage 0 in fp16 around torch's Adam) steps with gradients the
# loss scale over the gradient norm smaller than its ZeRO path and LazyTrain (its Adam moments here come out
# 25x smaller; Adam's scale invariance hides it in the weights of its own run): from LazyTrain's moments its
# next step differs by a few percent. The files load exactly (the tests above and below).
STEPS_ITS_OWN_WAY = {"stage0_fp16"}


@pytest.mark.parametrize("name", [n if n not in STEPS_ITS_OWN_WAY else pytest.param(
    n, marks=pytest.mark.skip(reason="DeepSpeed's stage-0 fp16 step scales gradients its own way")) for n in CASES])
def test_one_more_step_in_deepspeed_matches_lazytrains(exported, name):
    lt, ds, _ = case(exported, name)
    tolerance = tolerance_of(name)
    worst = 0.0
    frozen = {n for n, p in runs.Net().named_parameters() if not p.requires_grad}
    for n, w in ds["after_step"].items():
        ref = lt["after_step"][n]
        assert torch.equal(w, lt["weights"][n]) == (n in frozen), n   # it trained on
        worst = max(worst, ((w - ref).abs().max() / ref.abs().max()).item())
    assert worst < tolerance, worst


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0]["stage"] > 0])
def test_zero_to_fp32_gives_lazytrains_fp32_weights(exported, name):
    lt, ds, _ = case(exported, name)
    converted = ds["zero_to_fp32"]
    expected = dict(lt["weights"])   # parameters (the tied one under both names), buffers
    if CASES[name][0]["stage"] == 1:
        del expected["norm.bias"]     # DeepSpeed keeps frozen parameters for zero_to_fp32 from stage 2 on
    assert converted.keys() == expected.keys()
    frozen = {n for n, p in runs.Net().named_parameters() if not p.requires_grad}
    for n, w in expected.items():   # a frozen parameter as both keep it: in the training precision
        assert converted[n].dtype == (w.dtype if n in frozen else torch.float32) and torch.equal(converted[n], w), n


# the few places where LazyTrain's files differ from DeepSpeed's own, on purpose
def allowed(name: str, path: tuple, ours, theirs) -> bool:
    """The configs differ by LazyTrain's section; whether the last step overflowed is
    each run's own. At stage 0 DeepSpeed's FusedAdam counts steps its own way (only a group's last
    parameter's step advances, and FP16_Optimizer counts its set-up step); LazyTrain writes the updates
    applied, with which DeepSpeed continues LazyTrain's run."""
    if CASES[name][3] == "fused" and CASES[name][0]["stage"] == 0 and path[-1] == "step" and "state" in path:
        return type(ours) is type(theirs) is int
    return "ds_config" in path or "overflow" in path


def layout_differences(name: str, ours, theirs, path=()) -> list[str]:
    """Where two checkpoint objects of case ``name`` differ in structure: keys, lengths, types, tensor
    dtypes and shapes, DeepSpeed's record types and attributes, and plain values (numbers to 1e-6)."""
    if allowed(name, path, ours, theirs):
        return []
    where = "/".join(map(str, path))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if list(ours) != list(theirs):
            return [f"{where}: keys {list(ours)} vs DeepSpeed's {list(theirs)}"]
        return [d for k in ours for d in layout_differences(name, ours[k], theirs[k], path + (k,))]
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)) and \
            not isinstance(ours, torch.Size):
        if len(ours) != len(theirs):
            return [f"{where}: {len(ours)} items vs DeepSpeed's {len(theirs)}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs))
                for d in layout_differences(name, a, b, path + (i,))]
    numbers = (int, float)
    if isinstance(ours, numbers) and isinstance(theirs, numbers) and not isinstance(ours, bool) and \
            not isinstance(theirs, bool):   # a loss scale is an int in DeepSpeed until it first changes
        return [] if abs(ours - theirs) <= 1e-6 * max(1.0, abs(theirs)) else [f"{where}: {ours} vs {theirs}"]
    if type(ours).__name__ != type(theirs).__name__:
        return [f"{where}: {type(ours).__name__} vs DeepSpeed's {type(theirs).__name__}"]
    if isinstance(ours, torch.Tensor):
        if (ours.dtype, ours.shape) != (theirs.dtype, theirs.shape):
            return [f"{where}: {ours.dtype} {tuple(ours.shape)} vs DeepSpeed's {theirs.dtype} {tuple(theirs.shape)}"]
        return []
    if isinstance(ours, safe_load.DeepSpeedRecord):
        return layout_differences(name, vars(ours), vars(theirs), path)
    return [] if ours == theirs else [f"{where}: {ours!r} vs DeepSpeed's {theirs!r}"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_files_are_those_deepspeed_writes(exported, name):
    _, ds, paths = case(exported, name)
    ours, theirs = os.path.join(paths["dir"], "global_step2"), os.path.join(paths["own_dir"], "global_step2")
    ds_files = sorted(os.listdir(theirs))
    assert sorted(set(os.listdir(ours)) - {ds_layout.LAZYTRAIN_FILE, ckpt.MANIFEST}) == ds_files
    differences = []
    for f in ds_files:
        differences += layout_differences(name, safe_load.load(os.path.join(ours, f)),
                                          safe_load.load(os.path.join(theirs, f)), (f,))
    assert differences == []
    if "8bit" not in name:   # the same training: DeepSpeed's own masters and LazyTrain's agree
        lt, _, _ = exported[name]
        tolerance = tolerance_of(name)
        for n, w in ds["own_masters"].items():
            assert torch.allclose(w, lt["weights"][n], rtol=0, atol=tolerance * w.abs().max().item()), n


# ---- LazyTrain's side, without DeepSpeed ----------------------------------------------------------
RESUME = {   # name: (ZeRO stage, precision section, LazyTrain section)
    "stage0_fp16_8bit_overlapped": (0, {"fp16": {"enabled": True, "initial_scale_power": 8}},
                                    {"optimizer_states": "8bit", "hybrid_threshold": 64, "overlap_optimizer": True}),
    "stage1_bf16": (1, {"bf16": {"enabled": True}}, {}),
    "stage2_fp32_overlapped": (2, {}, {"overlap_optimizer": True}),
    "stage3_bf16_8bit": (3, {"bf16": {"enabled": True}}, {"optimizer_states": "8bit", "hybrid_threshold": 64}),
    "stage3_fp16": (3, {"fp16": {"enabled": True, "initial_scale_power": 8}}, {}),
}


def resume_config(name: str) -> dict:
    stage, precision, lazy = RESUME[name]
    cfg = copy.deepcopy(BASE)
    cfg["zero_optimization"] = {"stage": stage, "sub_group_size": 600}
    cfg.update(copy.deepcopy(precision))
    cfg["lazytrain"].update(lazy)
    return cfg


def train(engine, data):
    for x, y in data:
        engine.backward(runs.loss_of(engine(x), y))
        engine.step()


@pytest.mark.parametrize("name", list(RESUME))
def test_lazytrain_resumes_its_own_checkpoints_bit_identically(tmp_path, monkeypatch, name):
    """Saved in DeepSpeed's layout (every flat tensor streamed in pieces of 100 elements here), loaded
    back: the next steps are the ones the saving engine takes, bit for bit."""
    monkeypatch.setattr(ds_layout, "_CHUNK", 100)
    data = runs.batches(4)
    a = lazytrain_engine(resume_config(name))
    train(a, data[:2])
    a.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    train(a, data[2:])
    b = lazytrain_engine(resume_config(name))
    _, client = b.load_checkpoint(str(tmp_path))
    train(b, data[2:])
    assert client == {"epoch": 3}
    assert (a.global_steps, a.global_samples, a.micro_steps, a.skipped_steps) == \
        (b.global_steps, b.global_samples, b.micro_steps, b.skipped_steps)
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    assert (a.loss_scaler is None) or a.loss_scaler.state_dict() == b.loss_scaler.state_dict()
    wa, wb = a.module_state_dict(), b.module_state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    settings = [[{k: v for k, v in g.items() if k != "differentiable"} for g in sd["param_groups"]]
                for sd in (sa, sb)]   # (torch's load_state_dict adds differentiable=False to any optimizer's groups)
    assert settings[0] == settings[1] and sa["state"].keys() == sb["state"].keys()
    for i, st in sa["state"].items():
        assert st.keys() == sb["state"][i].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][i][k])) for k, v in st.items()), i
    a.destroy()
    b.destroy()


class _OddLayouts(torch.nn.Module):
    """Weights whose memory order is not their shape's: a channels_last convolution and a transposed matrix."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.proj = torch.nn.Parameter(torch.randn(6, 16).t())   # (16, 6), strides (1, 16)

    def forward(self, x):
        return self.conv(x).flatten(1) @ self.proj


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (0, "bf16"), (1, "fp32"), (3, "bf16")])
def test_a_resume_gives_moments_their_weights_memory_layout(tmp_path, stage, precision):
    """A checkpoint's moments come back contiguous (DeepSpeed's flat partitions), and torch's fused AdamW
    pairs a weight with its moments in memory order: a channels_last or transposed weight's moments were
    applied to other elements from the first step after a resume, bit-identical weights at the load
    hiding it. Loaded, the moments take their weight's layout, and the next steps are the saving engine's."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(1)
    data = [torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last) for _ in range(4)]

    def engine(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lazytrain.initialize(model=model, config=copy.deepcopy(cfg))[0]

    def train(e, xs):
        for x in xs:
            e.backward(e(x.to(e.compute_dtype)).float().pow(2).mean())
            e.step()

    a = engine(_OddLayouts())
    train(a, data[:2])
    a.save_checkpoint(str(tmp_path), tag="t")
    train(a, data[2:])
    model = _OddLayouts()
    torch.nn.init.zeros_(model.proj)   # other weights than the checkpoint's, in the same layouts
    b = engine(model)
    b.load_checkpoint(str(tmp_path), tag="t")
    for g in b.optimizer.param_groups:
        for p in g["params"]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert b.optimizer.state[p][key].stride() == p.stride(), (tuple(p.shape), key)
    train(b, data[2:])
    wa, wb = a.module_state_dict(), b.module_state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    a.destroy()
    b.destroy()


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_the_lazytrain_file_holds_what_the_deepspeed_files_do_not(tmp_path, states):
    """fp32 moments live in the DeepSpeed files only; with 8-bit moments the DeepSpeed files hold them
    dequantized and the LazyTrain file their codes."""
    cfg = resume_config("stage1_bf16")
    cfg["lazytrain"].update(optimizer_states=states, hybrid_threshold=64, overlap_optimizer=True)
    engine = lazytrain_engine(cfg)
    train(engine, runs.batches(2))
    engine.save_checkpoint(str(tmp_path), tag="t")
    own = safe_load.load(str(tmp_path / "t" / ds_layout.LAZYTRAIN_FILE))
    opt = safe_load.load(str(tmp_path / "t" / ds_layout.optim_file(bf16=True)))["optimizer_state_dict"]
    kept = {k: v for st in own["optimizer"]["state"].values() for k, v in st.items()}
    assert {k: v for k, v in kept.items() if isinstance(v, torch.Tensor) and v.dtype == torch.float32
            and v.dim() > 0} == ({} if states == "fp32" else {"absmax1": kept["absmax1"], "absmax2": kept["absmax2"]})
    assert ("state1" in kept) == (states == "8bit") and kept.get("exp_avg") in (None, ds_layout.FROM_DEEPSPEED)
    moments = fp32_moments(engine)
    flat = opt["base_optimizer_state"]["state"][0]["exp_avg"]
    offset = 0
    for name, shape in safe_load.load(str(tmp_path / "t" / ds_layout.model_file(1)))["param_shapes"][0].items():
        n = shape.numel()
        assert torch.equal(flat[offset:offset + n].view(shape), moments[name]["exp_avg"]), name
        offset += n


def test_the_ranks_files_cut_from_a_whole_state_read_8bit_moments_as_they_are_written(tmp_path, monkeypatch):
    """An optimizer every rank holds whole (passed to initialize): rank 0 writes every rank's files, and built
    them all, each 8-bit moment range dequantized, before writing any (a 7B model's moments in fp32 at once).
    The ranges are now read as their file is written; the files hold what the engine does."""
    engine = lazytrain_engine(config_of("stage2_bf16_8bit_moments"))
    for x, y in runs.batches()[:2]:
        engine.backward(runs.loss_of(engine(x), y))
        engine.step()
    read = []
    monkeypatch.setattr(ds_layout, "_range_pieces", lambda *a, f=ds_layout._range_pieces: (read.append(a), f(*a))[1])
    files = ds_layout.files_for_ranks(engine._export({}, False), 2)
    assert read == []                       # nothing dequantized yet
    ckpt.save(str(tmp_path), "t", files, True)
    assert read                             # each as its file was written
    moments = fp32_moments(engine)
    model = safe_load.load(str(tmp_path / "t" / ds_layout.model_file(2)))
    shares = [safe_load.load(str(tmp_path / "t" / ds_layout.optim_file(True, r)))["optimizer_state_dict"]
              for r in range(2)]
    assert model["dp_world_size"] == 2
    for i, shapes in enumerate(model["param_shapes"]):   # each group's flat moments: the ranks' shares end to end
        for key in ("exp_avg", "exp_avg_sq"):
            flat, offset = torch.cat([share["base_optimizer_state"]["state"][i][key] for share in shares]), 0
            for name, shape in shapes.items():
                assert torch.equal(flat[offset:offset + shape.numel()].view(shape), moments[name][key]), (name, key)
                offset += shape.numel()
    engine.destroy()


def test_a_client_state_key_deepspeed_uses_itself_is_refused(tmp_path):
    engine = lazytrain_engine(resume_config("stage1_bf16"))
    with pytest.raises(ckpt.CheckpointError, match="client_state key 'module' is one DeepSpeed's checkpoint uses "
                                                   "itself"):
        engine.save_checkpoint(str(tmp_path), client_state={"module": 1})
    assert not os.path.exists(tmp_path / "latest")


def test_parameters_stepped_fewer_times_than_their_group_are_named(tmp_path):
    """DeepSpeed keeps one step count per flat group: a parameter the optimizer skipped in a step (frozen for
    it: a parameter the loss merely did not reach gets a zero gradient, and is stepped) cannot be told apart
    there. The save says which, and LazyTrain's own load keeps each count."""
    engine = lazytrain_engine(resume_config("stage2_fp32_overlapped") | {"lazytrain": {"device": "cpu"}})
    data = runs.batches(2)
    train(engine, data[:1])
    x, y = data[1]
    engine.backward(runs.loss_of(engine(x), y))
    engine.module.norm.weight.grad = None             # frozen for this step: it gets no update
    engine.module.norm.weight.requires_grad_(False)
    engine.step()
    engine.module.norm.weight.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"stepped fewer times than others of their group: norm\.weight;"):
        engine.save_checkpoint(str(tmp_path), tag="t")
    opt = safe_load.load(str(tmp_path / "t" / ds_layout.optim_file(bf16=False)))["optimizer_state_dict"]
    assert [float(s["step"]) for s in opt["base_optimizer_state"]["state"].values()] == [2.0, 2.0]
    other = lazytrain_engine(resume_config("stage2_fp32_overlapped") | {"lazytrain": {"device": "cpu"}})
    other.load_checkpoint(str(tmp_path), tag="t")
    steps = {other._param_names[id(p)]: float(st["step"]) for p, st in other.optimizer.state.items()}
    assert steps["norm.weight"] == 1.0 and steps["emb.weight"] == 2.0


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("exclude", [True, False], ids=["without-frozen", "with-frozen"])
def test_a_model_file_holds_each_weight_once_not_the_layer_buffer_it_views(tmp_path, stage, exclude):
    """In fp32 the module entries are views of each layer's flat fp32 buffer: saved as they are, torch.save
    wrote the whole buffer behind each (a save without frozen parameters, as Trainer makes for a LoRA run,
    as large as the whole model). Each tensor is written with its own elements only."""
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_models import batches, lm_loss, make_model
    model = make_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("layers" in name and name.endswith("o_proj.weight"))   # a small trainable part
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                             if p.requires_grad], config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t", exclude_frozen_parameters=exclude)
    module = torch.load(tmp_path / "t" / ckpt.MODEL_FILE, weights_only=False)["module"]
    held = engine.module_state_dict()
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert (set(module) & set(dict(engine.module.named_parameters())) == trainable) if exclude else \
        (module.keys() == held.keys())
    for name, t in module.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
        assert torch.equal(t, held[name]), name
    engine.destroy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage3_checkpoint_of_an_engine_without_an_optimizer_holds_its_weights(tmp_path, precision):
    """At stage 3 the model file holds DeepSpeed's empty placeholders and the optimizer file the weights; an
    engine without an optimizer (an evaluation's) has no optimizer file, and its checkpoint held no weights at
    all (its load was refused: "(0,) there, (32, 32) here"). Its model file holds them whole, in the training
    precision, as a frozen parameter's; another model loads them."""
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_models import make_model
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": precision == "bf16"}, "lazytrain": {"device": "cpu"}}
    saved_model = make_model("llama")
    with torch.no_grad():
        for p in saved_model.parameters():
            p.add_(0.25)   # not what a fresh model holds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, optimizer, _, _ = lazytrain.initialize(model=saved_model, config=cfg)
        assert engine.basic_optimizer is None
        engine.save_checkpoint(str(tmp_path), tag="t")
        saved = engine.module_state_dict()
        engine.destroy()
        assert sorted(os.listdir(tmp_path / "t")) == ["lazytrain_manifest.json", "lazytrain_state.pt",
                                                      "zero_pp_rank_0_mp_rank_00_model_states.pt"]
        module = torch.load(tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["module"]
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for name, t in module.items():
            assert t.shape == saved[name].shape and t.dtype == dtype, name
        other, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        other.load_checkpoint(str(tmp_path), tag="t")
    for name, value in other.module_state_dict().items():
        assert torch.equal(value, saved[name].to(dtype).float()), name
    other.destroy()
