"""The README's runnable examples run as written."""
import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _block_after(heading: str) -> str:
    text = open(README).read()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_coming_from_deepspeed_script_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", _block_after("### Coming from DeepSpeed")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at step 8 data step 15" in r.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step8"


def test_the_hugging_face_trainer_script_runs_as_written(tmp_path):
    for package in ("transformers", "accelerate", "deepspeed"):
        pytest.importorskip(package)
    r = subprocess.run([sys.executable, "-c", _block_after("### With Hugging Face")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reloaded exactly: True" in r.stdout
    assert (tmp_path / "run" / "checkpoint-6" / "latest").read_text() == "global_step6"
