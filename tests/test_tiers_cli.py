"""`lazytrain bench tiers`: a small run writes a hardware profile the planner reads."""
import argparse
import json
import os

import pytest
import torch

from lazytrain.tiers import cli

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")

FIELDS = ["name", "peak_tflops", "achievable_tflops", "h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps",
          "host_mem_gbps", "host_optimizer_gparams_per_s", "gpu_mem_bytes", "host_mem_bytes"]


def parser():
    p = argparse.ArgumentParser(prog="lazytrain")
    cli.register(p.add_subparsers(dest="command", required=True))
    return p


def test_bench_tiers_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "hw" / "profile.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    args = parser().parse_args(["bench", "tiers", "--path", str(disk), "--json", str(out), "--nvme-bytes", "2MiB",
                                "--tensor-bytes", "512KiB", "--copy-bytes", "1MiB", "--seconds", "0.01",
                                "--optimizer-params", "8192"])
    assert args.func(args) == 0
    profile = json.loads(out.read_text())
    assert list(profile) == FIELDS
    for key in ("achievable_tflops", "nvme_read_gbps", "nvme_write_gbps", "host_mem_gbps",
                "host_optimizer_gparams_per_s"):
        assert isinstance(profile[key], float) and profile[key] > 0, key
    assert profile["host_mem_bytes"] > 0
    if not torch.cuda.is_available():
        assert profile["h2d_gbps"] is None and profile["d2h_gbps"] is None and profile["gpu_mem_bytes"] is None
        assert profile["peak_tflops"] is None
    hardware = pytest.importorskip("lazytrain.planner.hardware")
    assert hardware.HardwareProfile.from_dict(profile).nvme_read_gbps == profile["nvme_read_gbps"]
    printed, err = capsys.readouterr()
    assert "| nvme tier |" in printed and f"hardware profile written to {out}" in printed
    assert ("lazytrain bench tiers: note: --nvme-bytes 2.0 MiB (below 64.0 MiB), --tensor-bytes 512.0 KiB (below "
            "1.0 MiB), --copy-bytes 1.0 MiB (below 16.0 MiB), --optimizer-params 8192 (below 1048576) measure per-call "
            "overhead more than throughput; the profile's figures will understate this machine (the defaults "
            "measure it steadily)\n") in err
    assert list(disk.iterdir()) == []  # the NVMe run directory is gone


def test_bench_arguments_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "tiers", "--nvme-bytes", "lots"])
    assert "argument --nvme-bytes: size: cannot read 'lots' as a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "disks"])
    assert "argument target: invalid choice: 'disks' (choose from 'tiers')" in capsys.readouterr().err
    args = parser().parse_args(["bench", "tiers", "--path", str(tmp_path / "missing")])
    assert args.func(args) == 2
    assert capsys.readouterr().err == f"lazytrain bench tiers: --path {tmp_path / 'missing'} is not a directory\n"
    for flag, value, message in (("--tensor-bytes", "2", "size must be at least 4KiB, got '2'"),
                                 ("--optimizer-params", "0", "must be a positive integer, got '0'"),
                                 ("--seconds", "-1", "must be a positive number, got '-1'"),
                                 ("--seconds", "nan", "must be a positive number, got 'nan'"),
                                 ("--seconds", "inf", "must be a positive number, got 'inf'")):
        with pytest.raises(SystemExit):
            parser().parse_args(["bench", "tiers", flag, value])
        assert f"argument {flag}: {message}" in capsys.readouterr().err
    # a profile that cannot be written, and a directory nothing can be created in, fail before any measurement
    args = parser().parse_args(["bench", "tiers", "--json", str(tmp_path)])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"lazytrain bench tiers: cannot write the profile to --json {tmp_path} "
                                       f"(it is a directory)\n")
    (tmp_path / "file").write_text("")   # a file where a folder belongs: makedirs said "File exists"
    args = parser().parse_args(["bench", "tiers", "--json", str(tmp_path / "file" / "sub" / "hw.json")])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"lazytrain bench tiers: cannot write the profile to --json "
                                       f"{tmp_path / 'file' / 'sub' / 'hw.json'} ({tmp_path / 'file'} is not a "
                                       f"directory)\n")
    args = parser().parse_args(["bench", "tiers", "--json", "/proc/hw.json"])   # root's permission bits say yes
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("lazytrain bench tiers: cannot write the profile to --json "
                                              "/proc/hw.json (")
    fifo = tmp_path / "fifo"   # judged of the file the write replaces: the rename would replace the FIFO itself
    os.mkfifo(fifo)
    args = parser().parse_args(["bench", "tiers", "--json", str(fifo)])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"lazytrain bench tiers: cannot write the profile to --json {fifo} (it is not "
                                       f"a regular file)\n")
    (tmp_path / "link.json").symlink_to(tmp_path / "file" / "hw.json")   # its target's folder is a file
    args = parser().parse_args(["bench", "tiers", "--json", str(tmp_path / "link.json")])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"lazytrain bench tiers: cannot write the profile to --json "
                                       f"{tmp_path / 'link.json'} ({tmp_path / 'file'} is not a directory)\n")
    args = parser().parse_args(["bench", "tiers", "--path", "/proc"])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("lazytrain bench tiers: cannot create files under --path /proc (")


def test_bench_tiers_json_to_stdout_is_the_profile_alone(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    args = parser().parse_args(["bench", "tiers", "--path", str(disk), "--json", "-", "--nvme-bytes", "2MiB",
                                "--tensor-bytes", "512KiB", "--copy-bytes", "1MiB", "--seconds", "0.01",
                                "--optimizer-params", "8192"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert list(json.loads(out)) == FIELDS   # what `lazytrain plan --hardware` reads
    assert "| what |" in err


class _Recording:
    """A host tier that records which source buffers its writes read and can hand back a wrong key's data."""

    def __init__(self, swap=None):
        from lazytrain.tiers.memory import HostTier
        self.tier, self.sources, self.swap = HostTier("host"), set(), swap
        self.name = "recording"
        self.sizes, self.most = {}, 0   # bytes each key holds; the most held at once

    def write(self, key, t):
        self.sources.add(t.data_ptr())
        self.sizes[key] = t.numel() * t.element_size()
        self.most = max(self.most, sum(self.sizes.values()))
        return self.tier.write(key, t)

    def read(self, key, out):
        return self.tier.read(self.swap.get(key, key) if self.swap else key, out=out)

    def __contains__(self, key):
        return key in self.tier

    def free(self, key):
        self.tier.free(key)


def test_a_tier_is_measured_in_rounds_through_the_same_buffers_and_every_read_is_checked():
    """All of a total's tensors were held at once, twice (sources and read buffers): measuring an NVMe drive
    with --nvme-bytes N took about 2.6x N of RAM."""
    from lazytrain.tiers.bench import measure_tier
    tier = _Recording()
    r = measure_tier(tier, 16 << 20, 1 << 20, round_bytes=4 << 20)
    assert r["bytes"] == 16 << 20 and r["write_gbps"] > 0 and r["read_gbps"] > 0
    assert len(tier.sources) == 4           # one round's tensors, reused by the four rounds
    assert tier.tier.keys() == []           # every key freed
    wrong = _Recording(swap={"bench-9": "bench-5"})   # key 9 read as key 5 (same buffer, another round)
    with pytest.raises(RuntimeError, match="^tier 'recording' returned wrong data for bench-9$"):
        measure_tier(wrong, 16 << 20, 1 << 20, round_bytes=4 << 20)
    assert wrong.tier.keys() == []


@pytest.mark.parametrize("total,tensor", [(16 << 20, 1 << 20), (512 << 10, 2 << 20), (3 << 20, 2 << 20),
                                          (5 << 20, 2 << 20)])
def test_the_bytes_a_measurement_holds_in_a_tier_are_what_bench_checks_the_disk_for(total, tensor):
    from lazytrain.tiers.bench import measure_tier, tier_bytes_held
    tier = _Recording()
    measure_tier(tier, total, tensor, warmup_bytes=min(total, 256 << 20), round_bytes=4 << 20)
    assert tier.most == tier_bytes_held(total, tensor)


def test_a_disk_without_room_for_the_nvme_measurement_is_one_line_before_any_measurement(tmp_path, capsys,
                                                                                        monkeypatch):
    """With the default 1 GiB on a small disk the write failed with ENOSPC after the other measurements, as a
    traceback."""
    import collections

    from lazytrain.tiers import bench
    from lazytrain.tiers.nvme import NVMeIOError
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: usage(3 << 20, 2 << 20, 1 << 20))
    monkeypatch.setattr(bench, "run_bench", lambda **kw: pytest.fail("measured on a disk without room"))
    args = parser().parse_args(["bench", "tiers", "--path", str(tmp_path), "--nvme-bytes", "2MiB", "--tensor-bytes",
                                "512KiB", "--json", "-"])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (f"lazytrain bench tiers: {tmp_path} has 1.0 MiB free, and the NVMe measurement "
                                       f"writes 2.0 MiB there (--nvme-bytes 2.0 MiB in whole --tensor-bytes 512.0 KiB "
                                       f"tensors): give a smaller --nvme-bytes or --tensor-bytes, or a --path on a "
                                       f"disk with room\n")
    # a total below one tensor still writes a whole tensor
    bigger = parser().parse_args(["bench", "tiers", "--path", str(tmp_path), "--nvme-bytes", "512KiB",
                                  "--tensor-bytes", "2MiB", "--json", "-"])
    assert bigger.func(bigger) == 2
    assert "writes 2.0 MiB there (--nvme-bytes 512.0 KiB in whole --tensor-bytes 2.0 MiB" in capsys.readouterr().err
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: usage(3 << 20, 0, 3 << 20))

    def disk_filled_meanwhile(**kw):
        raise NVMeIOError("tier 'nvme': writing bench-1 failed: No space left on device")
    monkeypatch.setattr(bench, "run_bench", disk_filled_meanwhile)
    assert args.func(args) == 2
    err = capsys.readouterr().err   # (after the note on the small sizes)
    assert err.startswith("lazytrain bench tiers: note: --nvme-bytes 2.0 MiB (below 64.0 MiB)")
    assert err.endswith(f"\nlazytrain bench tiers: the NVMe measurement under {tmp_path} failed: tier "
                        f"'nvme': writing bench-1 failed: No space left on device\n")


def test_the_host_optimizer_figure_is_of_the_update_it_names(monkeypatch):
    """The row said "HybridAdamW (8-bit states)" and timed a 1-D tensor without a name, which HybridAdamW keeps
    in fp32, plus a finiteness pass over every gradient that the engine's optimizer does not make: what it
    times is the engine's default update (fp32 states, no pass of its own), and it says so."""
    from lazytrain.optim.hybrid_adamw import HybridAdamW
    from lazytrain.tiers.bench import measure_host_optimizer
    seen = []
    step = HybridAdamW.step

    def recorded(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        seen.append((self.check_finite, {row["states"] for row in self.state_report()}))
        return out
    monkeypatch.setattr(HybridAdamW, "step", recorded)
    rate, what = measure_host_optimizer(4096, 0.01)
    assert what == "lazytrain HybridAdamW (fp32 states, the engine's default)" and rate > 0
    assert seen and set(map(repr, seen)) == {repr((False, {"fp32"}))}


def test_a_card_is_given_its_own_variants_datasheet_peak():
    """"NVIDIA H100 PCIe" was given the SXM card's 989 TFLOP/s (the first key it contains)."""
    from lazytrain.tiers.bench import datasheet_peak_tflops
    assert datasheet_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert datasheet_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert datasheet_peak_tflops("NVIDIA H200 NVL") == 835.0   # 1,671 with sparsity
    assert datasheet_peak_tflops("NVIDIA H200") == 989.0
    assert datasheet_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert datasheet_peak_tflops("NVIDIA H800 PCIe") == 756.0
    assert datasheet_peak_tflops("NVIDIA GeForce RTX 3090") == 71.0
    assert datasheet_peak_tflops("cpu-only (x86_64, 2 cores)") is None
