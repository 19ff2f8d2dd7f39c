"""benchmarks/gpu_suite.sh keeps within its BUDGET: a section with too little time left is skipped, saying so."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_sections_past_the_budget_are_skipped_by_name(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), ONLY="14", BUDGET="20")
    done = subprocess.run(["bash", "benchmarks/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    skipped = [line for line in done.stdout.splitlines() if line.startswith("skipped for want of time")]
    assert len(skipped) == 3, done.stdout
    assert "tests/test_engine_chaos.py" in skipped[0]
    assert "-k on_a_gpu" in skipped[1]
    assert skipped[2].endswith(f"python3 benchmarks/engine_gpu.py --trace {tmp_path / 'out'}/traces")
    assert "## 2." not in done.stdout and "## 3." not in done.stdout
