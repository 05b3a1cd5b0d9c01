"""The training loop, for real ranks (DDP + comm hook) and for simulated workers.

Both modes share everything but the gradient exchange: the task, optimiser, schedules,
warm-up, clipping, compression schedule (dense start steps, DGC ratio warm-up),
checkpoints, metrics, evaluation. Real ranks: each process trains a DDP model whose comm
hook runs the compressor. Simulated (THC Section 8.3): one process computes n workers'
gradients per step on one model, runs n WorkerCompression protocols through the same
multiplexed per-tensor generators the hook uses, and applies the one aggregate. With the
same seed, n = 2 simulated equals a real 2-rank run step for step.

The loop (`Trainer.run`) trains and hands the rest to components: repro.checkpointer
(when a checkpoint is due, each process's part of it, which one to resume),
repro.runwriter (metrics lines, W&B, summary.json then DONE), repro.gradexchange (the
compression schedule), repro.stepmetrics (a step's metrics and projection),
repro.distributed (the process group, the heartbeat). Workers never compose configs:
they read RUN_DIR/config.yaml written by the launcher.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import time
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from compressors import MomentumCorrection, drive
from repro import config as config_mod
from repro import stopping
from repro.checkpointer import Checkpointer, Parts
from repro.costmodel import EfficiencySelector, profile_compressor, sent_fraction
from repro.distributed import (
    comm_clock,
    die_with_parent,
    from_rank0,
    init_distributed,
    naming_stopped_ranks,
)
from repro.faults import maybe_fail, poisoned
from repro.gradexchange import BuiltinAllreduce, GradientExchange, ratio_at, schedule
from repro.hooks import (
    CompressionHookState,
    StepRecord,
    WorkerCompression,
    check_replicas,
    compression_hook,
)
from repro.logging import progress
from repro.netcheck import probe_alpha_us
from repro.optim import MomentumCorrectedSGD
from repro.rankstate import SimulatedRanks, get_rng, set_rng
from repro.runwriter import MetricsGap, RunWriter
from repro.stepmetrics import network_of, projected_comm_s, step_metrics  # noqa: F401


class Trainer(ABC):
    """State and loop shared by both modes. A mode says how its workers exchange
    gradients (`setup_compression`, `exchange_step`) and what its checkpoints hold beyond
    trainer.pt (`checkpoint_files`, `checkpoint_parts`, `load_parts`)."""

    real_ranks = False  # each process of a process group writes its part of a checkpoint
    compressions: list[GradientExchange]  # one per worker this process runs

    def __init__(self, run_dir: str, rank: int, world_size: int):
        self.run_dir = run_dir
        self.cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
        self.rank = rank
        self.world_size = world_size
        self.is_main = rank == 0
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # task.hparams for the run's size and the short forms task.lr / batch_size / clip,
        # over the task file's values (validated before launch)
        self.task = config_mod.build_task(cfg)
        self.device = torch.device(cfg.cluster.device)
        self.model = self.task.build_model().to(self.device)
        self.network = network_of(cfg)
        self.compressor = config_mod.build_compressor(cfg, world_size)
        self.plan = config_mod.training_plan(cfg, self.compressor, self.task.hparams)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.wall_offset = 0.0
        self.best: dict[str, Any] = {}
        self._selector: EfficiencySelector | None = None
        self.checkpointer = Checkpointer(run_dir, cfg, rank, world_size, ranks=self.real_ranks)

    # -- what a mode provides ------------------------------------------------------------
    @abstractmethod
    def setup_compression(self) -> None:
        """Build self.compressions (once the optimiser exists)."""

    @abstractmethod
    def exchange_step(self, batches) -> tuple[float, int]:
        """Forward, backward and the gradient exchange of one step: every parameter's
        .grad holds the aggregate; (the loss averaged over the workers, samples per
        worker)."""

    @abstractmethod
    def checkpoint_files(self) -> list[str]:
        """The files beside trainer.pt a checkpoint must hold for this process to resume."""

    @abstractmethod
    def checkpoint_parts(self) -> Parts:
        """The files this process writes into a checkpoint (rank 0 adds trainer.pt)."""

    @abstractmethod
    def load_parts(self, path: str) -> None:
        """Resume this mode's own state from checkpoint `path` (after trainer.pt)."""

    # -- pieces both modes use ---------------------------------------------------------
    def compression_options(self) -> dict[str, Any]:
        """The keyword arguments of one worker's WorkerCompression / hook state."""
        cfg, plan = self.cfg, self.plan
        feedback: Any = plan.feedback
        if feedback == "momentum":
            feedback = MomentumCorrection(plan.correction_momentum, plan.correction_nesterov)
        return {"feedback": feedback, "seed": cfg.seed, "selector": self.selector(),
                "min_numel": cfg.compressor.min_numel, "measure": True,
                "granularity": plan.granularity, "local_clip": plan.local_clip,
                "nonfinite": cfg.nonfinite, "batch": cfg.compressor.batch}

    def selector(self) -> EfficiencySelector | None:
        """DRAGONN's efficiency-aware selection (Eq. 1), decided once for every worker: its
        T_comp profiled once, on the run's device and at the target cluster's number of
        workers (decoding grows with it; the network term is the target's), on rank 0,
        and broadcast, so every rank and simulated worker compresses the same tensors (a
        profile per rank would put the cut-off at a different size on each, and ranks
        would issue mismatched collectives)."""
        if self.cfg.compressor.efficiency_aware and self._selector is None:
            selector = None
            if self.rank == 0:
                profile = profile_compressor(self.compressor, sizes=(2**10, 2**14, 2**17),
                                             repeats=2, workers=self.network.workers,
                                             device=str(self.device))
                selector = EfficiencySelector(self.network, profile,
                                              sent_fraction(self.compressor))
            self._selector = from_rank0(selector)
        return self._selector

    def batches(self):
        """Endless batches (`epoch_batches`), resumable at (epoch, batch_in_epoch)."""
        while True:
            for i, batch in enumerate(self.epoch_batches(self.epoch)):
                if i < self.batch_in_epoch:
                    continue
                self.batch_in_epoch = i + 1
                yield batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def epoch_batches(self, epoch: int):
        """This rank's batches of one epoch."""
        return self.task.train_batches(self.rank, self.world_size, epoch)

    def setup_optim(self) -> None:
        self.optimizer, self.scheduler = self.build_optim(self.model)

    def build_optim(self, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """The task's optimizer for `model` and its LR schedule (or None)."""
        optimizer = self.task.make_optimizer(model.parameters())
        if self.plan.optimizer == "momentum_corrected_sgd":
            # The gradient's momentum is in the feedback: SGD keeps it for weight decay only.
            optimizer = MomentumCorrectedSGD(
                [{"params": g["params"], "weight_decay": g["weight_decay"]}
                 for g in optimizer.param_groups],
                lr=optimizer.defaults["lr"], momentum=self.plan.correction_momentum,
                nesterov=self.plan.correction_nesterov)
        steps_per_epoch = getattr(self.task, "steps_per_epoch", None)
        if callable(steps_per_epoch):
            steps_per_epoch = steps_per_epoch(self.world_size)
        return optimizer, self.task.make_scheduler(optimizer, steps_per_epoch or 100)

    def clip(self) -> None:
        """Clipping of the aggregate; with DGC's local clipping it happened on each worker
        before accumulation instead (WorkerCompression.clip_locally)."""
        if self.plan.global_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.plan.global_clip)

    def evaluate(self) -> dict[str, float]:
        result = self.task.evaluate(self.model, max_batches=self.cfg.eval_batches)
        return {f"eval/{k}": float(v) for k, v in result.items()}

    def reached_target(self, value: float) -> bool:
        return (value >= self.task.target if self.task.higher_is_better
                else value <= self.task.target)

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": get_rng(),
            "wall_time": self.wall_offset + (time.perf_counter() - self.t_start),
            "best": self.best,
        }

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch_in_epoch = sd["step"], sd["epoch"], sd["batch_in_epoch"]
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.scheduler is not None and sd["scheduler"] is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        set_rng(sd["rng"])
        self.wall_offset = sd["wall_time"]
        self.best = sd["best"]

    def resume(self) -> bool:
        """Load the checkpoint to resume from (Checkpointer.latest), if there is one."""
        path = self.checkpointer.latest(["trainer.pt", *self.checkpoint_files()])
        if path is None:
            return False
        self.load_checkpoint_state(Checkpointer.load(path, "trainer.pt"))
        self.load_parts(path)
        return True

    def save_checkpoint(self) -> None:
        parts = self.checkpoint_parts()
        if self.is_main:
            parts["trainer.pt"] = self.checkpoint_state
        self.checkpointer.save(self.step, parts)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to cfg.steps, or to the step a signal stopped the run at (then with a
        checkpoint there, and {"steps", "interrupted"}); the run's summary."""
        cfg = self.cfg
        self.setup_optim()
        self.setup_compression()
        self.t_start = time.perf_counter()
        resumed_from = self.step if self.resume() else None
        self.checkpointer.prepare()
        out = RunWriter(self.run_dir, cfg, self.is_main,
                        resume_step=None if resumed_from is None else self.step - 1,
                        wall_offset=None if resumed_from is None else self.wall_offset)
        batches = self.batches()
        final = None
        for _ in progress(range(self.step, cfg.steps), desc=os.path.basename(self.run_dir),
                          enabled=self.is_main and cfg.logger.progress):
            metrics = self.train_step(batches)
            if self.step == cfg.steps:  # the final evaluation is in the last step's record
                final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
            if metrics is not None:
                out.log(self.step - 1, metrics)
            save, stop = self.checkpointer.decide(self.step, self.step_flags())
            if save:
                self.save_checkpoint()
            if stop:
                break
        if self.step < cfg.steps:  # stopped by a signal (repro.stopping), a checkpoint here
            out.close()
            return {"steps": self.step, "interrupted": True}
        if final is None:  # relaunched after the last checkpoint: its record is on file already
            final = self.add_eval({})
        summary = out.finish(self.summary(final, resumed_from), self.step)
        self.checkpointer.tidy()
        return summary

    def train_step(self, batches) -> dict[str, Any] | None:
        """One step: the exchange, the update, and the step's metrics where it logs (its
        evaluation where one is due); those metrics, or None."""
        cfg = self.cfg
        maybe_fail(self.step, self.rank)
        schedule(self.compressions, self.compressor, cfg, self.step)
        comm_clock.pop()
        t0 = time.perf_counter()
        loss, samples = self.exchange_step(batches)
        # nonfinite=skip: every worker agreed to skip this step (GradScaler-style):
        # no update, no schedule step, error feedback as it was.
        skipped = self.compressions[0].skipped
        if not skipped:
            self.clip()
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.after_update()
        step_s = time.perf_counter() - t0
        comm_s = comm_clock.pop()
        records = [c.pop_records() for c in self.compressions]
        metrics = None
        if cfg.logger.log_every and self.step % cfg.logger.log_every == 0:
            # Simulated workers run one after the other in this process: the step holds
            # every worker's forward/backward and compression, not one worker's.
            serial_compress_s = sum(r.encode_s + r.decode_s for rs in records for r in rs)
            metrics = self.step_metrics(loss, step_s, comm_s, samples * self.world_size,
                                        records[0], serial_compress_s)
            if skipped:
                metrics["skipped"] = 1
        self.step += 1
        if self.step == cfg.steps or (cfg.eval_every and self.step % cfg.eval_every == 0):
            # The final evaluation goes into the last step's record: one line per step.
            metrics = self.add_eval(metrics or {})
        return metrics

    def summary(self, final: dict[str, Any], resumed_from: int | None) -> dict[str, Any]:
        """The finished run's summary (RunWriter.finish adds what metrics.jsonl says)."""
        return {
            "steps": self.step,
            "wall_time_s": self.wall_offset + time.perf_counter() - self.t_start,
            "metric": self.task.metric, "target": self.task.target,
            "higher_is_better": self.task.higher_is_better,
            "data_source": self.task.data_source, **final, **self.best,
            # feedback, granularity, momentum and clipping as this run resolved them
            "training": self.plan.describe(),
            # How this process got here: the checkpoint step it resumed from (None: from
            # scratch) and torchrun's relaunch count.
            "resumed_from_step": resumed_from,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }

    def after_update(self) -> None:
        """Once the step's update is applied (real ranks: the replica check)."""

    def step_flags(self) -> tuple[bool, bool]:
        """(stop after this step, write a checkpoint now), the same on every worker."""
        return self.checkpointer.local_flags()

    def compression_step(self) -> int:
        """The step index the exchanges use (seeds, cyclic leaders): steps skipped for a
        NaN/Inf do not count, so a skipped step is as if it never happened."""
        return self.step - self.compressions[0].skipped_steps

    def add_eval(self, metrics: dict[str, Any]) -> dict[str, Any]:
        result = self.evaluate() if self.is_main else {}
        metrics.update(result)
        key = f"eval/{self.task.metric}"
        if (key in result and "time_to_target_s" not in self.best
                and self.reached_target(result[key])):
            self.best["time_to_target_s"] = self.wall_offset + time.perf_counter() - self.t_start
            self.best["steps_to_target"] = self.step
        return metrics

    def step_metrics(self, loss: float, step_s: float, comm_s: float, global_batch: int,
                     records: list[StepRecord], serial_compress_s: float) -> dict[str, Any]:
        """One step's metrics (repro.stepmetrics), from worker 0's records; compute_s and
        compress_s are one worker's, also with simulated workers run in turn here."""
        return step_metrics(
            records, loss=loss, lr=self.optimizer.param_groups[0]["lr"], step_s=step_s,
            comm_s=comm_s, samples=global_batch, serial_compress_s=serial_compress_s,
            serial=len(self.compressions), world_size=self.world_size, network=self.network,
            residuals=self.compressions[0].residuals(), ratio=ratio_at(self.cfg, self.step))


class DDPTrainer(Trainer):
    """One real rank: a DDP model whose comm hook runs the compressor."""

    real_ranks = True

    def __init__(self, run_dir: str, rank: int, world_size: int):
        super().__init__(run_dir, rank, world_size)
        ids = [torch.cuda.current_device()] if self.device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids)
        if self.cfg.cluster.network == "emulated":
            # every rank, here: the link's own latency, for the projection onto this link
            self.network = network_of(self.cfg, base_latency_us=probe_alpha_us())

    def setup_compression(self) -> None:
        if self.cfg.comm_hook:
            state = CompressionHookState(self.compressor, model=self.ddp,
                                         **self.compression_options())
            self.ddp.register_comm_hook(state, compression_hook)
            self.compressions = [state]
        else:  # DDP's built-in allreduce: the baseline our hook's overhead is measured against
            self.compressions = [BuiltinAllreduce(self.model)]

    def after_update(self) -> None:
        every = self.cfg.cluster.replica_check_every
        if every and (self.step + 1) % every == 0:
            check_replicas(self.model, step=self.step)

    def exchange_step(self, batches) -> tuple[float, int]:
        batch = next(batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss = poisoned(self.task.loss(self.ddp, batch), self.step, self.rank)
        loss.backward()
        # The step's stop and checkpoint flags travel with the loss: every rank takes the
        # same decision at the same step (step_flags), at no extra collective.
        flags = torch.tensor(self.checkpointer.local_flags(), dtype=loss.dtype,
                             device=loss.device)
        value = torch.cat([loss.detach().reshape(1), flags])
        dist.all_reduce(value)
        self.agreed_flags = (bool(value[1] > 0), bool(value[2] > 0))
        return float(value[0]) / self.world_size, self.task.batch_samples(batch)

    def step_flags(self) -> tuple[bool, bool]:
        return self.agreed_flags

    def checkpoint_files(self) -> list[str]:
        return [f"rank{r}.pt" for r in range(self.world_size)]

    def checkpoint_parts(self) -> Parts:
        # Every rank's own part: its error feedback / compressor state and its RNG.
        return {f"rank{self.rank}.pt": lambda: {
            "compression": self.compressions[0].state_dict(), "rng": get_rng()}}

    def load_parts(self, path: str) -> None:
        mine = Checkpointer.load(path, f"rank{self.rank}.pt")
        self.compressions[0].load_state_dict(mine["compression"])
        set_rng(mine["rng"])


class SimulatedTrainer(Trainer):
    """n simulated workers in one process: n backward passes, one update. Each worker's
    pass sees what a real DDP rank's would (repro.rankstate.SimulatedRanks), so n = 2
    here equals a real 2-rank run step for step."""

    def __init__(self, run_dir: str):
        cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
        super().__init__(run_dir, 0, cfg.cluster.workers)
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.ranks = SimulatedRanks(self.model, self.world_size)

    def setup_compression(self) -> None:
        names = {id(p): n for n, p in self.named}
        self.compressions = [
            WorkerCompression(self.compressor, r, self.world_size, names=names,
                              **self.compression_options())
            for r in range(self.world_size)]

    def epoch_batches(self, epoch: int):
        """Every simulated worker's batches of one epoch, zipped: a group per step."""
        return zip(*[self.task.train_batches(r, self.world_size, epoch)
                     for r in range(self.world_size)])

    def exchange_step(self, batches) -> tuple[float, int]:
        group = next(batches)
        grads_per_worker: list[Any] = [None] * self.world_size
        losses: list[Any] = [None] * self.world_size
        for rank in self.ranks.passes():  # rank 0 last: its gradients stay on the model
            self.model.zero_grad(set_to_none=True)
            loss = poisoned(self.task.loss(self.model, group[rank]), self.step, rank)
            loss.backward()
            losses[rank] = loss.detach()
            grads_per_worker[rank] = [(n, p.grad) for n, p in self.named]
        self.exchange(grads_per_worker)  # worker 0's aggregate, in the model's .grad
        total = losses[0].clone()
        for l_ in losses[1:]:
            total += l_
        return float(total) / self.world_size, self.task.batch_samples(group[0])

    def exchange(self, grads: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Every worker's protocol on its own (name, gradient) list, run together; each
        list's gradients then hold that worker's aggregate."""
        step = self.compression_step()
        jobs, finishes = zip(*(comp.step_job(named, step)
                               for comp, named in zip(self.compressions, grads)))
        for finish, outcome in zip(finishes, drive(list(jobs))):
            finish(outcome)

    def checkpoint_files(self) -> list[str]:
        return ["workers.pt"]

    def checkpoint_parts(self) -> Parts:
        return {"workers.pt": lambda: self.ranks.state(self.compressions)}

    def load_parts(self, path: str) -> None:
        self.ranks.load(Checkpointer.load(path, "workers.pt"), self.compressions, path)


class ReplicaTrainer(SimulatedTrainer):
    """n simulated workers in one process, each with its own model replica and optimizer
    (cluster.mode=replicas).

    Worker r computes its gradient on replica r and steps replica r with the aggregate its
    own compression protocol decoded, so whatever makes the workers' aggregates differ
    (THC's packets lost on the way back) makes the replicas drift apart, as on a real
    cluster. Every cluster.sync_every steps (0: never) the replicas' floating-point
    parameters and buffers are averaged, before that step's forward: THC's periodic model
    synchronisation. Replica 0 is the trainer's own model, the one the loop in `run`
    clips, steps, schedules, evaluates and checkpoints; the others are stepped here, each
    with an optimizer and schedule built as replica 0's. Unlike SimulatedTrainer's
    workers, each replica keeps its own buffers (BatchNorm statistics), and the workers'
    forward passes draw from this process's one random stream in turn."""

    def setup_optim(self) -> None:
        super().setup_optim()
        self.sync_every = int(self.cfg.cluster.sync_every)
        self.replicas = [self.model] + [copy.deepcopy(self.model)
                                        for _ in range(self.world_size - 1)]
        built = [(self.optimizer, self.scheduler), *map(self.build_optim, self.replicas[1:])]
        self.replica_optimizers = [optimizer for optimizer, _ in built]
        self.replica_schedulers = [scheduler for _, scheduler in built]

    def synchronise(self) -> None:
        """Every floating-point parameter and buffer set to its mean over the replicas
        (integer buffers, e.g. BatchNorm's step count, are left as they are)."""
        with torch.no_grad():
            states = [m.state_dict() for m in self.replicas]
            for name, tensor in states[0].items():
                if tensor.is_floating_point():
                    mean = torch.stack([s[name] for s in states]).mean(0)
                    for s in states:
                        s[name].copy_(mean)

    def exchange_step(self, batches) -> tuple[float, int]:
        if self.sync_every and self.step and self.step % self.sync_every == 0:
            self.synchronise()
        group = next(batches)
        grads, losses = [], []
        for rank, (model, batch) in enumerate(zip(self.replicas, group)):
            model.zero_grad(set_to_none=True)
            loss = poisoned(self.task.loss(model, batch), self.step, rank)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append([(n, p.grad) for n, p in model.named_parameters() if p.requires_grad])
        self.exchange(grads)  # each replica's .grad: its own worker's aggregate
        if not self.compressions[0].skipped:
            for model, opt, sched in zip(self.replicas[1:], self.replica_optimizers[1:],
                                         self.replica_schedulers[1:]):
                if self.plan.global_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), self.plan.global_clip)
                opt.step()
                if sched is not None:
                    sched.step()
        return sum(losses) / len(losses), self.task.batch_samples(group[0])

    def checkpoint_state(self) -> dict[str, Any]:
        state = super().checkpoint_state()
        state["replicas"] = [
            {"model": m.state_dict(), "optimizer": o.state_dict(),
             "scheduler": s.state_dict() if s is not None else None}
            for m, o, s in zip(self.replicas[1:], self.replica_optimizers[1:],
                               self.replica_schedulers[1:])]
        return state

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        super().load_checkpoint_state(sd)
        if len(sd["replicas"]) != len(self.replicas) - 1:
            raise ValueError(f"checkpoint holds {len(sd['replicas']) + 1} replicas but "
                             f"cluster.workers={self.world_size}; restart the run (--restart)")
        for m, o, s, saved in zip(self.replicas[1:], self.replica_optimizers[1:],
                                  self.replica_schedulers[1:], sd["replicas"]):
            m.load_state_dict(saved["model"])
            o.load_state_dict(saved["optimizer"])
            if s is not None and saved["scheduler"] is not None:
                s.load_state_dict(saved["scheduler"])

    def checkpoint_parts(self) -> Parts:
        # Every worker's pass draws from this process's stream: that is each one's state.
        self.ranks.rng = [get_rng()] * self.world_size
        return super().checkpoint_parts()


def run_rank(run_dir: str, rank: int | None = None, world_size: int | None = None,
             init_method: str | None = None) -> dict[str, Any]:
    """Entry point of one real rank (spawned or under torchrun). When a collective fails
    because another rank died or hung (cluster.timeout_s), this rank stops with
    RankStopped naming the rank(s) that stopped answering. A SIGTERM / SIGINT stops every
    rank at the same step, after a checkpoint there (repro.stopping), and this returns."""
    die_with_parent()
    cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
    torch.set_num_threads(max(1, cfg.cluster.threads_per_worker))
    rank, world_size = init_distributed(cfg, rank, world_size, init_method)
    trainer = None
    try:
        with naming_stopped_ranks(  # every rank raises these itself: nobody stopped answering
                rank, world_size, cfg.cluster.timeout_s, own=(FloatingPointError, MetricsGap),
                own_names=("FloatingPointError", "ReplicasDiffer"),
                step=lambda: "?" if trainer is None else trainer.step,
        ), stopping.stop_on_signals(escalate=False):
            trainer = DDPTrainer(run_dir, rank, world_size)
            return trainer.run()
    finally:
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down
            dist.destroy_process_group()


def run_simulated(run_dir: str) -> dict[str, Any]:
    cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
    torch.set_num_threads(max(1, cfg.cluster.threads_per_worker))
    return SimulatedTrainer(run_dir).run()


def run_replicas(run_dir: str) -> dict[str, Any]:
    """Entry point of cluster.mode=replicas (ReplicaTrainer) in this process."""
    cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
    torch.set_num_threads(max(1, cfg.cluster.threads_per_worker))
    return ReplicaTrainer(run_dir).run()
