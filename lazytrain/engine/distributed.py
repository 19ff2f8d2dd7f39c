"""torch.distributed set-up from the launcher's environment, and the collectives the engine runs.

A plain ``python train.py`` (no RANK/WORLD_SIZE) is a single process: no process group, no mpi4py.
Under torchrun, the group is created from the environment (NCCL on CUDA, gloo otherwise). The engine's
own collectives run on groups it makes with ``lazytrain.collective_timeout_s`` (default 30 minutes, as
torch and DeepSpeed): host gradient buffers over gloo, since NCCL cannot reduce host memory, device
tensors over the default group's backend; at stage >= 2 on a GPU with NCCL each layer's gradient is reduced
to its owner on the device, before it leaves it (``reduce_gradients_on_device``). A rank that stops or dies
makes the others fail with :class:`CollectiveError`, naming the collective and the timeout, instead of
hanging.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launcher_env import LaunchError, launcher_int  # noqa: F401 - LaunchError: raised here, caught by callers

DEFAULT_TIMEOUT_S = 1800.0
NCCL_WATCHDOG_MARGIN_S = 60.0   # an NCCL group's timeout past the engine's (DistributedContext._nccl_timeout)


_GRADIENT_REDUCE = ("gradient reduce in the backward (at zero_optimization.stage >= 2 every rank must run the "
                    "same trainable layers in each backward; a model that skips layers on some ranks needs stage 1)")


class CollectiveError(RuntimeError):
    """A collective that did not complete on every rank (one stopped, hung or died)."""


class UnfinishedCollectives:
    """Collectives whose wait failed (timed out) while the backend may still be running them, held until it
    ends them. Why: gloo's worker thread ends such a collective later, at its own timeout, and dropping the last
    reference to its tensors takes the GIL; once the interpreter is shutting down, taking the GIL ends that
    thread inside a C++ destructor and the process aborts (SIGABRT, "terminate called without an active
    exception") after its CollectiveError was reported, with exit status 134 in place of the script's own.
    Held here, their last reference is dropped by the main thread; at exit (atexit runs before the shutdown)
    the ones a gloo group runs are waited for until they end, for at most the timeout again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[tuple[object, float]] = []   # (work, when to stop waiting for it at exit)
        self._at_exit = False

    def hold(self, work, wait_at_exit_s: float) -> None:
        with self._lock:
            self._held.append((work, time.monotonic() + wait_at_exit_s))
            if not self._at_exit:
                atexit.register(self.wait_at_exit)
                self._at_exit = True

    def wait_at_exit(self, poll_s: float = 0.02) -> None:
        t0, told = time.monotonic(), False
        while True:
            with self._lock:
                now = time.monotonic()
                left = [until for work, until in self._held if until > now and not work.is_completed()]
            if not left:
                return
            if not told and now - t0 > 2:
                print(f"lazytrain: waiting up to {max(left) - now:.0f} s for {len(left)} collective(s) that timed "
                      f"out to be ended by their backend, so that the process exits cleanly", file=sys.stderr)
                told = True
            time.sleep(poll_s)


UNFINISHED = UnfinishedCollectives()


class CallOrder:
    """The calls every rank must make together (``save_checkpoint``, ``load_checkpoint``), checked on the process
    group's store before their first collective. Why: a script that makes one on rank 0 alone (DDP's idiom for
    saving) had rank 0's collectives pair up with the others' next step's: gloo then aborted a process on the
    size mismatch, blaming "another rank stopped, hung or died", and where the sizes matched it would combine
    unrelated tensors. Before each call whose collectives need every rank (a step, a backward that reduces, a
    gather of partitioned parameters that broadcasts, a together-call, ``destroy()``, the script's end), a rank
    publishes how many such calls it has made and which this one
    is: every rank makes the same ones in the same order, so a together-call waits until every rank has
    arrived at it, and fails at once, naming the call, where a rank's call at the same count is another, or a
    rank is past it."""

    def __init__(self, rank: int, world: int, timeout_s: float, group):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.made = 0   # calls published so far (the same sequence on every rank)
        self.micro_step = 0   # the last one published
        self.store = None
        if world > 1:
            try:   # the store the process group was made from (torchrun's or a TCP store)
                store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, AttributeError, ValueError):   # a group made some other way: not checked
                return
            if _file_store(store):   # a file store's file grows with every write, for the whole run
                return
            # under the engine's own group's name: a second engine's calls are counted apart
            self.store = dist.PrefixStore(f"lazytrain/calls/{group.group_name}/", store)
            # a rank waiting in a save this one never makes learns it when this one's script ends
            atexit.register(self.entering, "the end of its script", None)

    def entering(self, call: str, micro_step: int | None) -> int:
        """This rank is about to run ``call``'s collectives at ``micro_step``; returns the call's number. Published
        where it can be: a store that cannot be reached leaves the collective itself to fail, naming itself."""
        number, self.made = self.made, self.made + 1
        self.micro_step = self.micro_step if micro_step is None else micro_step
        micro_step = self.micro_step
        if self.store is not None:
            try:
                self.store.set(f"at/{self.rank}", f"{number} {micro_step} {call}")
            except (RuntimeError, OSError):
                pass
        return number

    def at_micro_step(self, micro_step: int) -> None:
        """The micro-step the calls published without one (a gather, the script's end) are at."""
        self.micro_step = micro_step

    def together(self, call: str, micro_step: int, poll_s: float = 0.001) -> None:
        """Wait until every rank has arrived at this call (the same one, as the same call of the sequence); a
        :class:`CollectiveError` naming ``call`` where one is seen elsewhere, or does not come in the timeout."""
        number = self.entering(call, micro_step)
        if self.store is None:
            return
        # counted by call as well as by number: ranks at the same number with different calls never count each
        # other as arrived, so they stay to compare positions (and fail) rather than pair their collectives up
        key, t0 = f"together/{number}/{hashlib.sha256(call.encode()).hexdigest()[:16]}", time.monotonic()
        others = [r for r in range(self.world) if r != self.rank]
        keys = [f"at/{r}" for r in others]
        try:
            arrived = self.store.add(key, 1)
            while arrived < self.world:
                time.sleep(poll_s)
                poll_s = min(2 * poll_s, 0.05)
                published = self.store.check(keys)   # each rank publishes at its first such call (get would wait)
                positions = [v.decode().split(" ", 2) for v in self.store.multi_get(keys)] if published else []
                arrived = self.store.add(key, 0)   # after the positions: one seen past here went on once all came
                if arrived >= self.world:
                    break
                behind = [] if published else others
                for r, (there, step, elsewhere) in zip(others, positions):
                    if int(there) > number or (int(there) == number and elsewhere != call):
                        raise CollectiveError(self._skipped(call, micro_step, number, r, int(there), step, elsewhere))
                    if int(there) < number:
                        behind.append(r)
                if time.monotonic() - t0 > self.timeout_s:
                    raise CollectiveError(
                        f"rank {self.rank} of {self.world}: the arrival of every rank at {call} did not complete: it "
                        f"failed after {time.monotonic() - t0:.1f} s, with a collective timeout of {self.timeout_s:g} "
                        f"s ('lazytrain.collective_timeout_s'). Rank(s) {behind} did not reach it: every rank must "
                        f"call {call}; or another rank stopped, hung or died before reaching it")
        except (RuntimeError, OSError, ValueError) as e:
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"rank {self.rank} of {self.world}: the arrival of every rank at {call} could not "
                                  f"be checked: the process group's store failed ({type(e).__name__}: {e}); another "
                                  f"rank or the launcher may have stopped") from e

    def _skipped(self, call: str, micro_step: int, number: int, r: int, there: int, step: str, elsewhere: str) -> str:
        """What a rank seen elsewhere means: it went on without this call, or (the same call at another count)
        the ranks' calls differed earlier."""
        if there == number and elsewhere != call and elsewhere.split("(")[0] == call.split("(")[0]:
            return (f"rank {self.rank} of {self.world}: {call} was called here at micro-step {micro_step}, where rank "
                    f"{r} called {elsewhere}: every rank must make the same call, with the same arguments, as in "
                    f"DeepSpeed (its collectives would pair up different tensors)")
        if elsewhere == call:
            return (f"rank {self.rank} of {self.world}: {call} is this rank's call {number} whose collectives need "
                    f"every rank, and rank {r}'s call {there}: the ranks made different such calls before it (a "
                    f"step, a backward, a save or a load on some ranks only); every rank must make the same ones")
        return (f"rank {self.rank} of {self.world}: {call} was called here at micro-step {micro_step}, where rank {r} "
                f"went on to {elsewhere} (at micro-step {step}) without calling it: every rank must call it (each writes "
                f"or reads its part), as in DeepSpeed; a script that saves on rank 0 alone (as with DDP) calls it on "
                f"every rank instead")


def _is_gloo(group) -> bool:
    try:
        return group is not None and dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):   # a group already torn down: nothing to wait for
        return False


def _file_store(store) -> bool:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.FileStore)


def world_size() -> int:
    """Ranks training together: the process group the script created itself (``mp.spawn`` and
    ``init_process_group`` by hand, as DeepSpeed accepts), else the launcher's ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launcher_int("WORLD_SIZE", 1)


def launched() -> bool:
    """Whether a launcher (torchrun, DeepSpeed's) started this process: its environment names the rank, the
    world and the rendezvous, from which a process group can be made even for a world of one."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S),
                     init_method: str | None = None, dist_init_required: bool | None = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """DeepSpeed's ``init_distributed``, its parameters in its order: the default process group from the
    launcher's environment (or the arguments), NCCL on CUDA and gloo otherwise, with ``timeout`` on its
    collectives. A no-op when a group exists, or for a single process no launcher started. MPI discovery, the port
    fallback, ``verbose``, ``dist_init_required`` and ``config`` are accepted and unused: LazyTrain takes
    the launcher's environment as torchrun and DeepSpeed's launcher give it."""
    if not dist.is_available() or dist.is_initialized():
        return
    if world_size < 0 and launcher_int("WORLD_SIZE", 1) <= 1 and not launched():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {"backend": backend, "timeout": timeout, "init_method": init_method}
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


class DistributedContext:
    def __init__(self, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 comm_dtype: torch.dtype = torch.float32):
        self.comm_dtype = comm_dtype   # gradients are summed over the ranks in it (communication_data_type)
        self.world_size = world_size()
        own_group = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if own_group else launcher_int("RANK", 0)
        self.local_rank = launcher_int("LOCAL_RANK", self.rank if own_group else 0)
        self.timeout_s = float(timeout_s)
        self._started_lock = threading.Lock()
        self._in_flight: dict[int, tuple] = {}   # works _started and not yet waited for: id -> (work, group)
        self.host_group = self.device_group = self.update_group = self.gradient_group = None
        self.device_gradient_group = None   # see reduce_gradients_on_device
        if self.world_size > 1:
            if not dist.is_initialized():
                missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
                if missing:
                    raise LaunchError(f"WORLD_SIZE={self.world_size} but {', '.join(missing)} is not set: launch with "
                                       f"torchrun, or unset WORLD_SIZE for a single process")
                init_distributed("nccl" if device_type == "cuda" else "gloo", timeout=self._timeout())
            # groups of our own, so that the timeout holds whoever made the default group and how
            timeout = self._timeout()
            self.host_group = dist.new_group(backend="gloo", timeout=timeout)
            backend = dist.get_backend()
            self.device_group = self.host_group if backend == "gloo" else dist.new_group(
                backend=backend, timeout=self._nccl_timeout() if "nccl" in backend else timeout)
            # the layer-update thread's broadcasts (sharded optimizer state), apart from the main thread's
            self.update_group = dist.new_group(backend="gloo", timeout=timeout)
            # the gradient path's reduces (sharded gradients), from the thread that lands gradients on the host
            self.gradient_group = dist.new_group(backend="gloo", timeout=timeout)
        self.calls = CallOrder(self.rank, self.world_size, self.timeout_s, self.host_group)   # checks nothing alone

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def _collective(self, what: str, collective, /, *args, **kwargs) -> None:
        """``collective(*args, **kwargs)`` (a torch.distributed call on one of our groups), waited for on the
        host for at most the timeout: NCCL returns before the collective is done, and its watchdog would end
        the process without naming it. A failure names the collective and the timeout."""
        t0 = time.monotonic()
        try:
            work = collective(*args, async_op=True, **kwargs)
        except RuntimeError as e:
            raise self._failed(what, t0, e) from e
        self._wait(what, t0, work, kwargs.get("group"))

    def _wait(self, what: str, t0: float, work, group) -> None:
        """``work`` waited for at most the timeout; if it fails, held in :data:`UNFINISHED` until the backend
        ends it, and named (:meth:`_failed`)."""
        try:
            work.wait(self._timeout())
        except RuntimeError as e:
            with self._started_lock:   # those started beside it (_started) are as unfinished
                held, self._in_flight = [(work, group), *self._in_flight.values()], {}
            for w, g in held:
                UNFINISHED.hold(w, self.timeout_s + 5.0 if _is_gloo(g) else 0.0)   # NCCL's watchdog ends its own
            raise self._failed(what, t0, e) from e
        with self._started_lock:
            self._in_flight.pop(id(work), None)

    def _failed(self, what: str, t0: float, e: BaseException) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank} of {self.world_size}: the {what} did not complete: it failed after "
            f"{time.monotonic() - t0:.1f} s, with a collective timeout of {self.timeout_s:g} s "
            f"('lazytrain.collective_timeout_s'). Another rank stopped, hung or died before reaching it "
            f"({type(e).__name__}: {e})")

    def average(self, host_tensors: list[torch.Tensor], device_tensors: list[torch.Tensor],
                what: str = "gradient all-reduce of engine.step()") -> None:
        """Divide by the world size, then all-reduce (sum), in place: dividing first keeps loss-scaled
        gradients from overflowing in the sum."""
        if not self.enabled:
            return
        for tensors, group in ((host_tensors, self.host_group), (device_tensors, self.device_group)):
            for t in tensors:
                sent = self._for_sending(t)
                self._collective(what, dist.all_reduce, sent, group=group)
                if sent is not t:
                    t.copy_(sent)

    def group_for(self, t: torch.Tensor):
        return self.host_group if t.device.type == "cpu" else self.device_group

    def _for_sending(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` divided by the world size, in the communication dtype and contiguous (``t`` itself, in place,
        when it is both already). NCCL refuses a tensor that is not contiguous (a transposed parameter's
        gradient has its parameter's strides)."""
        if not t.is_floating_point():
            raise TypeError(f"a {t.dtype} tensor cannot be averaged over the ranks: gradients are floating point")
        if t.dtype == self.comm_dtype:
            return t.div_(self.world_size) if t.is_contiguous() else t.contiguous().div_(self.world_size)
        # divided in t's own dtype, then rounded once into the communication dtype: an fp32 sum of loss-scaled
        # micro-batches above fp16's range whose share fits is sent, not turned into inf
        sent = torch.empty(t.shape, dtype=self.comm_dtype, device=t.device)
        return torch.div(t, self.world_size, out=sent)

    def reduce_to(self, tensors: list[torch.Tensor], owner: int) -> None:
        """Divide by the world size, then sum into rank ``owner``'s tensors (the others' are left partial)."""
        for t in tensors:
            sent = self._for_sending(t)
            self._collective("gradient reduce of engine.step()", dist.reduce, sent, dst=owner,
                             group=self.group_for(t))
            if sent is not t and self.rank == owner:
                t.copy_(sent)

    def reduce_mean_to(self, t: torch.Tensor, owner: int, what: str) -> torch.Tensor:
        """``t`` divided by the world size (in the communication dtype: ``t`` itself, changed in place, when it
        is in it) and summed into rank ``owner``'s; returns what was sent, which holds the sum on the owner."""
        sent = self._for_sending(t)
        self._collective(what, dist.reduce, sent, dst=owner, group=self.group_for(sent))
        return sent

    def reduce_gradient(self, t: torch.Tensor, owner: int) -> None:
        """Sum every rank's host tensor ``t`` into rank ``owner``'s, on the gradient path's group (one layer's
        gradient of one micro-batch, as it lands: sharding.GradientsToOwners)."""
        self._collective(_GRADIENT_REDUCE, dist.reduce, t, dst=owner, group=self.gradient_group)

    def start_from_rank_0(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters into every rank's model, as DeepSpeed's ``initialize`` broadcasts them: a script
        that seeds each rank differently, or loads weights on rank 0 only, still trains one model. The ranks
        first agree that they hold the same parameters (names, shapes, dtypes, device types), else the
        broadcasts would pair tensors of different sizes or groups."""
        if not self.enabled:
            return
        params = list(model.named_parameters())
        digest = hashlib.sha256(repr([(n, tuple(p.shape), str(p.dtype), p.device.type)
                                      for n, p in params]).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        what = "comparison of the ranks' models in initialize()"
        self._collective(what, dist.all_reduce, low, op=dist.ReduceOp.MIN, group=self.host_group)
        self._collective(what, dist.all_reduce, high, op=dist.ReduceOp.MAX, group=self.host_group)
        if low.item() != high.item():
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: the ranks' models differ in their parameters' "
                               f"names, shapes, dtypes or device types ({len(params)} parameters here); every rank "
                               f"must build the same model before lazytrain.initialize()")
        with torch.no_grad():
            for name, p in params:
                data = p.detach()
                if data.numel() == 0:
                    continue
                dense = data if data.is_contiguous() else data.contiguous()
                # as bytes: any dtype crosses (a 0-dim scale, float8), and the values arrive bit for bit
                self._collective(f"broadcast of rank 0's parameter {name!r} in initialize()", dist.broadcast,
                                 dense.reshape(-1).view(torch.uint8), src=0, group=self.group_for(data))
                if dense is not data:
                    data.copy_(dense)

    def broadcast_from(self, tensors: list[torch.Tensor], owner: int,
                       what: str = "broadcast of updated weights in engine.step()") -> None:
        """Rank ``owner``'s values into every rank's ``tensors`` (the owner's updated weights)."""
        for t in tensors:
            sent = t if t.is_contiguous() else t.contiguous()   # NCCL refuses one that is not (a transposed weight)
            self._collective(what, dist.broadcast, sent, src=owner, group=self.group_for(t))
            if sent is not t:
                t.copy_(sent)

    def broadcast_started(self, t: torch.Tensor, owner: int):
        """Start rank ``owner``'s broadcast of host tensor ``t`` on the update thread's group; returns the call
        that waits for it (at most the timeout from that call, a failure named as in :meth:`_collective`).
        Every rank starts the same broadcasts in the same order, which pairs them up across ranks; gloo may
        complete them in another order, so each is waited for on its own."""
        return self._started("broadcast of updated weights in engine.step()", dist.broadcast, t, src=owner,
                             group=self.update_group)

    def reduce_gradients_on_device(self, device: torch.device, mode: str) -> bool:
        """Whether each micro-batch's layer gradients are reduced to their owners on ``device``, before they
        leave it (``mode``: the config's ``lazytrain.gradient_reduce``); if so, opens the group they run on.
        "auto" does so on a GPU whose default group is NCCL: a rank then copies to its host only the
        gradients of the layers it owns (1/world of them), where reducing on the host copies all of them.
        On the CPU the "device" is host memory: "device" runs the same ordering there (the tests' copy
        threads stand in for a GPU's streams) over gloo. Every rank calls it at the same point of set-up
        with the same arguments (opening a group is a collective)."""
        if not self.enabled or mode == "host":
            return False
        if device.type == "cuda" and "nccl" not in dist.get_backend():
            if mode == "device":
                from ..config import ConfigError
                raise ConfigError(f"config key 'lazytrain.gradient_reduce' is \"device\", but the process group's "
                                  f"backend is {dist.get_backend()!r}: reducing GPU tensors needs NCCL; set it "
                                  f"\"host\" or \"auto\"")
            return False
        if device.type != "cuda" and mode == "auto":
            return False
        self.open_device_gradient_group(device)
        return True

    def open_device_gradient_group(self, device: torch.device) -> None:
        """The group the layer gradients' device reduces run on: on CUDA an NCCL group of its own (apart from
        the main thread's collectives), its communicator made now, at set-up, by a one-element all-reduce
        (NCCL makes it at a group's first collective: else inside the first backward, at its peak memory);
        on the CPU the gradient path's gloo group."""
        if device.type != "cuda":
            self.device_gradient_group = self.gradient_group or dist.new_group(backend="gloo",
                                                                               timeout=self._timeout())
            return
        self.device_gradient_group = dist.new_group(backend="nccl", timeout=self._nccl_timeout())
        self._collective("set-up of the device gradient group in initialize()", dist.all_reduce,
                         torch.zeros(1, device=device), group=self.device_gradient_group)

    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def _nccl_timeout(self) -> timedelta:
        """An NCCL group's own timeout: past the engine's, so that the wait that names the collective
        (``CollectiveError``) fails before NCCL's watchdog ends the process (both count from the start)."""
        return timedelta(seconds=self.timeout_s + NCCL_WATCHDOG_MARGIN_S)

    def reduce_gradient_started(self, t: torch.Tensor, owner: int):
        """Start summing every rank's device tensor ``t`` into rank ``owner``'s, on the device gradient group,
        from the thread that makes the gradients (every rank starts the same reduces in the same order: the
        order the backward reaches the layers); returns the call that waits for it, made by the thread that
        lands the gradient (on a GPU with a stream of its own current: NCCL's wait also orders that stream)."""
        return self._started(_GRADIENT_REDUCE, dist.reduce, t, dst=owner, group=self.device_gradient_group)

    def _started(self, what: str, collective, /, *args, **kwargs):
        """``collective(*args, **kwargs)`` started without waiting; returns the call that waits for it (for at
        most the timeout from that call; a failure named as in :meth:`_collective`)."""
        t0 = time.monotonic()
        try:
            work = collective(*args, async_op=True, **kwargs)
        except RuntimeError as e:
            raise self._failed(what, t0, e) from e
        with self._started_lock:
            self._in_flight[id(work)] = (work, kwargs.get("group"))

        def finish() -> None:
            self._wait(what, time.monotonic(), work, kwargs.get("group"))
        return finish

    def send_to(self, t: torch.Tensor, peer: int, what: str) -> None:
        """Host tensor ``t`` to rank ``peer``, which receives it with :meth:`receive_from` (point to point on
        the host group, bounded by the timeout)."""
        self._point_to_point(what, dist.isend, t, peer)

    def receive_from(self, t: torch.Tensor, peer: int, what: str) -> None:
        self._point_to_point(what, dist.irecv, t, peer)

    def _point_to_point(self, what: str, op, t: torch.Tensor, peer: int) -> None:
        t0 = time.monotonic()
        try:
            work = op(t, peer, group=self.host_group)
        except RuntimeError as e:
            raise self._failed(what, t0, e) from e
        self._wait(what, t0, work, self.host_group)

    def sum_into(self, t: torch.Tensor, what: str) -> None:
        """Every rank's ``t`` (contiguous) summed into every rank's, in place."""
        self._collective(what, dist.all_reduce, t, group=self.group_for(t))

    def sum_over_ranks(self, value: float) -> float:
        flag = torch.tensor([value], dtype=torch.float64)
        self._collective("all-reduce of the gradient norm in engine.step()", dist.all_reduce, flag,
                         group=self.host_group)
        return float(flag.item())

    def all_gather_object(self, obj, what: str) -> list:
        """Every rank's ``obj``, in rank order, on every rank (pickled over the host group)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        t0 = time.monotonic()
        try:   # no async form: the host group's own timeout bounds it
            dist.all_gather_object(out, obj, group=self.host_group)
        except RuntimeError as e:   # named with the timeout, as every other collective's failure
            raise self._failed(what, t0, e) from e
        return out

    def fill_missing_grads(self, params: list[torch.Tensor]) -> None:
        """A parameter with a gradient on some ranks only (a branch or an expert that this rank's batch did
        not reach) gets a zero gradient on the others, so that every rank reduces the same tensors in the
        same order; without it the ranks' all-reduces pair up wrong tensors or hang. ``params`` must be in
        the same order on every rank. A parameter no rank has a gradient for stays without one."""
        if not self.enabled or not params:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        self._collective("all-reduce of which parameters have gradients, in engine.step()", dist.all_reduce, has,
                         op=dist.ReduceOp.MAX, group=self.host_group)
        for p, anywhere in zip(params, has.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)

    def barrier(self, what: str = "barrier") -> None:
        if self.enabled:
            self._collective(what, dist.barrier, group=self.host_group)

    def all_succeeded(self, ok: bool, what: str, on_update_thread: bool = False) -> bool:
        """Whether ``ok`` holds on every rank (a rank whose part failed tells the others, which would
        otherwise wait for it until the timeout)."""
        if not self.enabled:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        group = self.update_group if on_update_thread else self.host_group
        self._collective(what, dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())


    def all_succeeded_alike(self, ok: bool, value: int, what: str) -> tuple[bool, bool]:
        """Whether ``ok`` holds on every rank, and whether every rank holds the same ``value`` (an int64), in
        one collective."""
        if not self.enabled:
            return ok, True
        t = torch.tensor([1 if ok else 0, value, -value], dtype=torch.int64)
        self._collective(what, dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.host_group)
        return bool(t[0].item()), t[1].item() == -t[2].item()


class RankFailure:
    """This rank's failure of a part of the work that every rank must fail together (an optimizer update, a
    checkpoint read): kept, not raised, while the part's collectives go on (a rank that raised at once would
    leave the others waiting in them, or would train on alone with other weights), then agreed on by every
    rank in :meth:`agree`. A single process raises it at once."""

    def __init__(self, dist: "DistributedContext", on_update_thread: bool = False):
        self.dist, self.on_update_thread = dist, on_update_thread
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @contextlib.contextmanager
    def kept(self):
        """Around a piece of this rank's part: its exception kept (the first), or raised at once alone."""
        try:
            yield
        except Exception as e:   # noqa: BLE001 - the other ranks hear of it in agree()
            if not self.dist.enabled:
                raise
            if self.error is None:
                self.error = e

    def agree(self, what: str, elsewhere: BaseException) -> None:
        """Every rank fails here if any rank's part failed: with its own error where it failed, else with
        ``elsewhere`` (which says another rank's error tells why). ``what`` names the collective."""
        if self.dist.enabled and not self.dist.all_succeeded(self.error is None, what, self.on_update_thread):
            raise self.error or elsewhere
