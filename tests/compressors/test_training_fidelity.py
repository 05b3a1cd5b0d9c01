"""The compressors do in training what their papers describe: DEFT over the whole
model's gradient (Algorithm 3's allocation across layers) under the DDP hook and with
simulated workers, DGC's momentum correction replacing the optimizer's momentum and its
local gradient clipping, and the cost model charging each communication pattern as it
runs."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import compressors
from compressors import SimulatedGroup, drive
from compressors.base import target_k
from repro import config as config_mod
from repro.compression import WorkerCompression
from repro.costmodel import Network
from repro.optim import MomentumCorrectedSGD
from repro.testing import run_ranks
from repro.train import projected_comm_s

RATIO = 0.01
WORKERS = 3


def _mlp() -> nn.Module:
    """18 parameter tensors; the 9 biases (and two weights) hold fewer than n/δ = 300
    elements, so one DEFT per tensor would give each at least one selection per worker."""
    torch.manual_seed(0)
    widths = [48, 96, 64, 32, 24, 16, 12, 10, 8, 4]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 48, generator=g), torch.randn(32, 4, generator=g)


def _deft_under_the_hook(rank: int, world: int, name: str, steps: int):
    """A user's DDP script with repro.hooks.make: per step, this rank's local gradients
    (computed beside DDP on the same batch), the averaged gradients DDP hands back and
    the hook's records."""
    import repro.hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    local = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets: the hook must hold them
    state, hook = repro.hooks.make(name, ratio=RATIO, model=ddp, measure=True)
    ddp.register_comm_hook(state, hook)
    out = []
    for step in range(steps):
        x, y = _batch(rank, step)
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        ddp.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        records = state.pop_records()
        out.append({
            "local": [p.grad.clone() for p in local.parameters()],
            "averaged": [p.grad.clone() for p in model.parameters()],
            "records": [(r.name, r.numel, r.compressed, r.union, r.selected) for r in records],
        })
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["deft", pytest.param("cltk", marks=pytest.mark.heavy)])
def test_model_wide_exchange_under_the_ddp_hook(name):
    """DEFT and CLT-k through the public hook on 3 gloo ranks run ONE exchange over the
    whole gradient (their default granularity), so the aggregate's density is δ, not δ
    per tensor with a floor of one selection per tensor and worker; every rank holds the
    same average, and simulated workers given the same gradients produce it."""
    steps = 3
    real = run_ranks(_deft_under_the_hook, WORKERS, name, steps)
    model = _mlp()
    names = {id(p): n for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    workers = [WorkerCompression(compressors.build(name, ratio=RATIO), r, WORKERS, names=names,
                                 measure=True) for r in range(WORKERS)]
    assert all(w.granularity == "model" for w in workers)
    param_names = [n for n, _ in model.named_parameters()]
    for step in range(steps):
        (rec,) = real[0][step]["records"]
        assert rec[0] == "model" and rec[1] == numel and rec[2]
        density = rec[3] / numel
        assert 0.9 <= density / RATIO <= 1.1, f"density {density:.5f} vs δ = {RATIO}"
        for r in range(1, WORKERS):
            for a, b in zip(real[0][step]["averaged"], real[r][step]["averaged"]):
                assert torch.equal(a, b), f"rank {r} differs at step {step}"
        jobs, finishes = [], []
        for r, w in enumerate(workers):
            named = list(zip(param_names, [g.clone() for g in real[r][step]["local"]]))
            job, finish = w.step_job(named, step)
            jobs.append(job)
            finishes.append((finish, named))
        for (finish, named), outcome in zip(finishes, drive(jobs)):
            finish(outcome)
        # The same coordinates, and the same values up to the order in which gloo's
        # three-rank ring sums them (the simulated group sums in rank order).
        for (_, g), want in zip(finishes[0][1], real[0][step]["averaged"]):
            assert torch.equal(g != 0, want != 0)
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-8)


def test_one_instance_per_tensor_would_build_up():
    """The reason DEFT refuses per-tensor exchanges: run per tensor on the same model, the
    union is several times k (every small tensor takes at least one element per worker);
    run over the model, it is k."""
    model = _mlp()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    flat, layout = compressors.flatten_named(named)
    n = 16
    grads = [torch.randn(flat.numel(), generator=torch.Generator().manual_seed(r))
             for r in range(n)]
    whole = SimulatedGroup(compressors.build("deft", ratio=RATIO), n, feedback="none")
    out = whole.step(grads, layout=layout)[0]
    assert out.union <= 1.1 * target_k(flat.numel(), RATIO)
    union = 0
    for seg in layout:
        per = SimulatedGroup(compressors.build("deft", ratio=RATIO), n, feedback="none")
        part = [g[seg.offset: seg.offset + seg.numel] for g in grads]
        union += per.step(part, name=seg.name)[0].union
    assert union > 2 * target_k(flat.numel(), RATIO)


def test_deft_refuses_per_tensor_exchanges_with_the_reason():
    deft = compressors.build("deft", ratio=RATIO)
    with pytest.raises(ValueError, match="granularity='layer' is refused for 'deft'.*across"):
        WorkerCompression(deft, 0, 2, granularity="layer")
    assert WorkerCompression(deft, 0, 2, granularity="bucket").granularity == "bucket"
    assert WorkerCompression(compressors.build("topk"), 0, 2).granularity == "layer"
    cfg = _cfg("compressor=deft", "compressor.granularity=layer")
    with pytest.raises(ValueError, match="compressor.granularity=layer.*refused"):
        config_mod.validate(cfg)


@pytest.mark.parametrize("workers", [4, pytest.param(8, marks=pytest.mark.heavy)])
@pytest.mark.slow
def test_deft_density_in_simulated_training(tmp_path, workers):
    """`repro train` with simulated workers (the DEFT figures' mode) on a ResNet-20 of 23
    tensors, 17 of them smaller than n/δ: the logged density is δ."""
    from repro import launch
    from repro.logging import read_metrics

    (run_dir,) = launch.train([
        "compressor=deft", f"compressor.ratio={RATIO}", "task=cifar10_resnet20",
        "cluster=simulated", f"cluster.workers={workers}", "steps=3", "eval_every=0",
        "eval_batches=1", "logger=local", "logger.progress=false", f"runs_root={tmp_path}",
    ], out=lambda s: None)
    for line in read_metrics(run_dir):
        assert 0.9 <= line["density"] / RATIO <= 1.1, line["density"]


# -- DGC: momentum correction replaces the optimizer's momentum -------------------------------

def _cfg(*overrides):
    from repro import launch

    return launch.compose(["logger=local", *overrides])


def test_momentum_correction_takes_over_the_tasks_sgd_momentum():
    import tasks

    cfg = _cfg("compressor=dgc", "task=cifar10_resnet18")
    task = tasks.build_task("cifar10_resnet18", size="smoke")
    assert task.hparams["momentum"] == 0.9 and task.hparams["nesterov"]
    plan = config_mod.training_plan(cfg, config_mod.build_compressor(cfg, 2), task.hparams)
    assert plan.feedback == "momentum" and plan.optimizer == "momentum_corrected_sgd"
    assert plan.correction_momentum == 0.9 and plan.correction_nesterov
    # An Adam task keeps Adam (DRAGONN's setting) with DGC's default correction.
    cfg = _cfg("compressor=dragonn", "task=cifar10_mixer")
    adam = tasks.build_task("cifar10_mixer", size="smoke").hparams
    plan = config_mod.training_plan(cfg, config_mod.build_compressor(cfg, 2), adam)
    assert plan.optimizer == "task" and plan.correction_momentum == 0.9
    # Residual feedback leaves the task's optimizer alone, and refuses a correction momentum.
    cfg = _cfg("compressor=topk", "task=cifar10_resnet18")
    plan = config_mod.training_plan(cfg, config_mod.build_compressor(cfg, 2), task.hparams)
    assert plan.optimizer == "task" and plan.correction_momentum is None
    cfg = _cfg("compressor=topk", "compressor.momentum=0.5")
    with pytest.raises(ValueError, match="compressor.momentum=0.5.*compressor.feedback=momentum"):
        config_mod.validate(cfg)


@pytest.mark.slow
def test_the_trainer_applies_no_momentum_to_corrected_gradients(tmp_path):
    """A DGC run on a Nesterov-momentum task: the trainer's optimizer moves each parameter
    by exactly −lr · (its aggregate) (weight decay off), whatever came before: the
    momentum is in the feedback, not applied a second time."""
    from repro import launch
    from repro.train import SimulatedTrainer

    planned = launch.plan(["compressor=dgc", "compressor.ratio=0.05", "task=cifar10_resnet18",
                           "cluster=simulated", "cluster.workers=2", "steps=3", "eval_every=0",
                           "logger=local", "logger.progress=false", f"runs_root={tmp_path}"],
                          multirun=False)[0]
    os.makedirs(planned.run_dir)
    config_mod.save(planned.cfg, os.path.join(planned.run_dir, "config.yaml"))
    trainer = SimulatedTrainer(planned.run_dir)
    trainer.setup_optim()
    trainer.setup_compression()
    assert isinstance(trainer.optimizer, MomentumCorrectedSGD)
    for group in trainer.optimizer.param_groups:
        group["weight_decay"] = 0.0
    lr = trainer.optimizer.param_groups[0]["lr"]
    batches = trainer.batches()
    for _ in range(3):
        trainer.exchange_step(batches)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        grads = [p.grad.clone() for p in trainer.model.parameters()]
        trainer.optimizer.step()
        for b, g, p in zip(before, grads, trainer.model.parameters()):
            torch.testing.assert_close(p.detach(), b - lr * g, rtol=0, atol=1e-7)
        trainer.step += 1


def test_momentum_corrected_sgd_keeps_momentum_for_weight_decay_only():
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = MomentumCorrectedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    buf = torch.zeros(2)
    expect = p.detach().clone()
    for g in (torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 2.0])):
        p.grad = g.clone()
        buf = 0.9 * buf + 0.01 * expect if buf.any() else 0.01 * expect
        expect = expect - 0.1 * (g + buf)
        opt.step()
        torch.testing.assert_close(p.detach(), expect)


def test_densely_reduced_tensors_get_the_corrections_momentum():
    """Tensors below min_numel are reduced densely; under momentum correction their
    aggregate gets SGD's momentum (u ← m·u + ḡ) in the buffer the correction uses."""
    m = 0.9
    w = [WorkerCompression(compressors.build("dgc", ratio=0.1), r, 2,
                           feedback=compressors.MomentumCorrection(m), min_numel=100)
         for r in range(2)]
    u = torch.zeros(10)
    for step in range(3):
        grads = [torch.randn(10, generator=torch.Generator().manual_seed(10 * step + r))
                 for r in range(2)]
        mean = (grads[0] + grads[1]) / 2
        named = [[("bias", g.clone())] for g in grads]
        jobs = [wc.step_job(nm, step) for wc, nm in zip(w, named)]
        for (_, finish), o in zip(jobs, drive([j for j, _ in jobs])):
            finish(o)
        u = m * u + mean
        for wc, nm in zip(w, named):
            (rec,) = wc.pop_records()
            assert not rec.compressed
            torch.testing.assert_close(wc.sessions["bias"].state("bias")["feedback"]["momentum"], u)
            torch.testing.assert_close(nm[0][1], u)  # the gradient the optimizer gets


def test_nesterov_momentum_correction_follows_dgcs_form():
    fb = compressors.MomentumCorrection(0.9, nesterov=True)
    state = {}
    g1, g2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    v = fb.compensate(g1, state)
    torch.testing.assert_close(v, 0.9 * g1 + g1)
    v = fb.compensate(g2, state)
    u2 = 0.9 * (0.9 * g1 + g2)
    torch.testing.assert_close(v, (0.9 * g1 + g1) + u2 + g2)


def test_local_clipping_clips_each_worker_before_accumulation():
    """DGC Section 3.2: each worker's whole gradient is clipped to the clip norm × N^-1/2
    before it enters the accumulation: acc = sent + residual holds the clipped gradient."""
    n, clip = 4, 1.0
    workers = [WorkerCompression(compressors.build("dgc", ratio=0.1), r, n, local_clip=clip,
                                 feedback=compressors.MomentumCorrection(0.0))
               for r in range(n)]
    named = [[("w", 10 * torch.randn(300, generator=torch.Generator().manual_seed(r))),
              ("b", 10 * torch.randn(200, generator=torch.Generator().manual_seed(50 + r)))]
             for r in range(n)]
    originals = [[g.clone() for _, g in nm] for nm in named]
    jobs = [w.step_job(nm, 0) for w, nm in zip(workers, named)]
    outs = drive([j for j, _ in jobs])
    for w, orig, (job, finish), out in zip(workers, originals, jobs, outs):
        entered = []
        for (name, _), o in zip([("w", 0), ("b", 0)], out):
            residual = w.sessions[name].residual(name)
            entered.append(residual + o.sent.dense(residual.numel()))
        total = torch.linalg.vector_norm(torch.cat(entered))
        assert total == pytest.approx(clip / math.sqrt(n), rel=1e-5)
        scale = total / torch.linalg.vector_norm(torch.cat(orig))
        torch.testing.assert_close(torch.cat(entered), torch.cat(orig) * scale)


def test_local_clipping_plan_and_refusals():
    import tasks

    lstm = tasks.build_task("ptb_lstm", size="smoke").hparams
    cfg = _cfg("compressor=dgc", "task=ptb_lstm")
    plan = config_mod.training_plan(cfg, config_mod.build_compressor(cfg, 2), lstm)
    assert plan.local_clip == lstm["clip"] and plan.global_clip is None
    cfg = _cfg("compressor=topk", "task=ptb_lstm")
    plan = config_mod.training_plan(cfg, config_mod.build_compressor(cfg, 2), lstm)
    assert plan.local_clip is None and plan.global_clip == lstm["clip"]
    with pytest.raises(ValueError, match="local_clip=on.*task.clip"):
        config_mod.validate(_cfg("compressor=dgc", "compressor.local_clip=on",
                                 "task=cifar10_resnet20"))
    with pytest.raises(ValueError, match="bucket"):
        config_mod.validate(_cfg("compressor=dgc", "task=ptb_lstm", "compressor.granularity=bucket"))


# -- DGC's sparsity warm-up in a user's own DDP script ----------------------------------------

WARMUP_STEPS = 5


def _dgc_warmup_under_the_hook(rank: int, world: int, steps: int):
    """A user's DDP loop with repro.hooks.make("dgc", warmup_steps=...): per step, the
    hook's records and the parameters after the update."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks

    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets per step
    state, hook = repro.hooks.make("dgc", ratio=RATIO, model=ddp, measure=True,
                                   warmup_steps=WARMUP_STEPS, warmup_ratio=0.25)
    ddp.register_comm_hook(state, hook)
    out = []
    for step in range(steps):
        x, y = _batch(rank, step)
        ddp.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
        out.append({"records": [(r.name, r.numel, r.compressed, r.target)
                                for r in state.pop_records()],
                    "params": [p.detach().clone() for p in model.parameters()]})
    return out


@pytest.mark.heavy
@pytest.mark.distributed
def test_dgc_warmup_through_the_hook_follows_the_schedule_step_by_step():
    """make(warmup_steps=5, warmup_ratio=0.25): every tensor's k at step s is the one of
    δ_s = 0.25·(δ/0.25)^(s/5) (DGC's exponential warm-up, 25% → 1%), then δ from step 5
    on, on all 3 ranks, whose models stay identical."""
    steps = WARMUP_STEPS + 2
    real = run_ranks(_dgc_warmup_under_the_hook, WORKERS, steps)
    ratios = [0.25 * (RATIO / 0.25) ** (s / WARMUP_STEPS) for s in range(WARMUP_STEPS)]
    ratios += [RATIO] * (steps - WARMUP_STEPS)
    numels = [p.numel() for p in _mlp().parameters()]
    for step, ratio in enumerate(ratios):
        for r in range(WORKERS):
            records = real[r][step]["records"]
            assert sorted(n for _, n, _, _ in records) == sorted(numels)
            for name, numel, compressed, target in records:
                assert compressed
                assert target == target_k(numel, ratio), (step, r, name, numel, target)
            if r:
                for a, b in zip(real[0][step]["params"], real[r][step]["params"]):
                    assert torch.equal(a, b), f"rank {r} differs at step {step}"
    # the largest tensor (6144 elements): its k falls at every warm-up step, then stays
    largest = [max(t for _, n, _, t in real[0][s]["records"] if n == max(numels))
               for s in range(steps)]
    assert largest == [1536, 806, 423, 222, 116, 61, 61]


def test_hook_warmup_refuses_bad_values_and_compressors_without_a_ratio():
    import repro.hooks

    with pytest.raises(ValueError, match="warmup_steps=-1 must be an integer"):
        repro.hooks.make("dgc", ratio=RATIO, warmup_steps=-1)
    with pytest.raises(ValueError, match="warmup_steps=2.5 must be an integer"):
        repro.hooks.make("dgc", ratio=RATIO, warmup_steps=2.5)
    with pytest.raises(ValueError, match=r"warmup_ratio=0 must lie in \(0, 1\]"):
        repro.hooks.make("dgc", ratio=RATIO, warmup_steps=3, warmup_ratio=0)
    with pytest.raises(ValueError, match="'powersgd' takes no ratio"):
        repro.hooks.make("powersgd", warmup_steps=3)
    state, hook = repro.hooks.make("dgc", ratio=RATIO)
    assert hook is repro.hooks.compression_hook and state.compressor.ratio == RATIO


# -- what the wire carries, and what the cost model charges -----------------------------------

def test_unequal_allgathers_count_the_padded_payload():
    """A threshold sparsifier's workers select different counts; the padded allgather
    carries the longest on every rank, and that is what bytes_sent reports."""
    grads = [torch.randn(50_000, generator=torch.Generator().manual_seed(r)) * (1 + r)
             for r in range(3)]
    outs = SimulatedGroup(compressors.build("hard_threshold", lam=2.0), 3,
                          feedback="none").step(grads)
    counts = [o.selected for o in outs]
    assert len(set(counts)) == 3
    for o in outs:
        assert o.bytes_sent == max(counts) * (4 + 4)
        assert o.collectives == (("allgather", max(counts) * 4), ("allgather", max(counts) * 4))


def test_deft_is_charged_its_pattern_not_one_allgather():
    """DEFT's exchange is a broadcast of the bins, an allgather of each worker's indices
    (padded) and an allreduce of the values at the union: the projection charges those
    three, which for 16 workers is about half of one allgather of all the bytes."""
    from repro.compression import StepRecord

    n, numel = 16, 2_000_000
    layout = compressors.flatten_named([(f"t{i}", torch.zeros(numel // 8)) for i in range(8)])[1]
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    outs = SimulatedGroup(compressors.build("deft", ratio=0.001), n, feedback="none").step(
        grads, layout=layout)
    o = outs[0]
    kinds = [k for k, _ in o.collectives]
    assert kinds == ["broadcast", "allgather", "allreduce"]
    longest = max(x.selected for x in outs)
    assert o.collectives[1][1] == longest * 4 and o.collectives[2][1] == o.union * 4
    net = Network(workers=n, bandwidth_gbps=25, latency_us=0)  # bytes alone (as at 26M)
    record = StepRecord("model", numel, True, o.selected, o.target, o.union, o.bytes_sent,
                        0.0, 0.0, o.collectives)
    comm, _ = projected_comm_s([record], net)
    pattern = (net.broadcast_s(o.collectives[0][1]) + net.allgather_s(longest * 4)
               + net.allreduce_s(o.union * 4))
    assert comm == pytest.approx(pattern, rel=1e-12)
    one_allgather = net.allgather_s(o.bytes_sent)
    assert comm < 0.5 * one_allgather


# -- NaN/Inf in training: one decision for every worker ---------------------------------------

@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.slow
def test_trainer_nonfinite_policy(tmp_path, monkeypatch, policy):
    """A NaN in simulated worker 1's loss at step 2 of 4: with nonfinite=error the run
    stops naming the step, the tensor and the worker; with skip the step is logged as
    skipped, its update not applied, and the run goes on."""
    from repro import launch
    from repro.compression import NonFiniteGradient
    from repro.logging import read_metrics

    monkeypatch.setenv("GRADCOMP_NAN_AT_STEP", "2:1")
    overrides = ["compressor=topk", "compressor.ratio=0.05", "cluster=simulated",
                 "cluster.workers=3", "steps=4", "eval_every=0", "eval_batches=1",
                 "logger=local", "logger.progress=false", f"runs_root={tmp_path}",
                 f"nonfinite={policy}"]
    if policy == "error":
        with pytest.raises(NonFiniteGradient, match=r"step 2: gradient '.*' contains NaN on "
                                                    r"rank 1.*nonfinite=skip"):
            launch.train(overrides, out=lambda s: None)
        return
    (run_dir,) = launch.train(overrides, out=lambda s: None)
    lines = read_metrics(run_dir)
    assert [line.get("skipped", 0) for line in lines] == [0, 0, 1, 0]
    assert all(math.isfinite(line["loss"]) for i, line in enumerate(lines) if i != 2)
