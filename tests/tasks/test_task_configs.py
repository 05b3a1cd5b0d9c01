"""Task hyper-parameters come from conf/task/<name>.yaml (a `paper:` and a `smoke:` block):
the values every task trains with, the command-line overrides (task.hparams.KEY=VALUE),
their checks before any worker starts, the Python API without Hydra, and
`repro configs --check` on the task files.

tests/tasks/task_hparams.json records every task's hyper-parameters per size with their Python
types; the YAML files must give exactly those.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import tasks
from repro import config as config_mod
from repro import launch, runner

RECORDED = json.loads((Path(__file__).parent / "task_hparams.json").read_text())["tasks"]
SIZES = ("smoke", "paper")
# Everything a run needs besides the task: one simulated worker, no logging, no compression.
RUN = ["cluster=simulated", "cluster.workers=1", "compressor=none", "steps=1", "eval_every=0",
       "eval_batches=1", "logger=local", "logger.progress=false"]


def _as_recorded(value):
    """A hyper-parameter as JSON holds it: sequences as lists."""
    if isinstance(value, (tuple, list)):
        return [_as_recorded(v) for v in value]
    return value


def _differences(actual: dict, expected: dict) -> list[str]:
    """Keys whose value or Python type differs (True == 1 and 5 == 5.0 do not pass)."""
    out = [f"missing {k}" for k in expected if k not in actual]
    out += [f"extra {k}={actual[k]!r}" for k in actual if k not in expected]
    for k, want in expected.items():
        if k not in actual:
            continue
        got = _as_recorded(actual[k])
        types_got = [type(v) for v in got] if isinstance(got, list) else type(got)
        types_want = [type(v) for v in want] if isinstance(want, list) else type(want)
        if got != want or types_got != types_want:
            out.append(f"{k}: {got!r} ({types_got}) != recorded {want!r} ({types_want})")
    if any(isinstance(v, list) for v in actual.values()):
        out.append("sequences must be tuples (immutable), as the tasks give them")
    return out


def _prepare(root, *overrides: str) -> str:
    """Compose + validate one run and write its config.yaml, as `repro train` does."""
    planned = launch.plan([*RUN, *overrides, f"runs_root={root}"], multirun=False)[0]
    os.makedirs(planned.run_dir, exist_ok=True)
    config_mod.save(planned.cfg, os.path.join(planned.run_dir, "config.yaml"))
    return planned.run_dir


def _no_workers(monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a bad config")

    import repro.train

    monkeypatch.setattr(runner, "spawn", no_worker)
    monkeypatch.setattr(runner, "torchrun", no_worker)
    monkeypatch.setattr(repro.train, "run_simulated", no_worker)


def _refusal(tmp_path, monkeypatch, overrides) -> str:
    """The one-line message of a config refused before any worker starts."""
    _no_workers(monkeypatch)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        launch.train([*RUN, *overrides, f"runs_root={tmp_path}"], out=lambda s: None)
    assert not os.listdir(tmp_path), "a run directory was created for a bad config"
    message = str(info.value)
    assert "\n" not in message
    return message


def _conf_copy(tmp_path, monkeypatch) -> Path:
    conf = tmp_path / "conf"
    shutil.copytree(config_mod.conf_dir(), conf)
    monkeypatch.setenv("GRADCOMP_CONF", str(conf))
    return conf


# -- the values ----------------------------------------------------------------------------------
def test_every_registered_task_has_recorded_values():
    assert sorted(RECORDED) == tasks.list_tasks()
    assert all(set(RECORDED[name]) == set(SIZES) for name in RECORDED)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(RECORDED))
def test_trainer_hparams_are_the_recorded_values(tmp_path, name, size):
    """Composed by Hydra, written to the run's config.yaml and read back, built as the
    trainer builds its task: the recorded values, key for key and type for type."""
    run_dir = _prepare(tmp_path, f"task={name}", f"task.size={size}")
    cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
    problems = _differences(config_mod.build_task(cfg).hparams, RECORDED[name][size])
    assert not problems, problems


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(RECORDED))
def test_python_hparams_are_the_recorded_values(name, size):
    """tasks.build_task, without Hydra, reads the same files."""
    problems = _differences(tasks.build_task(name, size=size).hparams, RECORDED[name][size])
    assert not problems, problems


def test_a_config_without_hparams_gets_the_task_file_values():
    """A config holding no task.hparams (the bare schema) trains with the file's values."""
    cfg = OmegaConf.merge(config_mod.schema(), {"task": {"name": "ptb_lstm", "size": "paper"}})
    assert not _differences(config_mod.build_task(cfg).hparams, RECORDED["ptb_lstm"]["paper"])


def test_python_build_reads_the_yaml_file(tmp_path, monkeypatch):
    conf = _conf_copy(tmp_path, monkeypatch)
    path = conf / "task" / "cifar10_resnet20.yaml"
    node = OmegaConf.load(path)
    node.hparams.paper.lr = 0.25
    node.hparams.smoke.batch_size = 7
    OmegaConf.save(node, path)
    assert tasks.build_task("cifar10_resnet20", size="paper").hparams["lr"] == 0.25
    assert tasks.build_task("cifar10_resnet20", size="smoke").hparams["batch_size"] == 7
    cfg = launch.compose(["task=cifar10_resnet20", "task.size=paper"])
    assert config_mod.build_task(cfg).hparams["lr"] == 0.25


def test_a_task_file_edited_between_reads_is_read_again(tmp_path, monkeypatch):
    """Parsed files are kept per process: an edit of the same length, right after a read,
    is still seen, and what a caller does to the returned values reaches no later read."""
    from tasks.hyperparams import read_task_file

    conf = _conf_copy(tmp_path, monkeypatch)
    path = conf / "task" / "cifar10_resnet20.yaml"
    first = read_task_file("cifar10_resnet20")
    lr = first["hparams"]["paper"]["lr"]
    first["hparams"]["paper"]["lr"] = -1.0
    assert read_task_file("cifar10_resnet20")["hparams"]["paper"]["lr"] == lr
    text = path.read_text()
    edited = text.replace(f"lr: {lr}", f"lr: {lr}".replace("0.1", "0.3"), 1)
    assert edited != text and len(edited) == len(text)
    path.write_text(edited)
    assert read_task_file("cifar10_resnet20")["hparams"]["paper"]["lr"] == 0.3
    assert tasks.build_task("cifar10_resnet20", size="paper").hparams["lr"] == 0.3


def test_schema_is_a_fresh_config_each_time():
    a = config_mod.schema()
    a.task.name = "changed"
    assert config_mod.schema().task.name != "changed"
    with pytest.raises(Exception, match="nonexistent"):
        config_mod.schema().nonexistent = 1  # still struct: an unknown key is an error


# -- command-line overrides ----------------------------------------------------------------------
def test_momentum_override_reaches_the_optimizer(tmp_path):
    """task.hparams.momentum=0 on the Nesterov task: an SGD with momentum 0. Nesterov's step
    with momentum 0 is plain SGD (torch refuses the combination), so nesterov is turned
    off, with a warning that says so."""
    from repro.train import SimulatedTrainer

    turned_off = "nesterov=true with momentum=0 is plain SGD"
    with pytest.warns(UserWarning, match=turned_off):  # in validation, before launch
        run_dir = _prepare(tmp_path, "task=cifar10_resnet18", "task.hparams.momentum=0",
                           "task.hparams.epochs=3")
    with pytest.warns(UserWarning, match=turned_off):  # and where the worker builds it
        trainer = SimulatedTrainer(run_dir)
    trainer.setup_optim()
    assert type(trainer.optimizer) is torch.optim.SGD
    for group in trainer.optimizer.param_groups:
        assert group["momentum"] == 0 and group["nesterov"] is False
    assert trainer.task.hparams["epochs"] == 3
    assert trainer.task.hparams["momentum"] == 0 and trainer.task.hparams["nesterov"] is False
    # the other values stay the task's
    assert trainer.task.hparams["lr"] == RECORDED["cifar10_resnet18"]["smoke"]["lr"]


def test_overrides_reach_optimizer_and_schedule(tmp_path):
    from repro.train import SimulatedTrainer

    run_dir = _prepare(tmp_path, "task=cifar10_resnet18", "task.size=paper",
                       "task.hparams.momentum=0.5", "task.hparams.lr=0.4",
                       "task.hparams.warmup_epochs=0", "task.hparams.lr_milestones=[1]",
                       "task.hparams.batch_size=8")
    trainer = SimulatedTrainer(run_dir)
    trainer.setup_optim()
    group = trainer.optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["lr"]) == (0.5, True, 0.4)
    steps = trainer.task.steps_per_epoch(1)
    assert trainer.task.hparams["batch_size"] == 8
    assert trainer.task.hparams["lr_milestones"] == (1,)
    for _ in range(steps):
        trainer.optimizer.step()
        trainer.scheduler.step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.04)  # ×0.1 at epoch 1


def test_size_block_override_changes_that_size_only():
    smoke = launch.compose(["task=cifar10_resnet20", "task.hparams.paper.lr=0.3"])
    config_mod.validate(smoke)
    assert config_mod.build_task(smoke).hparams["lr"] == RECORDED["cifar10_resnet20"]["smoke"]["lr"]
    paper = launch.compose(["task=cifar10_resnet20", "task.size=paper", "task.hparams.paper.lr=0.3"])
    assert config_mod.build_task(paper).hparams["lr"] == 0.3


def test_short_aliases_set_the_hparams():
    cfg = launch.compose(["task=ptb_lstm", "task.lr=3.0", "task.batch_size=4", "task.clip=0.5"])
    config_mod.validate(cfg)
    h = config_mod.build_task(cfg).hparams
    assert (h["lr"], h["batch_size"], h["clip"]) == (3.0, 4, 0.5)


def test_alias_and_hparam_disagreeing_is_refused(tmp_path, monkeypatch):
    message = _refusal(tmp_path, monkeypatch, ["task.lr=0.3", "task.hparams.lr=0.2"])
    assert "task.lr" in message and "task.hparams.lr" in message


# -- refusals ------------------------------------------------------------------------------------
def test_misspelled_hparam_is_refused_naming_the_allowed_keys(tmp_path, monkeypatch):
    message = _refusal(tmp_path, monkeypatch, ["task=cifar10_resnet18", "task.hparams.momentun=0"])
    assert message.startswith("task=cifar10_resnet18: task.hparams.momentun ")
    allowed = message.split("allowed:", 1)[1]
    for key in ("momentum", "nesterov", "lr", "batch_size", "lr_schedule", "weight_decay"):
        assert key in allowed, message
    assert "bptt" not in allowed, "an LSTM key is not a ResNet's"


def test_misspelled_key_in_a_size_block_is_refused(tmp_path, monkeypatch):
    message = _refusal(tmp_path, monkeypatch, ["task=ptb_lstm", "task.hparams.paper.bptz=30"])
    assert "task.hparams.paper.bptz" in message and "bptt" in message


BAD_VALUES = [
    (["task.hparams.lr=-0.1"], ["task.hparams.lr=-0.1", "> 0"]),
    (["task.hparams.lr=0"], ["task.hparams.lr=0", "> 0"]),
    (["task.hparams.momentum=1"], ["task.hparams.momentum=1", "[0, 1)"]),
    (["task.hparams.momentum=-0.5"], ["task.hparams.momentum=-0.5", "[0, 1)"]),
    (["task.hparams.optimizer=rmsprop"], ["task.hparams.optimizer='rmsprop'", "sgd", "adam",
                                          "adamw"]),
    (["task.hparams.lr_schedule=cosine"], ["task.hparams.lr_schedule='cosine'", "constant",
                                           "step", "linear"]),
    (["task.hparams.batch_size=0"], ["task.hparams.batch_size=0", "integer >= 1"]),
    (["task.hparams.batch_size=2.5"], ["task.hparams.batch_size=2.5", "integer >= 1"]),
    (["task.hparams.weight_decay=-1e-4"], ["task.hparams.weight_decay", ">= 0"]),
    (["task.hparams.clip=0"], ["task.hparams.clip=0", "null or a number > 0"]),
    (["task.hparams.nesterov=maybe"], ["task.hparams.nesterov='maybe'", "true or false"]),
    (["task.hparams.lr_milestones=[10,-1]"], ["task.hparams.lr_milestones", ">= 0"]),
    (["task=movielens_ncf", "task.hparams.betas=[0.9,1.0]"], ["task.hparams.betas", "[0, 1)"]),
    (["task=ptb_lstm", "task.hparams.dropout=1"], ["task.hparams.dropout=1", "[0, 1)"]),
    (["task=ptb_lstm", "task.size=paper", "task.hparams.paper.lr=-2"],
     ["task.hparams.paper.lr=-2", "> 0"]),
    (["task.lr=-0.1"], ["task.lr=-0.1", "> 0"]),
    (["task.batch_size=0"], ["task.batch_size=0", "integer >= 1"]),
    (["task.hparams=5"], ["task.hparams", "mapping"]),
]


@pytest.mark.parametrize("overrides,words", BAD_VALUES, ids=[" ".join(b[0]) for b in BAD_VALUES])
def test_bad_hparam_value_is_refused_naming_key_and_range(tmp_path, monkeypatch, overrides,
                                                          words):
    message = _refusal(tmp_path, monkeypatch, overrides)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_python_overrides_are_checked_too():
    t = tasks.build_task("cifar10_resnet18", size="smoke", hparams={"lr": 0.5, "epochs": 2})
    assert (t.hparams["lr"], t.hparams["epochs"]) == (0.5, 2)
    with pytest.raises(ValueError, match=r"hparams\.momentun .*allowed: .*momentum"):
        tasks.build_task("cifar10_resnet18", hparams={"momentun": 0.0})
    with pytest.raises(ValueError, match=r"hparams\.momentum=1\.5: must be a number in \[0, 1\)"):
        tasks.build_task("cifar10_resnet18", hparams={"momentum": 1.5})


def test_task_without_a_yaml_file_says_where_its_values_belong(tmp_path, monkeypatch):
    conf = _conf_copy(tmp_path, monkeypatch)
    (conf / "task" / "wiki10_xml.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=r"wiki10_xml\.yaml"):
        tasks.build_task("wiki10_xml")


# -- repro configs --check -----------------------------------------------------------------------
def test_configs_check_passes_on_the_tree(capsys):
    from repro.cli import main

    assert main(["configs", "--check"]) == 0, capsys.readouterr().out


def test_configs_check_reports_each_bad_task_file(tmp_path, monkeypatch, capsys):
    from repro.cli import main

    conf = _conf_copy(tmp_path, monkeypatch)
    task_dir = conf / "task"

    def edit(name, change):
        node = OmegaConf.load(task_dir / f"{name}.yaml")
        change(node)
        OmegaConf.save(node, task_dir / f"{name}.yaml")

    def misspell(node):
        node.hparams.paper.bptz = node.hparams.paper.pop("bptt")

    edit("ptb_lstm", misspell)
    edit("cifar10_resnet20", lambda n: OmegaConf.update(n, "hparams.paper.momentum", 1.5))
    edit("cifar10_vgg16", lambda n: OmegaConf.update(n, "name", "cifar10_vgg61"))
    edit("wikitext2_lstm", lambda n: n.hparams.pop("smoke"))
    (task_dir / "wiki10_xml.yaml").unlink()
    (task_dir / "retired_task.yaml").write_text("name: retired_task\n")
    capsys.readouterr()
    assert main(["configs", "--check"]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if "task/" in line]
    assert any("ptb_lstm.yaml" in p and "hparams.paper.bptz" in p and "bptt" in p
               for p in problems), out
    assert any("ptb_lstm.yaml" in p and "lacks" in p and "bptt" in p for p in problems), out
    assert any("cifar10_resnet20.yaml" in p and "hparams.paper.momentum=1.5" in p
               and "[0, 1)" in p for p in problems), out
    assert any("cifar10_vgg16.yaml" in p and "cifar10_vgg61" in p for p in problems), out
    assert any("wikitext2_lstm.yaml" in p and "smoke" in p for p in problems), out
    assert any(p.startswith("missing") and "wiki10_xml.yaml" in p for p in problems), out
    assert any(p.startswith("orphan") and "retired_task.yaml" in p for p in problems), out
    untouched = ("cifar10_resnet18.yaml", "movielens_ncf.yaml", "bert_squad.yaml")
    assert not any(name in p for p in problems for name in untouched), out
