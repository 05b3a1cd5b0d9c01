"""The DDP hook under each option a user sets on DistributedDataParallel, for every family
of compressor (dense, sparse allgather, DEFT/CLT-k, THC, PowerSGD), on 3 gloo ranks:
training completes, the replicas are bit-identical, and per parameter the error-feedback
invariant holds: summed over the steps and averaged over the ranks, the raw gradient each
rank handed the hook equals the update DDP applied plus what the ranks' error feedback
still holds.

Each group of options runs in ONE spawn of 3 ranks that trains every (option, compressor)
in turn (a spawn costs seconds of start-up on its own); the tests then read its results.
"""

from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch
from torch import nn

from repro.testing import run_ranks

pytestmark = pytest.mark.distributed

WORKERS = 3
STEPS = 4
# name (or name/granularity) → the compressor's parameters
FAMILIES = {
    "none": {}, "fp16": {},  # dense
    "topk": {"ratio": 0.05}, "sidco_e": {"ratio": 0.05},  # sparse allgather
    "deft": {"ratio": 0.05}, "cltk": {"ratio": 0.05},  # one exchange of the whole model
    "thc": {}, "powersgd": {},
    "topk/bucket": {"ratio": 0.05},  # each DDP bucket as one tensor
}
# What each option sets: DDP's keyword arguments, the parameters' dtype (trained under
# autocast to it), micro-batches accumulated under no_sync per step, a frozen layer, a
# branch left unused on some steps, whether the hook is given the model, and ranks whose
# threads run late (_skewed).
OPTIONS = {
    "find_unused_all_used": {"ddp": {"find_unused_parameters": True}, "skewed": True},
    "find_unused_some_unused": {"ddp": {"find_unused_parameters": True}, "unused": True,
                                "skewed": True},
    "static_graph": {"ddp": {"static_graph": True}},
    "gradient_as_bucket_view": {"ddp": {"gradient_as_bucket_view": True}},
    "frozen_parameters": {"frozen": True},
    "model_not_given": {"model_given": False},
    "no_sync_accumulation": {"accumulate": 2},
    "autocast_bf16_gradients": {"dtype": torch.bfloat16},
    "autocast_fp16_gradients": {"dtype": torch.float16},
}
# One spawn per group (start-up is most of a spawn's time): find_unused_parameters,
# where a fault shows as ranks waiting on each other, apart from the rest.
GROUPS = (("find_unused_all_used", "find_unused_some_unused"),
          ("static_graph", "gradient_as_bucket_view", "frozen_parameters", "model_not_given",
           "no_sync_accumulation", "autocast_bf16_gradients", "autocast_fp16_gradients"))
# Error-feedback invariant tolerance, relative to the parameter's largest value: the
# rounding of float32 sums, of the fp16 compressor's values (it keeps no residual), and
# of residuals kept in bfloat16 or float16.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
FP16_COMPRESSOR_TOLERANCE = 2e-3


class Net(nn.Module):
    """Registered out of the order it runs in (the head first): DDP's first buckets
    follow the reverse registration order and are rebuilt after the first step in the
    order the gradients arrive, so the hook sees both."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.head = nn.Linear(48, 8)
        self.branch = nn.Linear(48, 48)
        self.body = nn.Linear(48, 48)
        self.stem = nn.Linear(16, 48)
        if frozen:
            self.stem.requires_grad_(False)

    def forward(self, x: torch.Tensor, branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(torch.tanh(self.stem(x))))
        if branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


@contextlib.contextmanager
def _skewed(rank: int, on: bool):
    """Rank 0's communication thread issues each round of collectives 2 ms late (a loaded
    rank's would); rank 1's backward goes on 10 ms late after it handed the hook its last
    bucket (see _train). DDP issues collectives of its own on the backward thread right
    after the last bucket (find_unused_parameters): unless the hook orders its own with
    them, the two then meet in a different order on ranks 0 and 1."""
    import time

    import repro.distributed as driver

    real = driver._run_round

    def late(requests, group):
        time.sleep(0.002)
        return real(requests, group)

    if on and rank == 0:
        driver._run_round = late
    try:
        yield
    finally:
        driver._run_round = real


def _branch_used(rank: int, step: int) -> bool:
    """Unused by every rank at steps 1 and 3, by rank 1 alone at step 2."""
    return step not in (1, 3) and not (step == 2 and rank == 1)


def _train(rank: int, option: str, name: str) -> dict:
    """One user's DDP loop with the hook; what each parameter's invariant needs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks

    opts = OPTIONS[option]
    dtype = opts.get("dtype", torch.float32)
    torch.manual_seed(0)
    model = Net(opts.get("frozen", False)).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.01, **opts.get("ddp", {}))
    compressor, _, granularity = name.partition("/")
    state, hook = repro.hooks.make(compressor, granularity=granularity or "default",
                                   model=ddp if opts.get("model_given", True) else None,
                                   **FAMILIES[name])
    names = {id(p): n for n, p in model.named_parameters()}
    raw: dict[str, torch.Tensor] = {}

    def recording(st, bucket):  # what the hook is handed: this rank's raw gradients
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            raw[names[id(p)]] = raw.get(names[id(p)], 0) + g.detach().double().flatten()
        fut = hook(st, bucket)
        if opts.get("skewed") and rank == 1 and bucket.is_last():
            time.sleep(0.01)
        return fut

    ddp.register_comm_hook(state, recording)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied: dict[str, torch.Tensor] = {}
    micro = opts.get("accumulate", 1)
    with _skewed(rank, opts.get("skewed", False)):
        for step in range(STEPS):
            opt.zero_grad()
            branch = _branch_used(rank, step) if opts.get("unused") else True
            for i in range(micro):
                g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
                sync = contextlib.nullcontext() if i == micro - 1 else ddp.no_sync()
                with sync, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                    loss = ((ddp(x.to(dtype), branch).float() - y) ** 2).mean()
                loss.backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    applied[n] = applied.get(n, 0) + p.grad.double().flatten()
            opt.step()
    repro.hooks.check_replicas(ddp)  # raises ReplicasDiffer on every rank if any differs
    residuals = state.parameter_residuals()
    return {"raw": raw, "applied": applied,
            "residual": {n: residuals[state.name_of(p)].double().clone()
                         for n, p in model.named_parameters()
                         if state.name_of(p) in residuals},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "dtype": dtype}


def _group(rank: int, world: int, options: tuple[str, ...]) -> dict:
    """Every (option, compressor) of a group in turn; one that raises on every rank
    (ReplicasDiffer, a refused argument) is reported and the others still run."""
    import traceback

    out = {}
    for option in options:
        for name in FAMILIES:
            try:
                out[(option, name)] = _train(rank, option, name)
            except Exception:  # noqa: BLE001 - the test reports it
                out[(option, name)] = {"error": traceback.format_exc()}
    return out


@functools.cache
def _spawn(group: int) -> dict | Exception:
    """Every (option, compressor) of a group, trained in one spawn: per rank; or what
    the spawn raised (kept, so the group's other tests do not wait for it again)."""
    try:
        by_rank = run_ranks(_group, WORKERS, GROUPS[group], timeout=180)
    except Exception as exc:  # noqa: BLE001 - raised again by every test of the group
        return exc
    return {key: [r[key] for r in by_rank] for key in by_rank[0]}


def _results(group: int) -> dict:
    results = _spawn(group)
    if isinstance(results, Exception):
        raise results
    return results


def invariant_errors(ranks: list[dict]) -> dict[str, float]:
    """Per parameter, max |mean_r Σraw − Σapplied − mean_r residual| relative to the
    largest value of the three."""
    out = {}
    for n in ranks[0]["raw"]:
        mean_raw = sum(r["raw"][n] for r in ranks) / len(ranks)
        applied = ranks[0]["applied"].get(n, torch.zeros_like(mean_raw))
        residual = sum(r["residual"].get(n, torch.zeros_like(mean_raw))
                       for r in ranks) / len(ranks)
        scale = max(float(t.abs().max()) for t in (mean_raw, applied, residual))
        out[n] = float((mean_raw - applied - residual).abs().max()) / max(scale, 1e-30)
    return out


@pytest.mark.parametrize("option", [o for group in GROUPS for o in group])
def test_the_hook_keeps_its_contract_under_each_ddp_option(option):
    group = next(i for i, g in enumerate(GROUPS) if option in g)
    results = _results(group)
    for name in FAMILIES:
        ranks = results[(option, name)]
        errors = [r["error"] for r in ranks if "error" in r]
        assert not errors, f"{option}, {name}:\n{errors[0]}"
        for r, out in enumerate(ranks[1:], 1):
            for n, p in out["params"].items():
                assert torch.equal(p, ranks[0]["params"][n]), f"{option}, {name}: rank {r}, {n}"
            for n, a in out["applied"].items():
                assert torch.equal(a, ranks[0]["applied"][n]), f"{option}, {name}: rank {r}, {n}"
        frozen = {n for n, p in ranks[0]["params"].items() if n.startswith("stem")}
        if OPTIONS[option].get("frozen"):
            assert frozen.isdisjoint(ranks[0]["raw"]), "a frozen parameter reached the hook"
        else:
            assert set(ranks[0]["raw"]) == set(ranks[0]["params"])
        tolerance = TOLERANCE[ranks[0]["dtype"]]
        if name == "fp16":
            tolerance = max(tolerance, FP16_COMPRESSOR_TOLERANCE)
        bad = {n: e for n, e in invariant_errors(ranks).items() if not e <= tolerance}
        assert not bad, (f"{option}, {name}: raw ≠ applied + residual (relative error, "
                         f"tolerance {tolerance:g}): {bad}")


EXIT_DURING_CALLBACK = """
import time
from repro.distributed import run_async

def job():
    return 1
    yield

def slow(fut):
    time.sleep(0.5)
    return fut.value()

run_async(job()).then(slow)
time.sleep(0.1)  # the script ends while the communication thread is in the callback
"""


def test_a_script_that_ends_while_the_hook_completes_exits_cleanly():
    """A user's script may end right after its last backward, while the communication
    thread is still inside a Future callback (torch's C++ frames). Finalising the
    interpreter under it aborted the process (SIGABRT, "terminate called without an
    active exception") after the script had finished; the thread is ended at exit."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_CALLBACK], check=False, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_the_communication_thread_is_not_waited_for_inside_a_collective():
    """At exit the thread is waited for while it completes a Future, not while a job's
    collectives run: a process ending then is failing (a peer is gone or hangs), and
    waiting would only hold up its exit. The job still finishes if it can."""
    import threading
    import time

    from repro.distributed import close_comm_thread, run_async

    started, gate = threading.Event(), threading.Event()

    def job():
        started.set()
        gate.wait(60)  # stands for a collective that does not return
        return 1
        yield

    fut = run_async(job())
    assert started.wait(30)
    t0 = time.monotonic()
    assert close_comm_thread(timeout=60) is False
    assert time.monotonic() - t0 < 30
    gate.set()
    assert fut.wait() == 1


def test_a_users_torchrun_script_with_a_branch_unused_on_some_steps(tmp_path):
    """tests/engine/ddp_user_script.py under torchrun on 3 ranks: DDP with
    find_unused_parameters=True and a branch unused on some steps (by every rank on some,
    by one rank on others) trains 20 steps with each of topk, deft and sidco_e, the
    replicas identical after every step; a NaN on one rank's loss is caught as
    NonFiniteGradient around backward on every rank, and the run goes on."""
    import json
    import math
    import os
    import signal
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))  # the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # Its own session, so that everything torchrun started can be ended together.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(WORKERS), os.path.join(here, "ddp_user_script.py"), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORKERS)]
    for name in ("topk", "deft", "sidco_e"):
        runs = [report[name] for report in reports]
        for run in runs:
            assert len(run["losses"]) == 20 and not run["caught"], name
            assert run["steps"] == 20 and all(math.isfinite(x) for x in run["losses"]), name
        assert len({run["params"] for run in runs}) == 1, name
    nan = [report["nan"] for report in reports]
    for run in nan:
        assert [c["step"] for c in run["caught"]] == [1]
        assert "step 1: gradient" in run["caught"][0]["message"]
        assert "contains NaN on rank 1" in run["caught"][0]["message"]
        assert len(run["losses"]) == 3
    assert len({run["params"] for run in nan}) == 1


# -- the collectives a step issues ---------------------------------------------------------

# name (or name/granularity) → the compressor's parameters: one per exchange pattern
# (dense allreduce, sparse allgather with fixed and with data-dependent sizes, THC's
# max-norm round, PowerSGD's two rounds, one exchange per DDP bucket, one of the whole
# model held until the last bucket).
COUNTED = {"none": {}, "topk": {"ratio": 0.05}, "dgc": {"ratio": 0.05},
           "sidco_e": {"ratio": 0.05}, "thc": {}, "powersgd": {}, "topk/bucket": {"ratio": 0.05},
           "deft": {"ratio": 0.05}}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")


def _count_collectives(rank: int, world: int) -> dict:
    """Per (compressor, nonfinite policy): the collectives of each kind that torch.distributed
    was asked for in 3 steps of a DDP model with several buckets, after the first step
    (DDP rebuilds its buckets there), and the hook calls (buckets) in them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks

    counts: dict[str, int] = {}
    counting = [False]
    for kind in COLLECTIVES:
        real = getattr(dist, kind)

        def wrapper(*args, _real=real, _kind=kind, **kwargs):
            if counting[0]:
                counts[_kind] = counts.get(_kind, 0) + 1
            return _real(*args, **kwargs)
        setattr(dist, kind, wrapper)
    out = {}
    for name, params in COUNTED.items():
        for policy in ("error", "error/folded", "off"):
            torch.manual_seed(0)
            model = Net(frozen=False)
            ddp = DDP(model, bucket_cap_mb=0.005)
            compressor, _, granularity = name.partition("/")
            state, hook = repro.hooks.make(compressor, granularity=granularity or "default",
                                           model=ddp, nonfinite=policy.partition("/")[0],
                                           **params)
            if policy.endswith("/folded"):  # as off the CPU, where it is cheaper
                state.fold_agreement = True
            buckets = [0]

            def counted_hook(st, bucket, _hook=hook, _buckets=buckets):
                if counting[0]:
                    _buckets[0] += 1
                return _hook(st, bucket)

            ddp.register_comm_hook(state, counted_hook)
            counts.clear()
            for step in range(4):
                counting[0] = step > 0
                g = torch.Generator().manual_seed(1000 * step + rank)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
                ((ddp(x) - y) ** 2).mean().backward()
            counting[0] = False
            out[(name, policy)] = {"collectives": dict(counts), "buckets": buckets[0]}
    return out


@pytest.fixture(scope="module")
def collectives_per_step():
    results = run_ranks(_count_collectives, WORKERS, timeout=180)
    assert all(r == results[0] for r in results[1:]), "the ranks issued different collectives"
    return results[0]


@pytest.mark.parametrize("name", COUNTED)
def test_the_finiteness_agreement_costs_no_collective(collectives_per_step, name):
    """Through the DDP hook on 3 gloo ranks, with several buckets: a step under
    nonfinite='error' with the agreement folded (fold_agreement, as off the CPU) issues
    exactly the collectives of the same step without any check (nonfinite='off'): the
    verdicts ride on the exchange's first collective instead of a small allreduce of
    their own per exchange. On the CPU the hook folds it where no error feedback has to
    be staged apart (`none`); elsewhere it keeps that one allreduce per exchange."""
    folded = collectives_per_step[(name, "error/folded")]
    checked = collectives_per_step[(name, "error")]
    unchecked = collectives_per_step[(name, "off")]
    assert folded["buckets"] == unchecked["buckets"] >= 3 * 3  # several buckets, 3 steps
    assert folded["collectives"] == unchecked["collectives"], (name, folded, unchecked)
    exchanges = 3 if name == "deft" else unchecked["buckets"]  # one per step, or per bucket
    extra = 0 if name == "none" else exchanges
    expected = dict(unchecked["collectives"])
    expected["all_reduce"] = expected.get("all_reduce", 0) + extra
    assert checked["collectives"] == {k: v for k, v in expected.items() if v}, name


def test_a_sparse_bucket_exchange_is_one_round_of_three_allgathers(collectives_per_step):
    """Sparsifiers over each parameter of a bucket, and over the bucket as one tensor, the
    finiteness agreement folded: per bucket, one round of three allgathers (the indices,
    the values, and one small table of every payload's size, each parameter's share of
    them and the finiteness verdicts), and no allreduce at all."""
    for name in ("topk", "dgc", "sidco_e", "topk/bucket"):
        counted = collectives_per_step[(name, "error/folded")]
        assert counted["collectives"] == {"all_gather": 3 * counted["buckets"]}, name
