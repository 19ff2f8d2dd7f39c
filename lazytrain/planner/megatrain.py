"""MegaTrain's executor as its code runs a step: the terms in which it differs from LazyTrain's.

Why: LazyTrain's speed-ups are claimed against MegaTrain, so MegaTrain's step is modelled from what its
code (DLYuanGod/MegaTrain: ``infinity/model/cpu_master.py`` and ``examples/sft/train.py``) does, not
from LazyTrain's executor running MegaTrain's checkpoint-every-k policy. ``simulate(...,
executor="megatrain")`` uses these terms; everything else (windows, links, FLOP rates) is shared.

- Re-runs: backward re-runs every layer of a checkpoint block, the last one too, whose output nothing
  reads, before differentiating the block layer by layer (:func:`rerun_range`).
- Serial host phase after backward (:func:`host_phase_parts`): ``clip_grad_norm_`` over the bf16
  gradients (a norm pass and a scaling pass), DeepSpeed CPUAdam updating the bf16 weights in place with
  fp32 moments, and a copy of every layer's weights into its pinned flat buffer; then the embedding,
  norm and head are copied to the GPU and the next forward waits for layer 0's weights. The phase is
  memory-bound, so it is charged in bytes moved at the host rate that LazyTrain's optimizer is charged
  at: ``host_optimizer_gparams_per_s`` parameters/s of LazyTrain's 28-byte update.
- It trains every parameter: it has no frozen or partial training (its layer templates are made to require
  grad before each backward, the backward runs down to block 0 and the embedding, and clipping, the
  optimizer and the refresh take ``model.get_parameters()``, all of them). A problem that trains less
  (a frozen bottom, a LoRA share) is replayed as :func:`as_it_trains` has it: the full fine-tuning MegaTrain
  would run for that model.
- Host memory (:func:`host_bytes`): the bf16 parameters, their bf16 gradients, CPUAdam's fp32 moments,
  each layer's pinned bf16 flat copy, and its pinned staging and gradient slabs.
- Gradients to the host: the head's and final norm's (its head slab) right after the loss's backward, beside
  the layers' backward; layer 0's and the embedding's after the backward, which the step waits for
  (:func:`tail_bytes`).
- Device memory (:func:`gpu_bytes`): the embedding, norm and head stay on the GPU; two flat weight
  buffers and, per distinct layer structure (two in a hybrid stack), two layer templates the flat
  buffers are copied into; every checkpoint boundary stays until the step ends; backward keeps the
  re-run outputs of the current block; the loss runs in chunks of 128 positions but keeps every chunk's
  logits in the autograd graph until one ``backward`` over their sum.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from .plan import DEVICE_HOME, RECOMPUTE, Plan

# bytes per parameter the serial host phase moves (bf16 weights and gradients, fp32 Adam moments)
CLIP_BYTES = 2 + 2 * 2          # norm pass reads each gradient; the scaling pass reads and writes it
ADAM_BYTES = 2 + 2 + 8 + 8 + 2  # read weight, gradient, two moments; write both moments and the weight
REFRESH_BYTES = 2 + 2           # a layer's weights read and written into its pinned flat buffer
LAZYTRAIN_UPDATE_BYTES = 28     # what one LazyTrain update moves (hardware.optimizer_params_per_s)
LOSS_CHUNK_POSITIONS = 128      # positions per loss chunk; all chunks' logits are kept until backward
MOMENT_BYTES = 8                # CPUAdam's two moments, fp32 (its default fp32_optimizer_states)
# torch's AdamW, which its script falls back to without DeepSpeed's CPUAdam: moments in the parameters' bf16
FALLBACK_MOMENT_BYTES = 4
GRAD_SLABS = 12                 # pinned layer-gradient slabs, each the largest layer (its num_grad_slabs default)
STAGING_BUFFERS = 2             # pinned flat buffers the largest layer is staged in (double-buffered)
# a layer's diff over its forward where no layer's was measured (the cost model's: forward, then backward 2x)
UNMEASURED_DIFF_RATIO = 3.0


class MegaTrainPlanError(ValueError):
    """A Plan MegaTrain's executor cannot run (it only keeps every k-th boundary, on the GPU)."""


def checkpoint_interval(plan: Plan) -> int:
    """The k of a checkpoint-every-k plan with every kept boundary on the GPU, or MegaTrainPlanError."""
    L = plan.num_layers
    k = plan.segments()[0][1] if L else 1
    want = tuple(DEVICE_HOME if i % k == 0 or i == L else RECOMPUTE for i in range(L + 1))
    if (plan.homes != want or plan.resident_layers or plan.last_segment_graph or plan.overlap_optimizer
            or plan.selective_layers or plan.offloaded_layers):
        raise MegaTrainPlanError(
            f"MegaTrain's executor runs only checkpoint-every-k plans with the kept boundaries on the GPU, no "
            f"resident layers, no graph tail, no selective layers, no offloaded layers and a serial optimizer "
            f"(policies.megatrain_plan); plan "
            f"{plan.policy!r} is not one")
    return k


def rerun_range(s: int, e: int) -> range:
    """Layers re-run (no grad) before block [s, e) is differentiated: all of them."""
    return range(s, e)


def as_it_trains(p):
    """``p`` (a Problem) as MegaTrain's code trains it: every parameter differentiated, its gradient copied to
    the host, clipped and updated, whatever ``p`` freezes (no frozen bottom, trainable shares 1).

    Measured costs are of the run measured. Where only a share of a layer trained (LoRA), its backward made no
    gradients for the frozen weights; MegaTrain's makes them: the cost model's 2 FLOPs per frozen weight and
    token, at the layer's measured forward rate. Below a frozen bottom no backward was measured: each layer takes
    its forward times the median ratio of diff to forward of the measured layers of its size (of all measured
    layers if none is of its size; the cost model's 3 if none was differentiated), their selective times
    likewise, and the saved bytes of the largest of them."""
    b = p.budgets
    full = replace(b, frozen_bottom_layers=0, trainable_share=1.0, non_block_trainable_share=1.0)
    c = p.measured
    if c is None:
        return replace(p, budgets=full, check=False) if full != b else p
    m, f, L = p.model, c.first_differentiated, c.num_layers
    params = [l.params for l in m.layers]
    weight_grads = [(1 - p.share_above) * fwd * 2 * l.token_params / l.fwd_flops_per_token(p.seq_len)
                    for fwd, l in zip(c.fwd_s, m.layers)]
    diff = tuple(d + w if i >= f else d for i, (d, w) in enumerate(zip(c.diff_s, weight_grads)))
    costs = replace(c, diff_s=diff, first_differentiated=0)
    if f:
        peers = {i: [j for j in range(f, L) if params[j] == params[i]] or list(range(f, L)) for i in range(f)}

        def filled(values, default):
            """``values`` below f: each layer's forward times the median ratio of its peers' to their forwards."""
            out = list(values)
            for i in range(f):
                ratios = [values[j] / c.fwd_s[j] for j in peers[i] if c.fwd_s[j] > 0]
                out[i] = c.fwd_s[i] * (statistics.median(ratios) if ratios else default)
            return tuple(out)
        costs = replace(costs, diff_s=filled(diff, UNMEASURED_DIFF_RATIO))
        for name in ("selective_fwd_s", "selective_rerun_s"):   # a frozen layer's are its forward's (with_selective)
            if getattr(c, name) is not None:
                costs = replace(costs, **{name: filled(getattr(c, name), 1.0) if f < L else None})
        if c.saved_bytes is not None:   # the most its peers saved; none measured: the analytic estimate
            costs = replace(costs, saved_bytes=tuple(max(c.saved_bytes[j] for j in peers[i]) if i < f else v
                                                     for i, v in enumerate(c.saved_bytes)) if f < L else None)
    if full == b and costs == c:
        return p
    return replace(p, budgets=full, measured=costs, check=False)


def host_bytes(p, moment_bytes: int = MOMENT_BYTES) -> int:
    """What MegaTrain keeps in host memory for ``p`` (as :func:`as_it_trains` has it): every parameter in the
    model's dtype, its gradient in that dtype and its optimizer's two moments (``moment_bytes`` a parameter:
    CPUAdam's fp32 ones, or FALLBACK_MOMENT_BYTES with torch's AdamW); for each layer, the pinned flat copy its
    weights are streamed from; and its pinned buffers: the staging buffers and gradient slabs of the largest
    layer, the head slab and the embedding slab."""
    m, db = p.model, p.model.dtype_bytes
    largest = max(l.params for l in m.layers)
    slabs = (GRAD_SLABS + STAGING_BUFFERS) * largest + _head_slab_params(m) + _embedding_params(m)
    return int(m.total_params * (2 * db + moment_bytes) + (m.layer_params + slabs) * db)


def host_bytes_after_step(p, moment_bytes: int = MOMENT_BYTES) -> int:
    """What its training script reports as host memory: the process's RSS after the step, whose
    ``optimizer.zero_grad()`` (torch's default set_to_none) has freed the gradients; :func:`host_bytes` less
    them. Python, CUDA's host side and the libraries are not in it."""
    return host_bytes(p, moment_bytes) - p.model.total_params * p.model.dtype_bytes


def _embedding_params(m) -> int:
    return m.vocab_size * m.hidden


def _head_slab_params(m) -> int:
    """Its head slab's size: the head's parameters and the final norm's (a tied head's weight is the embedding's)."""
    return m.nonlayer_params - (0 if m.tied_embeddings else _embedding_params(m))


def head_grad_bytes(p) -> int:
    """The gradients MegaTrain copies right after the loss's backward, beside the layers': an untied head's and
    the final norm's (a tied head's gradient is added to the embedding's, copied last: :func:`tail_bytes`)."""
    return (p.model.nonlayer_params - _embedding_params(p.model)) * p.model.dtype_bytes


def tail_bytes(p) -> int:
    """The gradients a micro-batch's backward copies to the host last, which the step waits for: layer 0's and
    the embedding's (every one trains, in the model's dtype)."""
    return int(p.Wl[0] + _embedding_params(p.model) * p.model.dtype_bytes)


def host_phase_parts(p) -> dict[str, float]:
    """Seconds of the serial host phase, by part (``p``: a Problem)."""
    if p.opt_rate is None:
        raise MegaTrainPlanError("MegaTrain's host phase needs the host optimizer's rate: the run measured did not "
                                 "update whole layers (a LoRA share, or every layer frozen), whose times would give "
                                 "it, and no hardware profile gives 'host_optimizer_gparams_per_s' or "
                                 "'host_mem_gbps'")
    bps = p.opt_rate * LAZYTRAIN_UPDATE_BYTES
    n, nl = p.model.total_params, p.model.layer_params
    return {"clip_grad_norm_": n * CLIP_BYTES / bps, "optimizer step": n * ADAM_BYTES / bps,
            "refresh pinned bf16 copies": nl * REFRESH_BYTES / bps}


def logits_bytes(p) -> int:
    """Logits of every loss chunk, held until the loss's backward (the last position predicts nothing)."""
    return p.micro_batch * (p.seq_len - 1) * p.model.vocab_size * p.model.dtype_bytes


def buffer_bytes(p) -> int:
    """Two flat weight buffers sized for the largest layer, and two templates per layer structure."""
    structures = {(l.params, l.linear is not None) for l in p.model.layers}
    return 2 * max(p.Wl) + 2 * sum(params * p.model.dtype_bytes for params, _ in structures)


def internals_bytes(p, i: int) -> int:
    """What layer ``i``'s autograd saves and its backward's gradient transients, as MegaTrain runs the
    transformers layer: its norms keep what they save (LazyTrain's lean norms are LazyTrain's)."""
    layer, db = p.model.layers[i], p.model.dtype_bytes
    # LazyTrain's (measured, where the costs are) with the norms as written
    written = layer.saved_bytes_per_token(db) - layer.saved_bytes_per_token(db, p.budgets.lean_norms)
    return p.ws_bwd[i] + written * p.tokens


def gpu_bytes(p, k: int, w: int, buffers: int | None = None) -> dict[str, int]:
    """Bytes MegaTrain has allocated on the GPU at the peak of window ``w``, by part (no CUDA context).
    ``buffers``: :func:`buffer_bytes`, where a caller asking for every window has it already (it walks
    every layer)."""
    L, A = p.L, p.A[0]
    i = p.layer_of(w)
    checkpoints = len(range(0, L, k)) + 1
    parts = {"embedding/norm/head": p.nonlayer_w,
             "weight buffers and templates": buffer_bytes(p) if buffers is None else buffers}
    if w < L:
        parts["checkpoints so far"] = (i // k + 1) * A
        parts["layer output (and input, unless a checkpoint), transients"] = (
            A + (A if i % k else 0) + p.ws_fwd[i])
        if w == L - 1:                                         # the loss outgrows the layer's forward
            del parts["layer output (and input, unless a checkpoint), transients"]
            parts["checkpoints so far"] = checkpoints * A
            head_grad = p.model.vocab_size * p.model.hidden * p.model.dtype_bytes
            parts["all chunks' logits, normed hidden and its gradient, head gradient"] = (
                logits_bytes(p) + 2 * A + head_grad)
        return parts
    s = (i // k) * k
    parts["checkpoints"] = checkpoints * A
    parts["re-run outputs of the block"] = (i - s + 1) * A
    parts["layer internals and gradient transients"] = internals_bytes(p, i)
    parts["boundary gradients"] = 2 * A
    parts["layer gradients"] = p.Gl[i] + (p.Gl[i + 1] if i + 1 < L else 0)
    return parts
