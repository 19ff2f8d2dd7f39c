"""Step traces: what a step did, as a timeline in the format the simulator writes for a Plan."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import lazytrain
from lazytrain.planner import simulate as sim
from lazytrain.trace import LANES, Timeline, write_chrome_trace
from lazytrain.tiers import streams
from engine_models import batches, lm_loss, make_model


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()


def traced_engine(tmp_path, **section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, "last_segment_graph": False,
                         "testing": {"copy_threads": True}, **section}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    return engine


def test_a_traced_step_records_each_layer_each_transfer_and_each_update(tmp_path):
    engine = traced_engine(tmp_path, boundary_home="host", overlap_optimizer=True)
    (x0, y0), (x1, y1) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    path = tmp_path / "step.json"
    engine.trace_next_step(str(path))
    engine.backward(lm_loss(engine(x1), y1))
    engine.step()
    t = engine.last_trace
    names = lambda lane: [s.name for s in t.spans if s.lane == lane]   # noqa: E731
    # 6 layers, boundaries 0, 2, 4 kept: forward, then per segment one re-run and two differentiations
    assert sorted(names("compute")) == sorted([f"fwd L{i}" for i in range(6)] +
                                              [f"recompute L{i}" for i in (0, 2, 4)] +
                                              [f"diff L{i}" for i in range(6)] + [f"bwd L{i}" for i in range(6)])
    layer_bytes = engine.weights.layer_numels[0] * 4
    weight_copies = [s for s in t.spans if s.lane == "h2d" and s.args["bytes"] == layer_bytes]
    assert len(weight_copies) == 6 + 9                       # forward 6, backward 3 per segment
    boundary_bytes = 2 * 12 * 32 * 4                         # micro-batch 2, 12 tokens, width 32, fp32
    assert len([s for s in t.spans if s.lane == "d2h" and s.args["bytes"] == boundary_bytes]) == 3   # offloads
    assert len([s for s in t.spans if s.lane == "h2d" and s.args["bytes"] == boundary_bytes]) == 3   # prefetches
    assert len([s for s in t.spans if s.lane == "d2h" and s.args["bytes"] == layer_bytes]) == 6      # gradients
    # each layer's gradient added into its fp32 buffer on the sink's worker, and the end of backward's wait;
    # on a GPU the embedding's, norm's and head's gradients land in their host masters beside them, one add each
    layer_adds = [n for n in names("host") if n.startswith("grad add L")]
    assert sorted(layer_adds) == sorted(f"grad add L{i}" for i in range(6))
    non_block = [f"grad add {tuple(m.shape)}" for _, m in engine.masters.pairs] if engine.device.type == "cuda" else []
    assert sorted(n for n in names("host") if n not in layer_adds) == sorted(non_block)
    assert "gradients landing (end of backward)" in names("wait")
    # the step's own updates last (the previous step's ran while this forward did: recorded too)
    assert names("optimizer")[-6:] == [f"update L{i}" for i in range(6)]
    assert all(s.end >= s.start for s in t.spans)
    events = json.loads(path.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == len(t.spans)
    lanes = {e["cat"] for e in events if e["ph"] == "X"}
    assert lanes <= set(LANES) and {"compute", "h2d", "d2h", "optimizer"} <= lanes
    # a lane whose spans overlap gets more rows, "optimizer 2" (on a GPU the previous step's overlapped update
    # runs beside this step's)
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(r in lanes or (r.rsplit(" ", 1)[0] in lanes and r.rsplit(" ", 1)[1].isdigit()) for r in rows), rows
    summary = t.summary()
    assert summary.splitlines()[0].startswith("measured: step ") and "compute" in summary
    engine.destroy()


def test_nvme_reads_are_traced_request_by_request(tmp_path):
    engine = traced_engine(tmp_path, weights_home="nvme", nvme_path=str(tmp_path))
    x, y = batches(1)[0]
    engine.trace_next_step()
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    reads = [s for s in engine.last_trace.spans if s.lane == "nvme_read"]
    assert sum(s.args["bytes"] for s in reads) >= 15 * engine.weights.layer_numels[0] * 4
    engine.destroy()


def test_the_simulator_writes_the_same_format(tmp_path):
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.problem import make_problem
    problem = make_problem("qwen2.5-3b", "h800", 8, 1024)
    result = sim.simulate(problem, megatrain_plan(problem, 4))
    predicted = result.trace()
    assert {s.lane for s in predicted.spans} <= set(LANES)
    assert abs(predicted.duration - result.step_time_s) <= 1e-9 * max(1.0, result.step_time_s)
    measured = Timeline("measured")
    measured.add(lane="compute", name="fwd L0", start=measured.origin, end=measured.origin + 0.5)
    path = tmp_path / "side-by-side.json"
    write_chrome_trace(str(path), predicted.finish(), measured.finish())
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"predicted", "measured"}


def test_a_trace_path_that_cannot_be_written_is_refused_before_training(tmp_path):
    engine = traced_engine(tmp_path)
    with pytest.raises(ValueError, match=r"its directory .*missing does not exist"):
        engine.trace_next_step(str(tmp_path / "missing" / "step.json"))
    with pytest.raises(ValueError, match=r"is a directory; give a file name"):
        engine.trace_next_step(str(tmp_path))
    engine.destroy()
    out = subprocess.run([sys.executable, "-m", "lazytrain.cli", "train", "--steps", "1", "--no-progress",
                          "--out", str(tmp_path / "out"), "--trace", str(tmp_path / "missing" / "t.json")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 2
    assert out.stderr.strip().endswith("missing does not exist") and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_on_cuda_the_trace_starts_once_the_work_queued_before_it_has_run(monkeypatch):
    """start_recording ties the device's clock to the host's by waiting for the work already queued on the
    compute stream: that wait (the previous step's tail) is not the traced step's, so the timeline starts
    after it, not before (else it would be read as the rest of the model). The wait is simulated here."""
    import time

    def origin_after_queued_work(t, device):   # as streams._device_origin: 50 ms of queued work drained
        time.sleep(0.05)
        t.device_origins[device] = (None, time.perf_counter())
        return t.device_origins[device]
    monkeypatch.setattr(streams, "_device_origin", origin_after_queued_work)
    timeline = Timeline("measured", device="cuda")
    streams.start_recording(timeline, torch.device("cuda", 0))
    try:
        with streams.span("compute", "fwd L0"):
            pass
    finally:
        streams.stop_recording()
    (s,) = timeline.spans
    assert 0 <= s.start < 0.04, s.start    # not 0.05 s in: the drained work is before the origin


def test_a_traced_step_that_raised_is_dropped_and_the_next_trace_goes_where_it_was_asked(tmp_path):
    """The recording of a step that raised went on into the next step, which was written under the failed
    step's path, while the path asked for next got the step after."""
    engine = traced_engine(tmp_path)
    (x, y), (x2, y2) = batches(2)
    engine.trace_next_step(str(tmp_path / "a.json"))
    engine(x)
    with pytest.warns(UserWarning, match=r"the step traced for .*a.json never completed \(it raised before step\(\)\); "
                                         r"its partial trace is dropped"):
        engine.trace_next_step(str(tmp_path / "b.json"))
    engine.backward(lm_loss(engine(x2), y2))
    engine.step()
    assert not (tmp_path / "a.json").exists() and (tmp_path / "b.json").exists()
    names = [e["name"] for e in json.loads((tmp_path / "b.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert names.count("fwd L0") == 1


def test_a_trace_that_cannot_be_written_warns_and_the_step_is_counted(tmp_path):
    engine = traced_engine(tmp_path)
    folder = tmp_path / "gone"
    folder.mkdir()
    engine.trace_next_step(str(folder / "t.json"))
    folder.rmdir()
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    with pytest.warns(UserWarning, match=r"the trace of step 1 could not be written to .*t.json"):
        engine.step()
    assert engine.global_steps == 1 and engine.last_trace is not None and not list(tmp_path.glob("gone*"))


def test_the_summary_names_each_wait_whole():
    from lazytrain.trace import Span
    t = Timeline("measured")
    t.spans += [Span("wait", "gradients to host", 0.0, 0.004), Span("wait", "weights 3", 0.0, 0.001),
                Span("wait", "gradient sink (embedding/head)", 0.0, 0.002), Span("compute", "fwd L0", 0.0, 0.01)]
    assert "waits: gradients to host 4.00 ms, gradient sink (embedding/head) 2.00 ms, weights 1.00 ms" in t.summary()


def test_spans_of_one_lane_that_overlap_without_nesting_go_on_tracks_of_their_own():
    """Concurrent NVMe requests overlapped on one track, which Chrome and Perfetto draw wrongly."""
    from lazytrain.trace import Span
    t = Timeline("measured")
    t.spans += [Span("nvme_read", "a", 0.0, 0.003), Span("nvme_read", "b", 0.001, 0.004),   # b overlaps a
                Span("nvme_read", "c", 0.005, 0.006), Span("compute", "fwd L0", 0.0, 0.004),
                Span("compute", "inner", 0.001, 0.002)]                                    # nested: same track
    events = t.chrome_events()
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    track = {e["name"]: names[e["tid"]] for e in events if e["ph"] == "X"}
    assert track == {"a": "nvme_read", "b": "nvme_read 2", "c": "nvme_read", "fwd L0": "compute",
                     "inner": "compute"}
    for tid in names:   # on every track, each event lies after or inside the ones before it
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == tid)
        open_ends = []
        for start, end in spans:
            open_ends = [x for x in open_ends if x > start]
            assert not open_ends or end <= open_ends[-1]
            open_ends.append(end)


def test_spans_back_to_back_stay_back_to_back_in_the_written_trace():
    """Each end rounded to the nanosecond apart would let one span end a nanosecond after the next begins on
    its track; the written duration is taken from the rounded ends (checked in nanoseconds, as Perfetto
    reads them)."""
    from lazytrain.trace import Span
    t = Timeline("measured")
    edges = [0.1 + k * 0.000123456789 for k in range(201)]
    t.spans += [Span("compute", f"L{k}", edges[k], edges[k + 1]) for k in range(200)]
    spans = sorted((e["ts"], e["dur"]) for e in t.chrome_events() if e["ph"] == "X")
    assert len(spans) == 200 and {e["tid"] for e in t.chrome_events() if e["ph"] == "X"} == {1}
    for (ts, dur), (next_ts, _) in zip(spans, spans[1:]):
        assert round(ts * 1000) + round(dur * 1000) == round(next_ts * 1000)
