"""A causal LM's head and loss in chunks of tokens, so the full logits tensor never exists.

A Hugging Face causal LM given ``labels`` computes ``lm_head`` over every position and then the
cross-entropy in fp32: at micro-batch 144 x 1024 tokens and a 152k vocabulary that is tens of GB of
logits and their gradient, more than the layers' whole working set. With ``lazytrain.loss_chunk_tokens``
set, a training forward with labels runs the model without them, with its head replaced for that call by
one that only keeps its input (the final hidden states) and hands back a zero-byte stand-in for the
logits; the loss is then computed here, ``chunk_tokens`` positions at a time, each chunk's logits
recomputed in backward instead of kept, the head's gradient summed over the chunks in fp32. The loss is Hugging Face's
``ForCausalLMLoss``: labels shifted by one, -100 ignored, summed and divided by ``num_items_in_batch``
when the caller passes it (Trainer does), else averaged over the counted tokens. The output's ``logits``
is None: a training forward with labels gives the loss only.

Only families whose head is a plain linear layer on the last hidden states and whose loss is
``ForCausalLMLoss`` take this path (:data:`FAMILIES`; no soft-capping or logit multiplier; no loss function
the user set with ``model.loss_function = ...``; no forward hook or instance ``forward`` on the head, which
would see or change logits the chunks compute without them), and only with the usual forward arguments:
any other model or argument (TRL's ``fused_lm_head``) keeps the model's forward, as does every forward
without labels or without gradients (evaluation and generation see the logits as usual).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100
# model families whose causal-LM head is a plain linear layer on the last hidden states and whose loss is
# ForCausalLMLoss (others may scale, cap or not shift their logits: they keep their own forward)
FAMILIES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3", "gpt2"}
# arguments such a forward may take; anything else (TRL's fused_lm_head, logits_to_keep) keeps the model's path
FORWARD_KWARGS = {"input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                  "use_cache", "output_attentions", "output_hidden_states", "return_dict", "cache_position",
                  "num_items_in_batch", "token_type_ids"}
_SCALED_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                "lm_head_multiplier")


def applies(model: nn.Module, kwargs: dict, engine_hooks: frozenset = frozenset()) -> bool:
    """Whether this forward can take the chunked path (see the module docstring for what is excluded).
    ``engine_hooks``: ids of the engine's own hooks on modules (ZeRO stage 3 fetches a head's weight with
    them, which the chunked path reads the same), not a user's that would see the logits."""
    if kwargs.get("labels") is None or not torch.is_grad_enabled() or not model.training:
        return False
    if not set(kwargs) <= FORWARD_KWARGS or kwargs.get("return_dict") is False:
        return False
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return False   # PEFT's prompt learning prepends virtual tokens, and -100 labels for them, in its forward
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or "forward" in vars(head) or \
            set(head._forward_hooks) - engine_hooks or set(head._forward_pre_hooks) - engine_hooks:
        return False
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in FAMILIES:
        return False
    if not _uses_causal_lm_loss(model):
        return False
    return all(getattr(config, k, None) in (None, 1, 1.0) for k in _SCALED_HEAD)


def _uses_causal_lm_loss(model: nn.Module) -> bool:
    """Whether the model's loss is transformers' ``ForCausalLMLoss``: not another ``loss_type``, nor a
    function the user set (``model.loss_function = fn``, label smoothing or a z-loss, say)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return getattr(model, "loss_function", None) is ForCausalLMLoss


def forward(model: nn.Module, chunk_tokens: int, args: tuple, kwargs: dict):
    """The model's output with ``loss`` computed chunk by chunk and ``logits`` None."""
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    head = model.get_output_embeddings()
    kept: list[torch.Tensor] = []

    def keep_hidden(hidden: torch.Tensor) -> torch.Tensor:
        kept.append(hidden)
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], head.out_features)   # no bytes behind it

    head.forward = keep_hidden
    try:
        out = model(*args, **kwargs)
    finally:
        del head.forward                                                              # the class's forward again
    if len(kept) != 1:
        raise RuntimeError(f"lazytrain chunked loss: the model called its head {len(kept)} times in one forward; "
                           f"set 'lazytrain.loss_chunk_tokens' to 0 for this model")
    loss = causal_lm_loss(kept[0], head.weight, head.bias, labels, chunk_tokens, num_items)
    # rebuilt so that the loss comes first, as the model's own output has it (out[0] is the loss)
    rest = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **rest)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   chunk_tokens: int, num_items_in_batch=None) -> torch.Tensor:
    """Hugging Face's causal-LM cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels``,
    ``chunk_tokens`` positions at a time, no chunk's logits kept for backward."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] != shifted.shape[0]:
        raise ValueError(f"labels hold {shifted.shape[0]} positions, the hidden states {flat.shape[0]}")
    # which chunks hold a label, read where the labels are (one read, none from the host): a check per
    # chunk on the device would make the host wait for the GPU before every chunk
    live = F.pad(shifted != IGNORE_INDEX, (0, (-shifted.shape[0]) % chunk_tokens)).view(-1, chunk_tokens)
    live = live.any(dim=1).tolist()
    shifted = shifted.to(hidden.device)
    total = _ChunkedCrossEntropy.apply(flat, weight, bias, shifted, chunk_tokens, live)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (shifted != IGNORE_INDEX).sum()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``F.linear(flat, weight, bias)``, a chunk of positions at a time; backward
    computes each chunk's logits again and differentiates them as autograd would, and sums the chunks'
    weight and bias gradients in fp32, cast once to the weight's dtype. Summed by autograd in a bf16
    weight's dtype, the head's gradient took one rounding per chunk (4x the model's own error at 64 chunks).
    A batch whose labels are all ignored still gives the head a (zero) gradient, as the model's own loss does."""

    @staticmethod
    def forward(ctx, flat, weight, bias, shifted, chunk_tokens: int, live: list):
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for part in _live_chunks(flat.shape[0], chunk_tokens, live):
            total = total + _chunk_loss_sum(flat[part], weight, bias, shifted[part])
        ctx.save_for_backward(flat, weight, bias, shifted)
        ctx.chunk_tokens, ctx.live = chunk_tokens, live
        ctx.autocast = _autocast_state(flat.device.type)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        flat, weight, bias, shifted = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(flat) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        wanted = [t for t, need in ((w, need_w), (b, need_b)) if need]
        # the forward's autocast again (backward runs outside it): the gradients of the logits it computed. One
        # context for every chunk, as the forward had, so that the head's low-precision cast is made once
        with torch.autocast(**ctx.autocast):
            for part in _live_chunks(flat.shape[0], ctx.chunk_tokens, ctx.live):
                with torch.enable_grad():
                    h = flat[part].detach().requires_grad_(need_h)
                    loss = _chunk_loss_sum(h, w, b, shifted[part])
                    grads = list(torch.autograd.grad(loss, ([h] if need_h else []) + wanted, grad_total))
                if need_h:
                    grad_h[part] = grads.pop(0)
                if need_w:
                    grad_w += grads.pop(0)
                if need_b:
                    grad_b += grads.pop(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def _autocast_state(device_type: str) -> dict:
    """The caller's autocast for ``device_type``, as ``torch.autocast``'s arguments, to recompute under."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}


def _live_chunks(positions: int, chunk_tokens: int, live: list):
    """The slices of the chunks that hold a label."""
    for k, start in enumerate(range(0, positions, chunk_tokens)):
        if live[k]:
            yield slice(start, start + chunk_tokens)


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
