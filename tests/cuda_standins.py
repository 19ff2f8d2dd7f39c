"""Stand-ins for CUDA's runtime as far as LazyTrain registers host memory with it, so that the logic runs
(and is tested) on a machine without CUDA."""
import torch


class StandInCudart:
    """torch.cuda.cudart() as far as registering host memory goes: records what is registered."""

    def __init__(self, fail=False):
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


class StandInDevices:
    """This thread's current CUDA device (0, as on any thread that set none) and the devices that have a
    context in the process, standing in for torch.cuda's; ``calls`` records each CUDA runtime call made on
    this thread as (name, current device)."""

    def __init__(self, monkeypatch, cudart, with_context=(0,), count=2):
        import contextlib
        self.current, self.calls = 0, []
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i in with_context, raising=False)

        @contextlib.contextmanager
        def device(i):
            before, self.current = self.current, i
            try:
                yield
            finally:
                self.current = before
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.calls.append(("synchronize", self.current)))
        for name in ("cudaHostRegister", "cudaHostUnregister"):
            call = getattr(cudart, name)
            setattr(cudart, name, lambda *a, _name=name, _call=call: self.calls.append((_name, self.current)) or
                    _call(*a))
