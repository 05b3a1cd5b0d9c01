"""DRAGONN as its paper runs it: efficiency-aware selection profiled where the run runs
and at the world size its network term uses."""

from __future__ import annotations

import os

import pytest

from repro import config as config_mod
from repro import launch


def test_efficiency_aware_selection_profiles_on_the_run_device_at_the_target_size(tmp_path,
                                                                                    monkeypatch):
    import repro.train

    planned = launch.plan(["compressor=dragonn", "compressor.ratio=0.01",
                           "compressor.efficiency_aware=true", "task=cifar10_mixer",
                           "cluster=simulated", "cluster.workers=2",
                           "cluster.target_workers=16", f"runs_root={tmp_path}"], multirun=False)[0]
    os.makedirs(planned.run_dir)
    config_mod.save(planned.cfg, os.path.join(planned.run_dir, "config.yaml"))
    calls = []
    real = repro.train.profile_compressor

    def spy(compressor, **kwargs):
        calls.append(kwargs)
        return real(compressor, **{**kwargs, "sizes": (2**8, 2**10), "repeats": 1})

    monkeypatch.setattr(repro.train, "profile_compressor", spy)
    trainer = repro.train.SimulatedTrainer(planned.run_dir)
    selector = trainer.selector()
    assert calls == [{"sizes": (2**10, 2**14, 2**17), "repeats": 2, "workers": 16, "device": "cpu"}]
    assert selector.network.workers == 16
    assert trainer.selector() is selector  # decided once


def test_the_training_figures_run_the_full_system_and_the_compressor_alone(monkeypatch):
    """Table 2 and Fig. 7 train both DRAGONN variants (_train_set), the full one with
    efficiency-aware selection on and a run name of its own (the two must not share a
    run directory)."""
    from repro.figures import dragonn

    seen = []

    def fake_grid(ctx, specs, repeats=1):
        seen.extend(specs)
        raise StopIteration  # the specs are all this test needs

    monkeypatch.setattr(dragonn, "train_grid", fake_grid)
    ctx = type("C", (), {"smoke": True})()
    with pytest.raises(StopIteration):
        dragonn._train_set(ctx, "wiki10_xml", ["none", "dragonn", dragonn.FULL])
    full = [s for s in seen if "compressor.efficiency_aware=true" in s]
    alone = [s for s in seen if "compressor=dragonn" in s and s not in full]
    assert len(full) == 1 and len(alone) == 1
    assert any(o.startswith("name=dragonn_ea-") for o in full[0])
    assert not any(o.startswith("name=") for o in alone[0])
