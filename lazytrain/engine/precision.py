"""fp32 masters for the non-block parameters (in bf16/fp16 training, or kept on the host), and fp16 loss scaling.

Block parameters need no extra care here: their ``nn.Parameter`` objects already *are* fp32 master views
on the host (see weights.py), and only their streamed compute copies are bf16/fp16.
"""
from __future__ import annotations

import collections
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from ..tiers import streams
from ..tiers.memory import async_copy, empty_host
from .blocks import is_quantized
from .host_accumulate import add_into, scratch_for


class Masters:
    """Non-block parameters run on the device, in the compute dtype, while the optimizer updates fp32
    masters kept at ``home``: beside them on the device (bf16/fp16 training of a streamed model), or on the
    host (a model with nothing to stream on a GPU: its optimizer runs on the host, as the blocks' does).
    Each gradient is added into its master's fp32 ``.grad`` as soon as autograd produces it (so accumulation
    over micro-batches happens in fp32, as the blocks' does), and the weights are copied down after the
    update. A master on the host gets its gradients through a :class:`MasterGradSink` (the backward goes on
    while they are copied); whatever reads the masters' gradients goes through ``flush_grads`` first.
    A frozen parameter (``requires_grad`` false) gets no master: nothing updates it (:class:`FrozenParams`)."""

    def __init__(self, params: list[nn.Parameter], compute_dtype: torch.dtype, home: torch.device | None = None):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._hooks = {}
        self.elsewhere: set[int] = set()   # ids of parameters whose master another rank holds (partitioned_params.py)
        self.sink: MasterGradSink | None = None
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}   # masters_to_params' pieces, by dtype
        # the trainable parameters whose gradients cross a link to their masters, through the sink
        self._to_sink = [p for p in params if p.requires_grad and _copied(p.device, p.device if home is None else home)]
        if self._to_sink:   # one micro-batch's gradients may wait to be copied, the most a device holds of them
            self.sink = MasterGradSink(compute_dtype, max_numel=max(p.numel() for p in self._to_sink),
                                       max_bytes=sum(p.numel() for p in self._to_sink) * compute_dtype.itemsize)
        try:
            for p in params:
                self._take(p, compute_dtype, p.device if home is None else home)
        except BaseException:   # what was taken so far goes back as it was
            self.hand_back()
            raise
        self.by_param = {id(p): m for p, m in self.pairs}

    def _take(self, p: nn.Parameter, compute_dtype: torch.dtype, where: torch.device) -> None:
        """A trainable ``p`` in the compute dtype, with its fp32 master at ``where``."""
        if not p.requires_grad:
            return
        if compute_dtype == torch.float32 and where == p.device:   # stage 3 in fp32: the parameter is its master
            master = nn.Parameter(p.detach(), requires_grad=True)
        else:
            master = nn.Parameter(p.detach().to(where, torch.float32, copy=True), requires_grad=True)
            p.data = p.data.to(compute_dtype)
        self._hooks[id(p)] = p.register_post_accumulate_grad_hook(
            _into_master(master, self.sink if _copied(p.device, where) else None))
        self.pairs.append((p, master))

    def sink_bytes(self, last: set[int]) -> tuple[int, int] | None:
        """Gradient bytes a micro-batch sends through the sink: (the others', those of the parameters whose ids
        are in ``last``, the ones autograd finishes last: the input embedding's); None without a sink."""
        if self.sink is None:
            return None
        sizes = [(id(p) in last, p.numel() * p.element_size()) for p in self._landing_through_sink()]
        return sum(b for lst, b in sizes if not lst), sum(b for lst, b in sizes if lst)

    def _landing_through_sink(self) -> list[nn.Parameter]:
        """The parameters whose gradients the sink lands in their masters (not those partitioned_params.py
        reduces to an owner instead)."""
        return [p for p in self._to_sink if id(p) in self._hooks]

    def remove_grad_hook(self, p: nn.Parameter) -> None:
        """``p``'s gradient goes elsewhere (partitioned_params.py reduces it to the master's owner)."""
        handle = self._hooks.pop(id(p), None)
        if handle is not None:
            handle.remove()

    def flush_grads(self) -> None:
        """Every gradient autograd has produced is in its master's ``.grad`` (raises the first failed copy)."""
        if self.sink is not None:
            self.sink.flush()

    def hand_back(self) -> None:
        """The model as it was given: its parameters in fp32 again (the masters' values, where the parameters
        live) and keeping their own ``.grad`` (after ``destroy()``, or a set-up that failed)."""
        if self.sink is not None:
            self.sink.close()
        self._staging = {}
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        with torch.no_grad():
            for p, m in self.pairs:
                if id(p) not in self.elsewhere:
                    p.data = m.data.to(p.device)

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        return self.by_param.get(id(p), p)

    def master_params(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def master_grads(self) -> list[torch.Tensor]:
        self.flush_grads()
        return [m.grad for _, m in self.pairs if m.grad is not None]

    @contextlib.contextmanager
    def params_showing_masters(self):
        """Meanwhile each parameter's storage is its fp32 master, so what code writes into the parameters
        lands in the masters at full precision; then the compute-dtype copies are refreshed from them."""
        here = [(p, m) for p, m in self.pairs if id(p) not in self.elsewhere]
        shown = [(p, p.data) for p, _ in here]
        for p, m in here:
            p.data = m.data
        try:
            yield
        finally:
            for p, data in shown:
                p.data = data
            self.masters_to_params()

    def masters_to_params(self) -> None:
        """The compute-dtype copies from the masters; a device copy of a host master goes through
        :func:`_to_device_through_staging` (the compute dtype's bytes over the link, at pinned speed)."""
        with torch.no_grad():
            for p, m in self.pairs:
                if id(p) in self.elsewhere or p.data_ptr() == m.data_ptr():
                    continue
                if p.is_cuda and not m.is_cuda and p.is_contiguous():
                    if p.dtype not in self._staging:
                        size = min(MasterGradSink.CHUNK, max(q.numel() for q, _ in self.pairs))
                        self._staging[p.dtype] = [empty_host(size, p.dtype) for _ in range(2)]
                    # through detach(): the write counts as an in-place change of p for autograd, as copy_ does
                    _to_device_through_staging(p.detach(), m.detach(), self._staging[p.dtype])
                else:
                    p.copy_(m)

    def zero_grad(self) -> None:
        """No gradient at all, not a zero one (the engine gives a parameter the next step's loss does not reach
        a zero one at the step, as DeepSpeed does: _zero_grads_of_unreached_params). A master whose
        gradients land through the sink gives the dropped gradient's memory to its next first landing (as
        the layers' flat buffers are reused): a master's ``.grad`` held across a step changes with it."""
        if self.sink is not None:   # a copy still in flight must not land after the zeroing
            self.sink.discard()
        for p in self._landing_through_sink():   # the next first landing writes it whole
            m = self.by_param[id(p)]
            if m.grad is not None:
                self.sink.reuse(m, m.grad)
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


class FrozenParams:
    """The parameters outside the blocks that do not train (a LoRA run's embedding and head): no fp32 master,
    since nothing updates them; on the compute device in the training precision alone, as DeepSpeed's
    bf16/fp16 module keeps them (a quantized one, integer or 8-bit float, as it is). Handed back during set-up as
    they were given (their host storage; one given in a device's memory is not held through set-up and comes
    back in the training precision), after it in fp32, as every parameter ``destroy()`` hands back."""

    def __init__(self, params: list[nn.Parameter], compute_dtype: torch.dtype, device: torch.device):
        self.params = [p for p in params if not p.requires_grad]
        self._given = [(p.data if p.device.type == "cpu" else None, p.dtype) for p in self.params]
        self._set_up_done = False
        try:
            for p in self.params:   # moved in the training precision: no fp32 copy of them reaches the device
                p.data = p.data.to(device, None if is_quantized(p) else compute_dtype)
        except BaseException:   # those moved so far go back as they were
            self.hand_back()
            raise

    def set_up_done(self) -> None:
        """The engine is set up: the storage they were given in is let go."""
        self._given = [(None, dtype) for _, dtype in self._given]
        self._set_up_done = True

    def hand_back(self) -> None:
        for p, (storage, dtype) in zip(self.params, self._given):
            if storage is not None:
                p.data = storage
            else:
                p.data = p.data.to(torch.float32 if self._set_up_done and not is_quantized(p) else dtype)
        self.set_up_done()

    def unfrozen(self) -> list[nn.Parameter]:
        """Those set to require grad since (engine.step() refuses to run then)."""
        return [p for p in self.params if p.requires_grad]

    def zero_grad(self) -> None:
        """A gradient one got while it was set to require grad goes (no optimizer may apply it)."""
        for p in self.params:
            p.grad = None


def _to_device_through_staging(dst: torch.Tensor, src: torch.Tensor, staging: list[torch.Tensor]) -> None:
    """``dst`` (a device tensor) = ``src`` (a host tensor in another dtype), returning when it is done: each
    piece converted on the host into one of two staging buffers (pinned where an accelerator exists) while the
    other's copy runs, then copied on the host-to-device stream after the compute queued on the current
    stream (which may still read ``dst``). ``dst.copy_(src)`` would send the fp32 bytes from pageable memory."""
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    size = staging[0].numel()
    handles, error, done = [], None, False
    try:
        for k, start in enumerate(range(0, flat_src.numel(), size)):
            if k >= 2:
                handles[k - 2].synchronize()   # the copy that read this buffer is done
            piece = staging[k % 2][:min(size, flat_src.numel() - start)]
            piece.copy_(flat_src[start:start + piece.numel()])
            handles.append(async_copy(flat_dst[start:start + piece.numel()], piece, direction="h2d",
                                      label=f"weights {tuple(dst.shape)} [{start}:]"))
        done = True
    finally:   # none left reading the staging buffers, even when a piece failed (that failure propagates)
        for handle in handles[-2:]:
            try:
                handle.synchronize()
            except Exception as e:   # noqa: BLE001 - the first one is raised below
                error = error or e
    if done and error is not None:
        raise error


def _copied(device: torch.device, home: torch.device) -> bool:
    """Whether gradients made on ``device`` cross a link to reach masters at ``home`` (with copy threads on,
    the CPU stands in for a device, as for the streamed layers' gradients)."""
    return device != home or (device.type == "cpu" and streams.settings().copy_threads)


def _into_master(master: nn.Parameter, sink: MasterGradSink | None):
    def hook(p: torch.Tensor) -> None:
        if p.grad is None:   # torch runs the hook for a tensor made from p that got no gradient (handed to blocks
            return           # that did not use it): nothing to add, as plain PyTorch leaves p.grad None
        grad = p.grad.detach()
        p.grad = None
        if sink is not None:   # copied beside the backward, in the compute dtype (converted on the host, so
            sink.submit(master, grad)   # that no fp32 copy of a large embedding's gradient is made on the device)
        elif master.grad is None:
            master.grad = grad.to(torch.float32)   # p.grad is dropped above: sharing its storage is safe
        else:
            master.grad.add_(grad)
    return hook


class MasterGradSink:
    """Gradients into host masters without holding up backward. The autograd hook records where on the
    compute stream the gradient was made and hands it over; one worker thread copies it in pieces of at most
    ``CHUNK`` elements through two staging buffers (pinned where an accelerator exists) on the device-to-host
    stream, the next piece's copy running while the last one is added into the master's fp32 ``.grad``.
    Gradients land in submission order (micro-batches accumulate in order); each device gradient is held
    until its copy is done, and at most ``max_bytes`` of them (one micro-batch's) wait: past that, the
    backward waits for the oldest. A failed landing leaves its gradient missing (the first of a step) or
    partly added: every ``flush`` raises it from then on, until ``discard`` (zero_grad) drops the gradients."""

    CHUNK = 16 * 2 ** 20   # elements: 32 MiB of bf16 a staging buffer

    def __init__(self, dtype: torch.dtype, max_bytes: int = 0, max_numel: int = CHUNK):
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.staging_numel = max(1, min(self.CHUNK, max_numel))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-master-grads")
        self.pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.failed: BaseException | None = None
        self._staging: list[torch.Tensor] | None = None
        self._spare: dict[int, torch.Tensor] = {}   # id(master) -> the memory of its dropped gradient (reuse)

    def submit(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        """Called from the autograd hook: never raises an earlier copy's failure (``flush`` does)."""
        grad = grad if grad.is_contiguous() else grad.contiguous()   # on the compute stream, before the event
        ready = None
        if grad.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(grad.device))
        nbytes = grad.numel() * grad.element_size()
        self._collect(lambda: bool(self.pending) and self.pending[0][0].done())
        if self.pending and sum(b for _, b in self.pending) + nbytes > self.max_bytes:
            with streams.wait_span("gradient sink (embedding/head)", grad.device):
                self._collect(lambda: bool(self.pending) and sum(b for _, b in self.pending) + nbytes > self.max_bytes)
        self.pending.append((self.pool.submit(self._land, master, grad, ready), nbytes))

    def _collect(self, more) -> None:
        """Wait for the oldest landings while ``more()``; a failure is kept for ``flush``."""
        while more():
            error = self.pending.popleft()[0].exception()
            if error is not None and self.failed is None:
                self.failed = error

    def _land(self, master: nn.Parameter, grad: torch.Tensor, ready) -> None:
        src = grad.reshape(-1)   # contiguous: a view
        n = src.numel()
        if self._staging is None:   # the one worker's, with the scratch of its fp32 adds
            self._staging, self._scratch = ([empty_host(self.staging_numel, self.dtype) for _ in range(2)],
                                            scratch_for(self.staging_numel))
        first = master.grad is None   # then it is set once whole: a failed copy leaves it missing
        if first:   # into the last step's gradient's memory: a fresh one is allocated and page-faulted each step
            acc = self._spare.pop(id(master), None)
            if acc is None:
                acc = torch.empty(master.shape, dtype=torch.float32, device=master.device)
        else:
            if not master.grad.is_contiguous():   # e.g. zeros_like of a transposed master
                master.grad = master.grad.contiguous()
            acc = master.grad
        dst = acc.view(-1)
        size = self.staging_numel
        in_flight = None

        def finish(piece) -> None:
            handle, staged, start = piece
            handle.synchronize()
            part = dst[start:start + staged.numel()]
            with streams.span("host", f"grad add {tuple(master.shape)}", bytes=staged.numel() * staged.element_size()):
                part.copy_(staged) if first else add_into(part, staged, self._scratch)

        for k, start in enumerate(range(0, n, size)):
            staged = self._staging[k % 2][:min(size, n - start)]
            handle = async_copy(staged, src[start:start + staged.numel()], after=ready, follow_current=False,
                                direction="d2h", label=f"grads {tuple(master.shape)} [{start}:]")
            if in_flight is not None:
                finish(in_flight)
            in_flight = (handle, staged, start)
        if in_flight is not None:
            finish(in_flight)
        if first:
            master.grad = acc

    def reuse(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        """``grad`` (``master``'s, being dropped by zero_grad) becomes the memory its next first gradient lands
        in, whole: a tensor of another layout is not kept."""
        if grad.shape == master.shape and grad.is_contiguous() and grad.dtype == torch.float32 and \
                grad.device == master.device:
            self._spare[id(master)] = grad

    def flush(self) -> None:
        """Every gradient handed over has landed; raises if any landing failed since the last ``discard``."""
        self._collect(lambda: bool(self.pending))
        if self.failed is not None:
            raise RuntimeError(f"copying an embedding/head gradient to its host master failed "
                               f"({type(self.failed).__name__}: {self.failed}); that gradient is missing or "
                               f"partly added: call zero_grad() and redo the step's micro-batches") from self.failed

    def discard(self) -> None:
        """Waits for what is in flight, forgets any failure: the gradients are about to be dropped."""
        self._collect(lambda: bool(self.pending))
        self.failed = None

    def close(self) -> None:
        """Waits for what is in flight (a failure is dropped: the model is being handed back), then stops."""
        self.discard()
        self.pool.shutdown(wait=True)
        self._staging = None
        self._spare = {}


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflow at ``min_loss_scale`` under ZeRO: no smaller scale is left to try, so the run
    stops, as DeepSpeed's ZeRO optimizers stop it."""


class LossScaler:
    """fp16 loss scale: static (``loss_scale`` > 0) or dynamic, as DeepSpeed 0.19's optimizers move it.

    With ZeRO (stage >= 1, ``zero=True``) its ``DynamicLossScaler``: the scale halves after ``hysteresis``
    overflows and a further overflow at the minimum stops the run. Without ZeRO (stage 0) its
    ``FP16_Optimizer``'s rule: every overflow halves the scale, hysteresis unused, and at the minimum the
    steps go on being skipped. In both the scale doubles after ``scale_window`` overflow-free steps counted
    from the step after an overflow, or from the start."""

    def __init__(self, static_scale: float = 0.0, initial_scale_power: int = 16, scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_scale: float = 1.0,
                 zero: bool = True):
        self.dynamic = static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.scale_window, self.min_scale, self.zero = scale_window, min_scale, zero
        self.hysteresis = hysteresis if zero else 1
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.zero and self.scale == self.min_scale:   # DeepSpeed's text, then what to do about it
                    raise LossScaleAtMinimumError(
                        f"Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
                        f"(fp16: the gradients overflow even at fp16.min_loss_scale = {self.min_scale:g}; lower the "
                        f"learning rate, lower min_loss_scale, or train in bf16)")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1   # overflow-free steps before this one
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter",
                                              "hysteresis", "dynamic")}

    def load_state_dict(self, sd: dict) -> str | None:
        """Take a saved scaler's state where its mode is this one's; returns why it was not taken, else None.

        The config says static or dynamic: a static ``fp16.loss_scale`` keeps its value over a resume, and a
        dynamic scaler does not adopt a static one's value (a bf16 or fp32 DeepSpeed checkpoint saves 1.0)
        but starts afresh. A state with no ``dynamic`` (saved before it was kept) is taken as this mode's."""
        saved_dynamic = bool(sd.get("dynamic", self.dynamic))
        if not self.dynamic:
            saved = sd.get("scale", self.scale)
            if saved_dynamic or saved != self.scale:
                return (f"the configured static fp16.loss_scale {self.scale:g} is kept; the checkpoint's "
                        f"{'dynamic' if saved_dynamic else 'static'} loss scale {saved:g} is not restored")
            return None
        if not saved_dynamic:
            return (f"the checkpoint's static loss scale {sd.get('scale', 1.0):g} is not restored: this run's fp16 "
                    f"scale is dynamic (fp16.loss_scale 0) and starts at {self.scale:g}")
        for k in ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter"):
            if k in sd:
                setattr(self, k, sd[k])
        # a scaler saved with another hysteresis (stage 0 has none; the config changed) starts this one's
        # afresh rather than count its overflows as used up
        if sd.get("hysteresis", self.hysteresis) != self.hysteresis or self.cur_hysteresis > self.hysteresis:
            self.cur_hysteresis = self.hysteresis
        return None
