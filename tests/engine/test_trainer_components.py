"""The components the training loop hands its concerns to, each on its own: the
checkpointer (when a checkpoint is due, its writing, sealing and pruning, which one a
relaunch takes), the run folder's writer (summary.json then DONE, or neither), the
simulated ranks' own streams and buffers, and the interface every gradient exchange
offers the loop. End to end they run in test_train, test_run_safety and test_durability."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

import compressors
from repro import checkpoints
from repro.checkpointer import Checkpointer
from repro.durable import OutputError
from repro.rankstate import SimulatedRanks, get_rng, set_rng
from repro.runwriter import MetricsGap, RunWriter


def config(**overrides):
    """A run's config as far as these components read it; `overrides` by dotted key."""
    cfg = OmegaConf.create({
        "steps": 10, "checkpoint_every": 0, "checkpoint_every_s": 0, "checkpoint_at_end": True,
        "keep_checkpoints": 2, "eval_every": 0, "seed": 0,
        "logger": {"log_every": 0, "wandb": False}, "compressor": {"ratio": None}})
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


# -- when -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "step", "flags", "expected"), [
    ({}, 3, (False, False), (False, False)),  # nothing asks for one
    ({"checkpoint_every": 3}, 3, (False, False), (True, False)),
    ({"checkpoint_every": 3}, 4, (False, False), (False, False)),
    ({}, 3, (False, True), (True, False)),  # due by time
    ({}, 3, (True, False), (True, True)),  # a signal: a checkpoint, then stop
    ({}, 10, (True, False), (True, False)),  # a signal at the last step: the run finishes
    ({"checkpoint_at_end": False}, 10, (True, False), (False, False)),
    ({"checkpoint_at_end": False}, 10, (False, False), (False, False)),
    ({}, 10, (False, False), (True, False)),  # the last step is kept
])
def test_when_a_checkpoint_is_written_and_the_run_stops(tmp_path, overrides, step, flags,
                                                        expected):
    keeper = Checkpointer(str(tmp_path), config(**overrides))
    assert keeper.decide(step, flags) == expected


def test_a_checkpoint_is_due_by_time_once_its_interval_passed(tmp_path):
    keeper = Checkpointer(str(tmp_path), config(checkpoint_every_s=3600))
    assert keeper.local_flags() == (False, False)
    keeper.last_saved_t -= 3600
    assert keeper.local_flags() == (False, True)


# -- how and which ----------------------------------------------------------------------------
def parts(step: int, order: list[str]):
    def made(name: str, value: dict):
        def state():
            order.append(name)
            return value
        return state

    return {"workers.pt": made("workers.pt", {"w": torch.full((3,), float(step))}),
            "trainer.pt": made("trainer.pt", {"step": step})}


def test_checkpoints_are_written_in_order_sealed_pruned_and_found(tmp_path):
    keeper = Checkpointer(str(tmp_path), config())
    keeper.prepare()
    order: list[str] = []
    for step in (1, 2, 3):
        keeper.save(step, parts(step, order))
    assert order == ["workers.pt", "trainer.pt"] * 3
    # keep_checkpoints=2: the oldest went; the newest is sealed with both files
    assert sorted(os.listdir(keeper.dir)) == ["LATEST", "step_00000002", "step_00000003"]
    newest = os.path.join(keeper.dir, "step_00000003")
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000003" / checkpoints.MANIFEST)
                          .read_text())
    assert sorted(manifest["files"]) == ["trainer.pt", "workers.pt"]
    assert (tmp_path / "checkpoints" / "LATEST").read_text() == "step_00000003"
    found = keeper.latest(["trainer.pt", "workers.pt"])
    assert found == newest
    assert torch.equal(Checkpointer.load(found, "workers.pt")["w"], torch.full((3,), 3.0))
    with pytest.warns(RuntimeWarning, match="rank1.pt is not part of this checkpoint"):
        assert keeper.latest(["trainer.pt", "rank1.pt"]) is None  # another number of ranks


def test_a_failed_write_removes_the_unfinished_checkpoint_and_names_it(tmp_path):
    keeper = Checkpointer(str(tmp_path), config())
    keeper.prepare()
    keeper.save(1, parts(1, []))

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError) as info:
        keeper.save(2, {"trainer.pt": full})
    assert "step_00000002 was not finished and was removed" in str(info.value)
    assert "the disk is full" in str(info.value)
    assert sorted(os.listdir(keeper.dir)) == ["LATEST", "step_00000001"]
    assert keeper.latest(["trainer.pt"]) == os.path.join(keeper.dir, "step_00000001")


def test_a_checkpoint_whose_steps_metrics_lack_is_passed_over(tmp_path):
    """steps=4, every step logged: the checkpoint at step 4 needs lines 0-3, the one at
    step 2 lines 0-1. With lines 2-3 gone the older one is taken (a warning says why);
    with line 1 gone too, none is, and MetricsGap names what is missing."""
    cfg = config(steps=4, **{"logger.log_every": 1})
    keeper = Checkpointer(str(tmp_path), cfg)
    keeper.prepare()
    keeper.save(2, parts(2, []))
    keeper.save(4, parts(4, []))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "wall_time": 0.0}) + "\n" for s in range(4)))
    assert keeper.latest(["trainer.pt"]) == os.path.join(keeper.dir, "step_00000004")
    metrics.write_text("".join(json.dumps({"step": s, "wall_time": 0.0}) + "\n" for s in (0, 1)))
    with pytest.warns(RuntimeWarning, match="resuming from .*step_00000002"):
        assert keeper.latest(["trainer.pt"]) == os.path.join(keeper.dir, "step_00000002")
    metrics.write_text(json.dumps({"step": 0, "wall_time": 0.0}) + "\n")
    with pytest.raises(MetricsGap, match=r"lacks the lines of 3 step\(s\) \(1, 2, 3\)"):
        keeper.latest(["trainer.pt"])


# -- the run folder --------------------------------------------------------------------------
def test_summary_then_done_and_only_rank_0_writes(tmp_path):
    cfg = config(steps=2, **{"logger.log_every": 1})
    elsewhere = RunWriter(str(tmp_path / "rank1"), cfg, main=False)
    elsewhere.log(0, {"loss": 1.0})
    assert elsewhere.finish({"steps": 2}, 2) == {"steps": 2}
    assert not (tmp_path / "rank1").exists()

    out = RunWriter(str(tmp_path), cfg, main=True)
    for step in range(2):
        out.log(step, {"loss": 1.0 - step, "samples": 8, "step_s": 0.5})
    summary = out.finish({"steps": 2}, 2)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    # completed from metrics.jsonl: 16 samples in 1 s of steps, the last loss
    assert summary["samples_per_s"] == pytest.approx(16.0) and summary["final_loss"] == 0.0
    assert (tmp_path / "DONE").read_text() == "2\n"
    assert (tmp_path / "summary.json").stat().st_mtime_ns <= (tmp_path / "DONE").stat().st_mtime_ns


def test_a_run_whose_metrics_lack_a_step_gets_neither_summary_nor_done(tmp_path):
    out = RunWriter(str(tmp_path), config(steps=3, **{"logger.log_every": 1}), main=True)
    out.log(0, {"loss": 1.0})
    out.log(2, {"loss": 0.5})
    with pytest.raises(MetricsGap, match=r"lacks the lines of 1 step\(s\) \(1\)"):
        out.finish({"steps": 3}, 3)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "DONE").exists()
    assert out.metrics is not None and out.metrics.file is None  # closed all the same


# -- simulated ranks --------------------------------------------------------------------------
def test_each_simulated_rank_has_its_own_stream_and_starts_from_rank_0s_buffers():
    """Three workers on one BatchNorm model: at the first step every stream starts from
    the same state (as every real rank's does), then each goes on from its own (rank 0's
    is the process's, between steps too); each forward starts from the buffers rank 0
    had when the step began; rank 0 runs last, so afterwards the process holds rank 0's
    stream and the buffers rank 0's forward left."""
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(4)
    ranks = SimulatedRanks(model, 3)
    start = model.running_mean.clone()
    draws, seen, after = {}, {}, {}
    for rank in ranks.passes():
        seen[rank] = model.running_mean.clone()
        draws[rank] = torch.rand(1).item()
        model(torch.randn(8, 4) + rank)  # moves the running statistics, differently per rank
        after[rank] = model.running_mean.clone()
    assert list(draws) == [1, 2, 0] and draws[0] == draws[1] == draws[2]
    assert all(torch.equal(s, start) for s in seen.values())
    assert torch.equal(model.running_mean, after[0]) and not torch.equal(after[0], after[1])
    continued = torch.rand(1).item()  # rank 0's stream goes on in the process
    second = {rank: torch.rand(1).item() for rank in ranks.passes()}
    # ranks 1 and 2 draw their second number, as rank 0 did in `continued`; rank 0 its third
    assert second[1] == second[2] == continued != second[0]

    state = get_rng()
    fresh = SimulatedRanks(model, 3)
    exchanges = [compressors_worker(r) for r in range(3)]
    saved = ranks.state(exchanges)
    fresh.load(saved, exchanges, "here")
    assert [torch.equal(a["torch"], b["torch"]) for a, b in zip(fresh.rng, ranks.rng)] == [True] * 3
    set_rng(state)
    with pytest.raises(ValueError, match="holds 3 simulated workers but cluster.workers=2"):
        SimulatedRanks(model, 2).load(saved, exchanges[:2], "here")


def compressors_worker(rank: int):
    from repro.hooks import WorkerCompression

    return WorkerCompression(compressors.build("topk", ratio=0.5), rank, 3)


# -- what the loop asks of an exchange --------------------------------------------------------
def test_every_gradient_exchange_offers_what_the_loop_asks():
    from repro.gradexchange import BuiltinAllreduce, GradientExchange
    from repro.hooks import CompressionHookState

    model = torch.nn.Linear(4, 2)
    for exchange in (BuiltinAllreduce(model), compressors_worker(0),
                     CompressionHookState(compressors.build("topk", ratio=0.5))):
        assert isinstance(exchange, GradientExchange), type(exchange).__name__
        assert exchange.skipped is False and exchange.skipped_steps == 0


def test_the_loop_asks_its_modes_through_methods_not_probes():
    """A mode is a Trainer subclass that implements the abstract methods; the loop never
    asks which mode it runs (isinstance) or whether an exchange has an attribute."""
    import inspect

    import repro.train

    assert inspect.isabstract(repro.train.Trainer)
    assert not any(inspect.isabstract(mode) for mode in (
        repro.train.DDPTrainer, repro.train.SimulatedTrainer, repro.train.ReplicaTrainer))
    source = inspect.getsource(repro.train)
    assert "isinstance(self" not in source and "getattr(self.compressions" not in source
