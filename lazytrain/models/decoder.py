"""A Llama-style decoder (RMSNorm, rotary attention, SwiGLU MLP) in plain PyTorch, nanoGPT-sized.

Used by the default job when transformers is not installed; with transformers, ``build_causal_lm``
builds a real ``LlamaForCausalLM`` from the same numbers instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 32
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, self.n_head, self.n_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = h // self.n_head
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        y = self.input_norm(x)
        q = self.q_proj(y).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        y = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyDecoder(nn.Module):
    """Causal LM: ``model(input_ids)`` -> logits. Blocks live in ``self.layers``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init)
        if cfg.tie_word_embeddings:   # as transformers' models tie them
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        t = torch.arange(T, device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[None, None], emb.sin().to(x.dtype)[None, None]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_causal_lm(cfg: DecoderConfig, prefer_transformers: bool = True) -> nn.Module:
    """A ``LlamaForCausalLM`` from transformers when installed (no download), else :class:`TinyDecoder`.
    Both map ``model(input_ids)`` to logits through :func:`logits_of`."""
    if prefer_transformers:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            pass
        else:
            hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                             max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
                             rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                             attn_implementation="sdpa", use_cache=False)
            return LlamaForCausalLM(hf)
    return TinyDecoder(cfg)


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params: int) -> float:
    return 6.0 * n_params  # the paper's convention: 6 * N per token for forward + backward
