"""Lean RMSNorms (engine/lean_norms.py) at their edges:

- a norm called by keyword (``norm(hidden_states=h)``) runs as it did before;
- a module named like an RMSNorm that draws random numbers gets the gradients plain autograd gives;
- a set-up that fails after the norms were made lean hands them back (as ``destroy`` does), and the
  model's gradient checkpointing flags with them;
- a measured profile's saved bytes are planned with the norms' setting they were measured with."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.lean_norms import make_norms_lean, restore_norms
from lazytrain.planner.plan import keep_all_plan

transformers = pytest.importorskip("transformers")
from engine_models import batches, lm_loss, make_hf_model   # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")


class KeywordRMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, hidden_states):
        return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class KeywordBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = KeywordRMSNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(hidden_states=x))


def test_a_norm_called_by_keyword_runs_as_written():
    torch.manual_seed(0)
    blocks = nn.ModuleList([KeywordBlock(8) for _ in range(2)])
    x = torch.randn(2, 3, 8, requires_grad=True)
    grads = {}
    for lean in (False, True):
        norms = make_norms_lean(blocks) if lean else []
        blocks.zero_grad()
        h = x
        for b in blocks:
            h = b(h)
        h.square().sum().backward()
        grads[lean] = [p.grad.clone() for p in blocks.parameters()]
        restore_norms(norms)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


class DropRMSNorm(nn.Module):
    """A user's norm, named as RMSNorms are, that drops out its input in training."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        x = F.dropout(x, 0.5, self.training)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.parametrize("eval_between", [False, True], ids=["train", "eval-before-backward"])
def test_a_norm_drawing_random_numbers_gets_plain_autograds_gradients(eval_between):
    """Also with the model put in eval() between its forward and its backward: the recompute runs in the
    forward's modes (with its dropout), as autograd's recorded graph differentiates it."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(DropRMSNorm(16), nn.Linear(16, 16)) for _ in range(2)])
    x = torch.randn(4, 16, requires_grad=True)
    grads = {}
    for lean in (False, True):
        norms = make_norms_lean(blocks) if lean else []
        blocks.zero_grad()
        blocks.train()
        torch.manual_seed(1)
        h = x
        for b in blocks:
            h = b(h)
        if eval_between:
            blocks.eval()
        torch.manual_seed(2)   # the backward's recompute draws from wherever the generator is by then
        h.square().sum().backward()
        grads[lean] = [p.grad.clone() for p in blocks.parameters()]
        assert all(m.training is not eval_between for m in blocks.modules())   # its modes put back
        restore_norms(norms)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_a_set_up_that_fails_late_hands_the_norms_back():
    model = make_hf_model("llama")
    model.gradient_checkpointing_enable()
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    with pytest.raises(ConfigError, match="profile_path' cannot be written"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazytrain.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "lazytrain": {"device": "cpu", "policy": "auto", "auto": {"profile_path": "/nonexistent-dir/p.json"}}})
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert flagged and all(m.gradient_checkpointing for m in flagged)   # the model's own flags too


def test_a_profile_is_planned_with_the_norms_it_was_measured_with(tmp_path):
    """A profile measured with lean norms (the default), planned for an engine with ``lean_norms: false``:
    its layers save what the norms as written save, not what the lean ones saved."""
    from lazytrain.planner.measured import MachineProfile
    from lazytrain.planner.search import profile_problem
    keep_all_plan(6, home="hbm").to_json(str(tmp_path / "plan.json"))
    profiles = {}
    for lean in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = lazytrain.initialize(model=make_hf_model("llama"), config={
                "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "lazytrain": {"device": "cpu", "policy": "plan", "plan": str(tmp_path / "plan.json"), "seq_len": 12, "overlap_optimizer": True,
                              "lean_norms": lean}})[0]
        (x, y), = batches(1)
        engine.trace_next_step()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        path = str(tmp_path / f"profile-{lean}.json")
        engine._profile_of([engine.last_trace]).to_json(path)
        profiles[lean] = MachineProfile.from_json(path)
        engine.destroy()
    tokens = 2 * 12
    for lean in (True, False):
        written, lean_one = (profile_problem(profiles[k], {"lean_norms": lean}) for k in (False, True))
        # measured as it runs: unchanged
        assert (written if not lean else lean_one).saved == list(profiles[lean].costs.saved_bytes)
        # the other setting's bytes by the estimate's difference: all but the two norms' reciprocal RMS (4 bytes
        # a token each), which the written norms save and the estimate leaves out
        rsqrt = 2 * 4 * tokens
        if lean:
            assert written.saved == [s + rsqrt for s in lean_one.saved]
        else:
            assert lean_one.saved == [s - rsqrt for s in written.saved]
