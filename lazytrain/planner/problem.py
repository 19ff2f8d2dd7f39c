"""The planning problem: one training step of one model shape on one machine, with per-tier budgets.

:class:`Problem` turns (model shape, micro-batch, sequence length, hardware profile, budgets) into the
per-layer and per-window numbers shared by the simulator, the policies and the MILP, so that all three
use one cost model. Static memory (resident embedding/head, their gradients, weight and gradient
buffers, optimizer state on the host) is computed here, and a budget that cannot hold it raises
:class:`InfeasibleBudgetError` naming what does not fit and by how much.

Execution model (the engine's streaming executor, see plan.py for the window conventions):

- Window ``w`` runs its compute tasks: forward window ``w < L`` runs layer ``w`` (no grad); backward
  window ``2L-1-i`` differentiates layer ``i`` (forward-with-grad from its input boundary + backward),
  preceded, when ``i`` is the last layer of a recompute segment ``[s, e)``, by the no-grad recompute of
  layers ``s..e-2`` that regenerates the segment's boundaries. The LM head (forward, loss, backward)
  runs in window ``L-1`` after layer ``L-1``.
- An offloaded layer ``j`` (Plan.offloaded_layers) records its graph in forward window ``j``; its saved
  internals and its input (``offl_bytes``) go device->host on the D2H link, window j's share when its
  forward ends and later forward windows' shares as those windows start (Plan.internals_offload_split;
  what has not left holds the device), and come back host->device in the shares of
  ``Plan.internals_prefetch_split(j)``; its backward window runs its backward alone (``bwd_s``), no re-run.
- Weights of the next window's layers are copied host->device during the current window (double
  buffering, generalised to windows with several layers); layers marked resident keep a device copy
  that is refreshed once per step during the forward. Gradients of the layer differentiated in window
  ``w`` go device->host in window ``w+1`` (the last ones, and the embedding/head gradients, after the
  last window).
- Transfers issued in a window run on their links (H2D, D2H, NVMe read, NVMe write; each a FIFO at
  its bandwidth, NVMe transfers pipelined with the PCIe leg through a host bounce buffer) while the
  window computes; the next window starts when the compute and every transfer of the window are done.
  A prefetch issued in its need window is exposed: the window's compute waits for it.
- A frozen bottom (``Budgets.frozen_bottom_layers`` f: layers 0..f-1 frozen, and nothing before them trains):
  the backward stops at layer f (``first_reached``). Windows 2L-f..2L-1 run nothing, copy no weights and no
  gradients; a boundary below f is never read back (held on its tier until layer f's backward, when the engine
  releases the pass); the last gradients the step waits for are layer f's.
- After the step the host optimizer updates the non-layer parameters, then layers 0..L-1. With
  overlap (LazyTrain), the next forward window ``w`` starts once layer ``w`` is updated and its weights
  are copied; without (MegaTrain), the next step starts after the whole update.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..units import parse_size
from .hardware import MAX_BYTES, GiB, HardwareError, HardwareProfile, load_profile
from .measured import MeasuredCosts
from .models import ModelShape, load_model


# The least share of a layer's forward that a selective layer's re-run still takes (Plan.selective_layers:
# its matrix multiplies' and attention's outputs are kept, the rest is recomputed). The rest's FLOPs are a
# fraction of a percent of the forward's (LayerShape.elementwise_flops_per_token), but those operations
# (norms, rotary, SiLU, products, residual sums) are bound by memory traffic, not by FLOPs: each reads and
# writes whole activations at HBM bandwidth and launches kernels of its own, so their time is far above
# their FLOP share. 0.1 of the forward is an assumption until the engine measures a selective re-run.
SELECTIVE_RERUN_FLOOR = 0.1
# what the embedding's and head's optimizer keeps on the GPU with Budgets.non_block_state "device", a parameter,
# beside the compute copy and its gradient: fp32 master, fp32 gradient, two fp32 Adam moments (in fp32
# training the parameter is its own master: the moments only)
NON_BLOCK_DEVICE_STATE_BYTES = 4 + 4 + 8
NON_BLOCK_DEVICE_STATE_BYTES_FP32 = 8
# Gradients the engine copies to the host off the backward's path (the head's, an earlier micro-batch's last
# ones) share the link with the next this many windows' own copies, in equal parts: the engine queues layers'
# gradients behind them, and its backward waits only once more than four layers' are queued
# (engine/weights.py, _GradientSink.max_in_flight).
GRAD_SHARE_WINDOWS = 4
# Layers' gradients the engine's sink may hold on the device, flattened, waiting for their copy to the host,
# beside the layer whose backward runs (engine/weights.py, _GradientSink.max_in_flight): where a layer's copy
# takes longer than a layer's backward the queue fills to this depth and stays there (Problem.grads_in_flight)
GRAD_SINK_IN_FLIGHT = 4


class InfeasibleBudgetError(ValueError):
    """A budget that cannot hold what the step needs; the message names the tier, the need and the gap."""


NVME_BLOCK_BYTES = 4096   # the NVMe tier counts a file as whole blocks of this size (tiers/pool.py ALIGNMENT)

# Where each tier's budget is given: the `lazytrain plan` flag and the engine's config key, for its errors to name
BUDGET_SOURCES = {"GPU": "--gpu-mem or lazytrain.gpu_memory", "host": "--host-mem or lazytrain.host_memory",
                  "NVMe": "--nvme or lazytrain.nvme_memory",
                  "micro-batch": "--micro-batch or train_micro_batch_size_per_gpu"}


def fmt_count(n: float) -> str:
    """A parameter count as people read it: 7.62B, 856.32k, 12."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Budgets:
    """Per-tier byte budgets. ``None`` takes the hardware profile's size (GPU, host); NVMe defaults to 0."""
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    nvme_bytes: int = 0
    gpu_reserved_bytes: int = GiB       # CUDA context, cuBLAS workspace, allocator fragmentation
    hybrid_8bit_fraction: float = 0.02  # share of parameters whose Adam moments are 8-bit blockwise
    quant_block_size: int = 256         # elements per 8-bit block (two fp32 absmax values each)
    loss_chunk_tokens: int = 2048       # the LM head computes logits and loss in chunks of this many tokens
    optimizer_state_share: float = 1.0  # the part of the Adam moments this rank holds (1/ranks when sharded)
    master_share: float = 1.0           # the part of the layers' fp32 master weights it holds (1/ranks: sharded bf16/fp16)
    gradient_share: float = 1.0         # the part of the layers' host gradient buffers (1/ranks at ZeRO stage >= 2)
    # the part of the fp32 masters of the parameters outside the layers it holds: 1/ranks when sharded (stage >= 1)
    # and the masters are apart from the compute copies (bf16/fp16, or kept on the host beside a GPU's copies)
    non_block_master_share: float = 1.0
    # the part of their fp32 gradient buffers: 1/ranks at ZeRO stage 3, which partitions those parameters; below
    # it every rank accumulates them whole until the step
    non_block_gradient_share: float = 1.0
    weights_copy_share: float = 1.0     # its part of the streamed copy (1/ranks per node when the node shares one)
    # the streamed compute copies live in host memory (weights_home "host" or "hbm"); False with them on NVMe,
    # where the host keeps the fp32 weights apart and the frozen parameters in the compute dtype alone
    weights_in_host: bool = True
    # where the parameters outside the layers (embedding, final norm, head) keep their fp32 masters, gradients
    # and Adam moments: "host" (updated first by the host optimizer, their gradients sent after each
    # micro-batch's backward and their weights copied back after the update) or "device" (16 bytes a
    # parameter on the GPU, updated there: no link carries them, and their update is not timed)
    non_block_state: str = "host"
    # the engine's lazytrain.lean_norms: each block's RMSNorms keep only their inputs for the backward
    lean_norms: bool = True
    # the share of the layers' parameters that train (a LoRA run: its adapters'): only they have fp32 masters,
    # gradient buffers, Adam moments, an update and gradients sent to the host; frozen ones are kept in the
    # streamed compute-dtype copy alone
    trainable_share: float = 1.0
    # the share of the parameters outside the layers (embedding, final norm, head) that train: a frozen one has
    # no fp32 master, gradient, moments, update or link traffic, and is kept on the device in the compute dtype
    # alone (a LoRA run's embedding and head). One share for all of them: the embedding's and head's gradient
    # bytes are each scaled by it
    non_block_trainable_share: float = 1.0
    # the layers below the first one that trains, when nothing run before the layers trains (a frozen embedding: at
    # most the others outside the layers, the head, count as trained whatever non_block_trainable_share says):
    # the backward never reaches them (the engine differentiates none of them, fetches none of their weights
    # again and reads none of their boundaries), so they have no backward window tasks, gradients or update,
    # and the layers' trainable_share is all in the layers above them
    frozen_bottom_layers: int = 0

    def __post_init__(self):
        """Each field checked by name: a negative reserve or an 8-bit share of 2 would plan with memory
        accounts that are silently wrong."""
        def whole(name, least, optional=False):   # sizes past any machine are named by Problem, with the tier
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= least:
                raise ValueError(f"Budgets field {name!r} must be a number of bytes >= {least}, got {v!r}")

        for name in ("gpu_bytes", "host_bytes"):
            whole(name, 0, optional=True)
        whole("nvme_bytes", 0)
        whole("gpu_reserved_bytes", 0)
        v = self.loss_chunk_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Budgets field 'loss_chunk_tokens' must be a whole number of tokens >= 1, got {v!r}")
        v = self.quant_block_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Budgets field 'quant_block_size' must be a whole number of elements >= 1, got {v!r}")
        v = self.hybrid_8bit_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"Budgets field 'hybrid_8bit_fraction' must be a fraction in [0, 1], got {v!r}")
        for name in ("optimizer_state_share", "master_share", "gradient_share", "weights_copy_share",
                     "non_block_master_share", "non_block_gradient_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Budgets field {name!r} must be a fraction in (0, 1], got {v!r}")
        if self.non_block_state not in ("host", "device"):
            raise ValueError(f"Budgets field 'non_block_state' must be \"host\" or \"device\", got "
                             f"{self.non_block_state!r}")
        for name in ("trainable_share", "non_block_trainable_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"Budgets field {name!r} must be a fraction in [0, 1], got {v!r}")
        v = self.frozen_bottom_layers
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"Budgets field 'frozen_bottom_layers' must be a whole number of layers >= 0, got {v!r}")
        for name in ("lean_norms", "weights_in_host"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Budgets field {name!r} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, gpu=None, host=None, nvme=None, sources: "dict[str, str] | None" = None, **kw) -> "Budgets":
        """Budgets from sizes as people write them ("70GB"). A size that is none is refused by where it was
        given: ``sources`` names it for gpu, host and nvme (``lazytrain plan``'s flags), else plan_for's
        ``budgets['gpu']``."""
        def size(key, value):
            return parse_size(value, (sources or {}).get(key, f"budgets[{key!r}]"))

        return cls(gpu_bytes=size("gpu", gpu), host_bytes=size("host", host), nvme_bytes=size("nvme", nvme) or 0,
                   **kw)


@dataclass
class Problem:
    model: ModelShape
    hardware: HardwareProfile
    budgets: Budgets
    micro_batch: int
    seq_len: int
    check: bool = True
    # compute and update times measured by the engine on this machine (see measured.py): they replace the
    # FLOP-based terms (the non-block parameters' copies and update among them)
    measured: MeasuredCosts | None = None
    # micro-batches per optimizer step: each runs the plan's windows and sends its last gradients to the
    # host; the host optimizer runs once, after the last (so its delay is shared by all of them)
    grad_accum: int = 1

    def __post_init__(self):
        for name in ("micro_batch", "seq_len", "grad_accum"):   # whole numbers: a Plan stores them
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        hw = self.hardware
        # touch every speed the cost model needs so a missing one fails here, naming the field
        self.flops = hw.flops_per_s
        self.bw_h2d, self.bw_d2h = hw.h2d_bps, hw.d2h_bps
        try:
            self.opt_rate = hw.optimizer_params_per_s()
        except HardwareError:
            if self.measured is None:
                raise
            # measured update times stand in for it; MegaTrain's host phase, which reads it, says it is missing
            self.opt_rate = None
        # the streamed compute copies on NVMe (weights_in_host False): every weight copy is read from it too,
        # and every update writes its layer's copy back
        self.nvme_weights = not self.budgets.weights_in_host
        uses_nvme = self.budgets.nvme_bytes > 0 or self.nvme_weights
        self.bw_nr = hw.nvme_read_bps if uses_nvme else float("inf")
        self.bw_nw = hw.nvme_write_bps if uses_nvme else float("inf")
        gpu = self.budgets.gpu_bytes if self.budgets.gpu_bytes is not None else hw.need("gpu_mem_bytes")
        host = self.budgets.host_bytes if self.budgets.host_bytes is not None else hw.need("host_mem_bytes")
        for what, budget, size in (("GPU", gpu, hw.gpu_mem_bytes), ("host", host, hw.host_mem_bytes)):
            if size is not None and budget > size:   # a budget caps the machine's memory, never adds to it
                raise InfeasibleBudgetError(
                    f"{what} budget {fmt_bytes(budget)} is more than the {what} memory of hardware profile "
                    f"{hw.name!r} ({fmt_bytes(size)}); lower {BUDGET_SOURCES[what]}, or describe the machine you "
                    f"have in a hardware profile JSON (`lazytrain bench tiers` writes one)")
        for what, budget in (("GPU", gpu), ("host", host), ("NVMe", self.budgets.nvme_bytes)):
            if not 0 <= budget <= MAX_BYTES:
                raise InfeasibleBudgetError(f"{what} budget {budget!r} bytes is not a memory size (0 to 2**60, 1 EiB): "
                                            f"check {BUDGET_SOURCES[what]}")
        self.gpu_budget, self.host_budget, self.nvme_budget = int(gpu), int(host), int(self.budgets.nvme_bytes)
        self._derive()
        if self.check:
            self.check_static_fit()

    # ---- per-layer / per-window constants ------------------------------------------------
    def _derive(self) -> None:
        m, L, T, S = self.model, self.model.num_layers, self.micro_batch * self.seq_len, self.seq_len
        db = m.dtype_bytes
        self.L, self.tokens = L, T
        f = self.budgets.frozen_bottom_layers
        if f > L:
            raise ValueError(f"Budgets field 'frozen_bottom_layers' is {f}, but the model {m.name!r} has {L} layers")
        self.first_reached = f                                        # the lowest layer the backward reaches
        self.A = [T * m.hidden * db] * (L + 1)                       # boundary bytes 0..L
        self.Wl = [l.params * db for l in m.layers]                   # compute-dtype weights per layer
        # the share of the layers above the frozen bottom that trains: the whole trainable_share is theirs
        above = sum(l.params for l in m.layers[f:])
        # (the frozen bottom's parameters train by definition not: at most the layers above it count as trained)
        self.layer_trainable_share = min(self.budgets.trainable_share, above / m.layer_params if m.layer_params else 0)
        # the share of each layer above the frozen bottom that trains
        self.share_above = share = self.layer_trainable_share * m.layer_params / above if above else 0.0
        self.Gl = [l.params * db * share if i >= f else 0.0 for i, l in enumerate(m.layers)]   # gradients per layer
        self.fwd_s = [l.fwd_flops_per_token(S) * T / self.flops for l in m.layers]
        self.diff_s = [3.0 * f for f in self.fwd_s]                   # forward-with-grad + backward (2x)
        self.head_s = m.head_flops_per_token() * T / self.flops
        self.ws_fwd = [l.fwd_transient_elems_per_token() * T * db for l in m.layers]
        self.saved = [l.saved_bytes_per_token(db, self.budgets.lean_norms) * T for l in m.layers]   # autograd internals
        self.ws_bwd = [s + l.bwd_transient_elems_per_token() * T * db for s, l in zip(self.saved, m.layers)]
        # selective layers (Plan.selective_layers): the matmul and attention outputs their forward keeps,
        # and the share of a forward their re-runs still take (the non-matmul FLOPs' share, at least
        # SELECTIVE_RERUN_FLOOR)
        self.sel_bytes = m.selective_bytes(T)
        self.sel_rerun_frac = [min(1.0, max(SELECTIVE_RERUN_FLOOR, l.elementwise_flops_per_token()
                                            / l.fwd_flops_per_token(S))) for l in m.layers]
        self.sel_rerun_s = [f * r for f, r in zip(self.fwd_s, self.sel_rerun_frac)]
        self.sel_fwd_extra = [0.0] * self.L   # what keeping the outputs adds to a forward (measured only)
        if self.budgets.lean_norms:   # each backward recomputes its norms
            self.diff_s = [d + n for d, n in zip(self.diff_s, self._norm_recompute_s())]
        # offloaded layers (Plan.offloaded_layers): what crosses PCIe each way, the tensors its autograd saves
        # and its input (which ``saved`` leaves out: a graph layer's input is counted as a boundary). No other
        # cost: its forward is charged as any forward (as a graph layer's is), its backward is ``bwd_s``.
        self.offl_bytes = [s + a for s, a in zip(self.saved, self.A)]
        chunk = min(T, self.budgets.loss_chunk_tokens)
        self.head_ws = chunk * m.vocab_size * 4 * 2                   # fp32 logits + their gradient, one chunk
        self.nonlayer_w = m.nonlayer_params * db
        # resident emb/head + grads; plus, when layers differ in size, what the engine's two streaming
        # buffers (each sized for the largest layer) hold beyond the two layers a window streams
        self.slot_slack = 2 * (max(self.Wl) - min(self.Wl))
        # the engine keeps its two streaming buffers whatever a window streams (unless every layer is resident):
        # a window streaming fewer than two layers (a resident or graph layer's, with the one after it) still
        # holds them; with slot_slack, two of the largest layers
        self.kept_buffers = 2 * min(self.Wl)
        b = self.budgets
        on_device = b.non_block_state == "device"
        # the parameters outside the layers that train (the others: their compute copy on the device alone)
        nb_trains = b.non_block_trainable_share
        if f and m.nonlayer_params:   # a frozen bottom means a frozen embedding: at most the rest trains (the head)
            nb_trains = min(nb_trains, max(0.0, 1 - m.vocab_size * m.hidden / m.nonlayer_params))
        self.nonlayer_trained = m.nonlayer_params * nb_trains
        # their compute copy, and the gradients of those that train
        self.gpu_static = self.nonlayer_w * (1 + nb_trains) + self.budgets.gpu_reserved_bytes + self.slot_slack
        if on_device:
            self.gpu_static += self.nonlayer_trained * (NON_BLOCK_DEVICE_STATE_BYTES_FP32 if db == 4
                                                        else NON_BLOCK_DEVICE_STATE_BYTES)
        f8 = self.budgets.hybrid_8bit_fraction
        adam = b.optimizer_state_share * ((1 - f8) * 8 + f8 * (2 + 8 / b.quant_block_size))   # fp32 / 8-bit moments
        # the parts of them this rank holds: fp32 gradient buffers (micro-batches accumulate in fp32) and moments;
        # a layer's fp32 weights apart from its streamed copy, except in fp32 with the copy in host memory, where
        # that copy is them; of a layer's parameters the frozen ones (1 - trainable_share) hold their compute-dtype
        # value alone: in the host's streamed copy, or, the copies on NVMe, apart from them
        grads = 4 * b.gradient_share
        layer_trains = (0 if db == 4 and b.weights_in_host else 4 * b.master_share) + grads + adam
        copy = db * b.weights_copy_share if b.weights_in_host else 0.0
        self.host_bytes_per_param = copy + layer_trains   # a layer's trained parameter
        tshare = self.layer_trainable_share
        self.host_bytes_per_layer_param = (copy if b.weights_in_host else db * (1 - tshare)) + tshare * layer_trains
        # a trained parameter outside the layers: its fp32 master, gradient and moments (its copy is on the device)
        self.host_bytes_per_nonlayer_param = 4 * b.non_block_master_share + 4 * b.non_block_gradient_share + adam
        self.host_static = int(m.layer_params * self.host_bytes_per_layer_param +
                               (0 if on_device else self.nonlayer_trained * self.host_bytes_per_nonlayer_param))
        self.host_act_budget = self.host_budget - self.host_static
        # the streamed compute copies on NVMe (weights_in_host False) take their bytes of its budget: whole
        # blocks, as the tier counts a file (tiers/nvme.py _footprint)
        self.nvme_static = 0 if b.weights_in_host or not self.nvme_budget else \
            sum(-(-int(w) // NVME_BLOCK_BYTES) * NVME_BLOCK_BYTES for w in self.Wl)
        self.nvme_act_budget = self.nvme_budget - self.nvme_static
        # host optimizer chain and the copies it gates
        rate = self.opt_rate or float("inf")   # none: measured times replace these (_use_measured)
        self.opt_nl = 0.0 if on_device else self.nonlayer_trained / rate
        # (with the copies on NVMe, a trained layer's update ends with its copy written there)
        write_back = [w / self.bw_nw if self.nvme_weights and share else 0.0 for w in self.Wl]
        self.opt_l = [l.params * share / rate + write_back[i] if i >= f else 0.0 for i, l in enumerate(m.layers)]
        # a layer's weights copied to the device: from NVMe too, the two links in a pipeline
        self.load_l = [w / min(self.bw_h2d, self.bw_nr if self.nvme_weights else float("inf")) for w in self.Wl]
        # the embedding's and head's trained weights (once a step) and gradients (each micro-batch) on the links
        self.nonlayer_link_bytes = 0 if on_device else self.nonlayer_w * nb_trains
        self.load_nl = self.nonlayer_link_bytes / self.bw_h2d
        # their gradients leave as autograd finishes them, beside the backward (the engine's copy queue):
        # the head's and final norm's in the head's backward, copied in the first GRAD_SHARE_WINDOWS backward
        # windows; the embedding's (a tied one's too) after layer 0's, with layer 0's
        # (a frozen bottom means a frozen embedding: the share that trains is the head's)
        self.embed_grad_bytes = 0 if on_device or f else m.vocab_size * m.hidden * db * nb_trains
        self.head_grad_bytes = self.nonlayer_link_bytes - self.embed_grad_bytes
        self._last_grads(self.last_grads_of_layers() + self.embed_grad_bytes)
        if self.measured is not None:
            self._use_measured(self.measured)

    def _use_measured(self, c: MeasuredCosts) -> None:
        """Measured compute and update times in place of FLOPs at a nominal rate. The non-block
        parameters' (embedding, head) update and weight copies are inside the measured times (step()'s
        serial phase), wherever Budgets.non_block_state puts them; their gradients, where the engine copies
        them to host masters beside its windows, are on the link as the analytic model has them."""
        if c.num_layers != self.L:
            raise ValueError(f"measured costs are for {c.num_layers} layers, the model {self.model.name!r} has {self.L}")
        if c.first_differentiated > self.first_reached:
            raise ValueError(f"the measured costs have no backward for layers 0..{c.first_differentiated - 1} (frozen "
                             f"below the first trainable layer in the run measured), but this plan's backward reaches "
                             f"layer {self.first_reached}: measure a run that trains as this one does")
        # diff_s includes a forward; measured below fwd_s (a forward slowed by a wait, timer noise), the layer's
        # backward is taken as 0 s, not a negative time that would shorten its window
        self.fwd_s, self.diff_s = list(c.fwd_s), [max(d, f) for d, f in zip(c.diff_s, c.fwd_s)]
        if c.selective_rerun_s is not None:   # measured on traced selective steps (measured.with_selective)
            self.sel_rerun_s = list(c.selective_rerun_s)
        else:                                 # not measured: the same share of the measured forward
            self.sel_rerun_s = [f * r for f, r in zip(self.fwd_s, self.sel_rerun_frac)]
        if c.selective_fwd_s is not None:
            self.sel_fwd_extra = [max(0.0, sf - f) for sf, f in zip(c.selective_fwd_s, self.fwd_s)]
        if c.lean_norms is not None and c.lean_norms != self.budgets.lean_norms:
            # measured with the norms' other setting: their backward recompute (the charge _derive makes) in or out
            sign = 1.0 if self.budgets.lean_norms else -1.0
            self.diff_s = [max(f, d + sign * n) for d, f, n in zip(self.diff_s, self.fwd_s, self._norm_recompute_s())]
        if c.saved_bytes is not None:   # what each layer's graph saved, measured, for the analytic estimate
            # measured with the norms' other setting (lazytrain.lean_norms): shifted by the estimate's difference
            db, lean = self.model.dtype_bytes, self.budgets.lean_norms
            was = lean if c.lean_norms is None else c.lean_norms   # not known: taken as measured
            saved = [m + (l.saved_bytes_per_token(db, lean) - l.saved_bytes_per_token(db, was)) * self.tokens
                     for m, l in zip(c.saved_bytes, self.model.layers)]
            self.ws_bwd = [w - s + m for w, s, m in zip(self.ws_bwd, self.saved, saved)]
            self.saved = saved
            self.offl_bytes = [s + a for s, a in zip(self.saved, self.A)]
        self.head_s = c.nonlayer_s
        self.opt_nl, self.opt_l = c.step_s, list(c.update_s)
        self.load_nl = 0.0
        self.nonlayer_link_bytes = 0
        # their gradients: copied beside the windows by the engine (measured in its profile), else inside the times
        self.head_grad_bytes, self.embed_grad_bytes = c.grads_beside_bytes or (0, 0)
        self._last_grads(self.last_grads_of_layers() + self.embed_grad_bytes)

    def last_use_window(self, b: int) -> int:
        """The window after which boundary ``b`` (< L) is released: layer b's backward window; below the lowest layer
        the backward reaches (a frozen bottom), that layer's, when the engine releases the pass (the step's last
        window where the backward reaches none)."""
        f, L = self.first_reached, self.L
        return 2 * L - 1 - max(b, f) if f < L else 2 * L - 1

    def last_grads_of_layers(self) -> float:
        """The layers' gradients a backward makes last: the lowest layer's it reaches (none when it reaches none)."""
        return self.Gl[self.first_reached] if self.first_reached < self.L else 0

    def _last_grads(self, nbytes: int) -> None:
        """The gradients a micro-batch's backward finishes last (layer 0's, the embedding's): the step waits
        for the last micro-batch's (``tail_s``); an earlier one's leave during the next micro-batch's first
        GRAD_SHARE_WINDOWS forward windows (``carry_bytes``), which do not wait for them."""
        self.carry_bytes = nbytes
        self.tail_s = nbytes / self.bw_d2h

    def _norm_recompute_s(self) -> list[float]:
        """What lean norms add to each layer's backward: the norms' share of its elementwise ops, of a
        selective re-run's time."""
        return [r * l.norm_flops_per_token() / l.elementwise_flops_per_token()
                for r, l in zip(self.sel_rerun_s, self.model.layers)]

    # ---- windows -------------------------------------------------------------------------
    @property
    def num_windows(self) -> int:
        return 2 * self.L

    def layer_of(self, w: int) -> int:
        return w if w < self.L else 2 * self.L - 1 - w

    def bwd_window(self, layer: int) -> int:
        return 2 * self.L - 1 - layer

    def fixed_gpu_bytes(self, w: int) -> int:
        """Device bytes in window ``w`` that no plan decision changes (boundaries and weights excluded)."""
        L = self.L
        i = self.layer_of(w)
        b = self.gpu_static
        if w < L:
            b += self.ws_fwd[i]
            if w == L - 1:
                b += self.head_ws + self.A[L]                          # head workspace, stack output
        elif i >= self.first_reached:
            b += self.ws_bwd[i] + 2 * self.A[i]                        # saved activations, boundary grads
            b += self.grad_bytes_on_device(i)
        return b

    def grads_in_flight(self, i: int) -> int:
        """Layers whose gradients the engine's sink may still hold on the device during layer ``i``'s backward
        (those after it, whose backward ran before): one where copying a layer's gradients to the host takes
        no longer than its backward (compute alone, the shortest its window can be), else the sink's whole
        queue, which a slower link fills within a few layers."""
        later = self.L - 1 - i
        link_bound = self.Gl[i] / self.bw_d2h > 2 * self.fwd_s[i] if self.bw_d2h else False
        return min(later, GRAD_SINK_IN_FLIGHT if link_bound else 1)

    def grad_bytes_on_device(self, i: int) -> int:
        """Gradient bytes on the device during layer ``i``'s backward: its own and those in flight."""
        return self.Gl[i] + sum(self.Gl[i + 1:i + 1 + self.grads_in_flight(i)])

    def rerun_s(self, j: int, selective: "frozenset[int] | set[int]" = frozenset()) -> float:
        """Seconds of re-running layer ``j``'s forward in backward (the no-grad recompute, or the forward
        part of its diff task): ``sel_rerun_s`` for a selective layer, its forward otherwise."""
        return self.sel_rerun_s[j] if j in selective else self.fwd_s[j]

    def recompute_s(self, s: int, e: int, selective: "frozenset[int] | set[int]" = frozenset()) -> float:
        """Compute seconds of recomputing segment [s, e): layers s..e-2 forward."""
        return sum(self.rerun_s(j, selective) for j in range(s, e - 1))

    def diff_task_s(self, i: int, selective: "frozenset[int] | set[int]" = frozenset()) -> float:
        """Seconds of layer ``i``'s diff task: its forward with autograd, then its backward."""
        return self.diff_s[i] - self.fwd_s[i] + self.rerun_s(i, selective)

    def bwd_s(self, i: int) -> float:
        """Seconds of layer ``i``'s backward alone, from the graph its forward recorded (a graph-tail or an
        offloaded layer: no re-run before it)."""
        return self.diff_s[i] - self.fwd_s[i]

    def compute_s(self, w: int, segment: "tuple[int, int] | None" = None,
                  selective: "frozenset[int] | set[int]" = frozenset()) -> float:
        """Compute seconds of window ``w``; ``segment`` = (s, e) when the window starts segment recompute;
        ``selective``: the plan's selective layers."""
        L = self.L
        if w < L:
            return self.fwd_s[w] + (self.sel_fwd_extra[w] if w in selective else 0.0) + \
                (self.head_s if w == L - 1 else 0.0)
        i = self.layer_of(w)
        if i < self.first_reached:                                     # no backward reaches it
            return 0.0
        rec = self.recompute_s(*segment, selective) if segment and segment[1] == i + 1 else 0.0
        return self.diff_task_s(i, selective) + rec

    # ---- bounds and checks ---------------------------------------------------------------
    def no_recompute_compute_s(self) -> float:
        """Forward, then each layer the backward reaches re-run for its backward (no segment recompute)."""
        return sum(self.fwd_s) + sum(self.diff_s[self.first_reached:]) + self.head_s

    def minimal_compute_s(self) -> float:
        """Each layer's forward once and, where the backward reaches it, its backward once (every layer keeps
        its graph)."""
        f = self.first_reached
        return sum(self.fwd_s[:f]) + sum(self.diff_s[f:]) + self.head_s

    def lower_bound_s(self) -> dict[str, float]:
        """The step's physical lower bounds (any plan): per micro-batch, each layer's forward and backward
        once and every gradient device->host; once per step, every weight host->device (a resident layer's
        refresh: with gradient accumulation its later micro-batches copy none) and the host optimizer's
        update (of the parameters it updates: the embedding's and head's only when their state is on the
        host, Budgets.non_block_state); with the compute copies on NVMe, every layer's weights read there once
        a step ("nvme_read")."""
        k = self.grad_accum
        parts = {"compute": k * self.minimal_compute_s(),
                 "h2d": (sum(self.Wl) + self.nonlayer_link_bytes) / self.bw_h2d,
                 "d2h": k * (sum(self.Gl) + self.nonlayer_link_bytes) / self.bw_d2h,
                 "optimizer": self.opt_nl + sum(self.opt_l)}
        if self.nvme_weights:
            parts["nvme_read"] = sum(self.Wl) / self.bw_nr
        parts["bound"] = max(parts.values())
        return parts

    def min_gpu_bytes(self, w: int) -> tuple[int, dict[str, int]]:
        """What window ``w`` needs on the device under any plan, itemised."""
        L, i = self.L, self.layer_of(w)
        parts = {"static (resident embedding/head + grads"
                 + (" + their fp32 optimizer state" if self.budgets.non_block_state == "device" else "")
                 + " + reserve"
                 + (", streaming buffers sized for the largest layer)" if self.slot_slack else ")"): self.gpu_static}
        if w < L:
            parts["forward transients"] = self.ws_fwd[i]
            parts["input and output boundaries"] = self.A[i] + self.A[i + 1]
            parts["weights (this layer + next)"] = self.Wl[i] + self.Wl[min(i + 1, L - 1)]
            if w == L - 1:
                parts["LM head logits chunk"] = self.head_ws
        elif i >= self.first_reached:
            parts["saved activations of one layer (backward)"] = self.ws_bwd[i]
            parts["boundary + its gradients"] = 3 * self.A[i]
            parts["gradient buffers"] = self.grad_bytes_on_device(i)
            parts["weights (this layer + next)"] = self.Wl[i] + (self.Wl[i - 1] if i > 0 else 0)
        return sum(parts.values()), parts

    def _static_terms(self) -> str:
        """What ``host_static`` counts, as parameters x bytes each."""
        m, b = self.model, self.budgets
        terms = f"{fmt_count(m.layer_params)} layer parameters x {self.host_bytes_per_layer_param:.2f} bytes"
        if b.non_block_state == "host" and self.nonlayer_trained:
            terms += (f" + {fmt_count(self.nonlayer_trained)} others trained x "
                      f"{self.host_bytes_per_nonlayer_param:.2f} bytes")
        return terms

    def check_static_fit(self) -> None:
        if self.host_act_budget < 0:
            raise InfeasibleBudgetError(
                f"host memory budget {fmt_bytes(self.host_budget)} cannot hold the optimizer state: "
                f"{self._static_terms()} (fp32 master weights, Adam moments, compute-dtype weights and "
                f"gradients) = {fmt_bytes(self.host_static)}; "
                f"short by {fmt_bytes(-self.host_act_budget)}. Raise {BUDGET_SOURCES['host']}.")
        if self.nvme_act_budget < 0:
            raise InfeasibleBudgetError(
                f"NVMe budget {fmt_bytes(self.nvme_budget)} cannot hold the streamed weights kept there "
                f"({fmt_bytes(self.nvme_static)}); short by {fmt_bytes(-self.nvme_act_budget)}. Raise "
                f"{BUDGET_SOURCES['NVMe']}.")
        worst = max(range(self.num_windows), key=lambda w: self.min_gpu_bytes(w)[0])
        need, parts = self.min_gpu_bytes(worst)
        if need > self.gpu_budget:
            kind = "forward" if worst < self.L else "backward"
            items = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
            raise InfeasibleBudgetError(
                f"GPU budget {fmt_bytes(self.gpu_budget)} is too small at micro-batch {self.micro_batch} x "
                f"seq {self.seq_len}: the {kind} of layer {self.layer_of(worst)} alone needs {fmt_bytes(need)} "
                f"({items}); short by {fmt_bytes(need - self.gpu_budget)}. {self.smaller_step_advice()}, or raise "
                f"{BUDGET_SOURCES['GPU']}.")

    def smaller_step_advice(self) -> str:
        """What shrinks a micro-batch's activations: fewer sequences, or at one sequence shorter ones."""
        if self.micro_batch > 1:
            return f"Lower {BUDGET_SOURCES['micro-batch']}"
        return "At micro-batch 1, shorten the sequence (--seq, the batches' length)"

    def describe(self) -> dict:
        return {"model": self.model.name, "hardware": self.hardware.name, "micro_batch": self.micro_batch,
                "seq_len": self.seq_len, "gpu_budget": self.gpu_budget, "host_budget": self.host_budget,
                "nvme_budget": self.nvme_budget}


def make_problem(model, hardware, micro_batch: int, seq_len: int, budgets: Budgets | None = None,
                 base: str | None = None, check: bool = True, measured: MeasuredCosts | None = None,
                 grad_accum: int = 1) -> Problem:
    """Build a Problem from names, paths, dicts or objects (see models.load_model, hardware.load_profile)."""
    return Problem(model=load_model(model), hardware=load_profile(hardware, base=base),
                   budgets=budgets or Budgets(), micro_batch=micro_batch, seq_len=seq_len, check=check,
                   measured=measured, grad_accum=grad_accum)   # whole numbers, checked by Problem
