"""The buffers a block's training forward writes, as the forward found them, for the block's re-runs.

Why: a block that updates a buffer in its training forward and reads it (spectral_norm's power iteration, fake
quantization's observers, a moving scale, a counter) must be re-run in backward from the values its forward
read, or its gradients are not plain PyTorch's; and the re-run must not move the buffers again (BatchNorm's
statistics move once per forward). A buffer *slot* is (module, name) in a module's ``_buffers``: one tensor may sit
in several slots (a buffer registered in two submodules), and a slot may hold None (a buffer made on first use).

Copying every buffer at every forward would double the cost of a block with a large read-only buffer (a causal
mask): a :class:`WrittenBuffers` copies them all at its block's first training forward only, and from then on
those its forwards have written. One written for the first time later is re-run that once from the value the
forward left, with a warning.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

_NOT_FOUND = object()


def buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str, "torch.Tensor | None"]]:
    """Every buffer slot under ``module`` with what it holds now (None included)."""
    return [(m, name, buf) for m in module.modules() for name, buf in m._buffers.items()]


def _version(t: "torch.Tensor | None"):
    """Autograd's version counter of ``t`` (None for None, and for an inference tensor, which keeps none: one
    cannot be written in place outside inference mode anyway)."""
    return None if t is None or t.is_inference() else t._version


class _Copies:
    """One copy per tensor, whichever slots hold it: slots that shared a tensor share its copy."""

    def __init__(self):
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, t):
        if t is None or t is _NOT_FOUND:   # (a slot absent: it stays absent)
            return t
        held = self._by_id.get(id(t))
        if held is None:
            held = self._by_id[id(t)] = (t, t.clone())   # (t itself kept: its id stays its own meanwhile)
        return held[1]


def copies_of(slots) -> list:
    """``(module, name, copy)`` for each slot: what it holds, copied (aliases share one copy; None stays None)."""
    copies = _Copies()
    return [(m, name, copies.of(buf)) for m, name, buf in slots]


@contextmanager
def buffers_set_to(values):
    """Each slot of ``values`` (``(module, name, value)``) holds a fresh copy of its value while the context runs
    (slots given one tensor share its copy), then what it held before: what runs inside writes nothing back."""
    copies = _Copies()
    before = [(m, name, m._buffers.get(name, _NOT_FOUND)) for m, name, _ in values]
    for m, name, value in values:
        if value is _NOT_FOUND:   # a slot its forward registered: the re-run registers it again
            m._buffers.pop(name, None)
        else:
            m._buffers[name] = copies.of(value)
    try:
        yield
    finally:
        for m, name, held in before:
            if held is _NOT_FOUND:
                m._buffers.pop(name, None)
            else:
                m._buffers[name] = held


class WrittenBuffers:
    """Which buffer slots one block's training forwards write, learned as they run."""

    def __init__(self, where: str):
        self.where = where
        self.seen = False                       # a training forward was watched: only written slots are copied
        self.written: set[tuple[int, str]] = set()   # (id(module), name)
        self._warned = self._warned_rerun = False

    @contextmanager
    def watching(self, block: nn.Module, found: list):
        """Around a forward of ``block`` that its backward re-runs: appends to ``found`` ``(module, name, value)``
        of each slot the forward wrote (in place, through ``.data``, by assignment, or registered), as the forward
        found it. A forward with every module in eval mode (an evaluation under grad) copies all, like a first
        training forward, and is not one: it writes nothing a training forward writes."""
        copies = _Copies()
        before = []
        training = any(m.training for m in block.modules())
        for m, name, buf in buffer_slots(block):
            copied = buf is not None and (not self.seen or (id(m), name) in self.written)
            before.append((m, name, buf, _version(buf), copies.of(buf) if copied else _NOT_FOUND))
        yield
        self.seen = self.seen or training
        missed = []
        for m, name, buf, version, copy in before:
            now = m._buffers.get(name, _NOT_FOUND)
            wrote = now is not buf or (buf is not None and (
                _version(buf) != version or (copy is not _NOT_FOUND and _values_differ(copy, buf))))
            if not wrote:
                continue
            self.written.add((id(m), name))
            if buf is None or copy is not _NOT_FOUND:
                found.append((m, name, None if buf is None else copy))
            else:
                missed.append(name)
        known = {(id(m), name) for m, name, *_ in before}
        for m, name, _ in buffer_slots(block):   # registered by the forward: absent for its re-runs
            if (id(m), name) not in known:
                self.written.add((id(m), name))
                found.append((m, name, _NOT_FOUND))
        if missed and not self._warned:
            self._warned = True
            warnings.warn(f"lazytrain: {self.where}'s training forward wrote the buffer(s) {', '.join(missed)}, "
                          f"which its earlier forwards left alone: this forward's re-run in backward starts from the "
                          f"value the forward left, not the one it read; from its next forward on, from the one read",
                          UserWarning, stacklevel=4)


def _values_differ(copy: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``buf`` no longer holds ``copy``'s values (a write through ``.data``, which the version counter
    does not see). Layouts ``torch.equal`` cannot compare (sparse, nested, meta) are judged by the counter
    alone; NaN reads as a write (the buffer is copied each forward: correct, only not free)."""
    if buf.layout != torch.strided or buf.is_nested or buf.device.type == "meta":
        return False
    return not torch.equal(copy, buf)


@contextmanager
def restored_for_rerun(block: nn.Module, found: list, watch: "WrittenBuffers | None" = None):
    """The context a re-run of ``block`` runs in: each slot its forwards write (``watch``'s, and ``found``) holds a
    fresh copy of what the forward found (or holds now), so the re-run reads what its forward read and moves
    nothing; the slots they never wrote are left as they are (a large read-only mask is not copied per re-run).
    Without ``watch`` (or before it watched a forward), every slot is copied."""
    found_at = {(id(m), name): value for m, name, value in found}
    slots = buffer_slots(block)
    copied = [(m, name, found_at.get((id(m), name), buf)) for m, name, buf in slots
              if watch is None or not watch.seen or (id(m), name) in found_at or (id(m), name) in watch.written]
    copied_keys = {(id(m), name) for m, name, _ in copied}
    left = [(m, name, buf, _version(buf)) for m, name, buf in slots if (id(m), name) not in copied_keys]
    with buffers_set_to(copied):
        yield
    undone = []
    for m, name, buf, version in left:   # a re-run that writes what its forwards never wrote (a branch of its own)
        if m._buffers.get(name, _NOT_FOUND) is not buf:
            m._buffers[name] = buf       # an assignment is undone
        elif buf is not None and _version(buf) != version:
            undone.append(name)
    if undone and watch is not None and not watch._warned_rerun:
        watch._warned_rerun = True
        warnings.warn(f"lazytrain: a re-run of {watch.where} in backward wrote the buffer(s) {', '.join(undone)} in "
                      f"place, which its training forwards never wrote: they moved once more than in plain PyTorch",
                      UserWarning, stacklevel=3)
