"""Model shapes: the per-layer numbers the cost model needs, from a Hugging Face config or a catalog.

A :class:`ModelShape` is a stack of repeated blocks (:class:`LayerShape`) plus the non-repeated
parameters (token embedding, final norm, LM head). Everything is derived analytically:

- parameters per layer: attention projections and the gated MLP (gate, up, down), each with its
  biases where the config says so, and two RMSNorm weights;
- forward FLOPs per token of a layer: ``2 * params`` for the matrix products plus ``2 * S * q_dim``
  for causal attention (QK^T and AV over on average S/2 keys); backward costs twice the forward;
- mixture-of-experts layers (see :class:`MoeShape`) store every expert but a token multiplies only its
  top-k experts and the shared ones: FLOPs and activations come from those, memory and transfers from
  all of them;
- activation bytes per token saved by a layer's forward-with-grad (what its backward reads): what
  transformers' layers save, tensor by tensor (:meth:`LayerShape.saved_bytes_per_token`: the RMSNorms'
  fp32 inputs, normalised inputs and outputs, q, k, v and the attention output, the MLP's gate, up,
  activation and product; the layer input is a boundary);
- the boundary (hidden state) is ``tokens * hidden * dtype_bytes`` bytes;
- hybrid stacks (Qwen3-Next, Qwen3.5: ``layer_types`` or ``full_attention_interval``) mix full-attention
  layers (with Qwen3-Next's output gate and q/k norms) and Gated DeltaNet linear-attention layers
  (:class:`LinearAttention`): its projections count as matrix products, its chunked delta-rule
  recurrence adds a per-token cost that does not grow with the sequence.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import warnings
from dataclasses import dataclass, replace
from typing import Any


def read_json(path: str, error: type[Exception], what: str) -> Any:
    """A local JSON file, or ``error`` naming the file and what it was meant to hold."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{what} file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise error(f"{what} {path!r} is not valid JSON: {e}") from e
    except (OSError, UnicodeDecodeError) as e:   # a directory, no permission, a binary file
        raise error(f"{what} file {path!r} cannot be read: {e}") from None


class ModelShapeError(ValueError):
    """A model description the planner cannot use; the message names the key (and the file it came from)."""


def _whole(value: Any, key: str, least: int = 1) -> int:
    """A count or size of a model config, refused by its key unless a whole number >= ``least``: int() would
    read "4096" or 2.5 as one, and a list would end in a bare TypeError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ModelShapeError(f"model config {key!r} must be an integer >= {least}, got {value!r}")
    return value


def _integral(value: Any) -> Any:
    """A float that is a whole number (2.5e8, 8.0) as that int; anything else as it is, for _whole to judge."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _flag(value: Any, key: str) -> bool:
    """A switch of a model config, refused by its key unless true or false: bool() reads "false" as true."""
    if not isinstance(value, bool):
        raise ModelShapeError(f"model config {key!r} must be true or false, got {value!r}")
    return value


def _optional_whole(cfg: dict[str, Any], key: str, least: int = 1) -> int | None:
    """An optional count of a model config: None where it is absent or null, else as :func:`_whole` reads it."""
    return None if cfg.get(key) is None else _whole(cfg[key], key, least)


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5 ``linear_attention`` layers).

    Why a shape of its own: its cost does not grow with the sequence (a recurrent state per head instead
    of attention over all keys), and it saves different internals for its backward. q and k have
    ``key_heads`` heads, v and the output gate ``value_heads``; q and k are repeated to the value heads
    before the recurrence, which runs in chunks of ``chunk`` tokens (the chunked delta rule)."""
    key_heads: int
    value_heads: int
    key_dim: int            # per head
    value_dim: int          # per head
    conv_kernel: int
    chunk: int = 64

    @property
    def conv_width(self) -> int:
        """q, k and v side by side: what the input projection makes and the causal convolution filters."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim

    def params(self, hidden: int) -> int:
        """in_proj_qkv, in_proj_z (output gate), in_proj_b and in_proj_a (per-head beta and decay), the
        depthwise convolution (no bias), dt_bias and A_log per head, the gated RMSNorm over a value
        head, out_proj."""
        return (hidden * self.conv_width + hidden * self.value_width + 2 * hidden * self.value_heads
                + self.conv_width * self.conv_kernel + 2 * self.value_heads + self.value_dim
                + self.value_width * hidden)

    def mixing_flops_per_token(self) -> float:
        """The chunked delta rule beyond the projections, per token and value head: within its chunk,
        q.k^T, the W = A.k and U = A.v transforms and the intra-chunk output (C*(2*dk + 2*dv)
        multiply-adds), and against the state, W.S, the state update k^T.(U - W.S) and q.S (3*dk*dv)."""
        dk, dv, c = self.key_dim, self.value_dim, self.chunk
        return 2.0 * self.value_heads * (c * (2 * dk + 2 * dv) + 3 * dk * dv)

    def saved_elems_per_token(self) -> int:
        """What its backward reads, per token: the projected q/k/v before and after the convolution
        (2 * conv_width), q and k repeated to the value heads and l2-normalised (2 * value_heads * dk),
        the output gate z, the recurrence output, its normed and gated products (4 * value width), and
        the chunk's intra-chunk matrix (value_heads * chunk)."""
        return (2 * self.conv_width + 2 * self.value_heads * self.key_dim + 4 * self.value_width
                + self.value_heads * self.chunk)

    def transient_elems_per_token(self) -> int:
        """Largest no-grad forward transient: the projections' outputs (q/k/v, z) and the convolved q/k/v."""
        return 2 * self.conv_width + self.value_width

    def selective_elems_per_token(self, hidden: int) -> int:
        """What the selective checkpointing policy keeps of the mixer, per token: the outputs of
        in_proj_qkv (conv_width), in_proj_z (value width), in_proj_b and in_proj_a (one value per value head
        each), the chunked delta rule's output (value width: the "attention" of this mixer) and out_proj
        (hidden)."""
        return self.conv_width + 2 * self.value_width + 2 * self.value_heads + hidden

    def elementwise_flops_per_token(self) -> float:
        """The mixer's operations that are neither projections nor the delta rule, per token: the
        depthwise causal convolution (2 * kernel per channel) and its SiLU (~4 per channel), the l2 norm of
        q and k (~3 per element of q and k repeated to the value heads), and the gated RMSNorm of the
        output (~8 per value element: norm, weight, SiLU of the gate, product)."""
        return (2.0 * self.conv_kernel + 4.0) * self.conv_width + 3.0 * 2 * self.value_heads * self.key_dim \
            + 8.0 * self.value_width


@dataclass(frozen=True)
class LayerShape:
    params: int          # trainable parameters of the block (what is stored, streamed and updated)
    hidden: int
    q_dim: int           # heads * head_dim
    kv_dim: int          # kv_heads * head_dim
    ffn: int             # MLP width one token passes through (MoE: top-k experts + shared experts)
    active_params: int | None = None   # parameters one token multiplies (MoE: fewer than ``params``)
    linear: LinearAttention | None = None   # a Gated DeltaNet token mixer instead of attention
    attn_gate: bool = False  # attention output scaled by a sigmoid gate (Qwen3-Next, Qwen3.5)
    qk_norm: bool = False    # q and k RMS-normalised per head before the rotary embedding (Qwen3, Qwen3.5)
    norm_fp32_weight: bool = False  # RMSNorms scale by (1 + weight) in fp32, cast after (Qwen3-Next, Qwen3.5)
    saved_bytes: int | None = None  # bytes per token its autograd saves, where given; else derived from the shape
    moe_top_k: int = 0       # routed experts a token goes to (a mixture-of-experts layer; 0: a dense MLP)

    @property
    def token_params(self) -> int:
        """Parameters one token multiplies: ``active_params`` where given (MoE), else all of them."""
        return self.params if self.active_params is None else self.active_params

    def fwd_flops_per_token(self, seq_len: int) -> float:
        active = self.token_params
        if self.linear is not None:
            return 2.0 * active + self.linear.mixing_flops_per_token()
        return 2.0 * active + 2.0 * seq_len * self.q_dim

    def saved_bytes_per_token(self, dtype_bytes: int, lean_norms: bool = False) -> int:
        """Bytes per token that autograd keeps from the layer's forward for its backward, tensor by tensor
        as transformers' Llama, Qwen2, Qwen3 and Qwen3.5 layers save them (measured with saved-tensor hooks
        in fp32 and bf16: tests/test_saved_bytes_model.py), the layer input (a boundary) left out:

        - each of the two RMSNorms: its input in fp32 for the variance (a copy below fp32; in fp32 the first
          norm's is the layer input itself and the second's the residual sum), its normalised input (for the
          weight's gradient: fp32 where the norm scales in fp32) and its output (the projections' input);
        - full attention: q and k after the rotary embedding, v (k and v at the key/value heads: SDPA's
          grouped-query path) and the attention output; with q/k norms, each one's input in fp32 (in fp32 the
          projection's output, with its gate half where q and the gate share one) and its normalised input;
          with the output gate, the gate's sigmoid and the gated product (o_proj's input);
        - the MLP: gate, up, activation and product (a mixture-of-experts layer's over its routed width, plus
          each routed copy of the token's input and each expert's output: measured on Qwen3-MoE to within
          the router's few values, tests/test_planner_lean_norms.py);
        - a Gated DeltaNet mixer: :meth:`LinearAttention.saved_elems_per_token` in the compute dtype (not
          measured: on the CPU transformers runs its reference implementation, not the CUDA kernels).

        With ``lean_norms`` (the engine's ``lean_norms``: each RMSNorm keeps only its input and recomputes the
        rest in backward), a norm saves its input (the first's is the layer input) and its output, and q/k
        norms their input (a view of the projection's output: with the output gate, the gate half too).

        Left out: the norms' reciprocal RMS and the attention's log-sum-exp, 4 bytes per token and head each.
        A layer given its ``saved_bytes`` (a block that is no such layer) saves those.
        """
        if self.saved_bytes is not None:
            return self.saved_bytes
        e, h, q, kv = dtype_bytes, self.hidden, self.q_dim, self.kv_dim
        normed = 4 if self.norm_fp32_weight else e
        if lean_norms:
            norms = 3 * e * h
        else:
            norms = (4 * h if e < 4 else 0) + 4 * h + 2 * (normed + e) * h
        # a routed token's gathered input to each of its experts and that expert's output (for the routing weight)
        mlp = 4 * self.ffn * e + 2 * self.moe_top_k * h * e
        if self.linear is not None:
            return norms + mlp + self.linear.saved_elems_per_token() * e
        attn = (2 * q + 2 * kv) * e
        if self.qk_norm and lean_norms:
            attn += e * ((2 * q if self.attn_gate else q) + kv)
        elif self.qk_norm:
            attn += (4 + normed) * (q + kv) + (4 * q if e == 4 and self.attn_gate else 0)
        if self.attn_gate:
            attn += 2 * q * e
        return norms + attn + mlp

    def selective_elems_per_token(self) -> int:
        """Elements per token that a forward under the selective checkpointing policy keeps for its re-runs
        in backward: the outputs of the layer's matrix multiplies and of its attention. Full attention: q
        (q_dim), k and v (2 * kv_dim), the attention output (q_dim; plus q_dim for the output gate's
        projection when ``attn_gate``), o_proj's output (hidden); Gated DeltaNet:
        :meth:`LinearAttention.selective_elems_per_token`; the MLP: gate and up (2 * ffn, for a
        mixture-of-experts layer the active width: top-k routed and shared experts) and down's output
        (hidden). The rest (norms, rotary, activations, products, residual sums) is what the re-runs
        recompute. The router's logits (one per expert) are left out: small beside these."""
        mlp = 2 * self.ffn + self.hidden
        if self.linear is not None:
            return mlp + self.linear.selective_elems_per_token(self.hidden)
        return mlp + 2 * self.q_dim + 2 * self.kv_dim + (self.q_dim if self.attn_gate else 0) + self.hidden

    def elementwise_flops_per_token(self) -> float:
        """FLOPs per token of a forward's operations that are neither matrix products nor attention (which
        :meth:`fwd_flops_per_token` does not count): two RMSNorms (~4 per hidden element each), two residual
        sums (hidden each), the MLP's SiLU (~4 per element) and product (1) over the ffn width; full
        attention: rotary embedding of q and k (~3 per element) and the output gate's sigmoid and product
        (~5 per element) and the q/k norms where there are (~4 per element of q and k); Gated DeltaNet:
        :meth:`LinearAttention.elementwise_flops_per_token`. An estimate:
        on a GPU these operations are bound by memory traffic, not by FLOPs (see problem.py,
        SELECTIVE_RERUN_FLOOR)."""
        base = 10.0 * self.hidden + 5.0 * self.ffn
        if self.linear is not None:
            return base + self.linear.elementwise_flops_per_token()
        return (base + 3.0 * (self.q_dim + self.kv_dim) + (5.0 * self.q_dim if self.attn_gate else 0.0)
                + (4.0 * (self.q_dim + self.kv_dim) if self.qk_norm else 0.0))

    def norm_flops_per_token(self) -> float:
        """The RMSNorms' share of :meth:`elementwise_flops_per_token` (~4 per element: two over the hidden
        state, and q and k per head where they are normed): what lean norms recompute in backward. 0 for a
        block given its ``saved_bytes``: no norms the planner knows of."""
        if self.saved_bytes is not None:
            return 0.0
        return 8.0 * self.hidden + (4.0 * (self.q_dim + self.kv_dim) if self.qk_norm and self.linear is None else 0.0)

    def fwd_transient_elems_per_token(self) -> int:
        """Largest transient of a no-grad forward: gate, up and activation of the MLP (or q,k,v,out)."""
        mixer = (self.linear.transient_elems_per_token() if self.linear is not None
                 else 2 * self.q_dim + 2 * self.kv_dim + self.hidden + (self.q_dim if self.attn_gate else 0))
        return max(3 * self.ffn, mixer)

    def bwd_transient_elems_per_token(self) -> int:
        """Gradient transients of a layer's backward beyond its saved activations (MLP gate/up grads)."""
        return 2 * self.ffn


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts part of a Hugging Face config: routed experts of a gated MLP each."""
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int          # summed width of the always-on shared experts (0: none)
    moe_layers: tuple[bool, ...]
    shared_gate: bool = False  # Qwen2-MoE scales its shared expert by a learnt gate
    router_bias: bool = False  # Ernie 4.5 keeps a learnt correction of each expert's routing score

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.expert_ffn

    def mlp_params(self, hidden: int) -> int:
        """Routed and shared experts, the router (and its per-expert bias where there is one), and the shared
        experts' gate where there is one."""
        return (self.experts * self.expert_params(hidden) + 3 * hidden * self.shared_ffn + hidden * self.experts
                + (self.experts if self.router_bias else 0) + (hidden if self.shared_gate else 0))

    def idle_params(self, hidden: int) -> int:
        """What a token does not multiply: the routed experts it is not sent to."""
        return (self.experts - self.top_k) * self.expert_params(hidden)

    def active_width(self) -> int:
        return self.top_k * self.expert_ffn + self.shared_ffn

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], n_layers: int) -> "MoeShape | None":
        """None for a dense config. Reads the expert keys of Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
        OLMoE, GraniteMoE, GPT-OSS, Llama 4, Ernie 4.5 and Jamba, and which layers are sparse
        (``decoder_sparse_step`` / ``mlp_only_layers``, ``first_k_dense_replace`` / ``moe_layer_freq``,
        ``interleave_moe_layer_step``, ``expert_layer_period`` / ``expert_layer_offset``, ``moe_layer_interval``
        / ``moe_layer_start_index`` / ``moe_layer_end_index``; every layer otherwise)."""
        counts = [_optional_whole(cfg, k, least=0) for k in ("num_local_experts", "num_experts", "n_routed_experts",
                                                                "moe_num_experts")]   # the last: Ernie 4.5
        experts = next((n for n in counts if n is not None and n > 1), None)
        if experts is None:
            return None
        top_k = next((cfg[k] for k in ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "moe_top_k")
                      if cfg.get(k) is not None), None)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
            raise ModelShapeError(f"mixture-of-experts config with {experts} experts needs 'num_experts_per_tok' "
                                  f"between 1 and {experts}, got {top_k!r}")
        if isinstance(cfg.get("moe_intermediate_size"), list) and cfg["moe_intermediate_size"]:
            # Ernie 4.5 VL: [text experts' width, vision experts']; the planner costs the text model
            cfg = {**cfg, "moe_intermediate_size": cfg["moe_intermediate_size"][0]}
        expert_ffn = _optional_whole(cfg, "moe_intermediate_size") or _whole(_needed(cfg, "intermediate_size"),
                                                                            "intermediate_size")
        shared = _optional_whole(cfg, "shared_expert_intermediate_size", least=0)
        n_shared = _optional_whole(cfg, "n_shared_experts", least=0) or _optional_whole(cfg, "moe_num_shared_experts",
                                                                                         least=0)
        if not shared and n_shared:
            shared = n_shared * expert_ffn
        if not shared and cfg.get("model_type") == "llama4_text":   # Llama 4: one shared expert
            shared = _whole(_needed(cfg, "intermediate_size"), "intermediate_size")
        sparse = [True] * n_layers
        if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:                 # DeepSeek
            k = _optional_whole(cfg, "first_k_dense_replace", least=0) or 0
            freq = _optional_whole(cfg, "moe_layer_freq") or 1
            sparse = [i >= k and i % freq == 0 for i in range(n_layers)]
        elif "decoder_sparse_step" in cfg or cfg.get("mlp_only_layers"):             # Qwen-MoE
            step, dense = _optional_whole(cfg, "decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or []
            if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
                raise ModelShapeError(f"model config 'mlp_only_layers' must list layer indices, got {dense!r}")
            dense = set(dense)
            sparse = [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]
        elif cfg.get("moe_layers") is not None:                                      # Llama 4's own list wins
            listed = cfg["moe_layers"]
            if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                                   or not 0 <= i < n_layers for i in listed):
                raise ModelShapeError(f"model config 'moe_layers' must list layer indices below {n_layers}, "
                                      f"got {listed!r}")
            sparse = [i in set(listed) for i in range(n_layers)]
        elif cfg.get("interleave_moe_layer_step") is not None:                       # Llama 4
            step = _whole(cfg["interleave_moe_layer_step"], "interleave_moe_layer_step")
            sparse = [(i + 1) % step == 0 for i in range(n_layers)]
        elif cfg.get("expert_layer_period") is not None:                             # Jamba
            period = _whole(cfg["expert_layer_period"], "expert_layer_period")
            offset = _optional_whole(cfg, "expert_layer_offset", least=0)
            offset = 1 if offset is None else offset   # JambaConfig's default
            sparse = [i % period == offset for i in range(n_layers)]
        elif cfg.get("moe_layer_interval") is not None:                              # Ernie 4.5
            step = _whole(cfg["moe_layer_interval"], "moe_layer_interval")
            first = _optional_whole(cfg, "moe_layer_start_index", least=0)
            first = 1 if first is None else first   # Ernie4_5_MoeConfig's default
            last = cfg.get("moe_layer_end_index")
            last = n_layers - 1 if last is None or last == -1 else _whole(last, "moe_layer_end_index")
            sparse = [(i + 1) % step == 0 and first <= i <= last for i in range(n_layers)]
        return cls(experts=experts, top_k=top_k, expert_ffn=expert_ffn, shared_ffn=shared or 0,
                   moe_layers=tuple(sparse), shared_gate=bool(cfg.get("shared_expert_intermediate_size")),
                   router_bias=cfg.get("model_type") == "ernie4_5_moe")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: tuple[LayerShape, ...]
    hidden: int
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: int = 2
    # parameter count the throughput convention uses; None = count the shape's own parameters
    reported_params: int | None = None
    notes: str = ""
    head_bias: bool = False   # the LM head has a bias (Ernie 4.5 MoE's use_bias; tying shares its weight alone)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ModelShapeError("a model needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def nonlayer_params(self) -> int:
        """Embedding (+ untied LM head and its bias, where it has one) + final norm."""
        return (self.vocab_size * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden
                + (self.vocab_size if self.head_bias else 0))

    @property
    def total_params(self) -> int:
        return self.layer_params + self.nonlayer_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies: a mixture-of-experts layer's routed top-k and shared experts, not
        every expert it stores (a dense model: all of them)."""
        layers = sum(l.token_params for l in self.layers)
        return layers + self.nonlayer_params

    @property
    def throughput_params(self) -> int:
        """N in the paper's TFLOPS = 6 * N * batch * seq / step_time convention: the active parameters, as MoE
        throughputs are quoted (the stored ones would count FLOPs of experts a token never visits, and put a
        mixture-of-experts model above the hardware's peak)."""
        return self.reported_params or self.active_params

    def selective_bytes(self, tokens: int) -> list[int]:
        """Bytes each layer's forward under the selective checkpointing policy keeps for its re-runs, at
        ``tokens`` tokens (Plan.selective_layers)."""
        return [l.selective_elems_per_token() * tokens * self.dtype_bytes for l in self.layers]

    def head_flops_per_token(self) -> float:
        """LM head forward + backward (the embedding lookup has no matrix product)."""
        return 6.0 * self.vocab_size * self.hidden

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | str, name: str | None = None) -> "ModelShape":
        """From a Hugging Face ``config.json`` (a dict, e.g. ``model.config.to_dict()``, or a path).

        Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``,
        ``vocab_size`` and optionally ``num_key_value_heads``, ``head_dim`` (each left out: its default in the
        model type's config class, as transformers loads it; else the heads, the hidden size over the heads),
        ``tie_word_embeddings`` (where it
        is missing, the model type's default in transformers: tied for Gemma, :data:`TIED_BY_DEFAULT`),
        ``attention_bias`` (Qwen2 models have q/k/v biases: ``model_type == "qwen2"``), ``mlp_bias``, Ernie
        4.5's ``use_bias`` (every projection's and its MoE model's LM head's), and the expert keys
        of mixture-of-experts configs (:meth:`MoeShape.from_hf_config`). Hybrid stacks: ``layer_types``
        (``"full_attention"`` / ``"linear_attention"`` per layer) or, without it,
        ``full_attention_interval`` n (every n-th layer full attention, the rest linear); their linear
        layers read ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
        ``linear_value_head_dim`` and ``linear_conv_kernel_dim``, and full-attention layers
        ``attn_output_gate`` (on by default in these stacks) and q/k norms.
        ``layer_params`` (not a Hugging Face key: the engine adds the parameter count of each block it
        streams, measured on the model) replaces the dense-Llama estimate of every layer's size, which is
        wrong for stacks whose layers differ and, in the details, for attention variants (MLA, q/k norms).
        """
        if isinstance(cfg, str):   # a file: its errors name it beside the key
            path = cfg
            cfg = read_json(path, ModelShapeError, "model config")
            try:
                return cls.from_hf_config(cfg, name)
            except ModelShapeError as e:
                raise ModelShapeError(f"{path}: {e}") from None
        if not isinstance(cfg, dict):
            raise ModelShapeError("a Hugging Face config must be a JSON object")
        outer, measured = cfg, cfg.get("layer_params")
        if cfg.get("is_encoder_decoder") is True:   # T5, BART, Whisper: costed as the encoder alone, wrongly
            raise ModelShapeError(f"model config of type {cfg.get('model_type', '?')!r} is an encoder-decoder; the "
                                  f"planner costs one decoder-only stack of blocks. Train it with a simple policy "
                                  f"(\"every_k\", \"keep_all\"), naming the stack to stream in 'lazytrain.blocks'")
        if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
            cfg = cfg["text_config"]
            if isinstance(outer.get("vision_config"), dict):
                warnings.warn(f"lazytrain planner: model type {outer.get('model_type', '?')!r} has a vision tower "
                              f"beside its text model; the plan costs the text model alone (the tower's weights, "
                              f"optimizer state and time are in no budget)", UserWarning, stacklevel=2)
        if any(k not in cfg for k in SHAPE_NAMES[:3]) and isinstance(cfg.get("model_type"), str):
            cfg = with_standard_names(cfg, transformers_attribute_map(cfg["model_type"]))   # GPT-2's n_embd, ...
        elif cfg.get("intermediate_size") is None:
            cfg = with_standard_names(cfg, None)   # Falcon's ffn_hidden_size, OPT's ffn_dim, ...
        reported = cfg.get("reported_params")

        def get(key: str, default: Any = None) -> Any:
            if key in cfg and cfg[key] is not None:
                return cfg[key]
            # left out: what transformers loads, its config class's default (save_pretrained writes only what
            # differs from them: a Gemma config with head_dim 256 may not say so). Written as null: what the
            # classes derive from None, ``default`` here (Qwen2's null key/value heads are its attention heads)
            class_default = _class_defaults(cfg, outer).get(key) if key in DEFAULTED_SHAPE_KEYS and key not in cfg \
                else None
            if class_default is not None:
                return class_default
            if default is None:
                raise ModelShapeError(f"model config lacks {key!r}, which the planner needs")
            return default

        def count(key: str, default: Any = None) -> int:
            return _whole(get(key, default), key)

        def flag(key: str, default: bool) -> bool:
            return default if cfg.get(key) is None else _flag(cfg[key], key)

        h = count("hidden_size")
        n_layers = count("num_hidden_layers")
        heads = count("num_attention_heads")
        kv_heads = count("num_key_value_heads", heads)
        if heads % kv_heads:   # grouped-query attention shares each key/value head among whole query groups
            raise ModelShapeError(f"model config 'num_key_value_heads' ({kv_heads}) must divide "
                                  f"'num_attention_heads' ({heads})")
        if cfg.get("head_dim") is None and h // heads < 1:
            raise ModelShapeError(f"model config 'num_attention_heads' ({heads}) must be at most 'hidden_size' "
                                  f"({h}) when the config gives no 'head_dim'")
        head_dim = count("head_dim", h // heads)
        moe = MoeShape.from_hf_config(cfg, n_layers)
        if moe is not None and all(moe.moe_layers) and cfg.get("intermediate_size") is None and \
                _class_defaults(cfg, outer).get("intermediate_size") is None:
            ffn = moe.expert_ffn   # every layer's MLP is of experts: no dense one to size (Qwen3.5-MoE names none)
        else:
            ffn = count("intermediate_size")
        vocab = count("vocab_size")
        tied = _tied_embeddings(cfg, outer)
        model_type = str(cfg.get("model_type", ""))
        if model_type and model_type not in LLAMA_STYLE_MODEL_TYPES:
            warnings.warn(f"lazytrain planner: model type {model_type!r} is costed as a Llama-style decoder (q/k/v/o "
                          f"projections, a gated MLP of three matrices, RMSNorms); its layers differ in part, so the "
                          f"plan's predicted times and activation memory are estimates"
                          + (" (its layers' sizes are the measured ones)" if measured is not None else ""),
                          UserWarning, stacklevel=2)
        # Ernie 4.5's use_bias puts a bias on every projection: attention, MLP and (MoE) its LM head
        ernie_bias = model_type.startswith("ernie4_5") and flag("use_bias", False)
        bias = ernie_bias or flag("attention_bias", flag("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
        # Llama's and Qwen3's attention_bias is on the output projection too; Qwen2's q/k/v biases are not
        o_bias = ernie_bias or (bias and cfg.get("attention_bias") is not None
                                and model_type not in ("qwen2", "qwen2_moe"))
        mlp_bias = ernie_bias or flag("mlp_bias", False)   # Llama's: gate, up and down projections'

        def mlp_biases(width: int) -> int:
            """The biases of a gated MLP of ``width`` (none where the config has none, or no such MLP)."""
            return 2 * width + h if mlp_bias and width else 0
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        kinds = cls._layer_kinds(cfg, n_layers)
        hybrid = "linear_attention" in kinds
        gate = hybrid and flag("attn_output_gate", True)
        qk_norm = hybrid or model_type in QK_NORM_MODEL_TYPES
        attn = (h * q_dim * (2 if gate else 1) + 2 * h * kv_dim + q_dim * h + 2 * h
                + ((q_dim + 2 * kv_dim) if bias else 0) + (h if o_bias else 0) + (2 * head_dim if qk_norm else 0))
        linear = cls._linear_attention(cfg) if hybrid else None
        mixer = {"full_attention": (attn, None, gate), "linear_attention": (
            (linear.params(h) + 2 * h, linear, False) if linear else None)}
        dense_ffn = _optional_whole(cfg, "intermediate_size_mlp") or ffn   # Llama 4 names its dense MLP apart

        def shapes(kind: str) -> "tuple[LayerShape, LayerShape | None]":
            mix, lin, g = mixer[kind]
            common = dict(hidden=h, q_dim=q_dim, kv_dim=kv_dim, linear=lin, attn_gate=g, qk_norm=qk_norm,
                          norm_fp32_weight=hybrid or model_type in FP32_NORM_MODEL_TYPES)
            d = LayerShape(params=mix + 3 * h * dense_ffn + mlp_biases(dense_ffn), ffn=dense_ffn, **common)
            if moe is None:
                return d, None
            sparse = mix + moe.mlp_params(h) + mlp_biases(moe.shared_ffn)   # routed experts keep no biases
            return d, LayerShape(params=sparse, ffn=moe.active_width(), active_params=sparse - moe.idle_params(h),
                                 moe_top_k=moe.top_k, **common)

        by_kind = {kind: shapes(kind) for kind in set(kinds)}
        if measured is not None:
            if (not isinstance(measured, list) or len(measured) != n_layers
                    or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in measured)):
                raise ModelShapeError(f"model config 'layer_params' must hold {n_layers} non-negative counts "
                                      f"(one per layer), got {measured!r}")
            layers = tuple(cls._measured_layer(p, *by_kind[kind], moe) for p, kind in zip(measured, kinds))
        elif moe is not None:
            layers = tuple(by_kind[kind][1] if is_moe else by_kind[kind][0] for kind, is_moe in zip(kinds, moe.moe_layers))
        else:
            layers = tuple(by_kind[kind][0] for kind in kinds)
        # the precision the layers compute and stream in: transformers >= 4.56 writes "dtype", older
        # versions "torch_dtype"; the engine sets both to its compute dtype
        # (a multimodal config's text config, else the outer one: save_pretrained writes it on the outer alone)
        said = next((c for c in (cfg, outer) if c.get("dtype") is not None or c.get("torch_dtype") is not None), cfg)
        dtype_key = "dtype" if said.get("dtype") is not None else "torch_dtype"
        dtype = said.get(dtype_key) or "bfloat16"
        dtype_bytes = DTYPE_BYTES.get(str(dtype).removeprefix("torch.")) if isinstance(dtype, str) else None
        if dtype_bytes is None:
            raise ModelShapeError(f"model config {dtype_key!r} must be one of {', '.join(DTYPE_BYTES)} (the "
                                  f"precision the layers compute and stream in), got {dtype!r}")
        return cls(name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
                   layers=layers, hidden=h, vocab_size=vocab, tied_embeddings=tied,
                   dtype_bytes=dtype_bytes, head_bias=ernie_bias and model_type == "ernie4_5_moe",
                   reported_params=None if reported is None else _whole(reported, "reported_params"))

    @staticmethod
    def _layer_kinds(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
        """Each layer's token mixer: ``layer_types`` when given (``"linear_attention"`` is a Gated DeltaNet
        layer; every other type, e.g. sliding-window or chunked attention, is costed as full attention),
        else every ``full_attention_interval``-th layer full attention and the others linear (Qwen3-Next's
        rule), else all full attention."""
        types = cfg.get("layer_types")
        if types is not None:
            if (not isinstance(types, (list, tuple)) or len(types) != n_layers
                    or not all(isinstance(t, str) and t for t in types)):
                raise ModelShapeError(f"model config 'layer_types' must list {n_layers} layer type names "
                                      f"(one per layer), got {types!r}")
            return tuple("linear_attention" if t == "linear_attention" else "full_attention" for t in types)
        interval = cfg.get("full_attention_interval")
        if interval is None or not any(k.startswith("linear_") for k in cfg):
            return ("full_attention",) * n_layers
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ModelShapeError(f"model config 'full_attention_interval' must be an integer >= 1, got {interval!r}")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))

    @staticmethod
    def _linear_attention(cfg: dict[str, Any]) -> LinearAttention:
        """The Gated DeltaNet keys of a hybrid config; each must be a positive integer."""
        vals = {}
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim"):
            v = cfg.get(key)
            if v is None:
                raise ModelShapeError(f"model config has linear-attention layers but lacks {key!r}, "
                                      f"which the planner needs")
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelShapeError(f"model config {key!r} must be an integer >= 1, got {v!r}")
            vals[key] = v
        if vals["linear_num_value_heads"] % vals["linear_num_key_heads"]:
            raise ModelShapeError(f"model config 'linear_num_value_heads' ({vals['linear_num_value_heads']}) must "
                                  f"be a multiple of 'linear_num_key_heads' ({vals['linear_num_key_heads']})")
        return LinearAttention(key_heads=vals["linear_num_key_heads"], value_heads=vals["linear_num_value_heads"],
                               key_dim=vals["linear_key_head_dim"], value_dim=vals["linear_value_head_dim"],
                               conv_kernel=vals["linear_conv_kernel_dim"])

    @staticmethod
    def _measured_layer(params: int, dense: LayerShape, sparse: "LayerShape | None",
                        moe: "MoeShape | None") -> LayerShape:
        """A layer of the measured size. It is a mixture-of-experts layer when its size is nearer the
        config's sparse-layer estimate than its dense one (the measurement decides, whatever layer
        pattern the config spells), and then a token multiplies all of it but the experts it is not
        routed to."""
        idle = moe.idle_params(dense.hidden) if moe else 0
        if sparse is None or abs(params - dense.params) <= abs(params - sparse.params) or params <= idle:
            return replace(dense, params=params)
        return replace(sparse, params=params, active_params=params - idle)

    @classmethod
    def from_layers(cls, name: str, layer_params: list[int], hidden: int, vocab_size: int = 0,
                    tied_embeddings: bool = True, q_dim: int | None = None, kv_dim: int | None = None,
                    ffn: int | None = None, dtype_bytes: int = 2,
                    saved_bytes_per_token: int | None = None) -> "ModelShape":
        """Explicit per-layer parameter counts (attention/MLP widths default to a 4h-FFN MHA block, whose
        saved internals are a Llama layer's unless ``saved_bytes_per_token`` gives them)."""
        if saved_bytes_per_token is not None and (isinstance(saved_bytes_per_token, bool)
                                                  or not isinstance(saved_bytes_per_token, int)
                                                  or saved_bytes_per_token < 0):
            raise ModelShapeError(f"saved_bytes_per_token must be a whole number of bytes >= 0, "
                                  f"got {saved_bytes_per_token!r}")
        # every number by its name: a negative count would plan a negative step, a fraction be cut silently
        if not isinstance(layer_params, (list, tuple)) or not layer_params:
            raise ModelShapeError(f"model config 'layer_params' must list each layer's parameter count, "
                                  f"got {layer_params!r}")
        # JSON writes 2.5e8 as a float: a whole one is taken as the count it is
        layer_params = [_whole(_integral(p), "layer_params", least=0) for p in layer_params]
        hidden = _whole(_integral(hidden), "hidden")
        vocab_size = _whole(_integral(vocab_size), "vocab_size", least=0)
        q_dim, kv_dim, ffn = (None if value is None else _whole(_integral(value), key)
                              for key, value in (("q_dim", q_dim), ("kv_dim", kv_dim), ("ffn", ffn)))
        if dtype_bytes not in (2, 4) or isinstance(dtype_bytes, bool):
            raise ModelShapeError(f"model config 'dtype_bytes' must be 2 or 4, got {dtype_bytes!r}")
        tied_embeddings = _flag(tied_embeddings, "tied_embeddings")
        layers = tuple(LayerShape(params=int(p), hidden=hidden, q_dim=q_dim or hidden, kv_dim=kv_dim or hidden,
                                  ffn=ffn or 4 * hidden, saved_bytes=saved_bytes_per_token) for p in layer_params)
        return cls(name=name, layers=layers, hidden=hidden, vocab_size=vocab_size,
                   tied_embeddings=tied_embeddings, dtype_bytes=dtype_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "hidden": self.hidden,
                "vocab_size": self.vocab_size, "tied_embeddings": self.tied_embeddings,
                "total_params": self.total_params, "active_params": self.active_params,
                "throughput_params": self.throughput_params}


# the precisions a model's layers compute and stream in, as a config's "dtype" / "torch_dtype" names them
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# The model types whose layers are the planner's layer: q/k/v/o projections (with their variants here: biases,
# q/k norms, an output gate, linear attention), a gated MLP of three matrices (or routed experts of one), and
# RMSNorms. Another type is costed as one all the same, with a warning (a two-matrix MLP, LayerNorms with
# biases, multi-latent attention: its times and activation memory are estimates)
LLAMA_STYLE_MODEL_TYPES = frozenset({
    "llama", "llama4", "llama4_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
    "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe",
    "qwen3_vl_moe_text", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "olmo", "olmo2", "olmoe", "granite",
    "granitemoe", "smollm3", "cohere", "cohere2"})


# Model types whose attention RMS-normalises q and k per head, and whose RMSNorms scale by (1 + weight) in
# fp32 (what they save differs: LayerShape.saved_bytes_per_token); hybrid stacks do both. Other model types
# are read as Llama's layer.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                 "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe",
                                 "qwen3_vl_moe_text"})
FP32_NORM_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


# transformers' default for ``tie_word_embeddings``, by model type, for the decoder families the planner reads:
# a config.json may leave the key out (save_pretrained writes only what differs from the defaults, so a Gemma
# config whose head is tied says nothing) and transformers then loads its config class's default. Checked
# against those classes by tests/test_planner.py; another model type's default is asked of transformers.
TIED_BY_DEFAULT: dict[str, bool] = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "cohere", "cohere2",
                     "starcoder2", "smollm3"), True),
    **dict.fromkeys(("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
                     "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v2", "deepseek_v3",
                     "olmoe", "granitemoe", "gpt_oss", "llama4", "llama4_text"), False),
}


def _tied_embeddings(cfg: dict[str, Any], outer: dict[str, Any]) -> bool:
    """Whether the LM head shares the embedding's weights, as transformers builds the model. A multimodal
    config's answer is its config class's (asked of transformers where it is installed): transformers 5 ties the
    head the outer model holds by the outer config's key, which some classes take from their text config's (a
    pre-5 save kept it there; Llava, Qwen2-VL) and others not (Qwen3-VL-MoE's text config says tied, its model
    is untied). Otherwise, and without transformers: the outer config's key, else its class's default, then the
    text config's key and its class's default; untied (LlamaConfig's default) where all are unknown."""
    said = {c.get("tie_word_embeddings") for c in (cfg, outer)}
    if cfg is not outer and isinstance(outer.get("model_type"), str) and (len(said) > 1 or None in said):
        # (both saying one answer, as the engine writes what the model built, leave nothing to ask)
        built = _built_ties_embeddings(json.dumps(outer, sort_keys=True, default=str))
        if isinstance(built, bool):
            return built
    for c in ((outer, cfg) if cfg is not outer else (cfg,)):
        if c.get("tie_word_embeddings") is not None:
            return _flag(c["tie_word_embeddings"], "tie_word_embeddings")
        default = _tied_by_default(c.get("model_type"))
        if default is not None:
            return default
    return False


@functools.lru_cache(maxsize=64)
def _built_ties_embeddings(cfg_json: str) -> bool | None:
    """:func:`_config_ties_embeddings` asked of a child interpreter once per config; None where it cannot say."""
    return _ask_transformers(_config_ties_embeddings, json.loads(cfg_json), otherwise=None)


def _config_ties_embeddings(cfg: dict[str, Any]) -> bool:
    """The child's side of :func:`_tied_embeddings`: whether the model transformers builds from ``cfg`` (on the
    meta device: no memory) ties its head, which the config alone does not say (Llama 4's head is tied by its
    text model's config, Llava's by the outer one's); LookupError where it cannot say."""
    import warnings

    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg))
            for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
                try:
                    with torch.device("meta"):
                        model = auto.from_config(config)
                    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
                except Exception:   # noqa: BLE001 - no such model for this config; try the next kind
                    continue
                if head is not None and embedding is not None:
                    return head.weight is embedding.weight
    except Exception as e:   # noqa: BLE001 - an unknown type, or keys its class refuses: the parent reads them
        raise LookupError(f"transformers cannot build this config: {e}") from None
    raise LookupError("transformers builds no model with an LM head from this config")


def _tied_by_default(model_type: Any) -> bool | None:
    """Whether the config class of ``model_type`` ties the embeddings by default; None where unknown."""
    if not isinstance(model_type, str) or not model_type:
        return None
    default = TIED_BY_DEFAULT.get(model_type)
    if default is None:
        default = transformers_class_defaults(model_type).get("tie_word_embeddings")
    return default if isinstance(default, bool) else None


# the shape keys a config.json may leave to its config class's defaults (where they have none, the planner
# derives them: the attention heads, the hidden size over the heads)
DEFAULTED_SHAPE_KEYS = ("num_key_value_heads", "head_dim")

# their defaults in transformers' config classes, by model type, for the families the planner knows (a Gemma
# config.json saved by save_pretrained leaves head_dim 256 out; a Mistral one its 8 KV heads); checked against
# those classes by tests/test_planner.py; another model type's are asked of transformers
SHAPE_DEFAULTS_BY_TYPE: dict[str, dict[str, int]] = {
    "gemma": {"num_key_value_heads": 16, "head_dim": 256}, "gemma2": {"num_key_value_heads": 4, "head_dim": 256},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256},
    "gemma3n_text": {"num_key_value_heads": 2, "head_dim": 256},
    "starcoder2": {"num_key_value_heads": 2}, "smollm3": {"num_key_value_heads": 4},
    "mistral": {"num_key_value_heads": 8}, "mixtral": {"num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32}, "qwen2_moe": {"num_key_value_heads": 16},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128}, "qwen3_moe": {"num_key_value_heads": 4},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256},
    "qwen3_5_text": {"num_key_value_heads": 4, "head_dim": 256},
    "qwen3_5_moe_text": {"num_key_value_heads": 2, "head_dim": 256},
    "deepseek_v3": {"num_key_value_heads": 128}, "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64},
    "llama4_text": {"num_key_value_heads": 8, "head_dim": 128},
    **dict.fromkeys(("llama", "cohere", "cohere2", "phi3", "olmoe", "granitemoe", "deepseek_v2", "gemma3", "gemma3n",
                     "qwen3_5", "qwen3_5_moe", "llama4"), {}),
}


def _class_defaults(cfg: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    """The defaults of the config class of ``cfg``'s model type (else the outer config's) for
    :data:`DEFAULTED_SHAPE_KEYS`, as its ``__init__`` declares them (not as a default instance derives them:
    LlamaConfig's head_dim is None, the hidden size over the heads, which the planner derives from this
    config's own); {} where no model type is given or transformers cannot say."""
    for c in (cfg, outer):
        model_type = c.get("model_type")
        if isinstance(model_type, str) and model_type:
            known = SHAPE_DEFAULTS_BY_TYPE.get(model_type)
            if known is not None:
                return known
            asked = transformers_class_defaults(model_type)
            return {k: v for k, v in asked.items() if k in DEFAULTED_SHAPE_KEYS}
    return {}


@functools.lru_cache(maxsize=None)
def transformers_class_defaults(model_type: str) -> dict[str, Any]:
    """What transformers' config class for ``model_type`` defaults to, for the keys the planner may find left
    out of a config.json: :data:`DEFAULTED_SHAPE_KEYS` as its ``__init__`` declares them (None ones left out)
    and ``tie_word_embeddings`` as a default instance holds it; and under ``"attribute_map"``, the class's own
    names for standard ones (:func:`transformers_attribute_map`). {} where transformers is not installed or knows
    no such class. Asked of one child interpreter per model type (importing transformers imports torch, which
    the planner never does), and only for a model type outside the planner's tables."""
    return _ask_transformers(_config_class_defaults, model_type, otherwise={})


def _config_class_defaults(model_type: str) -> dict[str, Any]:
    """The child's side of :func:`transformers_class_defaults`; LookupError for a model type transformers does
    not know."""
    import inspect
    import warnings

    from transformers import CONFIG_MAPPING
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        raise LookupError(f"transformers knows no model type {model_type!r}") from None
    params = inspect.signature(cls.__init__).parameters
    found = {k: params[k].default for k in DEFAULTED_SHAPE_KEYS
             if k in params and params[k].default not in (None, inspect.Parameter.empty)}
    try:
        with warnings.catch_warnings():     # the caller is told what the planner infers, not how a class builds
            warnings.simplefilter("ignore")
            tied = cls().tie_word_embeddings
    except Exception:  # noqa: BLE001 - a class without the key or that does not build with its defaults
        tied = None
    if isinstance(tied, bool):
        found["tie_word_embeddings"] = tied
    found["attribute_map"] = {k: v for k, v in (getattr(cls, "attribute_map", None) or {}).items()
                              if isinstance(v, str)}
    return found


# the shape names the planner reads that a config may keep under its own name (its class's attribute_map); others
# mapped there can mean something else (Zamba2's layer_types are its Mamba/hybrid labels)
SHAPE_NAMES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


# a family's own name for its MLP's width (None: 4 x hidden): Falcon's, OPT's, GPT-2's (GPT-J's, BigCode's)
MLP_WIDTH_NAMES = ("ffn_hidden_size", "ffn_dim", "n_inner")
FOUR_X_MLP_TYPES = ("bloom", "gpt_neo")   # no MLP width key (BLOOM), or intermediate_size None (GPT-Neo): 4 x hidden


def with_standard_names(cfg: dict[str, Any], attribute_map: dict[str, str] | None) -> dict[str, Any]:
    """``cfg`` (a config's ``to_dict()`` or config.json, which keep only a class's own names) with the standard
    shape names its class's ``attribute_map`` gives under its own (GPT-2's ``n_embd`` is its ``hidden_size``),
    and a family's own MLP width (:data:`MLP_WIDTH_NAMES`, None: 4 x hidden; :data:`FOUR_X_MLP_TYPES`) as
    ``intermediate_size``: the planner reads the standard ones."""
    out = dict(cfg)
    for standard, own in (attribute_map or {}).items():
        if standard in SHAPE_NAMES and standard not in out and isinstance(out.get(own), int):
            out[standard] = out[own]
    if out.get("intermediate_size") is None and isinstance(out.get("hidden_size"), int):
        own = next((name for name in MLP_WIDTH_NAMES if name in out), None)
        gpt2_style = (attribute_map or {}).get("hidden_size") == "n_embd"   # an older config.json leaves n_inner out
        if own is not None or gpt2_style or out.get("model_type") in FOUR_X_MLP_TYPES:
            out["intermediate_size"] = (out.get(own) if own else None) or 4 * out["hidden_size"]
    return out


def transformers_attribute_map(model_type: str) -> dict[str, str]:
    """transformers' config class's ``attribute_map`` for ``model_type`` ({} where it cannot say), from the same
    child interpreter's answer as :func:`transformers_class_defaults`: asked only for a config that lacks a
    standard shape name (a GPT-2 config.json given to `lazytrain plan --model`)."""
    return transformers_class_defaults(model_type).get("attribute_map", {})


def _needed(cfg: dict[str, Any], key: str) -> Any:
    """``cfg[key]``, which the planner cannot do without."""
    if cfg.get(key) is None:
        raise ModelShapeError(f"model config lacks {key!r}, which the planner needs")
    return cfg[key]


def _ask_transformers(fn, *args: Any, otherwise: Any) -> Any:
    """``fn(*args)`` in a child interpreter; ``otherwise`` where transformers is not installed, cannot say
    (LookupError) or does not answer."""
    if importlib.util.find_spec("transformers") is None:
        return otherwise
    from .isolate import call_with_deadline
    from .milp import PlanningError
    try:
        return call_with_deadline(fn, *args, deadline_s=120, what="reading transformers' config defaults")
    except (LookupError, PlanningError):
        return otherwise


# ---- catalog (Hugging Face config fields; read from the models' published config.json) ---------
CATALOG_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-3b": {"model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 11008,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                   "vocab_size": 152064, "tie_word_embeddings": False},
    "qwen2.5-14b": {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 13824,
                    "vocab_size": 152064, "tie_word_embeddings": False},
    # The paper's 27B (64 layers, hidden 5120, 24 heads, 4 KV heads, FFN 17408) has the shape of
    # Qwen3.5-27B, which MegaTrain's model code supports: a hybrid whose every 4th layer is gated
    # full attention (head_dim 256) and the other three Gated DeltaNet linear attention, vocabulary
    # 248,320 (Qwen3.5-27B's published text config). The paper states 23.68B trainable parameters, but its
    # TFLOPS and tokens/s imply N = TFLOPS / (6 * tokens/s) = 26.93B for LazyTrain on both GPUs (27.41B and
    # 27.07B for MegaTrain): the 26.90B the shape holds (24.35B in the layers), which throughput_params gives.
    # Its RTX 3090 rows imply each Qwen2.5's own count too (3.08B, 7.61B, 14.76B), its H800 rows the nominal
    # 3B, 7B and 14B: only tokens/s compares with the paper everywhere.
    "paper-27b": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                  "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                  "intermediate_size": 17408, "vocab_size": 248320, "tie_word_embeddings": False,
                  "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4},
}
ALIASES = {"27b": "paper-27b", "qwen-27b": "paper-27b", "qwen3.5-27b": "paper-27b", "3b": "qwen2.5-3b", "7b": "qwen2.5-7b",
           "14b": "qwen2.5-14b"}


def catalog_model(name: str) -> ModelShape:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG_CONFIGS:
        raise ModelShapeError(f"unknown model {name!r}; catalog entries: {', '.join(sorted(CATALOG_CONFIGS))}, "
                              f"or give a Hugging Face config.json path")
    return ModelShape.from_hf_config(CATALOG_CONFIGS[key], name=key)


def layers_of(name: str, num_layers: int) -> ModelShape:
    """A catalog model's shape with its layer count changed (how the planner scales with depth)."""
    key = ALIASES.get(name.lower(), name.lower())
    cfg = {k: v for k, v in CATALOG_CONFIGS[key].items() if k != "reported_params"}
    return ModelShape.from_hf_config(dict(cfg, num_hidden_layers=num_layers), name=f"{key}-{num_layers}-layers")


def load_model(spec: "str | dict | ModelShape") -> ModelShape:
    """A catalog name, a path to a config.json (or a directory holding one), a config dict, or a shape."""
    import os
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, dict):
        return ModelShape.from_hf_config(spec)
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelShapeError(f"a model is a catalog name, a config.json path, a config dict or a ModelShape, "
                              f"got {type(spec).__name__} {spec!r}")
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        spec = os.path.join(spec, "config.json")
    if os.path.exists(spec) or spec.endswith(".json"):
        # a model's folder names it (Qwen2.5-7B/config.json); a file of another name names itself
        name = os.path.basename(os.path.dirname(os.path.abspath(spec))) if os.path.basename(spec) == "config.json" \
            else os.path.splitext(os.path.basename(spec))[0]
        return ModelShape.from_hf_config(spec, name=name)
    return catalog_model(spec)
