"""The planner's host memory is what the engine holds: for the same model and config, ``Problem.host_static``
(fp32 masters apart from the streamed copy, fp32 gradient buffers, Adam moments in fp32 or 8 bits, frozen
weights as their copy alone) against the engine's host tensors counted after a step. The non-block parameters'
compute copies are the device's in the planner; on the CPU they are host memory too, and are left out here."""
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine.placement import planning_budgets
from lazytrain.planner.hardware import CATALOG
from lazytrain.planner.problem import Problem
from lazytrain.planner.search import as_budgets, as_model_shape
from engine_models import add_lora, batches, lm_loss, make_model

MICRO, SEQ = 2, 12


def _config(bf16: bool, **lazytrain_section) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, **lazytrain_section}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _engine_host_bytes(engine) -> int:
    """The host state the planner counts, as the engine holds it: the streamed copies (host tier), the blocks'
    fp32 weights, frozen parts and gradient buffers, the non-block fp32 masters and their gradients (their
    compute copies left out), and the optimizer's state."""
    w = engine.weights
    held = 0
    if w.weights_tier.kind == "host" and not w.shares_master:   # the copies as laid out (the tier's pool rounds
        held += sum(w.layer_numels) * w.compute_dtype.itemsize  # them up to its size classes, which is not counted)
    held += _nbytes(w.master) + _nbytes(w.frozen_part) + _nbytes(w.grad)
    if engine.masters is not None:
        held += sum(master.numel() * 4 * 2 for _, master in engine.masters.pairs)   # fp32 master and gradient
    else:   # fp32 on the CPU: the parameter is its own master; a GPU keeps one apart, beside its fp32 gradient
        held += sum(p.numel() * 4 * 2 for p in engine.non_block_params if p.requires_grad)
    held += _nbytes(t for st in engine.optimizer.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)   # moments (a scalar step count left out)
    return held


CASES = {
    "bf16": (True, False, {}),
    "bf16-8bit-states": (True, False, {"optimizer_states": "8bit", "hybrid_threshold": 1024}),
    "bf16-lora": (True, True, {}),
    "bf16-lora-nvme": (True, True, {"weights_home": "nvme"}),
    "fp32": (False, False, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_planners_host_bytes_are_what_the_engine_holds(case, tmp_path):
    bf16, lora, section = CASES[case]
    if section.get("weights_home") == "nvme":
        section = {**section, "nvme_path": str(tmp_path)}
    model = make_model("llama")
    if lora:
        model = add_lora(model, ("q_proj", "v_proj"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=_config(bf16, **section))
        for x, y in batches(1):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.wait_for_update()
    shape = as_model_shape(engine._model_cfg)
    in_blocks = {id(p) for b in engine.weights.blocks for p in b.parameters()}
    assert shape.nonlayer_params == sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    budgets = as_budgets(planning_budgets(engine._config, engine.tiers, MICRO, SEQ, engine._model_budgets))
    if "8bit" in case:
        assert 0.5 < budgets.hybrid_8bit_fraction < 1
    problem = Problem(model=shape, hardware=CATALOG["h800"], micro_batch=MICRO, seq_len=SEQ, budgets=budgets,
                      check=False)
    held = _engine_host_bytes(engine)
    # 8-bit states round each tensor up to whole blocks of absmax values; everything else is exact
    assert problem.host_static == pytest.approx(held, rel=2e-3 if "8bit" in case else 1e-6), (problem.host_static, held)
    engine.destroy()
