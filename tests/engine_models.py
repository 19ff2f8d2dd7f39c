"""Tiny models and a plain-PyTorch reference trainer for the engine's parity tests."""
from __future__ import annotations

import collections
import copy
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from lazytrain.models.decoder import DecoderConfig, build_causal_lm, logits_of
from lazytrain.tiers import Tier, TransferHandle

VOCAB = 32
# where an engine computes when its config leaves 'lazytrain.device' at "auto" (the tests' default): CUDA where it
# exists. A plain-PyTorch reference an auto-device engine is held to runs there too, on the same kernels: a CPU
# reference differs from CUDA by rounding (which AdamW turns into visible differences where a gradient is
# near zero), draws other dropout masks, and a CPU autocast does not reach CUDA ops.
AUTO_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# LAZYTRAIN_TEST_OVERLAP=1: the parity tests' configs turn lazytrain.overlap_optimizer on (a GPU's default), so a
# CPU runs them as a GPU does
OVERLAP_FORCED = os.environ.get("LAZYTRAIN_TEST_OVERLAP") == "1"
# benchmarks/gpu_suite.sh asks for deterministic kernels (the bit-for-bit tests compare two runs; some CUDA
# kernels, such as memory-efficient attention's backward, add in an order of their own unless asked); here, so
# that the ranks the tests spawn run under it too
if os.environ.get("LAZYTRAIN_TEST_DETERMINISTIC") == "1":
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():   # cuDNN's and the flash attention backwards have no deterministic mode
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)


class MLPBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ModuleListLM(nn.Module):
    """A user's own model: blocks in an nn.ModuleList under a non-standard name. Variants below change
    the ``block`` class (or ``_blocks``) and the forward."""
    block = MLPBlock

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.stack = nn.ModuleList(self._blocks(d, n_layers))
        self.extra = nn.ModuleList([nn.Linear(d, d)])   # a smaller list that must not be picked
        self.head = nn.Linear(d, VOCAB)

    def _blocks(self, d: int, n_layers: int) -> list[nn.Module]:
        return [self.block(d) for _ in range(n_layers)]

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x)
        return self.head(self.extra[0](x))


class TupleBlock(MLPBlock):
    """Returns a 1-tuple, as transformers' decoder layers did before 5.0 (the model indexes ``[0]``)."""

    def forward(self, x):
        return (super().forward(x),)


class TupleBlockLM(ModuleListLM):
    block = TupleBlock

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x)[0]
        return self.head(self.extra[0](x))


class BranchLM(ModuleListLM):
    """A non-block layer that only some samples reach (samples whose first token is even), and one that
    none reaches: on a data-parallel rank whose samples all skip the branch, its gradient is None."""

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__(d, n_layers)
        self.side = nn.Linear(d, VOCAB)
        self.unused = nn.Linear(d, d)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x)
        logits = self.head(self.extra[0](x))
        take = (ids[:, 0] % 2 == 0).nonzero().flatten()
        if take.numel():
            logits = logits.index_add(0, take, self.side(x[take]))
        return logits


class UnchainedLM(ModuleListLM):
    """Blocks whose input is not the previous block's output: ``"parallel"`` feeds every block the same
    input and sums their outputs; ``"between"`` changes the hidden state between blocks with a learnable
    non-block scale; ``"in-place"`` scales it in place (the same tensor object, a new version)."""

    def __init__(self, mode: str, d: int = 32, n_layers: int = 6):
        super().__init__(d, n_layers)
        self.mode = mode
        self.between = nn.Parameter(torch.full((d,), 0.9))

    def forward(self, ids):
        x = self.emb(ids)
        if self.mode == "parallel":
            x = x + sum(blk(x) for blk in self.stack)
        elif self.mode == "in-place":
            for blk in self.stack:
                x = blk(x)
                x.mul_(0.9)
        else:
            for blk in self.stack:
                x = blk(x) * self.between
        return self.head(self.extra[0](x))


class IgnoresSideBlock(MLPBlock):
    """Takes a side tensor it does not use."""

    def forward(self, x, side):
        return super().forward(x)


class SideLM(ModuleListLM):
    """Hands every block a tensor made from a trainable parameter outside them, which no block uses: torch runs
    that parameter's post-accumulate-grad hooks with no gradient."""
    block = IgnoresSideBlock

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__(d, n_layers)
        self.side = nn.Parameter(torch.ones(d))

    def forward(self, ids):
        x, side = self.emb(ids), self.side * 1.0
        for blk in self.stack:
            x = blk(x, side)
        return self.head(self.extra[0](x))


class AuxLossBlock(MLPBlock):
    """Returns its hidden state and an auxiliary loss (as a mixture-of-experts block may)."""

    def forward(self, x):
        h = self.fc1(self.norm(x))
        return x + self.fc2(F.gelu(h)), h.pow(2).mean()


class AuxLossLM(ModuleListLM):
    """Adds the blocks' auxiliary losses into ``self.aux`` for the training loss."""
    block = AuxLossBlock

    def forward(self, ids):
        x, self.aux = self.emb(ids), 0.0
        for blk in self.stack:
            x, aux = blk(x)
            self.aux = self.aux + aux
        return self.head(self.extra[0](x))


class NestedAuxLossBlock(MLPBlock):
    """Returns its hidden state and two auxiliary losses nested in a dict and a list."""

    def forward(self, x):
        h = self.fc1(self.norm(x))
        return [x + self.fc2(F.gelu(h)), {"aux": (h.pow(2).mean(), [h.abs().mean()]), "note": "kept"}]


class NestedAuxLossLM(ModuleListLM):
    """Adds the auxiliary losses its blocks return nested into ``self.aux``."""
    block = NestedAuxLossBlock

    def forward(self, ids):
        x, self.aux = self.emb(ids), 0.0
        for blk in self.stack:
            out = blk(x)
            assert isinstance(out, list) and out[1]["note"] == "kept"   # handed back as the block returned it
            x, (square, [absolute]) = out[0], out[1]["aux"]
            self.aux = self.aux + square + absolute
        return self.head(self.extra[0](x))


class SinkBlock(MLPBlock):
    """Appends a statistic of its activations to a list the model hands every block."""

    def forward(self, x, sink):
        h = self.fc1(self.norm(x))
        sink.append(h.pow(2).mean())
        return x + self.fc2(F.gelu(h))


class SinkLM(ModuleListLM):
    """Hands its blocks a list to append to: a new one per forward, or with ``keep`` one for all."""

    block = SinkBlock

    def __init__(self, d: int = 32, n_layers: int = 6, keep: bool = False):
        super().__init__(d, n_layers)
        self.keep, self.sink = keep, []

    def forward(self, ids):
        x = self.emb(ids)
        if not self.keep:
            self.sink = []
        for blk in self.stack:
            x = blk(x, self.sink)
        return self.head(self.extra[0](x))


class ScaledBlock(MLPBlock):
    def forward(self, x, ctx):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * ctx["scale"]


class ReusedDictLM(ModuleListLM):
    """Hands every block the same dict, with a per-layer entry changed before each call."""
    block = ScaledBlock

    def forward(self, ids):
        x, ctx = self.emb(ids), {}
        for i, blk in enumerate(self.stack):
            ctx["scale"] = 0.5 + 0.25 * i
            x = blk(x, ctx)
        return self.head(self.extra[0](x))


class WideBlock(MLPBlock):
    def __init__(self, d: int, mult: int):
        super().__init__(d)
        self.fc1, self.fc2 = nn.Linear(d, mult * d), nn.Linear(mult * d, d)


class MixedBlocksLM(ModuleListLM):
    """Blocks that differ in size and structure (as DeepSeek-V3's dense first layer before its MoE ones):
    odd blocks are wider than even ones, each wider than the last, and block 1 has no norm."""

    def _blocks(self, d: int, n_layers: int) -> list[nn.Module]:
        blocks = [MLPBlock(d) if i % 2 == 0 else WideBlock(d, 1 + i) for i in range(n_layers)]
        blocks[1].norm = nn.Identity()   # a block with fewer parameters
        return blocks


class SharedState(collections.UserDict):
    """A mapping the model hands every block (as Gemma 3n/4 hand ``shared_kv_states``)."""


class SharedStateBlock(MLPBlock):
    def __init__(self, d: int, index: int, store: bool, read_from: int | str | None):
        super().__init__(d)
        self.index, self.store, self.read_from = index, store, read_from

    def forward(self, x, shared):
        h = self.fc1(self.norm(x))
        if self.store:
            shared[f"block{self.index}"] = h
        if self.read_from is not None:
            h = h + shared[f"block{self.read_from}"]
        return x + self.fc2(F.gelu(h))


class SharedStateLM(ModuleListLM):
    """Block 1 stores an intermediate in the shared mapping; with ``read``, block 3 reads it. With
    ``model_writes``, the model puts a learnable tensor there and block 2 reads it."""

    def __init__(self, read: bool, model_writes: bool = False, d: int = 32, n_layers: int = 6):
        super().__init__(d, n_layers)
        torch.manual_seed(0)
        self.stack = nn.ModuleList(SharedStateBlock(d, i, store=i == 1, read_from=1 if read and i == 3 else None)
                                   for i in range(n_layers))
        if model_writes:
            self.stack[2].read_from = "model"
            self.shared_bias = nn.Parameter(torch.zeros(2 * d))

    def forward(self, ids):
        x, shared = self.emb(ids), SharedState()
        if hasattr(self, "shared_bias"):
            shared["blockmodel"] = self.shared_bias * 1.0
        for blk in self.stack:
            x = blk(x, shared)
        return self.head(self.extra[0](x))


class CheckpointingLM(ModuleListLM):
    """Gradient checkpointing the way transformers 4.x decoders do it: a flag on the module that holds
    the layers, and each layer call wrapped in reentrant ``torch.utils.checkpoint``."""

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__(d, n_layers)
        self.gradient_checkpointing = True

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(blk.__call__, x, use_reentrant=True)
            else:
                x = blk(x)
        return self.head(self.extra[0](x))


def make_model(kind: str, n_layers: int = 6) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                            num_attention_heads=4, num_key_value_heads=2)
        return build_causal_lm(cfg, prefer_transformers=True)
    if kind == "decoder":
        cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                            num_attention_heads=4, num_key_value_heads=2)
        return build_causal_lm(cfg, prefer_transformers=False)
    if kind == "tuple-blocks":
        return TupleBlockLM(n_layers=n_layers)
    if kind == "branch":
        return BranchLM(n_layers=n_layers)
    if kind in ("parallel", "between", "in-place"):
        return UnchainedLM(kind, n_layers=n_layers)
    if kind == "reused-dict":
        return ReusedDictLM(n_layers=n_layers)
    if kind in ("sink", "kept-sink"):
        return SinkLM(n_layers=n_layers, keep=kind == "kept-sink")
    if kind == "aux-loss":
        return AuxLossLM(n_layers=n_layers)
    if kind == "unused-side":
        return SideLM(n_layers=n_layers)
    if kind == "nested-aux-loss":
        return NestedAuxLossLM(n_layers=n_layers)
    if kind == "checkpointing":
        return CheckpointingLM(n_layers=n_layers)
    if kind == "mixed-blocks":
        return MixedBlocksLM(n_layers=n_layers)
    if kind in ("shared-store", "shared-read", "shared-model-write"):
        return SharedStateLM(read=kind == "shared-read", model_writes=kind == "shared-model-write", n_layers=n_layers)
    return ModuleListLM(n_layers=n_layers)


class LoRALinear(nn.Module):
    """A low-rank adapter around a frozen ``nn.Linear``, laid out as PEFT's: the frozen base first, then the
    trainable ``lora_A`` and ``lora_B`` (so a block's trainable tensors do not come first in its own order)."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)   # not PEFT's zeros: every adapter gets a gradient at once
        self._disable_adapters = False   # PEFT's switch, which its model.disable_adapter() sets

    def forward(self, x):
        if self._disable_adapters:
            return self.base(x)
        return self.base(x) + self.lora_B(self.lora_A(x))


def add_lora(model: nn.Module, targets: tuple[str, ...], rank: int = 4) -> nn.Module:
    """A LoRA fine-tuning set-up: each ``nn.Linear`` whose attribute name is in ``targets`` wrapped in a
    :class:`LoRALinear`, and every parameter but the adapters' frozen (embeddings, norms and head too)."""
    torch.manual_seed(1)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def around_each_forward(layer: nn.Module, context) -> list:
    """Runs each forward of ``layer`` inside ``context(outside)``, ``outside`` being the tensors the call passes
    in and the layer's parameters (what the engine's saved-bytes measurement leaves out); returns the contexts
    entered, the latest last."""
    entered = []

    def enter(module, args, kwargs):
        outside = [t for v in (*args, *kwargs.values()) for t in (v if isinstance(v, tuple) else (v,))
                   if isinstance(t, torch.Tensor)] + list(module.parameters())
        entered.append(context(outside))
        entered[-1].__enter__()

    def leave(module, args, kwargs, out):
        entered[-1].__exit__(None, None, None)

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(leave, with_kwargs=True)
    return entered


def make_hf_model(family: str, n_layers: int = 6, dropout: float = 0.0) -> nn.Module:
    """A tiny transformers causal LM of another family, built as users build them (``use_cache`` left at
    its default, on). GPT-2's blocks live at ``transformer.h``; the others at ``model.layers``."""
    import transformers as T
    torch.manual_seed(0)
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=n_layers, n_head=4,
                                              n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
                                              attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=dropout)
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if family == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    if family == "mistral":   # a sliding window shorter than the test sequence
        return T.MistralForCausalLM(T.MistralConfig(sliding_window=8, **common))
    if family == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, **common))
    if family == "gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **common))
    if family == "gemma2":    # alternating sliding-window and global layers, logit soft-capping
        return T.Gemma2ForCausalLM(T.Gemma2Config(head_dim=8, sliding_window=8, pad_token_id=0, **common))
    if family == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **common))
    if family == "mixtral":   # mixture of experts in every block
        return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    if family == "deepseek_v3":   # a dense first layer, then mixture-of-experts layers: blocks differ
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    if family in ("gemma4", "gemma4-kv-shared"):   # sliding and global layers; the last two may reuse K/V
        return T.Gemma4ForCausalLM(T.Gemma4TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, max_position_embeddings=64,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (n_layers // 2),
            num_kv_shared_layers=2 if family == "gemma4-kv-shared" else 0, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    if family == "qwen2moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=32, **common))
    raise ValueError(family)


def batches(n: int, batch: int = 2, seq: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
            for _ in range(n)]


def lm_loss(out, y):
    """Cross-entropy of the model's logits (on whichever device the engine computed them) against ``y``."""
    logits = logits_of(out)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten().to(logits.device))


def reference_train(model: nn.Module, data, lr=1e-2, wd=0.1, clip=1.0, gas=1, device="cpu", optimizer="torch",
                    step_every: int | None = None):
    """Plain PyTorch on ``device`` (``AUTO_DEVICE`` for an engine on the default device), but for a parameter the
    loss did not reach, which gets a zero gradient as under DeepSpeed: clip_grad_norm_,
    the loss averaged over `gas` micro-batches, then torch's fused AdamW (``optimizer="torch"``) or, for an
    engine whose update overlaps the next forward (``"hybrid"``), the AdamW arithmetic that update runs:
    HybridAdamW on fp32 host copies of the weights (so a weight whose gradient is rounding noise, which Adam
    turns into steps, compares like with like). ``step_every``: a step every so many micro-batches (default
    ``gas``), each loss still divided by ``gas``. The model returned is on ``device``."""
    ref = copy.deepcopy(model).to(device)
    params = [p for p in ref.parameters()]
    if optimizer == "hybrid":
        from lazytrain.optim.hybrid_adamw import HybridAdamW
        masters = [nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in params]
        opt = HybridAdamW(masters, lr=lr, weight_decay=wd, optimizer_states="fp32")
    elif optimizer == "torch":
        masters = params
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    else:
        raise ValueError(f"optimizer must be 'torch' or 'hybrid', got {optimizer!r}")
    for i, (x, y) in enumerate(data):
        (lm_loss(ref(x.to(device)), y) / gas).backward()
        if (i + 1) % (step_every or gas) == 0:
            for p in params:   # a parameter the loss did not reach: a zero gradient, as DeepSpeed and the engine
                if p.requires_grad and p.grad is None:   # give it (its weight decay and momentum still apply)
                    p.grad = torch.zeros_like(p)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            if masters is not params:
                for p, m in zip(params, masters):
                    m.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
            opt.step()
            if masters is not params:
                with torch.no_grad():
                    for p, m in zip(params, masters):
                        p.copy_(m)
            opt.zero_grad()
            ref.zero_grad()
    return ref


def plan_engine(tmp_path, model: nn.Module, plan, testing: dict | None = None, accumulation: int = 1,
                device: str = "cpu", bf16: bool = False):
    """An engine running ``plan`` (written to ``tmp_path``) with the tests' usual AdamW and clipping."""
    import lazytrain
    path = tmp_path / f"{plan.policy}-{len(plan.selective_layers)}-{len(plan.offloaded_layers)}.json"
    plan.to_json(str(path))
    lt = {"policy": "plan", "plan": str(path), "device": device}
    if testing:
        lt["testing"] = testing
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * accumulation, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": lt}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return lazytrain.initialize(model=model, config=cfg)[0]


def train_and_destroy(engine, data) -> dict:
    """Train ``engine`` on ``data`` one step per batch; its module's weights after, and the engine closed."""
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    weights = engine.module_state_dict()
    engine.destroy()
    return weights


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """max over parameters of max|a-b| / max|b|. A module an engine trains is read once the engine's overlapped
    layer updates have landed (on by default on a GPU): its ``state_dict()`` waits for them, as the README
    tells scripts that read weights right after ``engine.step()``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a stage-3 module's warning that its state_dict() is this rank's part
        a.state_dict(), b.state_dict()
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    worst = 0.0
    for k in sa:
        x, y = sa[k].detach().float().cpu(), sb[k].detach().float().cpu()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
    return worst


class DictTier(Tier):
    """A user's own tier: CPU clones in a dict, with no threads of its own."""
    kind = "dict"

    def __init__(self, name, capacity=None):
        super().__init__(name, capacity)
        self.store = {}

    def _write(self, key, tensor, owned):
        self.store[key] = tensor.detach().to("cpu", copy=True)
        return TransferHandle(value=None)

    def _read(self, key, out, device):
        src = self.store[key]
        if out is not None:
            return TransferHandle(value=out.copy_(src))
        return TransferHandle(value=src.to(device) if device is not None else src.clone())

    def _free(self, key):
        del self.store[key]


def fail_gradient_copy(monkeypatch, nth: int) -> None:
    """The ``nth`` copy of a layer's gradient off the device (the gradient sink's, from 1) raises
    ``OSError("a gradient copy failed")``; the others copy as usual."""
    import lazytrain.engine.weights as weights_module
    real, copies = weights_module.async_copy, []

    def failing(*args, **kwargs):
        if kwargs.get("label", "").startswith("grads L"):
            copies.append(1)
            if len(copies) == nth:
                raise OSError("a gradient copy failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(weights_module, "async_copy", failing)
