"""Checkpoints of LazyTrain's first format (tests/data/lazytrain_v1, written before the DeepSpeed layout
replaced it) still resume: weights, moments (fp32, and 8-bit codes), schedule, counters and client state,
exactly as the files hold them."""
import os
import sys

import pytest
import torch

from lazytrain.engine import safe_load

HERE = os.path.join(os.path.dirname(__file__), "data", "lazytrain_v1")
sys.path.insert(0, HERE)
import make_fixtures  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")


def engine_for(name):
    import warnings

    import lazytrain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_fixtures.model(), config=make_fixtures.config(name))
    return engine


@pytest.mark.parametrize("name", list(make_fixtures.CONFIGS))
def test_a_checkpoint_of_the_first_format_resumes_exactly_as_saved(name):
    engine = engine_for(name)
    path, client = engine.load_checkpoint(os.path.join(HERE, name))
    tag_dir = os.path.join(HERE, name, "global_step2")
    assert path == os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    saved = safe_load.load(path)
    optim = safe_load.load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))["optimizer"]
    assert client == {"epoch": 3, "seen": [1, 2]}
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (2, 4, 2)
    assert engine.lr_scheduler.state_dict() == saved["lr_scheduler"]
    weights = engine.module_state_dict()
    assert weights.keys() == saved["module"].keys()
    assert all(torch.equal(weights[k], saved["module"][k]) for k in weights)
    state = engine.optimizer.state_dict()["state"]
    assert state.keys() == optim["state"].keys()
    kinds = set()
    for i, st in optim["state"].items():
        assert state[i].keys() == st.keys()
        for k, v in st.items():
            kinds.add(k)
            assert torch.equal(torch.as_tensor(state[i][k]), torch.as_tensor(v)), (i, k)
    assert ("state1" in kinds) == (name == "bf16_8bit")
    x, y = make_fixtures_batch()
    from engine_models import lm_loss
    engine.backward(lm_loss(engine(x), y))
    engine.step()                                     # and it trains on
    assert engine.global_steps == 3 and all(torch.isfinite(v).all() for v in engine.module_state_dict().values())


def make_fixtures_batch():
    from engine_models import batches
    return batches(3, seq=6)[2]
