"""The host optimizer's update of the streamed layers, run layer by layer on a worker thread.

``engine.step()`` updates the non-block parameters at once and hands the streamed layers to this worker
in forward order, then returns. The next forward waits for layer i's update only when it needs layer
i's weights, so on a GPU the host update of later layers hides behind the forward of earlier ones (the
design's data flow; the planner's ``overlap_optimizer``). Anything else that reads weights, gradients
or optimizer state waits for all of them first (:meth:`LayerUpdates.wait_all`).

A failed update is kept and re-raised by every later wait: some layers would hold new weights and some
old ones, so training must not go on as if nothing happened.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from ..tiers import streams


class OverlappedUpdateError(RuntimeError):
    """An overlapped layer update raised; the model's streamed layers are partly updated."""


class LayerUpdates:
    """Per-layer "update done" flags and the worker thread that sets them."""

    def __init__(self, num_layers: int, device: torch.device | None = None,
                 on_done: Callable[[int], None] | None = None):
        self._done = [threading.Event() for _ in range(num_layers)]
        for e in self._done:
            e.set()
        # CUDA work on the worker (a resident layer's refresh) targets the engine's device, not cuda:0
        init = (lambda: torch.cuda.set_device(device)) if device is not None and device.type == "cuda" else None
        self._new_pool = lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-update",
                                                    initializer=init)
        self._pool = self._new_pool()
        self._on_done = on_done   # told each layer, after its flag is set (the weight stream's deferred prefetch)
        self._future: Future | None = None
        self._worker_ident: int | None = None
        self._error: BaseException | None = None
        self._error_seen = False
        self._notes: list[str] = []   # warnings of a finished update, given on the training thread (note())
        self._notes_lock = threading.Lock()
        self.busy_seconds = 0.0     # the worker's time on the last launched update
        self.waited_seconds = 0.0   # the caller's time blocked on it since that launch (exposed update time)

    def launch(self, update_layer: Callable[[int], None], layers: Iterable[int]) -> None:
        """Run ``update_layer(i)`` for each layer, in order, on the worker."""
        self.wait_all()
        layers = list(layers)
        for i in layers:
            self._done[i].clear()
        self.busy_seconds = self.waited_seconds = 0.0
        try:
            self._future = self._pool.submit(self._run, update_layer, layers)
        except BaseException:   # no thread, or an interrupt: nothing will set these flags, so no wait may hang
            for i in layers:
                self._done[i].set()
            # submit queues the work before it starts the thread: left queued, it would run first at the next
            # launch, on that step's gradients (every layer stepped twice). A new pool holds nothing
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            raise

    def _run(self, update_layer: Callable[[int], None], layers: list[int]) -> None:
        self._worker_ident = threading.get_ident()
        t0 = time.perf_counter()
        try:
            for i in layers:
                with streams.span("optimizer", f"update L{i}"):
                    streams.chaos_delay()
                    update_layer(i)
                self._done[i].set()
                if self._on_done is not None:
                    self._on_done(i)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by every wait
            self._error = e
        finally:
            for i in layers:   # a waiter must wake up (and raise) rather than hang
                self._done[i].set()
            self.busy_seconds = time.perf_counter() - t0

    def _on_worker(self) -> bool:
        return threading.get_ident() == self._worker_ident

    def running(self) -> bool:
        """A launched update has not finished all its layers yet."""
        return self._future is not None and not self._future.done()

    def pending(self, i: int) -> bool:
        """Layer i's update is still queued or running (never blocks)."""
        return not self._done[i].is_set()

    def wait(self, i: int) -> None:
        """Block until layer i is updated."""
        if self._on_worker():
            return
        if not self._done[i].is_set():
            t0 = time.perf_counter()
            self._done[i].wait()
            self.waited_seconds += time.perf_counter() - t0
        self._raise_if_failed()

    def wait_all(self) -> None:
        """Block until every launched update is done (a no-op on the worker itself)."""
        if self._on_worker():
            return
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()
            self._future = None
            self.waited_seconds += time.perf_counter() - t0
        self._raise_if_failed()

    def settle(self) -> None:
        """Block until a launched update has finished, whatever its outcome: a failure stays to be raised
        (by the next wait) or forgotten (:meth:`forget_failure`)."""
        if self._future is not None and not self._on_worker():
            concurrent.futures.wait([self._future])

    @property
    def failure(self) -> BaseException | None:
        """What a launched update that has finished raised on the worker (None: nothing, or forgotten)."""
        return self._error

    def forget_failure(self) -> None:
        """After a failed update: the caller restores a consistent state (a checkpoint) and goes on."""
        if self._future is not None:
            self._future.result()
            self._future = None
        self._error, self._error_seen = None, False

    def note(self, message: str) -> None:
        """A warning from the worker, given by the training thread's next wait: issued on the worker, a
        warnings filter of "error" would make it the update's failure, and a test's capture might miss it."""
        with self._notes_lock:
            self._notes.append(message)

    def _give_notes(self, stacklevel: int) -> None:
        with self._notes_lock:
            notes, self._notes = self._notes, []
        for message in notes:
            warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)

    def _raise_if_failed(self) -> None:
        self._give_notes(stacklevel=4)
        if self._error is not None:
            self._error_seen = True
            raise OverlappedUpdateError(
                f"the optimizer update of the streamed layers failed on the update thread ({self._error!r}); "
                "some layers hold updated weights and some do not, so training cannot continue from this "
                "state: reload a checkpoint") from self._error

    def close(self) -> None:
        """Finish any launched update and stop the worker."""
        try:
            if self._future is not None:
                self._future.result()
        finally:
            self._future = None
            self._pool.shutdown(wait=True)
        self._give_notes(stacklevel=3)   # nothing waited since the update: given here
        if self._error is not None and not self._error_seen:
            warnings.warn(f"lazytrain: the last overlapped optimizer update failed ({self._error!r}) and nothing "
                          f"waited for it before the engine was closed", RuntimeWarning, stacklevel=3)
