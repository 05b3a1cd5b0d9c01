"""Every rank holds the same model after every step: the aggregate does not depend on the
order in which payloads are added, ranks agree on per-tensor decisions, faults are
decided once for all ranks, and a replica check names the first tensor that differs."""

from __future__ import annotations

import functools

import pytest
import torch

import compressors
from compressors import SimulatedGroup
from compressors.kernels import ops
from repro.sources import synthetic


def _params(name: str) -> dict:
    return {"ratio": 0.05} if "ratio" in compressors.default_params(name) else {}


def _overlapping(workers: int, step: int) -> list[torch.Tensor]:
    """Gradients that share most of their large coordinates across workers (so sparse
    payloads collide on many indices) with values of mixed magnitudes (so the rounding
    of a sum depends on the order of its terms). Fresh copies of one draw per (workers,
    step): every compressor and every arrival order gets the same gradients."""
    return [g.clone() for g in _overlapping_draw(workers, step)]


@functools.cache
def _overlapping_draw(workers: int, step: int) -> tuple[torch.Tensor, ...]:
    base = synthetic("laplace", 20_000, workers, seed=step, step=step, shared=0.8)
    scale = torch.logspace(-3, 3, 20_000)[torch.randperm(20_000, generator=torch.Generator()
                                                           .manual_seed(step))]
    return tuple(g * scale for g in base)


def _aggregates(name: str, workers: int) -> list[torch.Tensor]:
    group = SimulatedGroup(compressors.build(name, **_params(name)), workers, seed=3)
    out = []
    for step in range(2):
        outs = group.step(_overlapping(workers, step), step=step)
        for o in outs[1:]:
            assert torch.equal(o.aggregate, outs[0].aggregate)
        out.append(outs[0].aggregate.clone())
    return out


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_aggregate_is_independent_of_the_order_payloads_are_added(monkeypatch, workers):
    """CUDA's index_add_ adds colliding pairs in arrival order (atomics). Modelled on the
    CPU: every index_add_ applies its pairs in a random order. Every registered
    compressor's aggregate must come out bit for bit the same under any such order, and
    the same as the native CPU decode's, with 3, 4 and 8 workers whose payloads overlap."""
    names = compressors.list_compressors()
    native = {name: _aggregates(name, workers) for name in names}
    real_index_add = torch.Tensor.index_add_
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)

        def arrival_order(self, dim, index, source, *, alpha=1):
            perm = torch.randperm(index.numel(), generator=g)
            return real_index_add(self, dim, index[perm], source[perm], alpha=alpha)

        with monkeypatch.context() as m:
            m.setattr(ops, "supports_cpu", lambda t: False)  # the torch decode
            m.setattr(torch.Tensor, "index_add_", arrival_order)
            for name in names:
                got = _aggregates(name, workers)
                for step, (a, b) in enumerate(zip(got, native[name])):
                    assert torch.equal(a, b), f"{name}, {workers} workers, step {step}"


# -- 3 real ranks through the trainer, every family -------------------------------------------

FAMILIES = {
    "topk": ["compressor=topk", "compressor.ratio=0.05"],
    "randomk": ["compressor=randomk", "compressor.ratio=0.05"],
    "dgc": ["compressor=dgc", "compressor.ratio=0.05"],
    "dragonn": ["compressor=dragonn", "compressor.ratio=0.05"],
    "sidco_e": ["compressor=sidco_e", "compressor.ratio=0.05"],
    "hard_threshold": ["compressor=hard_threshold", "compressor.params.lam=0.002"],
    "deft": ["compressor=deft", "compressor.ratio=0.05"],
    "cltk": ["compressor=cltk", "compressor.ratio=0.05"],
    "qsgd": ["compressor=qsgd"],
    "terngrad": ["compressor=terngrad"],
    "signsgd": ["compressor=signsgd"],
    "thc": ["compressor=thc"],
    "powersgd": ["compressor=powersgd"],
    "fp16": ["compressor=fp16"],
}
COMMON = ["task=cifar10_resnet20", "steps=30", "eval_every=0", "eval_batches=1",
          "logger=local", "logger.progress=false", "cluster.replica_check_every=1",
          "cluster.workers=3"]


def _prepare(root, *overrides: str) -> str:
    import os

    from repro import config as config_mod
    from repro import launch

    planned = launch.plan([*overrides, f"runs_root={root}"], multirun=False)[0]
    os.makedirs(planned.run_dir, exist_ok=True)
    config_mod.save(planned.cfg, os.path.join(planned.run_dir, "config.yaml"))
    return planned.run_dir


def _train_all(rank: int, world: int, run_dirs: list[str]) -> dict[str, dict]:
    from repro.train import DDPTrainer

    out = {}
    for run_dir in run_dirs:
        trainer = DDPTrainer(run_dir, rank, world)
        trainer.run()
        # Parameters: buffers (BatchNorm's running statistics) are each rank's own until
        # DDP broadcasts rank 0's before the next forward.
        out[run_dir] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return out


@pytest.mark.distributed
def test_three_ranks_stay_bit_identical_for_every_family(tmp_path):
    """30 steps on 3 gloo ranks for one compressor of every family, with the replica check
    after every step (a difference would stop the run naming the tensor); the final
    states are compared here as well."""
    from repro.testing import run_ranks

    runs = {name: _prepare(tmp_path, *ov, *COMMON) for name, ov in FAMILIES.items()}
    states = run_ranks(_train_all, 3, list(runs.values()), timeout=900)
    for name, run_dir in runs.items():
        for key, value in states[0][run_dir].items():
            for r in (1, 2):
                assert torch.equal(value, states[r][run_dir][key]), f"{name}: {key}, rank {r}"


def _diverge(rank: int, world: int):
    import repro.hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    repro.hooks.check_replicas(model, step=0)  # identical: passes
    if rank == 2:
        with torch.no_grad():
            model[1].weight[0, 0] = torch.nextafter(model[1].weight[0, 0], torch.tensor(9.0))
    try:
        repro.hooks.check_replicas(model, step=7)
    except repro.hooks.ReplicasDiffer as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_replica_check_names_the_first_tensor_that_differs():
    """One bit of one parameter on one rank: every rank stops with the same message."""
    from repro.testing import run_ranks

    messages = run_ranks(_diverge, 3)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "after step 7" in messages[0] and "'1.weight' on rank(s) 2" in messages[0]


# -- NaN/Inf decided once for all ranks ----------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)


def _nonfinite_worker(rank: int, world: int, name: str, policy: str, bad_step: int | None,
                      skip_batch: int | None, steps: int):
    """A user's DDP loop with repro.hooks.make(nonfinite=policy). Rank 1's loss is NaN at
    `bad_step`; `skip_batch` is a batch this run never trains on (the reference of a run
    in which that step never happened). A NonFiniteGradient is caught around backward,
    as the README shows, and the loop goes on without stepping."""
    import time

    import repro.hooks
    from repro.hooks import NonFiniteGradient
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.005)
    compressor, _, how = name.partition("/")
    state, hook = repro.hooks.make(compressor, ratio=0.1, model=ddp, nonfinite=policy)
    if how == "folded":  # the agreement rides on the exchange, as off the CPU
        state.fold_agreement = True
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    skipped, errors = [], []
    for step in range(steps):
        if step == skip_batch:
            continue
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        if step == bad_step and rank == 1:
            loss = loss * float("nan")
        t0 = time.monotonic()
        try:
            loss.backward()
        except NonFiniteGradient as exc:
            errors.append({"step": step, "error": str(exc), "seconds": time.monotonic() - t0,
                           "zero": all(not bool(p.grad.any()) for p in model.parameters())})
            continue
        if state.skipped:
            skipped.append(step)
            continue
        opt.step()
    residuals = {n: s.residual(n).clone() for n, s in state.sessions.items()
                 if s.residual(n) is not None}
    repro.hooks.check_replicas(ddp)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "residuals": residuals, "skipped": skipped, "errors": errors}


def _nonfinite_workers(rank: int, world: int, names: list[str], *args) -> dict:
    return {name: _nonfinite_worker(rank, world, name, *args) for name in names}


def _large_gradient_worker(rank: int, world: int, name: str, scale: float):
    """A user's DDP loop with repro.hooks.make under each policy: rank 1's loss, and so
    its gradient, is multiplied by `scale` at step 1 (finite, but its squares overflow)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks

    out = {}
    for policy in ("error", "skip"):
        model = _mlp()
        ddp = DDP(model)
        state, hook = repro.hooks.make(name, model=ddp, nonfinite=policy)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        skipped = []
        for step in range(3):
            x, y = _batch(rank, step)
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            if step == 1 and rank == 1:
                loss = loss * scale
            try:
                loss.backward()
            except repro.hooks.NonFiniteGradient as exc:
                out[policy] = {"error": str(exc)}
                break
            if state.skipped:
                skipped.append(step)
                continue
            opt.step()
        else:
            out[policy] = {"skipped": skipped, "finite": all(bool(torch.isfinite(p).all())
                                                            for p in model.parameters())}
    return out


def _faults_worker(rank: int, world: int):
    """The fault scenarios of the tests below in one spawn of three ranks."""
    names = ["topk", "deft", "topk/folded", "deft/folded"]
    return {"nan": _nonfinite_workers(rank, world, names, "error", 3, None, 6),
            "never": _nonfinite_workers(rank, world, names, "error", None, 3, 6),
            "large": _large_gradient_worker(rank, world, "powersgd", 1e25)}


@pytest.fixture(scope="module")
def three_ranks_faults():
    from repro.testing import run_ranks

    return run_ranks(_faults_worker, 3)


@pytest.mark.distributed
def test_nan_on_one_rank_raises_the_same_catchable_error_on_every_rank(three_ranks_faults):
    """Rank 1's gradient is NaN at step 3 (nonfinite='error'): every rank's backward
    raises NonFiniteGradient itself (not DDP's RuntimeError around it), naming the step,
    the tensor and the rank, with the gradients zeroed; the loop that catches it goes on
    training, and the replicas stay identical. topk exchanges bucket by bucket, deft
    holds the buckets for one exchange of the whole gradient; /folded: the agreement
    rides on the exchange (fold_agreement)."""
    for name in ("topk", "deft", "topk/folded", "deft/folded"):
        out = [r["nan"][name] for r in three_ranks_faults]
        messages = set()
        for r in out:
            (error,) = r["errors"]
            assert error["step"] == 3 and error["seconds"] < 10 and error["zero"], name
            assert "step 3: gradient" in error["error"], name
            assert "contains NaN on rank 1" in error["error"], name
            messages.add(error["error"])
        assert len(messages) == 1, name
        for r in out[1:]:
            for p, q in zip(r["params"], out[0]["params"]):
                assert torch.equal(p, q), name


@pytest.mark.distributed
def test_a_caught_nonfinite_error_leaves_every_rank_as_if_the_step_never_happened(
        three_ranks_faults):
    """After the NonFiniteGradient of step 3 (rank 1's NaN) is caught and the loop goes on,
    every rank's parameters and error-feedback residuals equal, bit for bit, those of a
    run that never trained on step 3's batch: no rank's exchange of that step left
    anything behind (/folded: although every rank had started it before they knew)."""
    for name in ("topk", "deft", "topk/folded", "deft/folded"):
        for r in three_ranks_faults:
            caught, never = r["nan"][name], r["never"][name]
            assert never["errors"] == []
            for p, q in zip(caught["params"], never["params"]):
                assert torch.equal(p, q), name
            assert caught["residuals"].keys() == never["residuals"].keys(), name
            assert caught["residuals"], name
            for key in caught["residuals"]:
                assert torch.equal(caught["residuals"][key], never["residuals"][key]), (name, key)


@pytest.mark.distributed
def test_gradients_too_large_to_compress_are_caught_on_every_rank(three_ranks_faults):
    """Rank 1's gradient is finite but ~1e25 (PowerSGD returned zeros for such a one, Top-k
    overflowed): under nonfinite=error every one of 3 gloo ranks stops with the same
    error naming it; under skip every rank skips that step and the model stays finite."""
    out = [r["large"] for r in three_ranks_faults]
    errors = [o["error"]["error"] for o in out]
    errors = [e[e.index("step 1"):] for e in errors]
    assert len(set(errors)) == 1
    assert "values too large to compress (their norm overflows float32) on rank 1" in errors[0]
    for o in out:
        assert o["skip"] == {"skipped": [1], "finite": True}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["topk", "topk/folded",
                                  *(pytest.param(n, marks=pytest.mark.heavy)
                                    for n in ("deft", "dgc/folded", "sidco_e/folded"))])
def test_skipped_step_is_as_if_it_never_happened(name):
    """nonfinite='skip': all three ranks skip step 3 (rank 1's gradient is NaN there);
    their parameters and error-feedback residuals then equal, bit for bit, those of a
    run that never trained on step 3's batch. /folded: the agreement rides on the
    exchange, which every rank has started before they know (fold_agreement; DGC: its
    momentum-corrected feedback; SIDCo: its stage count, adapted as it selects)."""
    from repro.testing import run_ranks

    skipped = run_ranks(_nonfinite_worker, 3, name, "skip", 3, None, 6)
    never = run_ranks(_nonfinite_worker, 3, name, "skip", None, 3, 6)
    for a, b in zip(skipped, never):
        assert a["skipped"] == [3] and b["skipped"] == []
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
        assert a["residuals"].keys() == b["residuals"].keys() and a["residuals"]
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), key


# -- per-tensor decisions made once ----------------------------------------------------------------

def _selector_worker(rank: int, world: int):
    import repro.hooks
    from repro.costmodel import EfficiencySelector, LinearProfile, Network
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Each rank's own profile of T_comp differs (timing noise): the cut-off would too.
    profile = LinearProfile(intercept=2e-4 * (1 + rank), slope=1e-9)
    mine = EfficiencySelector(Network(16, 25.0, 5.0), profile, sent_fraction=0.02)
    model = _mlp()
    ddp = DDP(model)
    state, hook = repro.hooks.make("dragonn", ratio=0.01, model=ddp, selector=mine)
    ddp.register_comm_hook(state, hook)
    x, y = _batch(rank, 0)
    ((ddp(x) - y) ** 2).mean().backward()
    return {"own": mine.min_numel(), "used": state.selector.min_numel(),
            "compressed": sorted(r.name for r in state.pop_records() if r.compressed)}


@pytest.mark.distributed
def test_efficiency_selection_is_decided_once_for_all_ranks():
    from repro.testing import run_ranks

    out = run_ranks(_selector_worker, 3)
    assert len({r["own"] for r in out}) == 3  # the ranks' own profiles disagree
    assert len({r["used"] for r in out}) == 1 and out[0]["used"] == out[0]["own"]
    assert all(r["compressed"] == out[0]["compressed"] for r in out)


def test_simulated_workers_share_one_profile(tmp_path, monkeypatch):
    """The simulated trainer profiles T_comp once, at the target cluster's number of
    workers (the one its network term is for, not the 4 simulated here), and every worker
    uses that one selector."""
    import os

    import repro.train
    from repro import config as config_mod
    from repro.train import SimulatedTrainer

    calls = []
    real = repro.train.profile_compressor

    def counting(compressor, **kwargs):
        calls.append(kwargs.get("workers"))
        return real(compressor, **kwargs)

    monkeypatch.setattr(repro.train, "profile_compressor", counting)
    run_dir = _prepare(tmp_path, "compressor=dragonn", "compressor.ratio=0.01",
                       "compressor.efficiency_aware=true", "cluster=simulated",
                       "cluster.workers=4", "steps=1", "eval_every=0", "logger=local")
    assert os.path.exists(os.path.join(run_dir, "config.yaml"))
    trainer = SimulatedTrainer(run_dir)
    trainer.setup_optim()
    trainer.setup_compression()
    assert calls == [trainer.network.workers] == [16]
    assert len({id(c.selector) for c in trainer.compressions}) == 1
    del config_mod


# -- a rank that dies ------------------------------------------------------------------------

def _rank_entry(rank: int, world: int, run_dir: str, init_file: str, out_dir: str) -> None:
    import os
    import traceback

    os.environ["OMP_NUM_THREADS"] = "1"
    from repro.train import run_rank

    try:
        run_rank(run_dir, rank, world, f"file://{init_file}")
        message = "finished"
    except BaseException as exc:  # noqa: BLE001 - the message is what the test reads
        message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write(message)


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_killed_rank_ends_the_others_naming_it(tmp_path, monkeypatch):
    """Rank 1 dies at step 3 (os._exit, as a kill would): ranks 0 and 2 stop within
    cluster.timeout_s, with RankStopped naming rank 1."""
    import multiprocessing as mp
    import os
    import time

    run_dir = _prepare(tmp_path, "compressor=topk", "compressor.ratio=0.05", "steps=8",
                       "eval_every=0", "eval_batches=1", "logger=local",
                       "logger.progress=false", "cluster.workers=3", "cluster.timeout_s=20")
    monkeypatch.setenv("GRADCOMP_FAIL_AT_STEP", "3:1")
    ctx = mp.get_context("spawn")
    init_file = os.path.join(tmp_path, "rendezvous")
    procs = [ctx.Process(target=_rank_entry, args=(r, 3, run_dir, init_file, str(tmp_path)))
             for r in range(3)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    elapsed = time.monotonic() - t0
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(p.is_alive() for p in procs)
    assert procs[1].exitcode == 17
    for r in (0, 2):
        text = open(os.path.join(tmp_path, f"{r}.txt")).read()
        assert text.startswith("RankStopped"), text[:2000]
        assert "rank(s) 1 stopped answering" in text and "at step 3" in text
    assert elapsed < 60


@pytest.mark.heavy
@pytest.mark.distributed
def test_replicas_command_reports_per_compressor(capsys):
    """`repro replicas` (scripts/gpu_check.sh on a GPU): one line per compressor."""
    from repro.cli import main

    rc = main(["replicas", "--device", "cpu", "--workers", "3", "--steps", "3",
               "--params", "20000", "--compressor", "sidco_e,deft"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert [line.split(":")[0].strip() for line in out] == ["sidco_e", "deft"]
    assert all(line.endswith("replicas identical") for line in out)
    assert main(["replicas", "--compressor", "none"]) == 2  # not a sparse compressor


def test_replicas_command_covers_every_sparsifier(monkeypatch):
    """`repro replicas` checks, by default, every registered compressor that selects
    coordinates, told apart by what one simulated exchange reports (Outcome.selected, the
    k̂ only a sparsifier has), so a sparsifier registered later is checked without a list
    to update."""
    import argparse

    from repro import replicacheck

    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    selecting = [name for name in compressors.list_compressors()
                 if SimulatedGroup(compressors.build(name, **_params(name)), world_size=2)
                 .step([g.clone() for g in grads])[0].selected is not None]
    assert "dgc_reference" in selecting and "none" not in selecting
    assert replicacheck.sparse_compressors() == selecting
    for name in selecting:  # each builds with the parameters the check gives it
        compressors.build(name, **replicacheck.hook_params(name, 0.01))
    checked = []
    monkeypatch.setattr(replicacheck, "check", lambda names, *args: checked.extend(names) or {
        n: "replicas identical" for n in names})
    parser = argparse.ArgumentParser()
    replicacheck.add_arguments(parser)
    assert replicacheck.run(parser.parse_args([])) == 0
    assert checked == selecting
