"""What keys a run (repro.config): its folder name and the config hash its checkpoints carry,
pinned on a fixed config (a change to either would strand every run folder and checkpoint
already written), and the result-neutral keys that neither the hash nor the comparison
with a run folder's config.yaml sees."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from repro import checkpoints, launch
from repro import config as config_mod

RUN = {
    "compressor": {"name": "topk", "ratio": 0.01, "params": {"b": [1, 2], "a": None}},
    "task": {"name": "cifar10_resnet20", "size": "smoke", "hparams": {"lr": 0.3}},
    "cluster": {"workers": 4, "mode": "spawn", "network": "emulated", "bandwidth_gbps": 2.5,
                "latency_ms": 1.0},
    "logger": {"wandb": True, "tags": ["x"], "log_every": 1},
    "seed": 3, "steps": 100, "comm_hook": True, "name": None, "run_dir": "/somewhere",
    "runs_root": "runs", "checkpoint_every": 5,
}
RUN_HASH = "a890be713106ad9b36837077ac8fd70638b5f4f3bd4a6f7a12b3d33369b3a177"


def _with(**dotted) -> dict:
    run = copy.deepcopy(RUN)
    for key, value in dotted.items():
        *parents, leaf = key.split("__")
        node = run
        for p in parents:
            node = node[p]
        node[leaf] = value
    return run


def test_the_folder_name_and_the_hash_are_those_runs_were_written_with():
    cfg = OmegaConf.create(RUN)
    assert config_mod.run_name(cfg, "abc123") == (
        "topk-r0.01-w4-spawn-emu2.5g1ms-cifar10_resnet20-smoke-s3-abc123")
    assert config_mod.config_hash(cfg) == RUN_HASH
    assert checkpoints.config_hash is config_mod.config_hash  # what the trainer writes


@pytest.mark.parametrize("change", [
    {"run_dir": "/elsewhere"}, {"runs_root": "other"}, {"logger__tags": ["y", "z"]},
    {"logger__wandb": False}, {"checkpoint_every": 50}, {"steps": 400},
])
def test_keys_that_cannot_change_results_leave_the_hash_alone(change):
    assert config_mod.config_hash(OmegaConf.create(_with(**change))) == RUN_HASH


@pytest.mark.parametrize("change", [
    {"task__hparams": {"lr": 0.1}}, {"logger__log_every": 2}, {"seed": 4},
    {"compressor__params": {"b": [2, 1], "a": None}},
])
def test_every_other_key_changes_the_hash(change):
    assert config_mod.config_hash(OmegaConf.create(_with(**change))) != RUN_HASH


def test_without_keys_drops_a_key_with_what_lies_under_it_only():
    node = {"logger": {"tags": ["a"], "tagsx": 1, "group": {"x": 1}}, "run_dir": "d", "seed": 0}
    kept = config_mod.without_keys(node, ("logger.tags", "logger.group", "run_dir"))
    assert kept == {"logger": {"tagsx": 1}, "seed": 0}
    assert config_mod.within("logger.tags.0", ["logger.tags"])
    assert not config_mod.within("logger.tagsx", ["logger.tags"])
    assert config_mod.flatten_config(node) == {"logger.tags": ["a"], "logger.tagsx": 1,
                                               "logger.group.x": 1, "run_dir": "d", "seed": 0}


def test_a_run_folder_compares_configs_up_to_the_same_neutral_keys():
    saved = _with(logger__tags=["other"], runs_root="elsewhere", checkpoint_every=1)
    assert launch.config_changes(OmegaConf.create(RUN), None, saved=saved) == []
    changes = launch.config_changes(OmegaConf.create(RUN), None, saved=_with(seed=9))
    assert [(c.key, c.old, c.new) for c in changes] == [("seed", 9, 3)]
