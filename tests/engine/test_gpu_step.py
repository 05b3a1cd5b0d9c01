"""scripts/gpu_step.py, the step measurement a GPU session runs (scripts/gpu_measure.sh),
checked here on the CPU so that it works when a device is lent: a torchvision model and
the MLP measured beside PyTorch's own hooks into one JSON file, one entry per model, with
nothing of Hydra, OmegaConf or W&B imported (the device has none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (heavy: a check of a script a GPU session runs, beside the hook's own tests)
pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[2]
RUN = """
import runpy, sys
sys.argv = ["gpu_step.py", *sys.argv[1:]]
try:
    runpy.run_path("scripts/gpu_step.py", run_name="__main__")
except SystemExit as stop:
    assert not stop.code, stop.code
banned = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf", "wandb"))
assert not banned, banned
"""


def _run(*args: str, port: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, "-c", RUN, "--device", "cpu", "--steps", "1",
                           "--warmup", "3", "--rounds", "1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_gpu_step_measures_models_beside_pytorchs_hooks_into_one_file(tmp_path):
    out = tmp_path / "model-step.json"
    _run("--model", "resnet18", "--batch", "2", "--image", "32",
         "--compressor", "topk,sidco_e@bucket", "--json", str(out), port=29611)
    _run("--params", "20K", "--compressor", "dgc", "--json", str(out), port=29612)
    stored = json.loads(out.read_text())
    assert set(stored) == {"resnet18", "mlp"}
    resnet = stored["resnet18"]
    assert (resnet["model"], resnet["batch"], resnet["image"], resnet["tensors"]) == (
        "resnet18", 2, 32, 62)
    assert set(resnet["step_ms"]) == {"none", "torch_fp16", "torch_powersgd", "topk",
                                      "sidco_e@bucket"}
    assert set(stored["mlp"]["step_ms"]) == {"none", "torch_fp16", "torch_powersgd", "dgc"}
    for entry in stored.values():
        times = entry["step_ms"]
        assert times["none"]["x_uncompressed"] == 1.0
        for t in times.values():
            assert 0 < t["min"] <= t["median"] <= t["max"]
            assert t["x_uncompressed"] == pytest.approx(
                t["median"] / times["none"]["median"], rel=1e-2)
