"""Plans against what the engine does: emulated links on the CPU, costs measured from traced steps, and
the cost model that uses them."""
import dataclasses
import time
import warnings

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.planner.hardware import HardwareProfile
from lazytrain.planner.measured import MeasuredCosts, MeasurementError
from lazytrain.planner.models import ModelShape
from lazytrain.utils import safe_set_full_grad
from lazytrain.planner.plan import Plan, keep_all_plan
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.simulate import simulate
from lazytrain.tiers import streams
from lazytrain.tiers.memory import async_copy
from lazytrain.trace import Timeline
from engine_models import batches, lm_loss, make_model


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()


# ---- the emulated link -----------------------------------------------------------------------------
def test_an_emulated_link_serves_transfers_first_come_first_served():
    link = streams.EmulatedLink("h2d", gbps=1.0, latency_s=0.002)
    assert link.reserve(100_000_000, ready=10.0) == pytest.approx(10.102)    # 0.1 s of bytes + latency
    assert link.reserve(50_000_000, ready=10.0) == pytest.approx(10.154)     # queued behind the first
    assert link.reserve(10_000_000, ready=20.0) == pytest.approx(20.012)     # an idle link starts at once


@pytest.mark.parametrize("gbps,latency,message", [
    (0, 0, "bandwidth must be > 0 GB/s, got 0"),
    (1, -1, "latency must be >= 0 s, got -1"),
])
def test_an_emulated_link_refuses_bad_numbers(gbps, latency, message):
    with pytest.raises(ValueError, match=message):
        streams.EmulatedLink("h2d", gbps, latency)


def test_emulated_links_need_copy_threads_and_known_names():
    with pytest.raises(ValueError, match="emulated links need copy threads"):
        streams.configure(links={"h2d": streams.EmulatedLink("h2d", 1.0)})
    with pytest.raises(ValueError, match="unknown emulated link"):
        streams.configure(copy_threads=True, links={"pcie": streams.EmulatedLink("pcie", 1.0)})


def test_copies_on_an_emulated_link_take_at_least_its_time_and_keep_their_data():
    link = streams.EmulatedLink("h2d", gbps=0.2)
    streams.configure(copy_threads=True, links={"h2d": link})
    src = torch.arange(2_500_000, dtype=torch.float32)       # 10 MB: 50 ms at 0.2 GB/s
    dsts = [torch.empty_like(src) for _ in range(3)]
    t0 = time.perf_counter()
    handles = [async_copy(d, src, direction="h2d") for d in dsts]
    for h in handles:
        h.wait()
    assert time.perf_counter() - t0 >= 3 * 0.05                # one link: the three copies queue
    assert all(torch.equal(d, src) for d in dsts)
    booked = link._free_at
    back = torch.empty_like(src)
    async_copy(back, src, direction="d2h").wait()   # the other direction is not emulated: the link is not booked
    assert link._free_at == booked and torch.equal(back, src)   # (no wall-clock bound: a loaded machine may stall)


def test_copies_queued_together_occupy_the_link_back_to_back():
    """Each copy is booked from when it became ready (here: when the copy all of them wait for ended), not
    from when its thread took it up: the thread's lag behind the last copy's sleep does not stretch the
    link. Small copies queued together ran at 0.040 of a 0.05 GB/s link when booked from the thread's clock."""
    from concurrent.futures import Future
    link = streams.EmulatedLink("h2d", gbps=0.05, latency_s=5e-5)
    streams.configure(copy_threads=True, links={"h2d": link})
    src = torch.ones(9280)                                     # 37,120 bytes: 0.7924 ms with the latency
    gate, ended = Future(), []
    timeline = Timeline("test")
    streams.start_recording(timeline)
    try:
        handles = [async_copy(torch.empty_like(src), src, after=streams.HostEvent(gate, ended), direction="h2d")
                   for _ in range(12)]
        ended.append(time.perf_counter())
        gate.set_result(None)
        for h in handles:
            h.wait()
    finally:
        streams.stop_recording()
    starts = sorted(s.start for s in timeline.spans if s.lane == "h2d")
    assert len(starts) == 12
    per_copy = 5e-5 + 37_120 / 0.05e9
    assert starts[0] == pytest.approx(ended[0] - timeline.origin, abs=1e-9)
    assert [b - a for a, b in zip(starts, starts[1:])] == pytest.approx([per_copy] * 11, abs=1e-9)


def test_a_transfer_is_ready_when_queued_or_when_what_it_waits_for_ended_and_late_by_the_chaos_delay():
    from concurrent.futures import Future

    def ended(at):
        f = Future()
        f.set_result(None)
        return streams.HostEvent(f, [at])
    assert streams.transfer_ready(5.0) == 5.0                           # nothing to wait for
    assert streams.transfer_ready(5.0, [ended(4.0)]) == 5.0             # ended before it was queued
    assert streams.transfer_ready(5.0, [ended(6.0), ended(5.5)]) == 6.0   # ended after: whenever the thread looks
    pending, finished = Future(), []

    def finish():
        time.sleep(0.02)
        finished.append(time.perf_counter())
        pending.set_result(None)
    before = time.perf_counter()   # before the sleep can start: under load the thread may run at once
    finisher = streams.host_stream("test-ready").submit(finish)
    assert streams.transfer_ready(before, [streams.HostEvent(pending, finished)]) == finished[0] >= before + 0.02
    finisher.result()
    unknown = Future()
    unknown.set_result(None)
    before = time.perf_counter()   # an event that does not say when it ended: when the thread saw it had
    assert before <= streams.transfer_ready(0.0, [streams.HostEvent(unknown)]) <= time.perf_counter()
    failed = Future()
    failed.set_exception(OSError("copy failed"))
    with pytest.raises(OSError, match="copy failed"):
        streams.transfer_ready(5.0, [streams.HostEvent(failed)])
    streams.configure(chaos=streams.Chaos(seed=3, max_delay_s=0.01))
    delay = streams.Chaos(seed=3, max_delay_s=0.01).draw()
    assert streams.transfer_ready(5.0) == pytest.approx(5.0 + delay, abs=1e-12)


def test_nvme_requests_take_at_least_the_emulated_links_time(tmp_path):
    from lazytrain.tiers.nvme import NVMeTier
    streams.configure(copy_threads=True, links={"nvme_write": streams.EmulatedLink("nvme_write", 0.1),
                                                "nvme_read": streams.EmulatedLink("nvme_read", 0.1)})
    tier = NVMeTier("nvme", path=str(tmp_path))
    x = torch.randn(1_250_000)                                 # 5 MB: 50 ms each way at 0.1 GB/s
    t0 = time.perf_counter()
    tier.write("x", x).wait()
    t1 = time.perf_counter()
    assert torch.equal(tier.read("x").wait(), x)
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.05 and t2 - t1 >= 0.05
    tier.close()


@pytest.mark.parametrize("links,message", [
    ({"pcie": {"gbps": 1}}, "unknown key 'pcie' in config section 'lazytrain.testing.links'"),
    ({"h2d": 5}, "'lazytrain.testing.links.h2d' must be an object with 'gbps'"),
    ({"h2d": {"gbps": 0}}, r"'lazytrain.testing.links.h2d.gbps' must be a bandwidth in GB/s > 0, got 0"),
    ({"h2d": {"gbps": 1, "latency_ms": -1}}, r"'lazytrain.testing.links.h2d.latency_ms' must be a number"),
    ({"h2d": {"gbps": 1, "jitter": 1}}, "unknown key 'jitter' in config section 'lazytrain.testing.links.h2d'"),
])
def test_bad_emulated_link_settings_are_named(links, message):
    cfg = {"train_micro_batch_size_per_gpu": 2, "lazytrain": {"testing": {"copy_threads": True, "links": links}}}
    with pytest.raises(ConfigError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazytrain.initialize(model=make_model("llama"), config=cfg)


def test_emulated_links_without_copy_threads_are_refused():
    cfg = {"train_micro_batch_size_per_gpu": 2, "lazytrain": {"testing": {"links": {"h2d": {"gbps": 1}}}}}
    with pytest.raises(ConfigError, match=r"'lazytrain.testing.links' needs 'lazytrain.testing.copy_threads': true"):
        lazytrain.initialize(model=make_model("llama"), config=cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_emulated_links_are_refused_on_cuda():
    cfg = {"train_micro_batch_size_per_gpu": 2, "lazytrain": {"device": "cuda", "testing": {
        "copy_threads": True, "links": {"h2d": {"gbps": 1}}}}}
    with pytest.raises(ConfigError, match="emulates links on the CPU's copy threads; the device cuda:0 has real"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazytrain.initialize(model=make_model("llama"), config=cfg)


def test_emulated_links_warn_that_they_are_a_test_setting():
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"device": "cpu",
                         "testing": {"copy_threads": True, "links": {"h2d": {"gbps": 5, "latency_ms": 0.01}}}}}
    with pytest.warns(UserWarning, match="'lazytrain.testing' is a setting for tests and benchmarks"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    link = streams.settings().links["h2d"]
    assert (link.gbps, link.latency_s) == (5.0, 1e-5)
    engine.destroy()


# ---- measured costs from traced steps --------------------------------------------------------------
def _timeline(spans):
    t = Timeline("measured")
    for lane, name, start, end in spans:
        t.add_relative(lane, name, start, end)
    return t


def _two_layer_step(fwd=(1.0, 2.0), diff=(3.0, 4.0), bwd=(5.0, 6.0), gap=0.5):
    """A traced step of 2 layers: waits and compute back to back, ``gap`` seconds outside the blocks."""
    spans, t = [("wait", "weights 0", 0.0, 0.25)], 0.25
    for i in range(2):
        spans.append(("compute", f"fwd L{i}", t, t + fwd[i]))
        t += fwd[i]
    t += gap                                                   # the head, the loss and their backward
    for i in (1, 0):
        spans += [("compute", f"diff L{i}", t, t + diff[i]), ("compute", f"bwd L{i}", t + diff[i], t + diff[i] + bwd[i])]
        t += diff[i] + bwd[i]
    spans += [("wait", "gradients to host", t, t + 1.0), ("optimizer", "gradient norm", t + 1.0, t + 1.5),
              ("optimizer", "embedding/head", t + 1.5, t + 1.75),
              ("optimizer", "update L0", t + 2.0, t + 2.5), ("optimizer", "update L1", t + 2.5, t + 3.25)]
    return _timeline(spans)


def test_measured_costs_are_read_from_traced_steps():
    c = MeasuredCosts.from_traces([_two_layer_step(), _two_layer_step(gap=0.75), _two_layer_step(gap=2.0)], 2)
    assert c.fwd_s == (1.0, 2.0)
    assert c.diff_s == (8.0, 10.0)                             # the re-run with autograd and the backward
    assert c.nonlayer_s == 0.75                                # median of 0.5, 0.75, 2.0
    assert c.step_s == 0.75
    assert c.update_s == (0.5, 0.75)
    assert MeasuredCosts.from_dict(c.to_dict()) == c
    # with two micro-batches a step: compute per micro-batch, the updates and the host phase per step
    half = MeasuredCosts.from_traces([_two_layer_step(), _two_layer_step(gap=0.75), _two_layer_step(gap=2.0)], 2,
                                     micro_batches=2)
    assert (half.fwd_s, half.diff_s, half.nonlayer_s) == ((0.5, 1.0), (4.0, 5.0), 0.375)
    assert (half.step_s, half.update_s) == (c.step_s, c.update_s)


@pytest.mark.parametrize("spans,message", [
    ([("compute", "fwd L0", 0, 1)], r"no 'fwd' span for layer\(s\) \[1\]"),
    ([("compute", "recompute L0", 0, 1)], "re-ran a segment"),
    ([("compute", "fwd L5", 0, 1)], "the trace has 'fwd L5' but the model has 2 layers"),
])
def test_traces_that_cannot_be_measured_are_named(spans, message):
    with pytest.raises(MeasurementError, match=message):
        MeasuredCosts.from_traces([_timeline(spans)], 2)


def test_the_previous_steps_updates_running_in_this_forward_are_not_counted():
    step = _two_layer_step()
    step.add_relative("optimizer", "update L1", 0.0, 0.2)   # the last step's update, overlapping this forward
    assert MeasuredCosts.from_traces([step], 2).update_s == (0.5, 0.75)


def test_a_cuda_trace_is_read_as_a_cpu_one_its_waits_being_the_devices():
    cpu = MeasuredCosts.from_traces([_two_layer_step()], 2)
    step = _two_layer_step()
    step.device = "cuda"
    assert MeasuredCosts.from_traces([step], 2) == cpu


def test_a_trace_whose_spans_overlap_is_refused():
    step = _two_layer_step()
    step.add_relative("wait", "weights 1", 0.5, 12.0)   # a wait within the blocks' compute
    with pytest.raises(MeasurementError, match=r"the traced step's blocks and waits \(33.7500 s\) take longer than "
                                               r"the time before step\(\) \(22.7500 s\): spans overlap"):
        MeasuredCosts.from_traces([step], 2)


def test_a_trace_without_the_step_is_refused():
    full = _two_layer_step()
    full.spans = [s for s in full.spans if s.name not in ("gradient norm", "embedding/head")]
    with pytest.raises(MeasurementError, match="no 'gradient norm' span"):
        MeasuredCosts.from_traces([full], 2)


def _keep_all_costs(device: str, testing: dict, home: str = "host", warmup: int = 2,
                    steps: int = 2, model: str = "llama", fastest: bool = False) -> tuple[MeasuredCosts, float]:
    """The costs of a keep-all plan (boundaries on ``home``) measured over ``steps`` traced steps after
    ``warmup`` untraced ones (``fastest``: each cost's least over the steps, as other work sharing the cores
    only ever adds time; else their medians), and the median time its compute side waited per step."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"policy": "keep_all", "boundary_home": home, "last_segment_graph": False, "device": device,
                         "overlap_optimizer": True, "testing": testing}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model(model), config=cfg)
    traces = []
    for i, (x, y) in enumerate(batches(warmup + steps)):
        if i >= warmup:
            engine.trace_next_step()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        if i >= warmup:
            traces.append(engine.last_trace)
    engine.destroy()
    waits = sorted(sum(s.end - s.start for s in t.spans if s.lane == "wait") for t in traces)
    if fastest:
        each = [MeasuredCosts.from_traces([t], 6) for t in traces]
        least = dataclasses.replace(each[0], fwd_s=tuple(map(min, zip(*(c.fwd_s for c in each)))),
                                    nonlayer_s=min(c.nonlayer_s for c in each))
        return least, waits[len(waits) // 2]
    return MeasuredCosts.from_traces(traces, 6), waits[len(waits) // 2]


def test_an_engine_trace_of_a_keep_all_step_gives_every_layers_costs():
    c, _ = _keep_all_costs("cpu", {"copy_threads": True}, home="hbm", warmup=1)
    assert c.num_layers == 6
    assert all(d > 0 for d in c.fwd_s + c.diff_s + c.update_s) and c.step_s > 0 and c.nonlayer_s >= 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_what_each_layers_graph_saves_is_measured_from_traces(device):
    """The re-run with autograd before each layer's backward counts what the block's graph saves, each
    storage once, beside its weights and its input. The toy block (LayerNorm, Linear d->2d, GELU, Linear
    2d->d, d = 32) saves per token LayerNorm's mean and rstd (1 + 1), its output (d, fc1's input), fc1's
    output (2d, GELU's input) and GELU's output (2d, fc2's input): 162 fp32 values."""
    copy_threads = {"copy_threads": True} if device == "cpu" else {}
    c, _ = _keep_all_costs(device, copy_threads, home="hbm", warmup=1, model="modulelist")
    tokens = 2 * 12
    assert c.saved_bytes == (tokens * 162 * 4,) * 6
    assert MeasuredCosts.from_dict(c.to_dict()) == c


def test_measuring_what_a_graph_saves_keeps_no_graph_alive():
    """An op that saves its own output (exp), its graph never differentiated: once the output is dropped,
    the graph goes (the measurement's hook keeps a detached tensor, not the output, which would hold its
    own node), and a graph that is differentiated gets its gradient as without the measurement."""
    import gc
    import weakref
    from lazytrain.engine.executor import _SavedBytes
    x = torch.randn(8, 8, requires_grad=True)
    outputs = []
    for _ in range(3):
        with _SavedBytes([x]):
            y = x.exp()
        outputs.append(weakref.ref(y))
        del y
    gc.collect()
    assert [r() for r in outputs] == [None] * 3
    counter = _SavedBytes([x])
    with counter:
        y = x.exp()
    assert counter.nbytes == 8 * 8 * 4
    y.sum().backward()
    assert torch.equal(x.grad, x.exp())


def test_measured_saved_bytes_replace_the_analytic_internals():
    """A graph layer holds, and an offloaded one sends, what was measured; the backward's working set
    trades the estimate for it too."""
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 3.0), diff_s=(4.0, 5.0, 6.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.1, 0.2, 0.3))
    estimated = _problem(c)
    measured = _problem(dataclasses.replace(c, saved_bytes=(100, 2000, 30000)))
    assert measured.saved == [100, 2000, 30000]
    assert measured.offl_bytes == [s + a for s, a in zip([100, 2000, 30000], estimated.A)]
    assert [m - e for m, e in zip(measured.ws_bwd, estimated.ws_bwd)] == \
        [s - e for s, e in zip([100, 2000, 30000], estimated.saved)]
    with pytest.raises(MeasurementError, match=r"saved_bytes must hold a whole number of bytes >= 0 for each of "
                                               r"the 3 layers, got \[1, 2\]"):
        dataclasses.replace(c, saved_bytes=(1, 2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_late_copies_are_measured_as_waits_not_as_the_rest_of_the_model(device):
    """Every copy and update delayed up to 20 ms: the compute side's extra time is in its waits (on CUDA
    the compute stream's stalls, timed by events), and the rest of the model measures as it does calm. Each
    compute cost is the least of four steps: on shared cores, a wake-up of each of the ~30 delayed copies'
    threads can cost the compute side a time slice, which a median of two took for compute (it failed 3 times
    in 4 with both cores busy)."""
    copy_threads = {"copy_threads": True} if device == "cpu" else {}
    calm, calm_waits = _keep_all_costs(device, copy_threads, steps=4, fastest=True)
    late, late_waits = _keep_all_costs(device, {**copy_threads, "chaos_seed": 3, "chaos_max_delay_ms": 20},
                                       steps=4, fastest=True)
    assert late_waits > calm_waits + 0.05                      # seconds: several of ~30 delayed copies stalled it
    assert late.nonlayer_s < calm.nonlayer_s + 0.25 * late_waits
    for calm_t, late_t in zip(calm.fwd_s, late.fwd_s):         # the delays are not in the blocks' compute either
        assert late_t < calm_t + 0.25 * late_waits


# ---- the cost model with measured costs ------------------------------------------------------------
def _problem(measured, gbps=1e5):
    shape = ModelShape.from_layers("m", [1000, 1000, 1000], hidden=8, vocab_size=16, dtype_bytes=4)
    hw = HardwareProfile("emulated", achievable_tflops=1.0, h2d_gbps=gbps, d2h_gbps=gbps,
                         host_optimizer_gparams_per_s=1.0, gpu_mem_bytes=10**9, host_mem_bytes=10**9)
    return Problem(shape, hw, Budgets(gpu_reserved_bytes=0), 1, 4, measured=measured)


def test_measured_costs_replace_the_flop_based_terms():
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 3.0), diff_s=(4.0, 5.0, 6.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.125, 0.125, 0.25))
    p = _problem(c)
    assert (p.fwd_s, p.diff_s, p.head_s, p.opt_nl, p.opt_l) == ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], 0.5, 0.25,
                                                                 [0.125, 0.125, 0.25])
    assert p.load_nl == 0.0                                    # the embedding and head stay on the device
    assert p.tail_s == pytest.approx(4000 / 1e14)              # layer 0's gradients, not the head's
    # every boundary on the device, the update after the step: the step is the sum of its parts
    plan = Plan(num_layers=3, homes=("hbm",) * 4, overlap_optimizer=False)
    expected = sum(c.fwd_s) + c.nonlayer_s + sum(c.diff_s) + c.step_s + sum(c.update_s)
    assert simulate(p, plan).step_time_s == pytest.approx(expected, rel=1e-9)


def test_a_measured_diff_below_its_forward_gives_a_backward_of_zero_not_a_negative_one():
    """diff_s includes a forward; measured below fwd_s (a forward slowed by a wait), it planned a negative
    backward that shortened the layer's window."""
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 3.0), diff_s=(4.0, 0.5, 6.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.125, 0.125, 0.25))
    p = _problem(c)
    assert p.diff_s == [4.0, 2.0, 6.0] and p.bwd_s(1) == 0.0


def test_measured_costs_put_the_gradients_the_engine_copies_beside_its_windows_on_the_link():
    """A profile from an engine whose embedding and head have host masters records what their gradients
    send each micro-batch; the planner puts them on the link as the analytic model does (the head's in the
    first backward windows, the input embedding's with layer 0's), not inside the measured compute."""
    import dataclasses
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 3.0), diff_s=(4.0, 5.0, 6.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.125, 0.125, 0.25), grads_beside_bytes=(6000, 2000))
    p = _problem(c, gbps=1e-6)   # 1000 bytes a second
    assert (p.head_grad_bytes, p.embed_grad_bytes, p.nonlayer_link_bytes, p.load_nl) == (6000, 2000, 0, 0.0)
    assert p.carry_bytes == 4000 + 2000 and p.tail_s == pytest.approx(6.0, rel=1e-12)
    plan = Plan(num_layers=3, homes=("hbm",) * 4, overlap_optimizer=False)
    r = simulate(p, plan)
    shares = [e for e in r.timeline if e.label == "grads embedding/head"]
    assert [e.window for e in shares] == [3, 4, 5] and all(e.end - e.start == pytest.approx(2.0) for e in shares)
    old = _problem(dataclasses.replace(c, grads_beside_bytes=None), gbps=1e-6)   # a profile from before
    assert (old.head_grad_bytes, old.embed_grad_bytes, old.tail_s) == (0, 0, pytest.approx(4.0, rel=1e-12))
    assert MeasuredCosts.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("value", [(1, 2, 3), (-1, 2), (1.5, 2), "12", (True, 0)])
def test_bad_gradient_bytes_in_a_profile_are_named(value):
    with pytest.raises(MeasurementError, match="grads_beside_bytes must be two whole numbers"):
        MeasuredCosts(fwd_s=(1.0,), diff_s=(2.0,), nonlayer_s=0.5, step_s=0.25, update_s=(0.1,),
                      grads_beside_bytes=value)


def test_measured_selective_costs_are_read_from_traces_and_replace_the_assumed_share():
    from lazytrain.planner.measured import with_selective
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 3.0), diff_s=(4.0, 5.0, 6.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.125, 0.125, 0.25))

    def selective_step(fwd, rerun):   # a traced keep-all step with every layer selective
        spans, t = [], 0.0
        for i in range(3):
            spans.append(("compute", f"fwd L{i}", t, t + fwd[i]))
            t += fwd[i]
        for i in (2, 1, 0):
            spans += [("compute", f"diff L{i}", t, t + rerun[i]), ("compute", f"bwd L{i}", t + rerun[i], t + 9)]
            t += 9
        return _timeline(spans)
    s = with_selective(c, [selective_step((1.5, 2.5, 3.5), (0.5, 1.0, 1.5)),
                           selective_step((1.5, 2.5, 4.5), (0.5, 1.0, 2.5)),
                           selective_step((1.5, 2.5, 5.5), (0.5, 1.0, 0.5))])
    assert (s.selective_fwd_s, s.selective_rerun_s) == ((1.5, 2.5, 4.5), (0.5, 1.0, 1.5))   # medians
    assert MeasuredCosts.from_dict(s.to_dict()) == s
    p = _problem(s)
    assert p.sel_rerun_s == [0.5, 1.0, 1.5] and p.sel_fwd_extra == [0.5, 0.5, 1.5]
    # layers 0 and 1 selective, re-run in backward from boundary 0: each forward pays its extra, each
    # re-run (the recompute of layer 0 and 1, the diff of each) takes the measured re-run
    plan = Plan(num_layers=3, homes=("hbm", "recompute", "recompute", "hbm"), overlap_optimizer=False,
                selective_layers=(0, 1))
    plain = simulate(p, dataclasses.replace(plan, selective_layers=())).step_time_s
    saved = 2 * (1.0 - 0.5) + 2 * (2.0 - 1.0) - (0.5 + 0.5)   # re-runs saved, forward extras paid
    assert simulate(p, plan).step_time_s == pytest.approx(plain - saved, rel=1e-9)
    with pytest.raises(MeasurementError, match="selective_rerun_s must hold a finite time >= 0 s for each of the 3"):
        dataclasses.replace(c, selective_rerun_s=(1.0,))


def test_selective_times_of_layers_not_measured_are_their_kinds_relative_to_their_own_forward():
    from lazytrain.planner.measured import with_selective
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 4.0, 8.0), diff_s=(24.0,) * 4, nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.1,) * 4)
    spans = [("compute", "fwd L0", 0, 1.5), ("compute", "diff L0", 2, 2.5),   # kind "a": 1.5x and 0.5x
             ("compute", "fwd L1", 3, 6), ("compute", "diff L1", 6, 8)]       # kind "b": 1.5x and 1.0x
    s = with_selective(c, [_timeline(spans)], layers=(0, 1), kinds=["a", "b", "a", "b"])
    assert s.selective_fwd_s == (1.5, 3.0, 6.0, 12.0)
    assert s.selective_rerun_s == (0.5, 2.0, 2.0, 8.0)
    with pytest.raises(MeasurementError, match="layer 3 has no measured selective layer of its kind"):
        with_selective(c, [_timeline(spans)], layers=(0, 1), kinds=["a", "b", "a", "c"])


@pytest.mark.parametrize("room,layers,why", [
    (None, (0, 1, 2, 3, 4, 5), False),
    (60, (0, 1, 2, 3, 4, 5), False),
    (59, (0, 1, 2, 4, 5), True),          # one kind: 5 of 6, spread evenly
    (20, (0, 5), True),                   # two: the ends
    (10, (3,), True),                     # one: the middle one
    (9, (), True),                        # not one
])
def test_the_layers_a_selective_calibration_measures_are_those_whose_kept_outputs_fit(room, layers, why):
    from lazytrain.planner.measured import layers_to_measure_selective
    chosen, reason = layers_to_measure_selective([10] * 6, ["a"] * 6, room)
    assert chosen == layers and (reason is not None) == why
    if why:
        assert reason == "every layer's kept matmul and attention outputs (about 0.0 MB) do not fit on the device " \
                         f"tier beside the calibration plan's peak ({room / 1e6:.1f} MB free)"


def test_a_selective_calibration_measures_every_kind_in_turn():
    from lazytrain.planner.measured import layers_to_measure_selective
    kinds = ["lin", "lin", "lin", "full"] * 3            # a hybrid stack: every fourth layer full attention
    sizes = [10 if k == "lin" else 30 for k in kinds]
    assert layers_to_measure_selective(sizes, kinds, 40)[0] == (5, 7)           # one of each, the middle
    assert layers_to_measure_selective(sizes, kinds, 80)[0] == (0, 3, 10, 11)   # two of each, at the ends
    assert layers_to_measure_selective(sizes, kinds, 29)[0] == ()               # no full-attention layer fits


def test_measured_costs_for_another_model_are_refused():
    c = MeasuredCosts(fwd_s=(1.0,), diff_s=(1.0,), nonlayer_s=0.0, step_s=0.0, update_s=(0.0,))
    with pytest.raises(ValueError, match="measured costs are for 1 layers, the model 'm' has 3"):
        _problem(c)


@pytest.mark.parametrize("kw,message", [
    (dict(diff_s=(1.0,)), "diff_s has 1 layers, fwd_s has 2"),
    (dict(update_s=(1.0, -1.0)), r"every update_s must be a finite time >= 0 s, got \[1.0, -1.0\]"),
    (dict(update_s=(1.0, float("inf"))), r"every update_s must be a finite time >= 0 s, got \[1.0, inf\]"),
    (dict(step_s=float("nan")), "step_s must be a finite time >= 0 s, got nan"),
    (dict(step_s=True), "step_s must be a finite time >= 0 s, got True"),
])
def test_bad_measured_costs_are_named(kw, message):
    base = dict(fwd_s=(1.0, 1.0), diff_s=(1.0, 1.0), nonlayer_s=0.0, step_s=0.0, update_s=(0.0, 0.0))
    with pytest.raises(MeasurementError, match=message):
        MeasuredCosts(**{**base, **kw})


# ---- the engine issues transfers in the order the cost model has them --------------------------------
def _resident_engine(tmp_path, resident=(3,)):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"policy": "plan", "overlap_optimizer": True, "testing": {"copy_threads": True}}}
    path = str(tmp_path / "plan.json")
    keep_all_plan(6, home="hbm", resident_layers=resident).to_json(path)
    cfg["lazytrain"]["plan"] = path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    return engine


def test_a_resident_layers_refresh_waits_for_the_forward_to_come_to_it(tmp_path):
    """A resident layer's refresh after its update goes on the link when the forward takes the layer
    before it, not ahead of the layers the forward needs first."""
    engine = _resident_engine(tmp_path, resident=(3, 5))
    for i, (x, y) in enumerate(batches(3)):
        if i == 2:
            engine.trace_next_step()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    h2d = [s.name for s in sorted(engine.last_trace.spans, key=lambda s: s.start) if s.lane == "h2d"]
    forward = h2d[:6]                                          # the forward's copies, in the order they ran
    assert forward == [f"weights.layer{i}" for i in range(6)]
    # the compute side's wait for each refresh is a wait of its own (not the rest of the model's time)
    waits = [s.name for s in engine.last_trace.spans if s.lane == "wait"]
    assert waits.count("refresh 3") == waits.count("refresh 5") == 1
    engine.destroy()


def test_later_micro_batches_copy_no_resident_layer(tmp_path):
    """With gradient accumulation, a micro-batch after the step's first copies no resident layer's weights:
    the first refreshed them after the update (as the simulator and the MILP have it since the later
    micro-batches got their own forward windows)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"policy": "plan", "overlap_optimizer": True, "testing": {"copy_threads": True}}}
    path = str(tmp_path / "plan.json")
    keep_all_plan(6, home="hbm", resident_layers=(3, 5)).to_json(path)
    cfg["lazytrain"]["plan"] = path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    for i, (x, y) in enumerate(batches(6)):
        if i == 4:
            engine.trace_next_step()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    spans = [s for s in sorted(engine.last_trace.spans, key=lambda s: s.start) if s.lane in ("h2d", "compute")]
    engine.destroy()
    names = [s.name for s in spans]
    turn = names.index("bwd L0")                         # the first micro-batch's last compute
    first = [s.name for s in spans[:turn] if s.lane == "h2d"]
    later = [s.name for s in spans[turn:] if s.lane == "h2d"]
    assert "weights.layer3" in first and "weights.layer5" in first       # refreshed after the update
    assert "weights.layer3" not in later and "weights.layer5" not in later
    assert "fwd L5" in names[turn:]                                       # the second micro-batch ran


def test_a_resident_refresh_that_fails_to_start_stays_due(tmp_path):
    engine = _resident_engine(tmp_path)
    w, stream = engine.weights, engine.stream
    real, armed = w.fetch_into, [False]

    def fetch_into(i, buf):
        if armed[0] and buf.data_ptr() == stream.resident[3].data_ptr():
            armed[0] = False
            raise OSError("transient read error")
        return real(i, buf)
    w.fetch_into = fetch_into
    (x0, y0), (x1, _) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    engine.wait_for_update()
    armed[0] = True
    with pytest.raises(OSError, match="transient read error"):
        engine(x1)
    with torch.no_grad():
        engine(x1)                                     # the refresh is issued now
    host = w.weights_tier.read("weights.layer3").wait()
    assert torch.equal(stream.resident[3].cpu(), host)   # the device copy (CUDA memory on a GPU) against the host's
    engine.destroy()


def test_a_resident_refresh_whose_copy_fails_refuses_every_forward_until_a_load(tmp_path):
    """The refresh's copy fails (its handle raises): the device copy holds no valid weights, and each
    forward says so by layer, with the way out, until load_checkpoint rewrites it."""
    from lazytrain.engine.weight_stream import ResidentRefreshError
    engine = _resident_engine(tmp_path)
    w, stream = engine.weights, engine.stream
    (x0, y0), (x1, y1) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="a")
    real, armed = w.fetch_into, [True]

    class FailedCopy:   # a copy that ran and failed, as its handle reports it
        def __init__(self, handle):
            self.handle = handle

        def completion(self):
            return self.handle.completion()

        def wait(self):
            self.handle.wait()
            raise RuntimeError("injected copy failure")

    def fetch_into(i, buf):
        handle = real(i, buf)
        if armed[0] and buf.data_ptr() == stream.resident[3].data_ptr():
            armed[0] = False
            return FailedCopy(handle)
        return handle
    w.fetch_into = fetch_into
    for _ in range(2):   # the first step's update made layer 3 stale: its refresh goes in this forward
        with pytest.raises(ResidentRefreshError, match=r"^resident layer 3's device copy could not be refreshed from "
                                                       r"its host copy \(RuntimeError: injected copy failure\): it "
                                                       r"holds no valid weights, so every forward refuses until "
                                                       r"engine.load_checkpoint\(...\) rewrites them$"):
            engine(x1)
        engine.zero_grad()
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="a")
    engine.backward(lm_loss(engine(x1), y1))
    engine.step()
    engine.wait_for_update()
    with torch.no_grad():
        engine(x1)                                     # refreshed after the update, from the loaded weights on
    assert torch.equal(stream.resident[3].cpu(), w.weights_tier.read("weights.layer3").wait())
    engine.destroy()


def test_a_refresh_due_from_an_earlier_step_never_reads_a_host_copy_being_written(tmp_path):
    from lazytrain.engine.weight_stream import WeightStream
    engine = _resident_engine(tmp_path)
    stream = engine.stream
    writing, violations = set(), []
    before, after = stream.before_host_write, stream.after_host_write

    def fenced(layers):
        layers = list(layers)
        before(layers)
        writing.update(layers)

    def published(i, event=None):
        writing.discard(i)
        after(i, event)
    stream.before_host_write, stream.after_host_write = fenced, published
    refresh = WeightStream._refresh_if_stale

    def watched(self, layer):
        if layer in self._stale and layer in writing:
            violations.append(layer)
        return refresh(self, layer)
    slow = engine.weights.refresh_compute_copy

    def slow_refresh(i, host_copy_current=False):
        if i == 3:
            time.sleep(0.2)                            # a long host write of the resident layer
        return slow(i, host_copy_current)
    engine.weights.refresh_compute_copy = slow_refresh
    try:
        WeightStream._refresh_if_stale = watched
        (x0, y0), (x1, y1) = batches(2)
        engine.backward(lm_loss(engine(x0), y0))
        engine.step()                                  # layer 3's refresh is due
        engine.wait_for_update()
        head = engine.module.lm_head.weight
        safe_set_full_grad(head, torch.zeros(head.shape))   # a step's gradient with no forward (none takes layer 3)
        engine.step()                                  # another update before any forward took layer 3
        engine.backward(lm_loss(engine(x1), y1))       # this forward meets the update still writing layer 3
        engine.step()
        engine.wait_for_update()
    finally:
        WeightStream._refresh_if_stale = refresh
    assert violations == []
    engine.destroy()
