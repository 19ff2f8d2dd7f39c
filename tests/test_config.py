"""Config parsing: DeepSpeed's batch rules and error texts, unknown keys, warnings, schedules."""
import glob
import json
import math
import os
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.config import BatchConfigError, ConfigError, parse_config
from lazytrain.optim.lr_schedules import build_schedule, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("given, expect", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 8)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 8, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (8, 4, 2)),
    ({"train_batch_size": 16}, (16, 16, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (3, 3, 1)),
])
def test_batch_triple_derived(given, expect):
    cfg = parse_config(given, world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expect


def test_batch_triple_world_size():
    cfg = parse_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert cfg.gradient_accumulation_steps == 4


def test_batch_triple_mismatch_has_deepspeeds_text():
    with pytest.raises(BatchConfigError) as e:
        parse_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                     world_size=1)
    assert str(e.value) == ("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                            "gradient_acc_step * world_size 10 != 4 * 2 * 1")
    assert isinstance(e.value, AssertionError)


def test_batch_missing():
    with pytest.raises(BatchConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu needs to be"):
        parse_config({}, world_size=1)


def test_unknown_key_in_implemented_section_names_key_and_section():
    with pytest.raises(ConfigError, match="unknown key 'offload_parm' in config section 'zero_optimization'"):
        parse_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_parm": {}}})
    with pytest.raises(ConfigError, match="unknown key 'polcy' in config section 'lazytrain'"):
        parse_config({"train_batch_size": 1, "lazytrain": {"polcy": "milp"}})
    with pytest.raises(ConfigError, match="unknown key 'devic' in config section "
                                          "'zero_optimization.offload_param'"):
        parse_config({"train_batch_size": 1, "zero_optimization": {"offload_param": {"devic": "cpu"}}})


def test_unknown_top_level_keys_are_ignored_with_one_warning_as_deepspeed_does():
    with pytest.warns(UserWarning, match=r"unknown top-level key\(s\) 'train_batch_sise', 'cuda_visible_devices': not a "
                                         r"DeepSpeed key LazyTrain knows; ignored, as DeepSpeed ignores them"):
        cfg = parse_config({"train_batch_size": 1, "train_batch_sise": 2, "cuda_visible_devices": "0"})
    assert cfg.train_batch_size == 1


def test_max_grad_norm_in_optimizer_params_is_an_error():
    with pytest.raises(ConfigError, match="'max_grad_norm' is not supported as an optimizer parameter.*"
                                          "gradient_clipping"):
        parse_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})


def test_unimplemented_deepspeed_features_are_listed_in_one_warning_and_off_values_are_silent():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        parse_config({"train_batch_size": 1, "tensorboard": {"enabled": True}, "wandb": {"enabled": False},
                      "prescale_gradients": False, "wall_clock_breakdown": True,
                      "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": False,
                                            "reduce_bucket_size": 5e8}})
    texts = [str(x.message) for x in w]
    assert len(texts) == 1
    assert texts[0].startswith("lazytrain config: 4 setting(s) have no effect in LazyTrain: 'tensorboard' is a "
                               "DeepSpeed feature LazyTrain does not implement")
    assert "'zero_optimization.overlap_comm'" in texts[0] and "'zero_optimization.reduce_bucket_size'" in texts[0]
    assert texts[0].endswith("'wall_clock_breakdown' prints DeepSpeed's per-phase timers, which LazyTrain does not "
                             "keep: trace a step instead (engine.trace_next_step(\"step.json\"), or lazytrain train "
                             "--trace), which times every layer's compute and transfer.")
    for off in ("wandb", "prescale_gradients", "contiguous_gradients"):
        assert off not in texts[0]


def test_unpinned_offload_is_named_as_not_honoured_and_pinned_is_silent():
    for name in ("offload_param", "offload_optimizer"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            parse_config({"train_batch_size": 1, "zero_optimization": {
                "stage": 2, name: {"device": "cpu", "pin_memory": False}}})
        assert len(w) == 1 and f"'zero_optimization.{name}.pin_memory': false is not honoured" in str(w[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            parse_config({"train_batch_size": 1, "zero_optimization": {
                "stage": 2, name: {"device": "cpu", "pin_memory": True}}})


def test_the_stock_hugging_face_zero3_config_warns_once():
    """transformers' documented ZeRO-3 config, with the "auto" values its Trainer fills in."""
    cfg = {"bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.0}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                                 "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 1048576,
                                 "stage3_prefetch_bucket_size": 943718, "stage3_param_persistence_threshold": 10240,
                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
           "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "wall_clock_breakdown": False}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        parse_config(cfg, world_size=1)
    assert len(w) == 1 and "8 setting(s) have no effect" in str(w[0].message)
    assert "gather_16bit" not in str(w[0].message)    # honoured: save_model gathers the 16-bit weights


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save"])
def test_gather_16bit_weights_on_model_save_is_read_under_each_of_deepspeeds_names(key):
    base = {"train_micro_batch_size_per_gpu": 1}
    assert parse_config(base, world_size=1).gather_16bit_weights_on_model_save is False
    on = parse_config(dict(base, zero_optimization={"stage": 3, key: True}), world_size=1)
    assert on.gather_16bit_weights_on_model_save is True
    assert parse_config(dict(base, zero_optimization={key: "yes"}), world_size=1).gather_16bit_weights_on_model_save
    with pytest.raises(ConfigError, match=f"config key 'zero_optimization.{key}' must be true or false, got 'maybe'"):
        parse_config(dict(base, zero_optimization={key: "maybe"}), world_size=1)


@pytest.mark.parametrize("section,key", [({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
                                          "bf16.bf16_master_weights_and_grads"),
                                         ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
                                          "bf16.bf16_optimizer_states"),
                                         ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
                                          "fp16.fp16_master_weights_and_grads")])
def test_low_precision_masters_are_refused_by_name_not_ignored(section, key):
    with pytest.raises(ConfigError, match=f"config key '{key}' keeps the .* in (bf16|fp16), which LazyTrain does not "
                                          f"do"):
        parse_config({"train_batch_size": 1, **section})
    off = {k: {kk: (False if kk != "enabled" else True) for kk in v} for k, v in section.items()}
    parse_config({"train_batch_size": 1, **off})     # set to false: accepted


@pytest.mark.parametrize("tp,ok", [({"autotp_size": 1}, True), ({}, True), ({"autotp_size": 2}, False)])
def test_tensor_parallel_of_size_one_is_accepted(tp, ok):
    if ok:
        parse_config({"train_batch_size": 1, "tensor_parallel": tp})
    else:
        with pytest.raises(ConfigError, match="asks for tensor parallelism of size 2"):
            parse_config({"train_batch_size": 1, "tensor_parallel": tp})


@pytest.mark.parametrize("extra,warned", [
    ({"use_data_before_expert_parallelism": True}, "'use_data_before_expert_parallelism'"),
    ({"vocabulary_size": 32000}, "'vocabulary_size'"),
    ({"gradient_allreduce_op": "avg"}, "'gradient_allreduce_op'"),
    ({"log_level": "info"}, "'log_level'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "legacy_fusion": False}}, "'optimizer.legacy_fusion'"),
    ({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
     "'zero_optimization.stage3_use_all_reduce_for_fetch_params'"),
    ({"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 10, "leaf_module": {"classes": []}}},
     "'zero_optimization.leaf_module'"),
])
def test_more_deepspeed_keys_are_accepted_with_a_warning(extra, warned):
    """Keys DeepSpeed 0.19 reads, for features LazyTrain does not have: a warning, never 'unknown key'."""
    with pytest.warns(UserWarning, match=warned):
        parse_config({"train_batch_size": 1, **extra})


def test_dataloader_drop_last_is_a_boolean():
    assert parse_config({"train_batch_size": 1}).dataloader_drop_last is False
    assert parse_config({"train_batch_size": 1, "dataloader_drop_last": True}).dataloader_drop_last is True
    # read as every flag is (DeepSpeed passes it to the DataLoader, which takes its truth value)
    assert parse_config({"train_batch_size": 1, "dataloader_drop_last": 1}).dataloader_drop_last is True
    assert parse_config({"train_batch_size": 1, "dataloader_drop_last": "no"}).dataloader_drop_last is False
    with pytest.raises(ConfigError, match="config key 'dataloader_drop_last' must be true or false, got 'sometimes'"):
        parse_config({"train_batch_size": 1, "dataloader_drop_last": "sometimes"})


def test_auto_values_must_be_resolved():
    with pytest.raises(ConfigError, match="config key 'optimizer.params.lr' is \"auto\""):
        parse_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


def test_offload_sections_map_onto_tiers():
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.lazytrain.weights_home == "nvme" and cfg.lazytrain.nvme_path == "/tmp/x"
    with pytest.raises(ConfigError, match="'zero_optimization.offload_param.nvme_path' is required"):
        parse_config({"train_batch_size": 1, "zero_optimization": {"offload_param": {"device": "nvme"}}})
    # DeepSpeed's template spells a path beside device "cpu" or "none", and DeepSpeed reads it only for "nvme": a
    # path that does not exist here stopped start-up, and one that did made an NVMe tier nothing used
    for device in ("cpu", "none"):
        cfg = parse_config({"train_batch_size": 1, "zero_optimization": {
            "stage": 3, "offload_param": {"device": device, "nvme_path": "/local_nvme"}}})
        assert cfg.lazytrain.weights_home == "host" and cfg.lazytrain.nvme_path is None
    cfg = parse_config({"train_batch_size": 1, "lazytrain": {"nvme_path": "/tmp/y"}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/local_nvme"}}})
    assert cfg.lazytrain.nvme_path == "/tmp/y"   # LazyTrain's own key, as before


def test_weights_on_nvme_without_a_path_are_refused_by_name():
    """The weights' files need a directory: named, where the engine used to fail with a bare KeyError."""
    with pytest.raises(ConfigError, match=r"^config key 'lazytrain.nvme_path' is required when "
                                          r"'lazytrain.weights_home' is \"nvme\""):
        parse_config({"train_batch_size": 1, "lazytrain": {"weights_home": "nvme"}})
    assert parse_config({"train_batch_size": 1, "lazytrain": {"weights_home": "nvme", "nvme_path": "/tmp/x"}}
                        ).lazytrain.nvme_path == "/tmp/x"


@pytest.mark.parametrize("section, message", [
    ({"gpu_memory": "lots"}, "config key 'lazytrain.gpu_memory': cannot read 'lots' as a size (examples: 1073741824, "
                             "'64GB', '512MiB')"),
    ({"nvme_memory": -3}, "config key 'lazytrain.nvme_memory' must be >= 0, got -3"),
    ({"capacities": {"host": "x"}}, "config key 'lazytrain.capacities.host': cannot read 'x' as a size (examples: "
                                    "1073741824, '64GB', '512MiB')"),
    ({"capacities": {"hbm": "x"}, "gpu_memory": "y"}, "config key 'lazytrain.gpu_memory': cannot read 'y' as a size "
                                                      "(examples: 1073741824, '64GB', '512MiB')"),
    ({"capacities": 5}, "config key 'lazytrain.capacities' must be an object of tier names and sizes, got 5"),
])
def test_a_budget_that_is_no_size_names_the_config_key_it_was_given_by(section, message):
    """It named the tier ("lazytrain budget for tier 'hbm'") rather than the key the config gave it by."""
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 1, "lazytrain": section})
    assert str(e.value) == message


def test_activation_checkpointing_is_honoured():
    cfg = parse_config({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 3,
                                                                           "cpu_checkpointing": True}})
    assert cfg.interval_for(12) == 4 and cfg.lazytrain.boundary_home == "host"
    assert parse_config({"train_batch_size": 1}).interval_for(12) == 4
    assert parse_config({"train_batch_size": 1, "lazytrain": {"checkpoint_interval": 2}}).interval_for(12) == 2


def test_fp16_and_bf16_together_is_an_error():
    with pytest.raises(ConfigError, match="enables both 'fp16' and 'bf16'"):
        parse_config({"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_steps_per_print_accepts_infinity():
    assert parse_config({"train_batch_size": 1, "steps_per_print": float("inf")}).steps_per_print == math.inf


def test_steps_per_print_unset_prints_no_progress_as_deepspeeds_default(capsys):
    """DeepSpeed's default is None (no progress report); LazyTrain's was 10, a line every 10 steps."""
    import lazytrain
    from engine_models import batches, lm_loss, make_model
    assert parse_config({"train_batch_size": 1}).steps_per_print is None
    assert parse_config({"train_batch_size": 1, "steps_per_print": None}).steps_per_print is None
    for every, lines in ((None, 0), (5, 2)):
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        if every is not None:
            cfg["steps_per_print"] = every
        engine, *_ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
        assert engine.steps_per_print() == every
        for x, y in batches(10):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.destroy()
        assert capsys.readouterr().out.count("[lazytrain] step ") == lines


def test_missing_model_is_a_clear_error():
    with pytest.raises(ConfigError, match="lazytrain.initialize requires a model"):
        lazytrain.initialize(config={"train_batch_size": 1})


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("compiled", ["wrapped model", "model compiled in place", "block", "block in place",
                                      "block of a list found"])
def test_compiled_model_or_block_is_a_clear_error(compiled):
    """torch.compile cannot trace the streaming executor; the error comes before any dynamo run. A list of
    blocks found without a name, one of them compiled, is found through the wrapper: before, it no longer
    looked like a list of identical blocks, and nothing streamed."""
    model, where = _Net(), "the model"
    config = {"train_batch_size": 1, "lazytrain": {"blocks": "blocks"}}
    if compiled == "wrapped model":
        model = torch.compile(model)
    elif compiled == "model compiled in place":
        model.compile()
    elif compiled == "block":
        model.blocks[1] = torch.compile(model.blocks[1])
        where = "submodule 'blocks.1'"
    elif compiled == "block in place":
        model.blocks[0].compile()
        where = "submodule 'blocks.0'"
    else:
        model.blocks[1] = torch.compile(model.blocks[1])
        where, config = "submodule 'blocks.1'", {"train_batch_size": 1}
    with pytest.raises(ConfigError, match=f"^{where} is compiled with torch.compile: pass lazytrain.initialize the "
                                          f"module before compiling it"):
        lazytrain.initialize(model=model, config=config)


def test_compiled_module_outside_the_blocks_is_accepted():
    model = _Net()
    model.head.compile()
    engine, _, _, _ = lazytrain.initialize(model=model, config={"train_batch_size": 1, "lazytrain": {"blocks": "blocks"}})
    assert engine(torch.ones(1, 4)).shape == (1, 4)


def test_config_and_config_params_that_differ_are_an_error(tmp_path):
    """DeepSpeed takes 'config' and drops its alias unread: the same config given twice is taken, two that
    differ are refused (one would be lost)."""
    with pytest.raises(ConfigError) as e:
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1},
                             config_params={"train_batch_size": 2})
    assert str(e.value) == "'config' and 'config_params' (its alias) give different configs: pass one"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    engine, _, _, _ = lazytrain.initialize(model=torch.nn.Linear(2, 2), config=str(path),
                                           config_params={"train_batch_size": 2})
    assert engine.train_batch_size() == 2


def test_initialize_has_deepspeeds_signature():
    import inspect
    params = list(inspect.signature(lazytrain.initialize).parameters)
    assert params == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                      "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                      "config_params"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))))
def test_shipped_configs_validate(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = parse_config(path, world_size=1)
    assert cfg.train_batch_size > 0


def test_default_job_config_is_the_shipped_tiny_cpu_json():
    import json
    from lazytrain.train import DEFAULT_CONFIG
    with open(os.path.join(ROOT, "configs", "tiny-cpu.json")) as f:
        assert json.load(f) == DEFAULT_CONFIG


# ---- LR schedules: DeepSpeed's formulas --------------------------------------------------------
def _opt(lr=0.1):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _run(sched, n):
    out = []
    for _ in range(n):
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_warmup_lr_log_and_linear():
    s = WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="log")
    assert s.get_last_lr() == [0.0]   # DeepSpeed's: the lr it starts from
    assert _run(s, 12) == pytest.approx([math.log(i + 1) / math.log(10) if i < 10 else 1.0 for i in range(12)])
    s = WarmupLR(_opt(), warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    assert _run(s, 6) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5])


def test_warmup_decay_lr():
    s = WarmupDecayLR(_opt(), total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                      warmup_type="linear")
    assert _run(s, 11) == pytest.approx([0, .25, .5, .75, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])


def test_warmup_cosine_lr():
    s = WarmupCosineLR(_opt(0.2), total_num_steps=10, warmup_min_ratio=0.0, warmup_num_steps=2, cos_min_ratio=0.1,
                       warmup_type="linear")
    got = _run(s, 11)
    expect = [0.0, 0.1]
    for step in range(2, 11):
        progress = min(1.0, (step - 2 + 1) / 8)
        expect.append(0.2 * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2))
    assert got == pytest.approx(expect)


def test_lr_range_test_continuous_and_staircase():
    opt = _opt()
    s = LRRangeTest(opt, lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_step_rate=1.0)
    assert opt.param_groups[0]["lr"] == 0.1   # the optimizer starts at min_lr, as in DeepSpeed
    assert _run(s, 4) == pytest.approx([0.15, 0.2, 0.25, 0.3])   # min_lr * (1 + rate * (step + 1) / step_size)
    s = LRRangeTest(_opt(), lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_step_rate=2.0,
                    lr_range_test_staircase=True)
    assert _run(s, 5) == pytest.approx([0.1, 0.3, 0.3, 0.5, 0.5])
    resumed = LRRangeTest(_opt(), lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_step_rate=2.0,
                          lr_range_test_staircase=True)
    resumed.load_state_dict(s.state_dict())
    assert _run(resumed, 2) == _run(s, 2) == pytest.approx([0.7, 0.7])
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer, got 0"):
        LRRangeTest(_opt(), lr_range_test_step_size=0)


def test_warmup_goes_to_each_groups_own_lr_when_no_max_is_given():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.01},
                             {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}])
    s = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    for _ in range(5):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.01, 0.05])
    cosine = WarmupCosineLR(_opt(0.2), total_num_steps=10)
    assert cosine.get_last_lr() == [0.0]


@pytest.mark.parametrize("schedule", [WarmupDecayLR, WarmupCosineLR])
def test_a_run_shorter_than_its_warmup_warns_as_deepspeed_does(schedule):
    with pytest.warns(UserWarning, match=f"^lazytrain: {schedule.__name__}'s total_num_steps 30 is less than "
                                         f"warmup_num_steps 50: the run ends within its warmup, and the lr never "
                                         f"decays$"):
        schedule(_opt(), total_num_steps=30, warmup_num_steps=50)
    with pytest.warns(UserWarning, match="total_num_steps 1 is less than warmup_num_steps 2"):   # warmup runs >= 2
        schedule(_opt(), total_num_steps=1, warmup_num_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule(_opt(), total_num_steps=50, warmup_num_steps=50)


def test_an_unknown_warmup_type_warms_up_on_the_log_curve_with_a_warning_as_deepspeed():
    with pytest.warns(UserWarning, match=r"unknown warmup_type 'cosine' in the scheduler's params: the warmup is "
                                         r"'log', as in DeepSpeed"):
        s = WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
    assert _run(s, 3) == pytest.approx([math.log(i + 1) / math.log(10) for i in range(3)])


def test_one_cycle_starts_unstepped_and_a_loaded_state_sets_lr_and_betas():
    s = OneCycle(_opt(), cycle_min_lr=0.2, cycle_max_lr=1.0, cycle_first_step_size=4)
    with pytest.raises(AssertionError, match="need to call step"):   # DeepSpeed's OneCycle too
        s.get_last_lr()
    _run(s, 3)
    fresh = _opt()
    resumed = OneCycle(fresh, cycle_min_lr=0.2, cycle_max_lr=1.0, cycle_first_step_size=4)
    resumed.load_state_dict(s.state_dict())
    assert fresh.param_groups[0]["betas"] == s.optimizer.param_groups[0]["betas"] != (0.8, 0.99)
    assert fresh.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]


def test_a_torch_scheduler_by_its_class_name_as_deepspeed_builds_it():
    engine, _, _, sched = lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}})
    assert type(sched) is torch.optim.lr_scheduler.StepLR
    engine.backward(engine(torch.ones(2, 2)).sum())
    engine.step()
    assert engine.get_lr() == [0.05]
    with pytest.raises(ConfigError, match=r"config 'scheduler.type' 'StepLr' is unknown \(known: WarmupLR, .*, or any "
                                          r"torch.optim.lr_scheduler class by its name\)"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "StepLr"}})
    with pytest.raises(ConfigError, match=r"config 'scheduler.params' for StepLR: .*step_size"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "StepLR"}})


def test_adam_params_deepspeed_takes_are_taken_or_refused_by_name():
    engine, opt, _, _ = lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {
            "lr": 0.1, "set_grad_none": True, "fp32_optimizer_states": True}}})
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ConfigError, match=r"config 'optimizer.params.fp32_optimizer_states' = false keeps DeepSpeed's "
                                          r"CPU Adam states in the parameters' 16-bit type"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1,
                                                                           "fp32_optimizer_states": False}}})


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_max_lr": [0.02, 0.03], "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 6, "warmup_max_lr": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
                  "decay_step_size": 2, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": 0.02, "cycle_first_step_size": 6,
                  "cycle_second_step_size": 3, "cycle_first_stair_count": 3}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5}),
    ("LRRangeTest", {"lr_range_test_min_lr": [0.001, 0.01], "lr_range_test_staircase": True,
                     "lr_range_test_step_size": 4}),
])
def test_each_schedule_gives_deepspeeds_lr_and_betas_step_by_step(name, params):
    theirs_module = pytest.importorskip("deepspeed.runtime.lr_schedules")

    def groups():
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.01},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.04}])

    ours_opt, theirs_opt = groups(), groups()
    ours = build_schedule(name, ours_opt, dict(params))
    theirs = getattr(theirs_module, name)(theirs_opt, **params)
    for step in range(30):
        for mine, other in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert (mine["lr"], *mine["betas"]) == (other["lr"], *other["betas"]), step   # to the last bit
        ours.step()
        theirs.step()
    assert ours.get_last_lr() == theirs.get_last_lr()


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3}),
])
def test_a_tensor_lr_is_filled_in_place_as_deepspeed_fills_it(name, params):
    """A captured or compiled optimizer step reads the group's lr tensor: the schedule keeps the object."""
    theirs_module = pytest.importorskip("deepspeed.runtime.lr_schedules")
    opts = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.01)) for _ in range(2)]
    lr_tensors = [opt.param_groups[0]["lr"] for opt in opts]
    ours, theirs = build_schedule(name, opts[0], dict(params)), getattr(theirs_module, name)(opts[1], **params)
    for _ in range(8):
        ours.step()
        theirs.step()
        assert [opt.param_groups[0]["lr"] for opt in opts] == lr_tensors   # the same objects
        assert lr_tensors[0].item() == lr_tensors[1].item()


def test_one_cycle_takes_one_value_per_parameter_group():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                             {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.005)
    s = OneCycle(opt, cycle_min_lr=[1e-3, 2e-3], cycle_max_lr=[1e-2, 2e-2], cycle_first_step_size=2,
                 cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95])
    assert [g["betas"][0] for g in opt.param_groups] == [0.8, 0.85]
    s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0055, 0.011])   # DeepSpeed 0.19's values
    with pytest.raises(ValueError, match="expected 2 values for cycle_max_lr, got 3"):
        OneCycle(opt, cycle_min_lr=1e-3, cycle_max_lr=[1e-2, 2e-2, 3e-2])


def test_one_cycle():
    opt = _opt()
    s = OneCycle(opt, cycle_min_lr=0.2, cycle_max_lr=1.0, cycle_first_step_size=2, decay_lr_rate=1.0,
                 decay_step_size=1, cycle_min_mom=0.8, cycle_max_mom=0.9)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    s.step()
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.85)   # momentum moves inversely to lr
    # cycle of 4 steps (up 2, down 2), then lr = min_lr / (1 + rate * steps_after_cycle / decay_step_size)
    assert [s.get_last_lr()[0]] + _run(s, 5) == pytest.approx([0.6, 1.0, 0.6, 0.2, 0.2 / 2, 0.2 / 3])
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9)    # decay_mom_rate 0: momentum stays at max


def test_aio_section_has_one_schema_and_reaches_the_nvme_tier(tmp_path):
    """config.py reads ``aio`` with the NVMe tier's own schema: the same defaults, and ``use_gds`` (false:
    never kvikio) reaches the tier instead of being dropped on the way."""
    from lazytrain.engine.placement import build_tiers
    from lazytrain.tiers.nvme_io import AioSettings
    default = parse_config({"train_batch_size": 2}, world_size=1).aio
    assert (default.block_size, default.queue_depth, default.intra_op_parallelism, default.use_gds) == \
        (AioSettings.block_size, AioSettings.queue_depth, AioSettings.intra_op_parallelism, AioSettings.use_gds)
    cfg = parse_config({"train_batch_size": 2, "aio": {"use_gds": False, "thread_count": 2},
                        "lazytrain": {"nvme_path": str(tmp_path)}}, world_size=1)
    tier = build_tiers(cfg, torch.device("cpu"))["nvme"]
    try:
        assert tier.settings.use_gds is False and tier.settings.intra_op_parallelism == 2
        assert "kvikio not used: aio.use_gds is false" in tier.backend_report
    finally:
        tier.close()
    with pytest.raises(ConfigError, match=r"aio.queue_depth must be an integer >= 1, got 0"):
        parse_config({"train_batch_size": 2, "aio": {"queue_depth": 0}}, world_size=1)


def test_communication_data_type_takes_deepspeeds_values_and_message():
    base = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}
    assert parse_config(base).communication_data_type is None   # unset: the model's dtype, as DeepSpeed's
    assert [parse_config({**base, **extra}).communication_dtype_name
            for extra in ({}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}},
                          {"bf16": {"enabled": True}, "communication_data_type": "fp32"})] == ["fp32", "bf16", "fp16", "fp32"]
    for value in ("fp16", "bf16", "fp32"):
        assert parse_config({**base, "communication_data_type": value}).communication_data_type == value
    with pytest.raises(ConfigError, match=re.escape("Invalid communication_data_type. Supported data types: "
                                                    "['fp16', 'bf16', 'fp32']. Got: float32")):
        parse_config({**base, "communication_data_type": "float32"})


@pytest.mark.parametrize("word,on", [("false", False), ("False", False), ("no", False), ("0", False), (0, False),
                                     ("true", True), ("yes", True), (1, True), (True, True)])
def test_true_false_settings_read_words_as_deepspeed_does(word, on):
    """``bool("false")`` is True: a string that says off turned fp16 on."""
    cfg = parse_config({"train_batch_size": 2, "fp16": {"enabled": word, "consecutive_hysteresis": word},
                        "bf16": {"enabled": False}, "lazytrain": {"prefetch": word}, "wall_clock_breakdown": word})
    assert (cfg.fp16.enabled, cfg.fp16.consecutive_hysteresis, cfg.lazytrain.prefetch, cfg.wall_clock_breakdown) == \
        (on, on, on, on)
    bf16 = parse_config({"train_batch_size": 2, "bf16": {"enabled": word}})
    assert bf16.bf16 is on


@pytest.mark.parametrize("lazytrain,message", [
    ({"policy": "plan", "plan": 5}, "config key 'lazytrain.plan' must be the path of a Plan JSON written by "
                                    "`lazytrain plan --json` (or its text), got 5"),
    ({"hardware": None}, "config key 'lazytrain.hardware' must be \"auto\", a catalog name (h800, h200, rtx3090) or "
                         "the path of a JSON written by `lazytrain bench tiers --json`, got None"),
    ({"hardware": {"name": "x"}}, "config key 'lazytrain.hardware' must be \"auto\", a catalog name (h800, h200, "
                                  "rtx3090) or the path of a JSON written by `lazytrain bench tiers --json`, got "
                                  "{'name': 'x'}"),
    ({"milp_time_limit": float("inf")}, "config key 'lazytrain.milp_time_limit' must be a finite number of seconds, "
                                        "got inf"),
    ({"gpu_memory": "0"}, "config key 'lazytrain.gpu_memory' must be above 0 (the device holds the layer being "
                          "computed); leave it out for no limit"),
    ({"capacities": {"host": 0}}, "config key 'lazytrain.capacities.host' must be above 0 (the host holds the weights "
                                  "and the optimizer state); leave it out for no limit"),
])
def test_lazytrain_settings_the_engine_or_planner_would_fail_on_later_are_refused_by_name(lazytrain, message):
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 2, "lazytrain": lazytrain})
    assert str(e.value) == message


@pytest.mark.parametrize("section,key,value,message", [
    ("fp16", "enabled", "maybe", "config key 'fp16.enabled' must be true or false, got 'maybe'"),
    ("fp16", "initial_scale_power", 16.7, "config key 'fp16.initial_scale_power' must be a whole number, got 16.7"),
    ("fp16", "loss_scale", -4, "config key 'fp16.loss_scale' must be >= 0, got -4"),
    ("fp16", "loss_scale", "dynamic", "config key 'fp16.loss_scale' must be a number, got 'dynamic'"),
    ("lazytrain", "hybrid_threshold", 4096.9, "config key 'lazytrain.hybrid_threshold' must be a whole number, got 4096.9"),
    ("lazytrain", "hybrid_threshold", "big", "config key 'lazytrain.hybrid_threshold' must be a number, got 'big'"),
    ("lazytrain", "milp_time_limit", "10s", "config key 'lazytrain.milp_time_limit' must be a number, got '10s'"),
    ("lazytrain", "fp32_state_patterns", "norm", "config key 'lazytrain.fp32_state_patterns' must be a list of "
                                                 "regular expressions such as [\"norm\", \"bias\"], got 'norm'"),
    ("lazytrain", "plan", "/nonexistent/plan.json", "config key 'lazytrain.plan' is read only with 'lazytrain.policy': "
                                                    "\"plan\" (the policy here is 'every_k'): set the policy to \"plan\" "
                                                    "to run it, or remove the key"),
])
def test_values_that_would_be_converted_or_ignored_silently_are_refused_by_name(section, key, value, message):
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 2, section: {key: value}})
    assert str(e.value) == message


@pytest.mark.parametrize("key, value, message", [
    ("gradient_clipping", float("nan"), "config key 'gradient_clipping' must be a number >= 0 (0 = off), got nan"),
    ("steps_per_print", float("nan"), "config key 'steps_per_print' must be a positive number (float('inf') allowed) "
                                      "or null, got nan"),
])
def test_a_nan_setting_is_refused_not_read_as_off(key, value, message):
    """NaN compares false both ways: a NaN clipping threshold passed the check for < 0, then clipped nothing
    (the engine clips where it is > 0), and a NaN print interval never printed."""
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 2, key: value})
    assert str(e.value) == message


def test_flags_written_as_words_or_numbers_are_read_as_deepspeed_reads_them():
    """bf16_master_weights_and_grads "false" was refused as if it were on (its truth value as a string)."""
    for off in ("false", 0, False):
        assert parse_config({"train_batch_size": 2, "bf16": {"enabled": True,
                                                             "bf16_master_weights_and_grads": off}}).bf16
    with pytest.raises(ConfigError, match="config key 'bf16.bf16_master_weights_and_grads' keeps the master weights"):
        parse_config({"train_batch_size": 2, "bf16": {"enabled": True, "bf16_master_weights_and_grads": "true"}})


def test_keys_deepspeed_no_longer_reads_are_said_to_have_no_effect():
    """fp32_allreduce (DeepSpeed replaced it by communication_data_type) and seed (no DeepSpeed key) were
    taken without a word, and read by nothing: a bf16 run with fp32_allreduce still reduced in bf16."""
    with pytest.warns(UserWarning, match=r"'fp32_allreduce' is a DeepSpeed feature LazyTrain does not implement; it "
                                         r"is ignored \(DeepSpeed itself replaced it by 'communication_data_type'"):
        cfg = parse_config({"train_batch_size": 2, "bf16": {"enabled": True}, "fp32_allreduce": True})
    assert cfg.communication_data_type is None
    with pytest.warns(UserWarning, match=r"unknown top-level key\(s\) 'seed'"):
        parse_config({"train_batch_size": 2, "seed": 1234})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config({"train_batch_size": 2, "fp32_allreduce": False})   # off: nothing to say


def test_onecycle_refuses_step_sizes_deepspeed_refuses():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="cycle_second_step_size must be non-negative, got -3"):
        OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2, cycle_second_step_size=-3)
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive, got 0"):
        OneCycle(opt, 0.01, 0.1, cycle_first_step_size=0)



def test_a_schedule_parameter_out_of_range_is_named_with_its_section():
    with pytest.raises(ConfigError, match=r"config 'scheduler.params' for OneCycle: cycle_first_step_size must be "
                                          r"positive, got 0"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                         "cycle_first_step_size": 0}}})


# ---- what DeepSpeed 0.19 accepts (checked against its DeepSpeedConfig), LazyTrain accepts the same way ----

def test_sections_set_to_null_read_as_not_set():
    cfg = parse_config({"train_batch_size": 2, "bf16": None, "fp16": None, "zero_optimization": None, "aio": None,
                        "activation_checkpointing": None, "scheduler": None, "lazytrain": None,
                        "optimizer": {"type": "AdamW", "params": None}})
    assert (cfg.bf16, cfg.fp16.enabled, cfg.zero_stage, cfg.optimizer.params, cfg.scheduler.type) == \
        (False, False, 0, {}, None)
    zero = parse_config({"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": None},
                         "zero_optimization": {"stage": 3, "offload_param": None, "offload_optimizer": None}})
    assert (zero.zero_stage, zero.offload_param.device, zero.offload_optimizer.device, zero.scheduler.params) == \
        (3, "none", "none", {})


def test_numpy_numbers_in_a_dict_config_are_taken_as_numbers():
    np = pytest.importorskip("numpy")
    cfg = parse_config({"train_batch_size": np.int64(8), "train_micro_batch_size_per_gpu": np.int32(4),
                        "optimizer": {"type": "AdamW", "params": {"lr": np.float32(0.5)}}}, world_size=1)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.optimizer.params["lr"]) == (8, 2, 0.5)
    assert type(cfg.train_batch_size) is int and type(cfg.optimizer.params["lr"]) is float
    with pytest.raises(ConfigError, match=r"config value array\(\[1, 2\]\) is not JSON-serializable"):
        parse_config({"train_batch_size": np.array([1, 2])})


def test_numbers_written_as_deepspeeds_models_read_them():
    cfg = parse_config({"train_batch_size": 8.0, "gradient_accumulation_steps": 2.0, "communication_data_type": "BF16",
                        "zero_optimization": {"stage": "2", "stage3_gather_16bit_weights_on_model_save": "true"},
                        "fp16": {"enabled": True, "loss_scale": "0", "initial_scale_power": "12",
                                 "min_loss_scale": "0.5"}}, world_size=1)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.train_micro_batch_size_per_gpu) == (8, 2, 4)
    assert type(cfg.train_batch_size) is int and type(cfg.zero_stage) is int
    assert (cfg.zero_stage, cfg.gather_16bit_weights_on_model_save, cfg.communication_data_type) == (2, True, "bf16")
    assert (cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.min_loss_scale) == (0.0, 12, 0.5)
    # whole numbers written 2.0 in DeepSpeed's own sections, as its get_scalar_param reads them
    cfg = parse_config({"train_batch_size": 2, "activation_checkpointing": {"number_checkpoints": 2.0},
                        "aio": {"queue_depth": 8.0, "intra_op_parallelism": 2.0}}, world_size=1)
    assert cfg.lazytrain.number_checkpoints == 2 and type(cfg.lazytrain.number_checkpoints) is int
    assert (cfg.aio.queue_depth, cfg.aio.intra_op_parallelism) == (8, 2) and type(cfg.aio.queue_depth) is int
    for bad, message in (({"activation_checkpointing": {"number_checkpoints": 2.5}},
                          "config key 'activation_checkpointing.number_checkpoints' must be an integer >= 1, got 2.5"),
                         ({"aio": {"queue_depth": 8.5}}, "aio.queue_depth must be an integer >= 1, got 8.5")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"train_batch_size": 2, **bad}, world_size=1)


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 2.5}, "config key 'train_batch_size' must be an integer, got 2.5"),
    ({"train_batch_size": "8"}, "config key 'train_batch_size' must be an integer, got '8'"),
    ({"zero_optimization": {"stage": "three"}}, "config key 'zero_optimization.stage' must be 0, 1, 2 or 3, got 'three'"),
    ({"zero_optimization": {"stage": True}}, "config key 'zero_optimization.stage' must be 0, 1, 2 or 3, got True"),
    ({"fp16": {"initial_scale_power": "12.5"}}, "config key 'fp16.initial_scale_power' must be a whole number, got 12.5"),
    ({"fp16": {"loss_scale": "nan"}}, "config key 'fp16.loss_scale' must be a number, got 'nan'"),
    ({"optimizer": {"type": "AdamW", "params": [0.1]}}, "config key 'optimizer.params' must be an object"),
])
def test_what_deepspeed_would_fail_on_later_is_refused_at_once(config, message):
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 2, **config}, world_size=1)
    assert str(e.value) == message


def _one_step_with(optimizer_section, lr_of=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    plain.load_state_dict(model.state_dict())
    engine, optimizer, _, _ = lazytrain.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": optimizer_section, "lazytrain": {"policy": "keep_all"}})
    x = torch.randn(2, 4)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine, optimizer, plain, x


@pytest.mark.parametrize("typ, cls, params", [
    ("RMSprop", torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.1}),
    ("NAdam", torch.optim.NAdam, {"lr": 0.01}),
])
def test_any_torch_optimizer_by_its_class_name_as_deepspeed_builds_it(typ, cls, params):
    engine, optimizer, plain, x = _one_step_with({"type": typ, "params": params})
    assert type(optimizer) is cls
    reference = cls(plain.parameters(), **params)
    for _ in range(2):
        reference.zero_grad()
        plain(x).square().mean().backward()
        reference.step()
    for p, q in zip(engine.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("typ, message", [
    ("Lamb", "config 'optimizer.type' 'Lamb' is DeepSpeed's FusedLamb, which LazyTrain does not implement"),
    ("OneBitAdam", "config 'optimizer.type' 'OneBitAdam' is DeepSpeed's 1-bit Adam, which LazyTrain does not implement"),
    ("ZeroOneAdam", "config 'optimizer.type' 'ZeroOneAdam' is DeepSpeed's 0/1 Adam, which LazyTrain does not implement"),
    ("Lion", "config 'optimizer.type' 'Lion' is DeepSpeed's Lion (FusedLion / CPU Lion), which LazyTrain does not "
             "implement"),
    ("Optimizer", "config 'optimizer.type' 'Optimizer' is not supported by LazyTrain"),
    ("Adamm", "config 'optimizer.type' 'Adamm' is not supported by LazyTrain"),
    ("LBFGS", "config 'optimizer.type' \"LBFGS\" needs a closure"),
])
def test_optimizers_lazytrain_does_not_build_are_refused_by_name(typ, message):
    with pytest.raises(ConfigError) as e:
        _one_step_with({"type": typ, "params": {"lr": 0.1}})
    assert str(e.value).startswith(message)


_SCHEDULE_LR = "must be a learning rate >= 0 (or one per parameter group), got "


@pytest.mark.parametrize("typ, params, message", [
    ("WarmupLR", {"warmup_max_lr": "0.001"}, "'scheduler.params.warmup_max_lr' for WarmupLR " + _SCHEDULE_LR + "'0.001'"),
    ("WarmupLR", {"warmup_min_lr": float("nan")}, "'scheduler.params.warmup_min_lr' for WarmupLR " + _SCHEDULE_LR + "nan"),
    ("WarmupLR", {"warmup_max_lr": -0.01}, "'scheduler.params.warmup_max_lr' for WarmupLR " + _SCHEDULE_LR + "-0.01"),
    ("WarmupDecayLR", {"total_num_steps": "100"}, "'scheduler.params.total_num_steps' for WarmupDecayLR must be a "
                                                  "number, got '100'"),
    ("WarmupCosineLR", {"total_num_steps": 100, "cos_min_ratio": float("inf")},
     "'scheduler.params.cos_min_ratio' for WarmupCosineLR must be a number, got inf"),
    ("OneCycle", {"cycle_min_lr": [0.01, float("nan")], "cycle_max_lr": 0.1},
     "'scheduler.params.cycle_min_lr' for OneCycle " + _SCHEDULE_LR + "[0.01, nan]"),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_momentum": "maybe"},
     "key 'scheduler.params.cycle_momentum' must be true or false, got 'maybe'"),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_min_mom": [0.8, "0.85"]},
     "'scheduler.params.cycle_min_mom' for OneCycle must be a number (or one per parameter group), got "
     "[0.8, '0.85']"),
])
def test_a_schedule_setting_that_is_no_number_or_a_bad_learning_rate_is_refused_at_initialize(typ, params, message):
    """A string learning rate (as a YAML file converted to JSON gives) passed initialize and failed at the first
    step, after the weights had changed, leaving the engine refusing to train or save; a NaN or negative one
    trained on without a word (every weight NaN, or uphill)."""
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias]}]
    with pytest.raises(ConfigError) as e:
        lazytrain.initialize(model=model, model_parameters=groups, config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "scheduler": {"type": typ, "params": params}})
    assert str(e.value) == "config " + message


def test_a_schedule_flag_written_as_a_word_is_read_as_deepspeed_reads_it():
    engine, opt, _, schedule = lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.99]}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_momentum": "false"}}})
    assert schedule.cycle_momentum is False and tuple(opt.param_groups[0]["betas"]) == (0.9, 0.99)


def test_one_cycle_momenta_given_per_group_are_taken_as_deepspeed_takes_them():
    """A list of momenta (one per group, which DeepSpeed's OneCycle reads) was refused as 'must be a number'."""
    from deepspeed.runtime.lr_schedules import OneCycle as DeepSpeedOneCycle
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4,
              "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": [0.9, 0.95]}

    def groups():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        return model, [{"params": model[0].parameters()}, {"params": model[1].parameters(), "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups()[1], lr=1e-3)
    DeepSpeedOneCycle(reference, **params).step()
    model, model_groups = groups()
    engine, opt, _, schedule = lazytrain.initialize(model=model, model_parameters=model_groups, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "OneCycle", "params": params}})
    schedule.step()
    assert [tuple(g["betas"]) for g in opt.param_groups] == [tuple(g["betas"]) for g in reference.param_groups] \
        == [(0.875, 0.99), (0.9249999999999999, 0.99)]


@pytest.mark.parametrize("params, adam_w_mode, amsgrad", [
    ({"adam_w_mode": "false"}, False, False), ({"adam_w_mode": 0, "amsgrad": "true"}, False, True),
    ({"amsgrad": "false"}, True, False), ({"amsgrad": 1}, True, True),
])
def test_adam_flags_written_as_words_or_numbers_are_read_as_deepspeed_reads_them(params, adam_w_mode, amsgrad):
    """adam_w_mode "false" read as true (the truth value of a string) and trained AdamW; amsgrad "false" reached
    torch's fused kernel as a string and failed the first step."""
    model = torch.nn.Linear(2, 2)   # no streamed blocks: torch's Adam or AdamW
    _, opt, _, _ = lazytrain.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1, **params}}})
    assert type(opt) is (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)
    assert opt.param_groups[0]["amsgrad"] is amsgrad


@pytest.mark.parametrize("torch_adam, weight_decay", [(True, 0.01), ("true", 0.01), (0, 0.0), ("false", 0.0)])
def test_torch_adam_sets_torchs_default_weight_decay_however_it_is_written(torch_adam, weight_decay):
    _, opt, _, _ = lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": torch_adam}}})
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == weight_decay


@pytest.mark.parametrize("off", [False, 0, "false"])
def test_adam_without_bias_correction_is_refused_however_it_is_written(off):
    """bias_correction 0 (false to DeepSpeed's FusedAdam and CPUAdam) was dropped without a word, and the run
    corrected the bias."""
    with pytest.raises(ConfigError, match=r"^config 'optimizer.params.bias_correction' = false is not supported"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "bias_correction": off}}})


def test_a_bad_parameter_of_a_torch_optimizer_is_named_with_its_section():
    with pytest.raises(ConfigError, match=r"config 'optimizer.params' for RMSprop: .*'betas'"):
        _one_step_with({"type": "RMSprop", "params": {"lr": 0.1, "betas": [0.9, 0.99]}})


@pytest.mark.parametrize("params, says", [
    ({"lr": -0.1}, r"config 'optimizer.params' for AdamW: Invalid learning rate: -0.1"),
    ({"lr": 0.1, "eps": -1}, r"config 'optimizer.params' for AdamW: Invalid epsilon value: -1"),
    ({"lr": 0.1, "betas": [0.9]}, r"config 'optimizer.params.betas' must be two numbers, got \[0.9\]"),
])
def test_a_bad_parameter_of_torchs_adamw_is_named_with_its_section(params, says):
    with pytest.raises(ConfigError, match=says):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={   # no streamed blocks: torch's AdamW
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": params}})


_HYBRID_PARAMS = r"config 'optimizer.params' for AdamW8bit \(or a parameter group passed to initialize\): "


@pytest.mark.parametrize("params, says", [
    ({"lr": 0.1, "amsgrad": True}, _HYBRID_PARAMS + r".*'amsgrad'"),
    ({"lr": -0.1}, _HYBRID_PARAMS + r"lr must be >= 0, got -0.1"),
    ({"lr": float("nan")}, _HYBRID_PARAMS + r"lr must be >= 0, got nan"),
])
def test_a_bad_parameter_of_the_8bit_optimizer_is_named_with_its_section(params, says):
    with pytest.raises(ConfigError, match=says):
        _one_step_with({"type": "AdamW8bit", "params": params})


@pytest.mark.parametrize("typ", ["AdamW", "AdamW8bit"])
@pytest.mark.parametrize("key, value", [("lr", "3e-4"), ("eps", "1e-8"), ("weight_decay", [0.1])])
def test_an_adam_setting_that_is_no_number_is_refused_by_key(typ, key, value):
    """A string learning rate reached torch's check as "'<=' not supported between 'float' and 'str'"."""
    with pytest.raises(ConfigError, match=rf"^config 'optimizer.params.{key}' for {typ} must be a number, "
                                          rf"got {re.escape(repr(value))}$"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": typ, "params": {key: value}}})


def test_the_hybrid_optimizer_runs_adam_with_l2_decay_when_adam_w_mode_is_false():
    engine, _, _, _ = _one_step_with({"type": "HybridAdamW", "params": {"lr": 0.1, "adam_w_mode": False}})
    assert [g["adamw_mode"] for g in engine.optimizer.param_groups] == [False]


@pytest.mark.parametrize("size", [16, 100, 32768])
def test_a_quant_block_size_the_8bit_kernels_cannot_run_is_refused_at_parsing(size):
    says = (f"config key 'lazytrain.quant_block_size' must be >= 32, got {size}" if size < 32 else
            f"config key 'lazytrain.quant_block_size' must be a multiple of 32 from 32 to 16384, got {size}")
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_config({"train_batch_size": 2, "lazytrain": {"quant_block_size": size}})


def test_auto_left_in_zero_tuning_keys_lazytrain_ignores_is_dropped_as_deepspeed_drops_it():
    """TRL's reference model copies the config before Trainer fills its "auto" values: DeepSpeed's models
    drop "auto" and take their defaults; where LazyTrain uses the value, "auto" stays an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # and nothing to say about keys left at "auto"
        cfg = parse_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "offload_param": {"device": "cpu", "buffer_size": "auto"}}})
    assert cfg.zero_stage == 3 and "reduce_bucket_size" not in cfg.raw["zero_optimization"]
    with pytest.raises(ConfigError, match="config key 'zero_optimization.stage' is \"auto\""):
        parse_config({"train_batch_size": 2, "zero_optimization": {"stage": "auto"}})


def test_a_config_schedule_without_an_optimizer_is_not_built_as_deepspeed_does():
    """An evaluation run (Trainer's evaluate() before train(), under the stock ZeRO-3 config) keeps the
    config's scheduler section and drops its optimizer: DeepSpeed evaluates, and so does LazyTrain."""
    engine, optimizer, _, scheduler = lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    assert optimizer is None and scheduler is None and engine.lr_scheduler is None
    with torch.no_grad():
        assert engine(torch.ones(1, 2)).shape == (1, 2)


def test_parameter_groups_as_torch_reads_them_and_an_optimizer_object_without_model_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    groups = [{"params": model[0].weight, "weight_decay": 0.0},               # one tensor
              {"params": [("bias", model[0].bias)]},                             # (name, parameter) pairs
              {"params": list(model[1].parameters()), "lr": 0.5}]
    engine, optimizer, _, _ = lazytrain.initialize(model=model, model_parameters=groups, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1, 2]
    engine.backward(engine(torch.ones(2, 2)).sum())
    engine.step()
    other = torch.nn.Linear(2, 2)   # an optimizer object keeps its groups: model_parameters unused, as in DeepSpeed
    _, given, _, _ = lazytrain.initialize(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                                          model_parameters=[], config={"train_batch_size": 2})
    assert len(given.param_groups[0]["params"]) == 2


def test_hybrid_adamw_settings_given_as_optimizer_params_are_named_with_where_they_belong():
    with pytest.raises(ConfigError, match="config 'optimizer.params.optimizer_states' is not an optimizer parameter "
                                          "here: set 'lazytrain.optimizer_states' instead"):
        lazytrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "HybridAdamW", "params": {"optimizer_states": "8bit"}}})


@pytest.mark.parametrize("typ, states, kept", [("HybridAdamW", None, "8bit"), ("HybridAdamW", "fp32", "fp32"),
                                               ("HybridAdamW", "8bit", "8bit"), ("AdamW8bit", None, "8bit"),
                                               ("AdamW8bit", "8bit", "8bit"), ("AdamW", None, "fp32")])
def test_the_8bit_types_keep_the_states_lazytrain_optimizer_states_names(typ, states, kept):
    """HybridAdamW with 'lazytrain.optimizer_states' "fp32" kept 8-bit moments without a word (the message for
    the key under optimizer.params sends users there)."""
    section = {"policy": "keep_all"} if states is None else {"policy": "keep_all", "optimizer_states": states}
    cfg = {"train_batch_size": 2, "optimizer": {"type": typ, "params": {"lr": 0.1}}, "lazytrain": section}
    assert parse_config(cfg).lazytrain.optimizer_states == kept
    engine, _, _, _ = lazytrain.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    if typ != "AdamW":
        assert [g["optimizer_states"] for g in engine.optimizer.param_groups] == [kept]


def test_adamw8bit_with_fp32_states_is_refused():
    with pytest.raises(ConfigError, match=re.escape(
            "config 'optimizer.type' 'AdamW8bit' keeps 8-bit Adam moments, and 'lazytrain.optimizer_states' is "
            "\"fp32\": for fp32 moments name the type \"AdamW\" (or \"HybridAdamW\"), or remove the key")):
        parse_config({"train_batch_size": 2, "optimizer": {"type": "AdamW8bit"},
                      "lazytrain": {"optimizer_states": "fp32"}})


@pytest.mark.parametrize("key, value", [("overlap_optimizer", 1), ("overlap_optimizer", 0), ("overlap_optimizer", 0.0),
                                        ("last_segment_graph", 1), ("last_segment_graph", 0)])
def test_switches_read_as_true_or_false_refuse_numbers(key, value):
    """The engine reads these switches as true, false or "auto": a 1 would pass a membership test (1 == True)
    and then count as off; it is refused by name."""
    with pytest.raises(ConfigError, match=rf"config key 'lazytrain.{key}' must be \"auto\", true or false"):
        parse_config({"train_batch_size": 2, "lazytrain": {key: value}})


@pytest.mark.parametrize("fp16", [{"enabled": False}, {"enabled": True, "loss_scale": 128}])
def test_the_dynamic_scalers_settings_are_range_checked_only_where_it_runs_as_deepspeed_does(fp16):
    """A disabled or static-scale fp16 section carrying values the dynamic scaler would refuse: DeepSpeed 0.19.8
    takes it (its checks run only for fp16 with loss_scale 0), and so does LazyTrain; their types are checked."""
    unused = {"loss_scale_window": 0, "min_loss_scale": 0, "hysteresis": 0, "initial_scale_power": 2000}
    cfg = parse_config({"train_batch_size": 2, "fp16": {**fp16, **unused}})
    assert cfg.fp16.enabled == fp16["enabled"]
    with pytest.raises(ConfigError, match=r"^config key 'fp16.loss_scale_window' must be a whole number, got 0.5$"):
        parse_config({"train_batch_size": 2, "fp16": {**fp16, "loss_scale_window": 0.5}})


@pytest.mark.parametrize("value", ["16", True, -3, 0, 2.5])
def test_seq_len_must_be_a_whole_number_of_tokens(value):
    with pytest.raises(ConfigError, match=r"config key 'lazytrain.seq_len' must be a whole number of tokens >= 1"):
        parse_config({"train_batch_size": 2, "lazytrain": {"seq_len": value}})


@pytest.mark.parametrize("config, error, message", [
    ({"fp16": {"enabled": True, "loss_scale": math.inf}}, ConfigError,
     "config key 'fp16.loss_scale' must be a finite number, got inf"),   # every step was skipped as an overflow
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ConfigError, "config key 'fp16.min_loss_scale' must be > 0, got 0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ConfigError,   # a ZeroDivisionError in the scaler
     "config key 'fp16.loss_scale_window' must be >= 1, got 0"),
    ({"fp16": {"enabled": True, "min_loss_scale": math.inf}}, ConfigError,
     "config key 'fp16.min_loss_scale' must be a finite number, got inf"),
    ({"fp16": {"enabled": True, "loss_scale_window": math.inf}}, ConfigError,
     "config key 'fp16.loss_scale_window' must be a finite whole number, got inf"),   # was an OverflowError
    ({"fp16": {"enabled": True, "initial_scale_power": 1024}}, ConfigError,
     "config key 'fp16.initial_scale_power' must be at most 1023 (the loss scale is 2**power, a float), got 1024"),
    ({"lazytrain": {"hybrid_threshold": math.inf}}, ConfigError,
     "config key 'lazytrain.hybrid_threshold' must be a finite whole number, got inf"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 0}, BatchConfigError,   # were ZeroDivisionErrors
     "Gradient accumulation steps: 0 has to be greater than 0"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 0}, BatchConfigError,
     "Micro batch size per gpu: 0 has to be greater than 0"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": 5}}}, ConfigError,
     "config key 'zero_optimization.offload_param.nvme_path' must be a directory path, got 5"),
    ({"lazytrain": {"nvme_path": 5}}, ConfigError, "config key 'lazytrain.nvme_path' must be a directory path, got 5"),
    ({"lazytrain": {"fp32_state_patterns": ["norm", "("]}}, ConfigError,
     "config key 'lazytrain.fp32_state_patterns' holds '(', which is not a regular expression: missing ), "
     "unterminated subpattern at position 0"),
    ({"wall_clock_breakdown": 2}, ConfigError, "config key 'wall_clock_breakdown' must be true or false, got 2"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, ConfigError,
     "config key 'optimizer.type' must be a string such as \"AdamW\" (or leave the section out), got None"),
])
def test_values_no_run_can_use_are_refused_by_name(config, error, message):
    with pytest.raises(error) as e:
        parse_config({"train_batch_size": 2, **config}, world_size=1)
    assert str(e.value) == message


def test_a_config_file_naming_a_key_twice_is_refused_as_deepspeed_refuses_it(tmp_path):
    """json keeps the last of two, so a pasted second section changed the run without a word."""
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "gradient_clipping": 0.5, "gradient_clipping": 2.0}')
    with pytest.raises(ConfigError, match=r"^config names 'gradient_clipping' twice in one object; keep one$"):
        parse_config(str(path), world_size=1)


def test_configs_deepspeed_reads_are_read_as_it_reads_them():
    import base64
    import json
    import pathlib
    cfg = {"train_batch_size": 4, "lazytrain": {"nvme_path": "/tmp/x?>~~"}}
    urlsafe = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()   # DeepSpeed's launcher writes these
    assert "-" in urlsafe and parse_config(urlsafe, world_size=1).lazytrain.nvme_path == "/tmp/x?>~~"
    wrapped = "\n".join(urlsafe[i:i + 16] for i in range(0, len(urlsafe), 16))   # as the base64 command writes it
    assert parse_config(wrapped, world_size=1).lazytrain.nvme_path == "/tmp/x?>~~"
    given = {"train_batch_size": 2, "zero_optimization": {"offload_param": {"device": "nvme",
                                                                            "nvme_path": pathlib.Path("/tmp/nv")}}}
    assert parse_config(given, world_size=1).offload_param.nvme_path == "/tmp/nv"
    for empty in ("optimizer", "scheduler"):   # an empty section: none
        parsed = parse_config({"train_batch_size": 2, empty: {}}, world_size=1)
        assert (parsed.optimizer.type, parsed.scheduler.type) == (None, None)
    for old, stage in ((True, 1), (False, 0)):
        with pytest.warns(UserWarning, match=r"'zero_optimization': (true|false) is DeepSpeed's deprecated form"):
            assert parse_config({"train_batch_size": 2, "zero_optimization": old}, world_size=1).zero_stage == stage
    said_off = {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": "false"}}
    assert parse_config(said_off, world_size=1).lazytrain.boundary_home != "host"   # "false" turned it on


def test_a_config_file_with_comments_is_read_with_hjson_as_deepspeed_reads_it(tmp_path, monkeypatch):
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text('{\n  // from a DeepSpeed example\n  "train_batch_size": 8,\n  "gradient_clipping": 0.5,\n}\n')
    assert parse_config(str(path), world_size=1).gradient_clipping == 0.5
    path.write_text('{"train_batch_size": 8, "gradient_clipping": 0.5, // twice\n "gradient_clipping": 2}')
    with pytest.raises(ConfigError, match=r"^config names 'gradient_clipping' twice in one object; keep one$"):
        parse_config(str(path), world_size=1)
    monkeypatch.setitem(__import__("sys").modules, "hjson", None)   # not installed: the reason, and the remedy
    path.write_text('{"train_batch_size": 8, // a comment\n}')
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))} is not valid JSON: .*pip install "
                                          rf"hjson to read it so\)$"):
        parse_config(str(path), world_size=1)


def test_a_config_path_that_is_a_directory_or_not_text_is_refused_by_name(tmp_path):
    """A directory raised IsADirectoryError and a binary file UnicodeDecodeError, neither naming the config."""
    with pytest.raises(ConfigError, match=rf"^config {re.escape(repr(str(tmp_path)))} is a directory, not a JSON "
                                          rf"file$"):
        parse_config(str(tmp_path), world_size=1)
    path = tmp_path / "ds.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))} is not UTF-8 text: .*invalid start "
                                          rf"byte$"):
        parse_config(path, world_size=1)


def test_a_tiers_budget_given_twice_is_refused():
    """'lazytrain.gpu_memory' silently replaced 'lazytrain.capacities.hbm' (a user tier's two budgets are refused)."""
    with pytest.raises(ConfigError) as e:
        parse_config({"train_batch_size": 2, "lazytrain": {"gpu_memory": "10GB", "capacities": {"hbm": "5GB"}}})
    assert str(e.value) == ("config keys 'lazytrain.gpu_memory' and 'lazytrain.capacities.hbm' both give tier 'hbm' a "
                            "budget ('10GB' and '5GB'): give the budget in one place")
    assert parse_config({"train_batch_size": 2, "lazytrain": {"host_memory": "5GB", "capacities": {"host": 5e9}}}) \
        .lazytrain.capacities == {"host": 5 * 10**9}   # the same budget twice: one budget
    assert parse_config({"train_batch_size": 2, "lazytrain": {"gpu_memory": None, "capacities": {"hbm": "8GB"}}}) \
        .lazytrain.capacities == {"hbm": 8 * 10**9}   # null is no budget given
