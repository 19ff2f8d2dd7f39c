"""A model without repeated blocks (the CIFAR example's CNN) trains with nothing streamed."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lazytrain
from engine_models import max_rel_diff

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")


class Net(nn.Module):
    """DeepSpeedExamples' CIFAR-10 network."""

    def __init__(self):
        super().__init__()
        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc3(F.relu(self.fc2(x)))


def test_a_model_without_blocks_trains_like_pytorch_and_says_nothing_streams(tmp_path):
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    with pytest.warns(UserWarning, match="the model has no repeated blocks .* so nothing streams: every parameter "
                                         "stays on the compute device"):
        engine, _, _, _ = lazytrain.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        (F.cross_entropy(ref(x), y) / 2).backward()
        if i % 2:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert engine.plan.num_layers == 0 and engine.global_steps == 3
    assert max_rel_diff(engine.module, ref) < 1e-5
    engine.save_checkpoint(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other, _, _, _ = lazytrain.initialize(model=Net(), config=cfg)
    other.load_checkpoint(str(tmp_path))
    assert max_rel_diff(other.module, engine.module) == 0
    with torch.no_grad():
        assert other.eval()(x).shape == (2, 10)
