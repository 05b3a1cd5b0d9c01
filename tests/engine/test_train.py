"""The training engine: real gloo ranks through the DDP comm hook, simulated
workers, checkpoints and relaunch, schedules, sweeps, config validation.

The distributed runs train the smoke MLP-Mixer (cifar10_mixer: 16k parameters in 30
tensors, LayerNorm, Adam) and the smoke ResNet (BatchNorm buffers) for a few steps; all
real-rank runs of the family test share one spawn of two gloo ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from compressors.base import target_k
from repro import config as config_mod
from repro import launch, runner
from repro.logging import read_metrics, read_summary
from repro.testing import run_ranks

# One member of each compressor family; ratios large enough that every tensor sends a few.
FAMILIES = {
    "topk": ["compressor=topk", "compressor.ratio=0.05"],
    "sidco_e": ["compressor=sidco_e", "compressor.ratio=0.05"],
    "dgc": ["compressor=dgc", "compressor.ratio=0.05"],
    "dragonn": ["compressor=dragonn", "compressor.ratio=0.05"],
    "deft": ["compressor=deft", "compressor.ratio=0.05"],
    "thc": ["compressor=thc"],
    "powersgd": ["compressor=powersgd"],
    "none": ["compressor=none"],
}
STEPS = 3
COMMON = [
    "task=cifar10_mixer", f"steps={STEPS}", "eval_every=0", "eval_batches=1",
    "cluster.threads_per_worker=1", "logger=local", "logger.progress=false",
]
# Per-step values that must agree exactly between real ranks and simulated workers.
EXACT_KEYS = ("loss", "bytes_sent", "estimation_quality", "density", "target_ratio",
              "compressed_fraction", "ratio", "lr")


def prepare(root, *overrides: str) -> str:
    """Compose + validate one run and write its config, as `repro train` does before launch."""
    planned = launch.plan([*overrides, f"runs_root={root}"], multirun=False)[0]
    os.makedirs(planned.run_dir, exist_ok=True)
    config_mod.save(planned.cfg, os.path.join(planned.run_dir, "config.yaml"))
    return planned.run_dir


@contextmanager
def one_thread():
    """Simulated workers in this process with the real ranks' thread count: conv/matmul
    reductions (and so the last bits of gradients) depend on it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def simulate(run_dir: str):
    from repro.train import SimulatedTrainer

    with one_thread():
        trainer = SimulatedTrainer(run_dir)
        trainer.run()
    return trainer


def _train_real(rank: int, world: int, run_dirs: list[str]) -> dict[str, dict]:
    """On each rank: every run in turn, in the one process group; final states back."""
    from repro.train import DDPTrainer

    out = {}
    for run_dir in run_dirs:
        trainer = DDPTrainer(run_dir, rank, world)
        initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.run()
        out[run_dir] = {
            "initial": initial,
            "final": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        }
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Real 2-rank runs of every family (+ DDP's built-in allreduce, + a BatchNorm model)
    and the simulated n = 2 runs of the same configs."""
    root = str(tmp_path_factory.mktemp("engine"))
    real = {name: prepare(root, *ov, *COMMON) for name, ov in FAMILIES.items()}
    real["ddp_allreduce"] = prepare(root, "compressor=none", "comm_hook=false", *COMMON)
    bn = ["compressor=topk", "compressor.ratio=0.05", "task=cifar10_resnet20", f"steps={STEPS}",
          "eval_every=0", "eval_batches=1", "cluster.threads_per_worker=1", "logger=local",
          "logger.progress=false"]
    real["topk_batchnorm"] = prepare(root, *bn)
    states = run_ranks(_train_real, 2, list(real.values()))
    sim_overrides = {**FAMILIES, "topk_batchnorm": bn[:2]}
    simulated = {}
    for name, ov in sim_overrides.items():
        common = bn[2:] if name == "topk_batchnorm" else COMMON
        run_dir = prepare(root, *ov, *common, "cluster=simulated", "cluster.workers=2")
        simulated[name] = (run_dir, simulate(run_dir))
    return real, states, simulated


@pytest.mark.distributed
@pytest.mark.parametrize("family", [*FAMILIES, "topk_batchnorm"])
def test_every_rank_holds_bit_identical_parameters(engine, family):
    real, states, _ = engine
    run_dir = real[family]
    rank0, rank1 = states[0][run_dir], states[1][run_dir]
    # BatchNorm's running statistics are buffers, not parameters: DDP broadcasts rank 0's
    # at the start of every forward, so after the last step each rank holds its own.
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    params = {k: v for k, v in rank0["final"].items() if not k.endswith(buffers)}
    assert len(params) >= 20
    for key, value in params.items():
        assert torch.equal(value, rank1["final"][key]), f"{family}: {key} differs between ranks"
    changed = [k for k, v in rank0["final"].items() if not torch.equal(v, rank0["initial"][k])]
    assert changed, f"{family}: training did not change any parameter"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    # every tensor went through the compressor; `none` sends all of it in fp32
    assert all(r["compressed_fraction"] == 1.0 for r in records), family
    dense_bytes = 4 * sum(v.numel() for v in params.values())
    sent = {r["bytes_sent"] for r in records}
    assert sent == {dense_bytes} if family == "none" else max(sent) < dense_bytes, (family, sent)
    assert read_summary(run_dir)["steps"] == STEPS


@pytest.mark.distributed
def test_none_through_the_hook_equals_ddp_builtin_allreduce(engine):
    real, states, _ = engine
    ours = states[0][real["none"]]["final"]
    builtin = states[0][real["ddp_allreduce"]]["final"]
    for key, value in ours.items():
        assert torch.equal(value, builtin[key]), key
    losses = [r["loss"] for r in read_metrics(real["none"])]
    assert losses == [r["loss"] for r in read_metrics(real["ddp_allreduce"])]


@pytest.mark.distributed
@pytest.mark.parametrize("family", [*FAMILIES, "topk_batchnorm"])
def test_simulated_two_workers_match_real_ranks_step_for_step(engine, family):
    real, states, simulated = engine
    sim_dir, trainer = simulated[family]
    real_records, sim_records = read_metrics(real[family]), read_metrics(sim_dir)
    assert [r["step"] for r in sim_records] == [r["step"] for r in real_records]
    for a, b in zip(real_records, sim_records):
        for key in EXACT_KEYS:
            assert a.get(key) == b.get(key), f"{family} step {a['step']}: {key}"
        if "ef_norm" in a:  # a norm of per-tensor norms: summation order may differ
            assert b["ef_norm"] == pytest.approx(a["ef_norm"], rel=1e-6)
    final = states[0][real[family]]["final"]
    for key, value in trainer.model.state_dict().items():  # parameters and buffers
        assert torch.equal(value, final[key]), f"{family}: {key}"


# -- checkpoints and relaunch ------------------------------------------------------------------
class Killed(Exception):
    pass


def _comparable(records):
    """Metrics without the wall-clock ones (timings differ between any two runs)."""
    timed = ("wall_time", "step_s", "comm_s", "compute_s", "compress_s", "samples_per_s")
    return [{k: v for k, v in r.items() if k not in timed and not k.startswith("projected/")}
            for r in records]


@pytest.mark.parametrize("compressor", [("dgc", "compressor.ratio=0.05"), ("powersgd",)],
                         ids=["dgc", "powersgd"])
@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(tmp_path, monkeypatch, compressor):
    """Killed mid-run, relaunched: the checkpoint (model, Adam state, compressor and
    error-feedback state, RNG) makes the rest of the run identical."""
    ov = [f"compressor={compressor[0]}", *compressor[1:], "task=cifar10_mixer", "steps=6",
          "eval_every=3", "eval_batches=1", "checkpoint_every=2", "cluster=simulated",
          "cluster.workers=2", "logger=local", "logger.progress=false"]
    reference = simulate(prepare(tmp_path / "a", *ov))
    run_dir = prepare(tmp_path / "b", *ov)

    def die(code):
        raise Killed(code)

    monkeypatch.setenv("GRADCOMP_FAIL_AT_STEP", "5:0")  # logs step 4, checkpoint is at 4
    monkeypatch.setattr(os, "_exit", die)
    with pytest.raises(Killed):
        simulate(run_dir)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(run_dir, "DONE"))
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000004")
    assert open(os.path.join(run_dir, "checkpoints", "LATEST")).read() == "step_00000004"
    trainer_sd = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
    assert {"model", "optimizer", "scheduler", "rng", "step", "epoch", "batch_in_epoch"} <= set(trainer_sd)
    assert trainer_sd["step"] == 4 and trainer_sd["optimizer"]["state"]  # Adam moments
    workers = torch.load(os.path.join(ckpt, "workers.pt"), weights_only=False)
    assert len(workers) == 2 and all("torch" in w["rng"] for w in workers)
    sessions = workers[1]["compression"]["sessions"]
    assert "head.weight" in sessions
    state = sessions["head.weight"]["states"]["head.weight"]
    held = [v for part in state.values() for v in part.values() if isinstance(v, torch.Tensor)]
    assert held and any(v.abs().sum() > 0 for v in held), "no error-feedback / compressor state"

    resumed = simulate(run_dir)
    assert read_summary(run_dir)["resumed_from_step"] == 4
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(6))  # step 4 logged once, not twice
    assert _comparable(records) == _comparable(read_metrics(reference.run_dir))
    for key, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    ref_opt, res_opt = reference.optimizer.state_dict(), resumed.optimizer.state_dict()
    for p, st in ref_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(res_opt["state"][p][k])), (p, k)
    for a, b in zip(reference.compressions, resumed.compressions):
        for x, y in zip(a.residuals(), b.residuals()):
            assert torch.equal(x, y)


@pytest.mark.heavy
@pytest.mark.distributed
def test_torchrun_relaunch_after_killed_rank(tmp_path, monkeypatch):
    """Rank 1 dies at step 3 under torchrun --max-restarts 1; the relaunched ranks resume
    from the checkpoint at step 2 (step 2 was logged before the kill, and is dropped and
    logged again: exactly once), and the run ends where an uninterrupted one ends."""
    ov = ["compressor=dgc", "compressor.ratio=0.05", "task=cifar10_mixer", "steps=6",
          "eval_every=0", "eval_batches=1", "checkpoint_every=2", "logger=local",
          "logger.progress=false"]
    monkeypatch.setenv("GRADCOMP_FAIL_AT_STEP", "3:1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (run_dir,) = launch.train([*ov, "cluster=elastic_cpu", f"runs_root={tmp_path}"], out=lambda s: None)
    monkeypatch.delenv("GRADCOMP_FAIL_AT_STEP")
    summary = read_summary(run_dir)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 2
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(6))
    times = [r["wall_time"] for r in records]
    assert times == sorted(times)

    reference = simulate(prepare(tmp_path / "ref", *ov, "cluster=simulated", "cluster.workers=2",
                                 "cluster.threads_per_worker=1"))
    assert _comparable(records) == _comparable(read_metrics(reference.run_dir))
    final = torch.load(os.path.join(run_dir, "checkpoints", "step_00000006", "trainer.pt"),
                       weights_only=False)
    for key, value in reference.model.state_dict().items():
        assert torch.equal(value, final["model"][key]), key


# -- schedules and metrics -----------------------------------------------------------------------
def test_ratio_warmup_schedule_values():
    from repro.train import ratio_at

    cfg = config_mod.schema()
    cfg.compressor.ratio = 0.001
    cfg.compressor.start_step = 10
    cfg.compressor.warmup_steps = 4
    cfg.compressor.warmup_ratio = 0.25
    # DGC's warm-up: density falls geometrically from 25% to 0.1% over the warm-up, from
    # start_step on (25% → 6.3% → 1.6% → 0.4% → 0.1%, the paper's ≈ ×1/4 per stage).
    got = [ratio_at(cfg, s) for s in (0, 10, 11, 12, 13, 14, 100)]
    geometric = [0.25 * (0.001 / 0.25) ** (i / 4) for i in range(5)]
    assert got == pytest.approx([0.25, *geometric, 0.001], rel=1e-12)
    assert got[2:6] == pytest.approx([0.0629, 0.0158, 0.00398, 0.001], rel=2e-3)
    cfg.compressor.warmup_steps = 0
    assert ratio_at(cfg, 0) == 0.001
    cfg.compressor.ratio = None
    assert ratio_at(cfg, 5) is None


@pytest.mark.slow
def test_dense_start_steps_and_dgc_warmup_in_a_run(tmp_path):
    from repro.train import ratio_at

    run_dir = prepare(tmp_path, "compressor=dgc", "compressor.ratio=0.01", "compressor.start_step=2",
                      "compressor.warmup_steps=3", "compressor.warmup_ratio=0.25",
                      "task=cifar10_mixer", "steps=7", "eval_every=0", "eval_batches=1",
                      "cluster=simulated", "cluster.workers=2", "logger=local",
                      "logger.progress=false")
    trainer = simulate(run_dir)
    numels = [p.numel() for _, p in trainer.named]
    dense_bytes = 4 * sum(numels)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(7))
    for r in records[:2]:  # dense warm-up: plain fp32 allreduce of everything
        assert r["compressed_fraction"] == 0.0 and r["bytes_sent"] == dense_bytes
        assert "estimation_quality" not in r
    ratios = []
    for r in records[2:]:
        assert r["compressed_fraction"] == 1.0 and r["bytes_sent"] < dense_bytes
        ratio = ratio_at(trainer.cfg, r["step"])
        assert r["ratio"] == ratio
        # what the compressor really targeted follows the schedule
        want = sum(target_k(n, ratio) for n in numels) / sum(numels)
        assert r["target_ratio"] == pytest.approx(want, rel=1e-12)
        ratios.append(ratio)
    assert ratios[0] == pytest.approx(0.25) and ratios[-2:] == [0.01, 0.01]
    assert ratios == sorted(ratios, reverse=True)
    sent = [r["bytes_sent"] for r in records[2:]]
    assert sent[0] > sent[2] > sent[-1]


@pytest.mark.slow
def test_projected_metrics_are_labelled_projected(tmp_path):
    run_dir = prepare(tmp_path, "compressor=topk", "compressor.ratio=0.01", "task=cifar10_mixer",
                      "steps=2", "eval_every=0", "eval_batches=1", "cluster=simulated",
                      "cluster.workers=2", "cluster.target_workers=16", "logger=local",
                      "logger.progress=false")
    trainer = simulate(run_dir)
    records = read_metrics(run_dir)
    for r in records:
        model_keys = {k for k in r if "speedup" in k or "projected" in k}
        assert model_keys == {"projected/step_s", "projected/samples_per_s",
                              "projected/speedup_vs_dense", "projected/comm_s"}
        # the measured throughput is what one process did; the projected one is per the
        # target cluster's 16 workers at the cost model's step time
        batch = trainer.task.hparams["batch_size"]
        assert r["samples_per_s"] == pytest.approx(2 * batch / r["step_s"])
        assert r["projected/samples_per_s"] == pytest.approx(16 * batch / r["projected/step_s"])
    import io

    from repro.compare import compare

    out = tmp_path / "cmp"
    compare([run_dir], out=str(out), x="step", stream=io.StringIO())
    table = (out / "table.csv").read_text()
    assert "projected samples/s" in table.splitlines()[0]
    assert "projected" in (out / "index.html").read_text()


# -- sweeps, W&B offline, compare ----------------------------------------------------------------
@pytest.mark.heavy  # four trainings in a `repro train -m` process with W&B offline: 11-13 s
def test_multirun_sweep_offline_skips_finished_runs_and_compares(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "repro.cli", "train", "-m", "compressor=topk,dgc",
           "compressor.ratio=0.01,0.001", "task=cifar10_mixer", "steps=3", "eval_every=2",
           "eval_batches=1", "cluster=simulated", "cluster.workers=2", "logger.progress=false",
           f"runs_root={tmp_path}", "group=sweep"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    runs = sorted(os.path.join(tmp_path, "sweep", d) for d in os.listdir(tmp_path / "sweep"))
    assert len(runs) == 4 and first.stdout.count("[running]") == 4
    for run_dir in runs:
        assert os.path.exists(os.path.join(run_dir, "DONE"))
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
        offline = [d for _, dirs, _ in os.walk(os.path.join(run_dir, "wandb")) for d in dirs
                   if d.startswith("offline-run-")]
        assert len(offline) == 1, f"expected one W&B offline run under {run_dir}: {offline}"
    stamps = {r: os.path.getmtime(os.path.join(r, "metrics.jsonl")) for r in runs}

    # The same sweep again (in this process: only planning happens) skips all four.
    lines: list[str] = []
    again = launch.train(cmd[cmd.index("train") + 2:], multirun=True, out=lines.append)
    assert sorted(again) == runs
    assert len(lines) == 4 and all(line.startswith("[done, skipped]") for line in lines)
    assert stamps == {r: os.path.getmtime(os.path.join(r, "metrics.jsonl")) for r in runs}

    import io

    from repro.compare import compare

    out = tmp_path / "cmp"
    shown = io.StringIO()
    compare(runs, out=str(out), x="step", stream=shown)
    rows = (out / "table.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4
    for run_dir in runs:
        assert os.path.basename(run_dir) in shown.getvalue()
    assert (out / "index.html").exists() and list(out.glob("*.png"))


# -- bad configs fail before any worker starts ------------------------------------------------
BAD = [
    (["compressor=nosuch"], ValueError, ["compressor=nosuch", "topk", "dgc", "thc"]),
    (["compressor=topk", "compressor.ratoi=0.1"], ValueError,
     ["compressor.ratoi", "ratio", "feedback", "granularity"]),
    (["stepz=3"], ValueError, ["stepz", "steps", "eval_every"]),
    (["compressor=dgc", "compressor.params.sample_ration=0.1"], ValueError,
     ["compressor.params.sample_ration", "sample_ratio", "max_overselect"]),
    (["compressor=thc", "cluster.workers=16"], ValueError,
     ["cluster.workers=16", "overflows", "uint8", "sum_dtype"]),
    (["compressor=topk", "compressor.ratio=1.5"], ValueError, ["compressor.ratio", "(0, 1]"]),
    (["compressor=topk", "compressor.ratio=0"], ValueError, ["compressor.ratio", "(0, 1]"]),
    (["task.data=canonical"], ValueError, ["data_root", "standin"]),
    (["task.data=canonical", "task.data_root=/nonexistent/cifar"], FileNotFoundError,
     ["task.data_root", "/nonexistent/cifar"]),
    (["task=nosuch"], ValueError, ["task=nosuch", "cifar10_resnet20", "movielens_ncf"]),
    (["cluster.mode=mpi"], ValueError, ["cluster.mode", "spawn", "torchrun", "simulated"]),
    (["compressor=none", "compressor.ratio=0.1"], ValueError, ["compressor.ratio", "none"]),
    (["compressor=topk", "comm_hook=false"], ValueError, ["comm_hook", "compressor=none"]),
    (["cluster=simulated", "compressor.granularity=bucket"], ValueError,
     ["compressor.granularity", "layer"]),
]


@pytest.mark.parametrize("overrides,error,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_fails_before_any_worker_starts(tmp_path, monkeypatch, overrides, error, words):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a bad config")

    monkeypatch.setattr(runner, "spawn", no_worker)
    monkeypatch.setattr(runner, "torchrun", no_worker)
    import repro.train

    monkeypatch.setattr(repro.train, "run_simulated", no_worker)
    with pytest.raises(error) as info:
        launch.train([*overrides, f"runs_root={tmp_path}"], out=lambda s: None)
    message = str(info.value.args[0] if info.value.args else info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    assert "\n" not in message
    assert not os.listdir(tmp_path), "a run directory was created for a bad config"


def test_bad_config_on_the_command_line_is_one_clear_line(tmp_path, capsys):
    from repro.cli import main

    assert main(["train", "compressor=topk", "compressor.ratoi=0.1", f"runs_root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("repro train: error: compressor.ratoi") and len(err.splitlines()) == 1


# -- generated configs ---------------------------------------------------------------------------
def test_configs_check_passes_and_detects_drift(tmp_path, monkeypatch, capsys):
    from repro.cli import main

    assert main(["configs", "--check"]) == 0, capsys.readouterr().out
    conf = tmp_path / "conf"
    shutil.copytree(config_mod.conf_dir(), conf)
    (conf / "compressor" / "topk.yaml").write_text("name: topk\nratio: 0.5\n")
    (conf / "task" / "retired_task.yaml").write_text("name: retired_task\n")
    (conf / "compressor" / "dgc.yaml").unlink()
    monkeypatch.setenv("GRADCOMP_CONF", str(conf))
    capsys.readouterr()
    assert main(["configs", "--check"]) == 1
    out = capsys.readouterr().out
    assert "stale" in out and "topk.yaml" in out
    assert "orphan" in out and "retired_task.yaml" in out
    assert "missing" in out and "dgc.yaml" in out
    assert main(["configs", "--write"]) == 0
    (conf / "task" / "retired_task.yaml").unlink()
    assert main(["configs", "--check"]) == 0


def test_simulated_step_metrics_are_one_workers_step():
    """Simulated workers run one after the other in one process: compute_s and the
    projected step must be ONE worker's (the step's remaining time over n), not n
    workers' passes in a row, or every projected throughput of a simulated run is n×
    too pessimistic."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from compressors import Pattern
    from repro.compression import StepRecord
    from repro.costmodel import Network
    from repro.train import Trainer

    def rec(seconds):
        return StepRecord("w", 1000, True, 10, 10, 10, 80, seconds / 2, seconds / 2)

    class Comp:
        def residuals(self):
            return []

    n = 4
    fake = SimpleNamespace(
        optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]), compressions=[Comp()] * n,
        cfg=OmegaConf.create({"compressor": {"ratio": None}}), step=0,
        compressor=SimpleNamespace(pattern=Pattern.SPARSE_ALLGATHER),
        network=Network(workers=16, bandwidth_gbps=25.0, latency_us=5.0), world_size=n,
    )
    # Each of the 4 workers: 0.5 s forward/backward and 0.1 s compression; no real comm.
    m = Trainer.step_metrics(fake, 1.0, 4 * 0.6, 0.0, 4 * 32, [rec(0.1)], 4 * 0.1)
    assert m["compute_s"] == pytest.approx(0.5)
    assert m["compress_s"] == pytest.approx(0.1)
    assert m["projected/step_s"] == pytest.approx(0.6 + m["projected/comm_s"])
    assert m["projected/samples_per_s"] == pytest.approx(32 * 16 / m["projected/step_s"])
    fake.compressions, fake.world_size = [Comp()], 1  # a real rank: nothing is divided
    m = Trainer.step_metrics(fake, 1.0, 0.6, 0.0, 32, [rec(0.1)], 0.1)
    assert m["compute_s"] == pytest.approx(0.5)
