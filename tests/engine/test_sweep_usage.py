"""Sweeps as their users run them: a ratio applied only where it means something, one folder
per distinct config, more steps extending a finished run, a failing run recorded while the
sweep goes on, progress and an end table, every override validated before anything is
made (`+key`, `~key`, `glob()`, Hydra's own flags), what made each run, missing extras and
an offline Hub in one line, SLURM sweeps planned from a machine without a GPU.

Trainings are the smoke ResNet-20 on one simulated worker for two or three steps."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
import yaml

from repro import config as config_mod
from repro import failures, launch
from repro.cli import main
from repro.logging import read_metrics, read_summary, run_summary_lines
from repro.runs import fmt

COMMON = ["cluster=simulated", "cluster.workers=1", "task=cifar10_resnet20", "task.size=smoke",
          "eval_every=0", "eval_batches=1", "logger=local", "logger.progress=false"]


def status_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("[")]


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(b, n), root)
                  for b, _, names in os.walk(root) for n in names)


def no_training(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(launch, "launch", refuse)


# -- 1. a ratio where it means something ----------------------------------------------------------
@pytest.mark.slow  # over a second: validates several runs
def test_a_ratio_applies_only_to_the_compressors_that_take_one(tmp_path):
    notes: list[str] = []
    planned = launch.plan(["compressor=none,topk,thc", "compressor.ratio=0.01,0.001",
                           "cluster=simulated", "cluster.workers=2", f"runs_root={tmp_path}"],
                          multirun=True, notes=notes)
    got = [(p.cfg.compressor.name, p.cfg.compressor.ratio) for p in planned]
    # none and thc take no ratio: each runs once, without one; topk at both ratios
    assert got == [("none", None), ("topk", 0.01), ("topk", 0.001), ("thc", None)]
    names = [os.path.basename(p.run_dir) for p in planned]
    assert names[0].startswith("none-w2-") and names[3].startswith("thc-w2-")
    assert names[1].startswith("topk-r0.01-w2-") and names[2].startswith("topk-r0.001-w2-")
    assert len([n for n in notes if "ratio" in n]) == 1  # said once, for the whole sweep
    assert "none, thc take no ratio" in notes[0]
    assert any("2 run(s) of the sweep came out the same" in n for n in notes)
    assert not os.listdir(tmp_path)
    # A single run is still told that its compressor takes no ratio.
    with pytest.raises(ValueError, match="'none' takes no ratio"):
        launch.plan(["compressor=none", "compressor.ratio=0.01", f"runs_root={tmp_path}"],
                    multirun=False)


# -- 2. one folder per config; more steps extend ----------------------------------------------------
@pytest.mark.slow  # over a second: validates several runs
def test_each_config_gets_its_own_folder(tmp_path):
    sweep_args = ["task.hparams.lr=0.1,0.05", *COMMON, f"runs_root={tmp_path}"]
    first, second = launch.plan(sweep_args, multirun=True)
    assert first.run_dir != second.run_dir
    readable = "none-w1-simulated-cifar10_resnet20-smoke-s0-"
    assert os.path.basename(first.run_dir).startswith(readable)
    assert re.fullmatch(readable + "[0-9a-f]{6}", os.path.basename(second.run_dir))
    assert [p.run_dir for p in launch.plan(sweep_args, multirun=True)] == [first.run_dir,
                                                                           second.run_dir]
    # Settings that only say where a run lives or how it is shown key no folder.
    (same,) = launch.plan(["task.hparams.lr=0.1", *COMMON, f"runs_root={tmp_path}",
                           "logger.wandb=true", "checkpoint_every=5", "steps=7"], multirun=False)
    assert same.run_dir == first.run_dir
    # A fixed name gives a sweep's runs one folder: refused, naming both runs and the key.
    with pytest.raises(ValueError) as info:
        launch.plan([*sweep_args, "name=mine"], multirun=True)
    message = str(info.value)
    assert "task.hparams.lr=0.1" in message and "task.hparams.lr=0.05" in message
    assert "task.hparams.lr: 0.1 -> 0.05" in message and "name=" in message
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_more_steps_extend_a_finished_run_from_its_last_checkpoint(tmp_path):
    args = ["compressor=topk", *COMMON, f"runs_root={tmp_path}"]
    (run_dir,) = launch.train([*args, "steps=2"], out=lambda s: None)
    assert os.path.exists(os.path.join(run_dir, "DONE"))
    lines: list[str] = []
    assert launch.train([*args, "steps=3"], out=lines.append) == [run_dir]
    assert status_lines(lines) == [f"[extending 2 -> 3 steps, from step 2] {run_dir}"]
    assert read_summary(run_dir)["resumed_from_step"] == 2
    assert read_summary(run_dir)["steps"] == 3
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert yaml.safe_load(f)["steps"] == 3
    with pytest.raises(ValueError, match="steps: 3 -> 2"):  # fewer steps: refused
        launch.train([*args, "steps=2"], out=lambda s: None)


# -- 3, 4, 6, 10: a sweep with a diverging run ------------------------------------------------------
SWEEP = ["compressor=topk", "compressor.ratio=0.001", "task.hparams.lr=1e30,0.1", "steps=2",
         *COMMON]


@pytest.fixture(scope="module")
def diverging_sweep(tmp_path_factory):
    """lr=1e30 diverges at once, lr=0.1 trains: (runs_root, lines, error, run dirs)."""
    root = tmp_path_factory.mktemp("sweep")
    lines: list[str] = []
    with pytest.raises(launch.RunsFailed) as info:
        launch.train([*SWEEP, f"runs_root={root}"], multirun=True, out=lines.append,
                     keep_going=True, retry_failed=False, progress=True)
    bad, good = launch.plan([*SWEEP, f"runs_root={root}"], multirun=True)
    return root, lines, info.value, bad.run_dir, good.run_dir


@pytest.mark.slow
def test_a_failing_run_is_recorded_and_the_sweep_goes_on(diverging_sweep, monkeypatch):
    root, lines, error, bad, good = diverging_sweep
    assert os.path.exists(os.path.join(good, "DONE"))  # the run after the failure ran
    record = failures.read_failure(bad)
    assert record["status"] == "diverged" and "NaN" in record["reason"]
    assert not os.path.exists(os.path.join(bad, "DONE"))
    assert error.failed == [(bad, record)] and "1 of 2 runs failed" in str(error)
    assert any(line.startswith("  diverged: NonFiniteGradient") for line in lines)
    assert f"  {bad}: diverged: NonFiniteGradient: step" in "\n".join(lines)
    # The same sweep again: the diverged run is skipped, saying why; nothing trains.
    with monkeypatch.context() as m:
        no_training(m)
        again: list[str] = []
        with pytest.raises(launch.RunsFailed):
            launch.train([*SWEEP, f"runs_root={root}"], multirun=True, out=again.append,
                         keep_going=True, retry_failed=False, progress=True)
    assert status_lines(again)[0].startswith(f"[diverged before, skipped] {bad}: ")
    assert status_lines(again)[1] == f"[done, skipped] {good}"
    # --retry-failed runs it again (it diverges again: recorded again).
    retried: list[str] = []
    with pytest.raises(launch.RunsFailed):
        launch.train([*SWEEP, f"runs_root={root}"], multirun=True, out=retried.append,
                     keep_going=True, retry_failed=True, progress=True)
    assert status_lines(retried)[0] == f"[running] {bad}"
    assert failures.read_failure(bad)["status"] == "diverged"


@pytest.mark.slow
def test_a_sweep_shows_its_progress_and_ends_with_a_table(diverging_sweep):
    _, lines, _, bad, good = diverging_sweep
    progress = [line for line in lines if line.startswith("run ")]
    assert progress[0].startswith("run 1/2: 2 run(s) to train")
    assert re.match(r"run 2/2: about \d+ s left for 1 run\(s\) \(\d+ s elapsed\)", progress[1])
    at = lines.index(next(line for line in lines if line.startswith("sweep: 2 runs in ")))
    header, _, first, second = lines[at + 1:at + 5]
    assert header.split() == ["run", "status", "final", "loss", "final", "metric", "samples/s"]
    summary = read_summary(good)
    assert first.split()[:2] == [os.path.basename(bad), "diverged"]
    assert second.split() == [os.path.basename(good), "done", fmt(summary["final_loss"]),
                              "accuracy", fmt(summary["eval/accuracy"]),
                              fmt(summary["samples_per_s"], ".1f")]


@pytest.mark.slow
def test_each_run_records_what_made_it(diverging_sweep):
    root, _, _, bad, good = diverging_sweep
    assert os.path.commonpath([root, good]) == str(root)
    with open(os.path.join(good, "provenance.json")) as f:
        (record,) = json.load(f)["launches"]
    assert record["overrides"]["command"] == [*SWEEP, f"runs_root={root}"]
    assert "task.hparams.lr=0.1" in record["overrides"]["run"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["gradcomp-repro"] and record["versions"]["hydra-core"]
    assert "wandb" not in record["versions"]  # logger=local: not in use
    clone = os.path.exists(os.path.join(os.path.dirname(config_mod.conf_dir()), ".git"))
    if clone:
        assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"])
        assert isinstance(record["git"]["dirty"], bool)
    with open(os.path.join(bad, "provenance.json")) as f:  # a failed run records it too
        assert json.load(f)["launches"]


@pytest.mark.slow
def test_summary_holds_what_the_summary_line_prints(diverging_sweep):
    _, _, _, _, good = diverging_sweep
    summary = read_summary(good)
    records = read_metrics(good)
    assert summary["final_loss"] == [r["loss"] for r in records][-1]
    for key in ("estimation_quality", "density", "target_ratio"):
        values = [r[key] for r in records if r.get(key) is not None]
        assert summary[key] == pytest.approx(sum(values) / len(values))
    assert summary["ratio"] == 0.001
    # The target the density is measured against: at least one element per tensor.
    import compressors.base
    import tasks

    model = tasks.build_task("cifar10_resnet20", size="smoke").build_model()
    sizes = [p.numel() for p in model.parameters()]
    effective = sum(compressors.base.target_k(n, 0.001) for n in sizes) / sum(sizes)
    assert summary["target_ratio"] == pytest.approx(effective, rel=1e-6) and effective > 0.0015
    done, speed, _ = run_summary_lines(good)
    assert f"loss {summary['final_loss']:.4g}" in done
    assert f"accuracy {summary['eval/accuracy']:.4g}" in done
    assert f"{summary['samples_per_s']:.1f} samples/s measured" in speed
    assert (f"density {summary['density']:.3g} vs target {summary['target_ratio']:.3g} "
            "(ratio 0.001, at least one element per tensor)") in speed


# -- 5. every override validated; Hydra's flags ------------------------------------------------------
@pytest.mark.slow  # over a second: validates several runs
def test_added_keys_are_validated_before_anything_is_made(tmp_path, capsys):
    for added, named in (("+foo=1", "foo is not a config key"),
                         ("+compressor.rato=0.1", "compressor.rato is not a config key"),
                         ("++task.hf.nme=x", "task.hf.nme is not a config key")):
        assert main(["train", "--dry-run", added, f"runs_root={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err and "allowed keys" in err
    assert main(["train", "+foo=1", f"runs_root={tmp_path}"]) == 2
    assert not os.listdir(tmp_path)


def test_tilde_glob_and_hydras_output_folders(tmp_path):
    (p,) = launch.plan(["seed=5", "~seed", "compressor=dgc", "~compressor.params.sample_ratio",
                        f"runs_root={tmp_path}"], multirun=False)
    assert p.cfg.seed == 0 and "sample_ratio" not in p.cfg.compressor.params
    combos = launch.expand_sweep(["compressor=glob(sidco_*)", "steps=3"])
    assert combos == [[f"compressor={c}", "steps=3"] for c in ("sidco_e", "sidco_gp", "sidco_p")]
    kept = launch.expand_sweep(["compressor=glob(*,exclude=[sidco_*,t*])"])
    assert kept == [[f"compressor={c}"] for c in launch.group_options("compressor")
                    if not c.startswith(("sidco_", "t"))]
    with pytest.raises(ValueError, match="steps is not one"):
        launch.expand_sweep(["steps=glob(1*)"])
    with pytest.raises(ValueError, match="set runs_root=DIR, group=NAME or name=NAME"):
        launch.plan(["hydra.run.dir=/elsewhere", f"runs_root={tmp_path}"], multirun=False)
    assert not os.listdir(tmp_path)


def test_hydra_flags_cfg_info_version_and_the_groups_in_help(capsys):
    assert main(["train", "--cfg", "job", "compressor=topk"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["compressor"]["name"] == "topk" and "hydra" not in job
    assert main(["train", "--cfg", "hydra", "compressor=topk"]) == 0
    hydra = yaml.safe_load(capsys.readouterr().out)["hydra"]
    assert hydra["runtime"]["choices"]["compressor"] == "topk"
    assert main(["train", "--info", "compressor=topk"]) == 0
    info = capsys.readouterr().out
    assert "config search path: " in info and "compressor=topk" in info
    with pytest.raises(SystemExit) as done:
        main(["train", "--version"])
    assert done.value.code == 0 and "gradcomp-repro " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for group in launch.CONFIG_GROUPS:
        assert f"{group}: {', '.join(launch.group_options(group))}" in text


# -- 7. extras and the offline Hub ----------------------------------------------------------------
def test_a_missing_extra_is_one_line_before_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    for args, module, extra in ((["task=bert_squad"], "transformers", "transformers"),
                                (["task=ptb_lstm", "task.data=hf"], "datasets", "hf")):
        assert main(["train", *args, f"runs_root={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"needs the `{module}` package" in err
        assert f'pip install -e ".[{extra}]"' in err
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_an_unreachable_hub_names_offline_mode_without_retrying(tmp_path, monkeypatch):
    import time

    datasets = pytest.importorskip("datasets")
    from tasks import hf_data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hf_data, "hub_unreachable",
                        lambda timeout_s=3.0: "huggingface.co:443: Name or service not known")
    started = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:
        hf_data.load("roberta_sst2", hf_data.HFSource("glue", "sst2"), None, ["train"],
                      ["sentence"])
    assert time.monotonic() - started < 10  # no retries against a missing network
    message = str(info.value)
    assert "the Hub is unreachable from here (huggingface.co:443" in message
    assert "set HF_HUB_OFFLINE=1" in message and "save_to_disk" in message


# -- 8. SLURM from a login node ------------------------------------------------------------------
SLURM = ["cluster=multi_node", "cluster.nodes=2", "cluster.workers=16",
         "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
         "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=8",
         "hydra.launcher.timeout_min=240"]


@pytest.mark.slow  # over a second: validates several runs
def test_a_slurm_sweep_is_planned_without_a_gpu_and_its_jobs_shown(tmp_path, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra is not installed")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check is for a login node without one")
    lines: list[str] = []
    dirs = launch.train(["compressor=topk,sidco_e", *SLURM, f"runs_root={tmp_path}"],
                        multirun=True, dry_run=True, out=lines.append)
    assert len(dirs) == 2 and not os.listdir(tmp_path)
    for d in dirs:
        at = lines.index(f"[would run] {d}")
        job = lines[at + 1:at + 20]
        assert job[0] == f"  job: runs repro.cluster.run_job({d!r}), submitted with:"
        for flag in ("--partition=gpu", "--nodes=2", "--gpus-per-node=8", "--time=240"):
            assert f"  #SBATCH {flag}" in job
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    with pytest.raises(ValueError, match="sbatch and srun are not on PATH") as info:
        launch.train(["compressor=topk", *SLURM, f"runs_root={tmp_path}"], multirun=True,
                     out=lines.append)
    assert "\n" not in str(info.value) and not os.listdir(tmp_path)


def test_a_job_checks_the_device_where_it_runs(tmp_path):
    from repro import cluster

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (p,) = launch.plan(["cluster.device=cuda", f"runs_root={tmp_path}"], multirun=False,
                       device=False)
    launch.prepare(p)
    with pytest.raises(ValueError, match="no CUDA device is present"):
        cluster.run_job(p.run_dir)


# -- 13. task sizes ---------------------------------------------------------------------------------
def test_a_paper_size_run_shorter_than_the_papers_schedule_is_warned(tmp_path):
    notes: list[str] = []
    launch.plan(["task.size=paper", "steps=100", f"runs_root={tmp_path}"], multirun=False,
                notes=notes)
    (note,) = notes
    assert "task.size=paper" in note and "140 epochs" in note
    assert "steps=100 ends inside its" in note and "warm-up" in note
    notes.clear()
    launch.plan([f"runs_root={tmp_path}"], multirun=False, notes=notes)
    assert notes == []  # smoke, the default: its own short schedule


def test_the_readme_states_the_task_sizes():
    with open(os.path.join(os.path.dirname(config_mod.conf_dir()), "README.md")) as f:
        text = " ".join(f.read().split())
    assert "`task.size` is `smoke` by default" in text
    assert "task.size=paper" in text and "warm-up" in text


# -- 14. the small ones ------------------------------------------------------------------------------
def readme() -> str:
    with open(os.path.join(os.path.dirname(config_mod.conf_dir()), "README.md")) as f:
        return f.read()


def calls_in_readme(name: str) -> list:
    """The calls of `name` in README's code (its indented blocks and inline `code`)."""
    import ast

    found = []
    text = readme()
    for start in (m.start() for m in re.finditer(re.escape(name) + r"\(", text)):
        depth, end = 0, start
        for end in range(start, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0 and text[end] == ")":
                break
        snippet = " ".join(text[start:end + 1].split())
        found.append(ast.parse(snippet, mode="eval").body)
    assert found, f"README has no call of {name}"
    return found


def test_the_readmes_snippets_call_the_api_as_it_is():
    import inspect

    import repro.hooks

    params = list(inspect.signature(repro.hooks.check_replicas).parameters)
    for call in calls_in_readme("check_replicas"):
        # each positional argument lands on the parameter its name says
        assert [a.id for a in call.args] == params[:len(call.args)]
        assert {k.arg for k in call.keywords} <= set(params)
    for call in calls_in_readme("pl.Trainer"):  # under torchrun Lightning needs both
        assert {"accelerator", "devices", "strategy"} <= {k.arg for k in call.keywords}


def test_figure_list_takes_a_pattern(capsys):
    assert main(["figure", "--list", "sidco-*"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]
            if not line.startswith(("(?)", "*", "the "))]
    assert rows and all(r.startswith("sidco-") for r in rows)
    assert main(["figure", "--list"]) == 0
    out = capsys.readouterr().out
    assert "thc-fig8" in out and "built-in upper estimates for" in out


def test_help_texts_state_each_default_once():
    import argparse

    from repro.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.help in (None, argparse.SUPPRESS):
                continue
            text = formatter._expand_help(action)
            assert "(default: None)" not in text and "(default: False)" not in text, (name, text)
            assert text.lower().count("default") <= 1, f"repro {name} {action.dest}: {text}"
    args = parser.parse_args(["hookbench", "--granularity", "model"])
    assert args.granularity == "model"
