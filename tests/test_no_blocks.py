"""A model without repeated blocks (the CIFAR example's CNN) trains with nothing streamed."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lazytrain
from engine_models import AUTO_DEVICE, max_rel_diff

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
    ref = copy.deepcopy(net).to(AUTO_DEVICE)   # where the engine keeps the model (nothing streams)
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    with pytest.warns(UserWarning, match="the model has no repeated blocks .* so nothing streams: every parameter "
                                         "stays on the compute device"):
        engine, _, _, _ = lazytrain.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
        x, y = x.to(AUTO_DEVICE), y.to(AUTO_DEVICE)   # the targets must be on the logits' device
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


def test_masters_kept_apart_take_each_gradient_in_fp32_and_copy_the_weights_down():
    """What a GPU run of a block-less model does with its host masters, here with both sides on the CPU:
    gradients accumulate in the masters' fp32 .grad (the parameters keep none), an update of the masters
    reaches the parameters by masters_to_params, and hand_back returns the masters' values."""
    from lazytrain.engine.precision import Masters
    lin = nn.Linear(3, 2)
    w0 = lin.weight.detach().clone()
    masters = Masters(list(lin.parameters()), torch.bfloat16, home=torch.device("cpu"))
    master_w = masters.master_of(lin.weight)
    assert master_w is not lin.weight and master_w.dtype == torch.float32 and torch.equal(master_w, w0)
    assert lin.weight.dtype == torch.bfloat16
    x = torch.randn(4, 3).bfloat16()
    lin(x).sum().backward()
    lin(x).sum().backward()
    assert lin.weight.grad is None
    expected = 2 * (torch.ones(4, 2).bfloat16().t() @ x).float()
    torch.testing.assert_close(master_w.grad, expected, rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        master_w.add_(1.0)
    masters.masters_to_params()
    assert torch.equal(lin.weight, (w0 + 1.0).bfloat16())
    masters.hand_back()
    assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight, w0 + 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host optimizer of a block-less model is a GPU path")
def test_on_a_gpu_a_model_without_blocks_stays_on_the_gpu_and_its_optimizer_runs_on_the_host():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net).cuda()
    cfg = {"train_batch_size": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(2, 3, 32, 32, generator=g).cuda(), torch.randint(0, 10, (2,), generator=g).cuda()
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert all(p.device.type == "cuda" for p in net.parameters())
    state = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert state and all(t.device.type == "cpu" for t in state)
    assert all(p.device.type == "cpu" for g in engine.optimizer.param_groups for p in g["params"])
    assert max_rel_diff(engine.module, ref) < 1e-5


def test_a_vision_language_models_text_layers_are_streamed_not_its_vision_tower():
    """transformers 5 keeps a VLM's language model under model.language_model (Llama 4: language_model.model):
    no known path matched, and the search for a list of identical blocks skipped the text layers (Gemma 4's
    differ in attention) and streamed the vision tower, the language model left on the device. A larger list
    left unstreamed is said, naming the key that picks it."""
    transformers = pytest.importorskip("transformers")
    from lazytrain.engine.blocks import find_blocks
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, max_position_embeddings=64, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config = transformers.Gemma4Config(text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    path, blocks = find_blocks(model)
    assert path == "model.language_model.layers" and len(blocks) == 4

    class Named(nn.Module):   # a list merely named "layers", beside the blocks
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
            self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
    with pytest.warns(UserWarning, match=r"the streamed blocks are 'layers' \(2 blocks, 28 parameters\), and 'blocks' "
                                         r"holds more \(12,480\), which stays on the compute device: if those are the "
                                         r"blocks to stream, name them: \"lazytrain\": \{\"blocks\": \"blocks\"\}"):
        assert find_blocks(Named())[0] == "layers"


def test_lists_of_modules_that_differ_are_named_where_nothing_streams():
    """T5's blocks are found by no search (its first block keeps the relative position bias), and the warning
    said the model had no repeated blocks: it names the largest list, which streams once named."""
    import warnings

    import transformers
    from lazytrain.engine.blocks import find_blocks
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=2,
                                num_heads=4)
    model = transformers.T5ForConditionalGeneration(cfg)
    n = sum(p.numel() for p in model.encoder.block.parameters())
    with pytest.warns(UserWarning) as seen:
        path, blocks = find_blocks(model)
    assert (path, len(blocks)) == ("", 0)
    assert str(seen[0].message).endswith(
        f"The largest list of several modules, 'encoder.block' (3 modules, {n:,} parameters), holds modules that "
        f"differ in structure (T5's first block keeps the position bias), which the search does not take: to "
        f"stream it, name it: \"lazytrain\": {{\"blocks\": \"encoder.block\"}}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_blocks(model, "encoder.block")[1] is model.encoder.block
    with pytest.warns(UserWarning, match=r"stays on the compute device\. If it has blocks, name them"):
        find_blocks(Net())
