"""Step traces: what a step did, as a timeline in the format the simulator writes for a Plan."""
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch

import lazytrain
from lazytrain.planner import simulate as sim
from lazytrain.trace import LANES, Timeline, check_writable, write_chrome_trace
from lazytrain.tiers import streams
from engine_models import batches, lm_loss, make_model
from test_planner_toys import A_BYTES, toy_problem


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
    assert len([e for e in events if e["ph"] == "X"]) == len(t.spans) and t.written_to == str(path)
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


def test_a_measured_trace_says_its_rank_and_when_it_began_on_the_wall_clock(tmp_path):
    """Over several ranks each rank writes its own file: named by its rank, and each file's times (which start
    at the step's start, its first forward, not at its first span: the work before the first block is the
    step's) placed on the wall clock, so that the ranks' files can be lined up."""
    import time
    from lazytrain.trace import measured_source
    assert (measured_source(0, 1), measured_source(1, 2)) == ("measured", "measured (rank 1)")
    before = time.time()
    measured = Timeline(measured_source(1, 2), device="cpu")
    measured.add(lane="compute", name="fwd L0", start=measured.origin + 0.25, end=measured.origin + 0.5)
    path = tmp_path / "rank1.json"
    write_chrome_trace(str(path), measured.finish())
    written = json.loads(path.read_text())
    assert [e["args"]["name"] for e in written["traceEvents"] if e["name"] == "process_name"] == ["measured (rank 1)"]
    (name, start), = written["otherData"]["start_unix_s"].items()
    assert name == "measured (rank 1)" and before <= start <= time.time()
    (span,) = [e for e in written["traceEvents"] if e["ph"] == "X"]
    assert (span["ts"], span["dur"]) == (250000, 250000)
    assert "measured (rank 1): step 500.00 ms" in measured.summary()


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
    wall_before = timeline.wall_origin
    streams.start_recording(timeline, torch.device("cuda", 0))
    # the wall-clock instant moves with the origin (it stayed: each rank's file placed early by its own wait)
    assert timeline.wall_origin - wall_before >= 0.05
    try:
        with streams.span("compute", "fwd L0"):
            pass
    finally:
        streams.stop_recording()
    (s,) = timeline.spans
    assert 0 <= s.start < 0.04, s.start    # not 0.05 s in: the drained work is before the origin


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_file_places_the_traced_step_after_the_work_queued_before_it(tmp_path):
    """The file's wall-clock start stayed at the first forward's call while the timeline began once the
    work queued before it had run: each rank's file was placed early by its own wait."""
    import time
    engine = traced_engine(tmp_path)
    (x0, y0), (x1, y1) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    torch.cuda.synchronize()
    path = tmp_path / "step.json"
    engine.trace_next_step(str(path))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    queued_at = time.time()
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    for _ in range(200):   # about 0.1-0.3 s of work queued before the traced step
        a = (a @ a).clamp_(-1, 1)
    ended.record()
    engine.backward(lm_loss(engine(x1), y1))
    engine.step()
    queued_s = began.elapsed_time(ended) / 1e3
    start = json.loads(path.read_text())["otherData"]["start_unix_s"]["measured"]
    assert queued_s > 0.02 and start >= queued_at + 0.8 * queued_s, (queued_s, start - queued_at)
    engine.destroy()


def test_a_traced_step_that_raised_is_dropped_and_the_next_trace_goes_where_it_was_asked(tmp_path):
    """The recording of a step that raised went on into the next step, which was written under the failed
    step's path, while the path asked for next got the step after."""
    engine = traced_engine(tmp_path)
    (x, y), (x2, y2) = batches(2)
    engine.trace_next_step(str(tmp_path / "a.json"))
    engine(x)
    with pytest.warns(UserWarning, match=r"the step traced for .*a.json did not complete \(it raised before step\(\), "
                                         r"or trace_next_step\(\) was called again during it\); its partial trace is "
                                         r"dropped"):
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
    assert engine.last_trace.written_to is None


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


def test_spans_back_to_back_stay_back_to_back_as_perfetto_reads_the_written_trace(tmp_path):
    """Perfetto reads ts and dur each as value * 1000 made integer ns: truncated by older releases, rounded by
    newer ones. Written as decimals rounded to the ns, 1056518.417 read as 1056518416 ns, and a span could end
    a nanosecond after the next one on its track began."""
    import random
    from lazytrain.trace import Span
    rng = random.Random(0)
    t = Timeline("measured")
    edges = sorted(rng.uniform(0, 2.0) for _ in range(2001))
    t.spans += [Span("compute", f"L{k}", edges[k], edges[k + 1]) for k in range(2000)]
    t.spans.append(Span("compute", "inner", edges[5], edges[6]))             # nested: ends where L5 does
    path = tmp_path / "step.json"
    write_chrome_trace(str(path), t)
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1}
    # each end in integer ns from the origin, the duration their difference: back to back stays so
    at = [round(x * 1e9) for x in edges]
    for read in (int, round):
        ns = {(e["name"], read(e["ts"] * 1000.0), read(e["dur"] * 1000.0)) for e in spans}
        assert ns == {(f"L{k}", at[k], at[k + 1] - at[k]) for k in range(2000)} | {("inner", at[5], at[6] - at[5])}
    assert int(1056518.417 * 1000.0) == 1056518416                          # why not the decimal itself


def test_a_trace_path_whose_folder_takes_no_new_file_is_refused_before_training(tmp_path):
    """The check opened the file alone, but the write creates PATH.<pid>.tmp beside it and renames that over
    it: a writable file in a folder that takes no new file passed, and the write failed after training
    (here a directory holds the temporary name; a read-only folder fails the same way)."""
    path = tmp_path / "step.json"
    path.write_text("before")
    partial = f"{os.path.realpath(path)}.{os.getpid()}.tmp"
    os.mkdir(partial)
    message = (f"trace path {path} cannot be written: its temporary file {partial} cannot be created (Is a "
               f"directory); the file is written there, then renamed over the path")
    with pytest.raises(ValueError) as e:   # what engine.trace_next_step and lazytrain train --trace check
        check_writable(str(path))
    assert str(e.value) == message
    assert path.read_text() == "before" and os.path.isdir(partial)
    os.rmdir(partial)
    check_writable(str(path))                                 # the folder clear: accepted, and nothing left behind
    assert path.read_text() == "before" and sorted(os.listdir(tmp_path)) == ["step.json"]


def test_a_trace_path_that_is_no_regular_file_is_refused_and_never_replaced(tmp_path):
    """A device (/dev/null), a FIFO: the write renamed its file over the path, so the node itself became a
    regular file (as root, /dev/null did)."""
    import stat
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "to-fifo.json"
    link.symlink_to(fifo)
    for path, named in (("/dev/null", "/dev/null"), (str(fifo), str(fifo)),
                        (str(link), f"{link} (resolved: {os.path.realpath(fifo)})")):
        with pytest.raises(ValueError) as e:
            check_writable(path)
        assert str(e.value) == f"trace path {named} is not a regular file; give the name of a file to write"
    t = Timeline("measured")
    t.add("compute", "fwd L0", t.origin, t.origin + 0.001)
    with pytest.raises(OSError) as e:                          # the write refuses too (the engine warns, as for any
        write_chrome_trace(str(fifo), t.finish())              # trace it cannot write)
    assert str(e.value) == f"trace path {fifo} is not a regular file; give the name of a file to write"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and t.written_to is None
    assert sorted(os.listdir(tmp_path)) == ["fifo", "to-fifo.json"]


def test_a_trace_written_to_a_symlink_goes_to_its_target_and_the_link_stays(tmp_path):
    """The write renamed its file over the link: the link was gone and its target never written. The
    temporary file goes beside the target (here the link's folder could not take it)."""
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "step.json"
    target.write_text("")
    link = tmp_path / "step.json"
    link.symlink_to(target)
    os.mkdir(f"{os.path.realpath(tmp_path)}/step.json.{os.getpid()}.tmp")   # the link's folder: no temporary file
    t = Timeline("measured")
    t.add("compute", "fwd L0", t.origin, t.origin + 0.001)
    check_writable(str(link))
    write_chrome_trace(str(link), t.finish())
    assert link.is_symlink() and os.readlink(link) == str(target) and t.written_to == str(link)
    assert [e["name"] for e in json.loads(target.read_text())["traceEvents"] if e["ph"] == "X"] == ["fwd L0"]
    assert os.listdir(tmp_path / "runs") == ["step.json"]
    dangling = tmp_path / "later.json"                         # a link whose target is not there yet: created
    dangling.symlink_to(tmp_path / "runs" / "later.json")
    check_writable(str(dangling))
    write_chrome_trace(str(dangling), t)
    assert dangling.is_symlink() and json.loads((tmp_path / "runs" / "later.json").read_text())["traceEvents"]


def test_lazytrain_train_says_the_trace_was_written_only_when_it_was(tmp_path, monkeypatch, capsys):
    """A write that failed after training was a warning alone: the command still printed "trace of step 2
    written to ..."."""
    import copy
    import errno
    from lazytrain.cli import main
    from lazytrain.engine import engine as engine_module
    from lazytrain.train import DEFAULT_CONFIG
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["job"].update(eval_examples=4)
    cfg["job"]["model"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    job = tmp_path / "job.json"
    job.write_text(json.dumps(cfg))
    path = tmp_path / "step.json"

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(engine_module, "write_chrome_trace", disk_full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the engine's warning filtered out: the command says it itself
        code = main(["train", str(job), "--steps", "2", "--no-progress", "--out", str(tmp_path / "out"),
                     "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and "measured: step " in out and "written to" not in out and not path.exists()
    assert err == f"lazytrain: the trace of step 2 could not be written to {path}; its summary is above\n"


def test_a_predicted_trace_lasts_the_step_time():
    """With the update overlapped, its last layers' spans run on into the next step, and the trace's duration
    (and its summary's step) was theirs, not the step time."""
    from lazytrain.planner.policies import keep_all
    p1 = toy_problem(4, 5.0, host_slots=4)
    plan = keep_all(p1)[0]
    assert plan.overlap_optimizer
    for p in (p1, dataclasses.replace(p1, grad_accum=3)):
        r = sim.simulate(p, plan)
        t = r.trace()
        assert t.duration == r.step_time_s
        assert t.summary().splitlines()[0] == f"predicted: step {r.step_time_s * 1e3:.2f} ms"
        last = max(t.spans, key=lambda s: s.end)                # kept: they are real
        assert last.name == "update L3" and last.end > r.step_time_s


def test_a_predicted_trace_carries_the_bytes_each_transfer_moves():
    """The simulator's transfers had no bytes: a predicted trace's summary had none, and
    measured.link_bandwidths read no link from it."""
    from lazytrain.planner.measured import link_bandwidths
    from lazytrain.planner.plan import Plan, offload_all_plan
    p = toy_problem(4, 5.0, host_slots=4, nvme_slots=4)
    # boundaries 0 and 2 kept on the host, 1 and 3 on NVMe; the update after the step, not overlapped
    plan = Plan(num_layers=4, homes=("host", "nvme", "host", "nvme", "hbm"), overlap_optimizer=False)
    t = sim.simulate(p, plan).trace()
    moved = lambda lane: Counter((s.name, s.args["bytes"]) for s in t.spans if s.lane == lane)   # noqa: E731
    W = G = [4000, 6000, 5000, 4400]   # the toy's layers' weights and gradients: parameters x 2 bytes
    assert (p.Wl, p.Gl, p.A[0], p.nonlayer_link_bytes) == (W, G, A_BYTES, 128)   # 128: its final norm's
    # each layer's weights in its forward (layer 0's came with the step before) and its backward, each boundary
    # back before its backward, and the next step's first weights
    assert moved("h2d") == Counter([(f"weights L{j}", W[j]) for j in (1, 2, 3, 3, 2, 1, 0)] +
                                   [(f"prefetch b{b}", A_BYTES) for b in range(4)] +
                                   [("next step's first weights (embedding/head + L0)", W[0] + 128)])
    # each layer's gradients, the head's beside the first backward windows, each boundary out after its forward
    assert moved("d2h") == Counter([(f"grads L{j}", G[j]) for j in (3, 2, 1)] + [("grads L0 + embedding", G[0])] +
                                   [("grads embedding/head", 32)] * 4 + [(f"offload b{b}", A_BYTES) for b in range(4)])
    assert moved("nvme_write") == Counter({("offload b1", A_BYTES): 1, ("offload b3", A_BYTES): 1})
    assert moved("nvme_read") == Counter({("prefetch b1", A_BYTES): 1, ("prefetch b3", A_BYTES): 1})
    summary = t.summary().splitlines()
    h2d_total, d2h_total = 2 * sum(W) + 4 * A_BYTES + 128, sum(G) + 128 + 4 * A_BYTES
    assert [line.split()[-1] for line in summary if line.split()[0] in ("h2d", "d2h", "nvme_read", "nvme_write")] \
        == [str(h2d_total), str(d2h_total), str(2 * A_BYTES), str(2 * A_BYTES)]
    # transfers run at the profile's rates: measured.link_bandwidths reads them back from the predicted trace
    assert link_bandwidths([t]) == pytest.approx({"h2d_gbps": 0.002, "d2h_gbps": 0.0025, "nvme_read_gbps": 0.001,
                                                  "nvme_write_gbps": 0.0015}, rel=1e-9)
    # three micro-batches: each moves its own weights, boundaries and gradients; the step, the next one's once
    t3 = sim.simulate(dataclasses.replace(p, grad_accum=3), plan).trace()
    total = lambda lane: sum(s.args["bytes"] for s in t3.spans if s.lane == lane)   # noqa: E731
    assert (total("h2d"), total("d2h")) == (3 * (h2d_total - 128) + 128, 3 * d2h_total)
    # an offloaded layer's internals, out after its forward and back before its backward
    t = sim.simulate(p, offload_all_plan(4), strict=False).trace()
    internals = Counter((s.lane, s.name, s.args["bytes"]) for s in t.spans if "internals" in s.name)
    assert internals == Counter([("d2h", f"offload internals L{j}", p.offl_bytes[j]) for j in range(3)] +
                                [("h2d", f"prefetch internals L{j}", p.offl_bytes[j]) for j in range(3)])
