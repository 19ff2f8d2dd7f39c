"""Non-block gradients reach their host fp32 masters beside the backward (precision.MasterGradSink): the
autograd hook returns before the copy lands, pieces land in order and add up exactly, readers wait, and a
failed copy leaves the gradient missing, not half written."""
import threading

import pytest
import torch
import torch.nn as nn

from lazytrain.engine import precision
from lazytrain.engine.precision import Masters, MasterGradSink
from lazytrain.tiers import streams


@pytest.fixture
def copy_threads():
    """The CPU standing in for a device: gradients cross an emulated device-to-host link on a copy thread."""
    streams.configure(copy_threads=True)
    yield
    streams.configure()


@pytest.fixture
def gated(monkeypatch):
    """Every gradient copy waits until the test opens the gate."""
    gate = threading.Event()
    real = precision.async_copy

    def held(*args, **kwargs):
        assert gate.wait(30), "the gate was never opened"
        return real(*args, **kwargs)
    monkeypatch.setattr(precision, "async_copy", held)
    return gate


def _bf16_grads(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_the_hook_returns_before_the_copy_lands_and_readers_wait(copy_threads, gated, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 7)   # several pieces a gradient, the last one short
    head = nn.Linear(5, 9, bias=False)
    masters = Masters([head.weight], torch.bfloat16)
    assert masters.sink is not None
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    head(x).float().sum().backward()
    master = masters.master_of(head.weight)
    assert head.weight.grad is None and master.grad is None   # handed over, not landed: backward went on
    gated.set()
    grads = masters.master_grads()                           # waits for it
    expected = torch.ones(3, 9, dtype=torch.bfloat16).T @ x
    assert grads[0].dtype == torch.float32 and torch.equal(grads[0], expected.float())


def test_micro_batches_accumulate_in_fp32_in_order(copy_threads, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 5)
    streams.configure(copy_threads=True, chaos=streams.Chaos(seed=3, max_delay_s=0.002))
    p = nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    master = nn.Parameter(torch.zeros(4, 6))
    sink = MasterGradSink(torch.bfloat16)
    parts = [_bf16_grads(seed, (4, 6)) for seed in range(6)]
    for g in parts:
        sink.submit(master, g)
    sink.flush()
    expected = parts[0].float()
    for g in parts[1:]:
        expected = expected + g.float()
    assert torch.equal(master.grad, expected)
    sink.close()


def test_a_failed_first_copy_leaves_the_gradient_missing(copy_threads, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 4)
    calls = []

    def failing(dst, src, **kwargs):
        calls.append(src.numel())
        if len(calls) == 2:
            raise RuntimeError("link down")
        dst.copy_(src)
        return _Done()
    monkeypatch.setattr(precision, "async_copy", failing)
    master = nn.Parameter(torch.zeros(10))
    sink = MasterGradSink(torch.bfloat16)
    sink.submit(master, torch.ones(10, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="link down"):
        sink.flush()
    assert master.grad is None and calls == [4, 4]
    sink.close()


class _Done:
    def synchronize(self) -> None:
        pass


def test_zero_grad_waits_for_copies_in_flight(copy_threads, gated):
    """A copy that landed after the zeroing would leak one step's gradient into the next."""
    emb = nn.Embedding(6, 4)
    emb.weight.data = emb.weight.data.to(torch.bfloat16)
    masters = Masters([emb.weight], torch.bfloat16)
    emb(torch.tensor([1, 2, 2])).float().sum().backward()
    threading.Timer(0.05, gated.set).start()
    masters.zero_grad()
    masters.sink.pool.submit(lambda: None).result()          # whatever the worker still had, it has done
    assert all(m.grad is None for m in masters.master_params())
    assert not masters.sink.pending


def test_a_master_on_the_same_cpu_without_copy_threads_is_added_at_once():
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    masters = Masters([p], torch.bfloat16)
    assert masters.sink is None
    (p.float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(masters.master_of(p).grad, torch.tensor([1.0, 2.0, 3.0]))
