"""The planner's host memory is what the engine holds: for the same model and config, ``Problem.host_static``
(fp32 masters apart from the streamed copy, fp32 gradient buffers, Adam moments in fp32 or 8 bits, frozen
weights as their copy alone) against the engine's host tensors counted after a step, for one process and for
each of two sharded ranks. The non-block parameters' compute copies are the device's in the planner; on the CPU
they are host memory too, and are left out here."""
import dataclasses
import os
import warnings

import pytest
import torch

import lazytrain
from lazytrain.engine.placement import planning_budgets
from lazytrain.planner.hardware import CATALOG
from lazytrain.planner.problem import Problem
from lazytrain.planner.search import as_budgets, as_model_shape
from dist_helpers import spawn_cases
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


def _rank_host_bytes(engine, nb_grad_bytes: int) -> float:
    """What one rank of a sharded run holds, as the planner counts it: its streamed layers' state as above,
    a node-shared buffer (the fp32 weights in fp32 training, else the compute copies) as its part of the
    node's one copy, the non-block fp32 masters it keeps (those it owns, where they are apart from the compute
    copies or partitioned) with the gradients it held at the step (``nb_grad_bytes``, counted before it), and
    its share of the moments."""
    w = engine.weights
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if engine.node_shared_weights else 1
    held = 0.0
    if w.weights_tier.kind == "host" and not w.shares_master:
        held += sum(w.layer_numels) * w.compute_dtype.itemsize / per_node
    held += _nbytes(w.master) / (per_node if w.shares_master else 1) + _nbytes(w.frozen_part) + _nbytes(w.grad)
    if engine.masters is not None:
        # another rank's master (stages 1-2) is a placeholder of its shape: one element, seen everywhere
        held += sum(m.untyped_storage().nbytes() for p, m in engine.masters.pairs if id(p) not in engine.masters.elsewhere)
    else:   # fp32 on the CPU: the parameter is its own master
        held += sum(p.numel() * 4 for p in engine.non_block_params if p.requires_grad)
    held += nb_grad_bytes
    held += _nbytes(t for st in engine.optimizer.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)
    return held


def _sharded_rank(rank, world, out_dir, stage, bf16, lora, home):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)   # as torchrun says: every rank on this one node
    section = {"weights_home": home}
    if home == "nvme":
        section["nvme_path"] = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(section["nvme_path"], exist_ok=True)
    cfg = {**_config(bf16, **section), "zero_optimization": {"stage": stage}}
    model = make_model("llama")
    if lora:
        model = add_lora(model, ("q_proj", "v_proj"))
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    (x, y), = batches(1)
    engine.backward(lm_loss(engine(x), y))
    if engine.masters is not None:   # the gradients the non-block parameters hold at the step
        engine.masters.flush_grads()
        nb_grads = _nbytes(m.grad for _, m in engine.masters.pairs)
    else:
        nb_grads = _nbytes(p.grad for p in engine.non_block_params)
    engine.step()
    engine.wait_for_update()
    budgets = as_budgets(planning_budgets(engine._config, engine.tiers, MICRO, SEQ, engine._model_budgets))
    problem = Problem(model=as_model_shape(engine._model_cfg), hardware=CATALOG["h800"], micro_batch=MICRO,
                      seq_len=SEQ, budgets=budgets, check=False)
    out = {"held": _rank_host_bytes(engine, nb_grads), "planned": problem.host_static,
           "whole": Problem(model=problem.model, hardware=CATALOG["h800"], micro_batch=MICRO, seq_len=SEQ,
                            budgets=dataclasses.replace(budgets, optimizer_state_share=1.0, master_share=1.0,
                                                        gradient_share=1.0, non_block_master_share=1.0,
                                                        non_block_gradient_share=1.0,
                                                        weights_copy_share=1.0), check=False).host_static,
           "shared": engine.node_shared_weights}
    engine.destroy()
    return out


SHARDED_CASES = {   # stage, bf16, LoRA, weights home
    "stage1-bf16": (1, True, False, "host"),
    "stage2-bf16": (2, True, False, "host"),
    "stage2-fp32": (2, False, False, "host"),
    "stage3-bf16": (3, True, False, "host"),
    "stage3-fp32": (3, False, False, "host"),
    "stage2-bf16-nvme": (2, True, False, "nvme"),
    "stage2-bf16-lora": (2, True, True, "host"),
}


@pytest.fixture(scope="module")
def sharded_ranks(tmp_path_factory):
    cases = {name: (_sharded_rank, dict(zip(("stage", "bf16", "lora", "home"), spec)))
             for name, spec in SHARDED_CASES.items()}
    return spawn_cases(2, tmp_path_factory.mktemp("sharded-host"), cases)


@pytest.mark.parametrize("case", sorted(SHARDED_CASES))
def test_a_sharded_ranks_planned_host_bytes_are_what_it_holds(sharded_ranks, case):
    """Two ranks on one node: the planner's host state per rank (``Problem.host_static`` with the engine's
    shares) summed over the ranks is what the ranks hold together, exactly (each tensor is owned whole by one
    rank, so a rank's part is near, not at, its share: the balance is checked to one layer), and below what
    one rank would hold unsharded."""
    ranks = sharded_ranks[case]
    assert not isinstance(ranks, Exception), ranks
    stage, bf16, lora, home = SHARDED_CASES[case]
    assert all(r["shared"] == (home == "host") for r in ranks)   # the node's one copy of the streamed weights
    held, planned = sum(r["held"] for r in ranks), sum(r["planned"] for r in ranks)
    assert planned == pytest.approx(held, rel=1e-6), [(r["planned"], r["held"]) for r in ranks]
    for r in ranks:
        assert r["planned"] < r["whole"]
        assert r["held"] == pytest.approx(r["planned"], rel=0.1)   # ownership by whole layers: 6 layers, 2 ranks


def test_the_planner_counts_the_lm_head_the_model_has_not_the_one_its_config_says():
    """A head untied after the model was built (its config still says tied) was left out of the planner's
    host memory: the engine reads the tying off the model."""
    model = make_model("llama")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False))
    shape = as_model_shape(engine._model_cfg)
    in_blocks = {id(p) for b in engine.weights.blocks for p in b.parameters()}
    assert shape.tied_embeddings is False
    assert shape.nonlayer_params == sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)


def test_what_the_engine_reads_off_a_model_where_its_accessors_or_configs_do_not_say():
    """A model whose get_output_embeddings() raises was refused at initialize (its ValueError); a multimodal
    model's use_cache is its text config's (the eval-mode no-KV-cache warning never fired for them)."""
    import types
    transformers = pytest.importorskip("transformers")
    from lazytrain.engine.engine import _config_uses_cache, _embeddings_tied

    class Odd(torch.nn.Module):
        def get_output_embeddings(self):
            raise ValueError("no head here")

    assert _embeddings_tied(Odd()) is None
    gemma3 = transformers.CONFIG_MAPPING["gemma3"]()
    assert getattr(gemma3, "use_cache", None) is None and gemma3.get_text_config().use_cache is True
    assert _config_uses_cache(types.SimpleNamespace(config=gemma3)) is True
    gemma3.get_text_config().use_cache = False
    assert _config_uses_cache(types.SimpleNamespace(config=gemma3)) is False
