"""Sweeps on a cluster: the submitit launcher's settings composed by Hydra, the multi-node
torchrun rendezvous built from SLURM's environment, and a 2-run smoke sweep submitted
through submitit's local executor."""

from __future__ import annotations

import os
import sys

import pytest

from repro import cluster


def test_slurm_node_lists_expand_in_order():
    assert cluster.expand_nodelist("gpu[01-03,07]") == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert cluster.expand_nodelist("a17,b[8-10],c") == ["a17", "b8", "b9", "b10", "c"]
    assert cluster.expand_nodelist("node[0009-0010]") == ["node0009", "node0010"]
    with pytest.raises(ValueError, match="names no host"):
        cluster.expand_nodelist("")


def test_torchrun_rendezvous_comes_from_slurms_environment():
    env = {"SLURM_JOB_NODELIST": "gpu[11-12]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_NODEID": "1"}
    cmd = cluster.torchrun_command(env, 8, "/runs/g/r", max_restarts=2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=gpu11:29500" in cmd
    assert "--rdzv-id=4242" in cmd and "--max-restarts=2" in cmd
    assert cmd[-3:] == ["-m", "repro.worker", "/runs/g/r"]
    with pytest.raises(ValueError, match="SLURM_NNODES=3 but"):
        cluster.torchrun_command({**env, "SLURM_NNODES": "3"}, 8, "r")
    with pytest.raises(ValueError, match="not inside a SLURM job"):
        cluster.torchrun_command({}, 8, "r")


def test_launcher_settings_are_hydras():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra is not installed")
    run, launcher = cluster.split_overrides(
        ["compressor=topk", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
         "hydra.launcher.timeout_min=30", "steps=5"])
    assert run == ["compressor=topk", "steps=5"]
    settings = cluster.launcher_config(launcher)
    assert settings["kind"] == "slurm" and settings["partition"] == "gpu"
    assert settings["timeout_min"] == 30 and "submitit_folder" not in settings
    with pytest.raises(ValueError, match="choose one of"):
        cluster.launcher_config(["hydra/launcher=basic"])
    with pytest.raises(ValueError, match="need a launcher"):
        cluster.launcher_config(["hydra.launcher.partition=gpu"])
    assert cluster.launcher_config([]) is None


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_smoke_sweep_through_submitit_local(tmp_path):
    from repro import launch
    from repro.logging import read_metrics

    runs = launch.train(["compressor=topk,dgc", "compressor.ratio=0.05",
                         "cluster=simulated", "cluster.workers=2", "steps=2", "eval_every=0",
                         "eval_batches=1", "logger=local", "logger.progress=false",
                         f"runs_root={tmp_path}", "hydra/launcher=submitit_local",
                         "hydra.launcher.timeout_min=10"], multirun=True, out=lambda s: None)
    assert len(runs) == 2
    for run_dir in runs:
        assert os.path.exists(os.path.join(run_dir, "DONE"))
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    # submitit's job folders live beside the runs, not in the repository
    assert os.path.isdir(os.path.join(tmp_path, "default", ".submitit"))
