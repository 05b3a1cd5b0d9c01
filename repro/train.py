"""The training loop, for real ranks (DDP + comm hook) and for simulated workers.

Both modes share everything but the gradient exchange: the task, optimiser, schedules,
warm-up, clipping, compression schedule (dense start steps, DGC ratio warm-up),
checkpoints, metrics, evaluation. Real ranks: each process trains a DDP model whose comm
hook runs the compressor. Simulated (THC Section 8.3): one process computes n workers'
gradients per step on one model, runs n WorkerCompression protocols through the same
multiplexed per-tensor generators the hook uses, and applies the one aggregate. With the
same seed, n = 2 simulated equals a real 2-rank run step for step.

Workers never compose configs: they read RUN_DIR/config.yaml written by the launcher.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from compressors import drive
from repro import config as config_mod
from repro.costmodel import (
    EfficiencySelector,
    Network,
    profile_compressor,
    sent_fraction,
    wire_bytes_per_worker,
)
from repro.distributed import (
    comm_clock,
    die_with_parent,
    from_rank0,
    init_distributed,
    naming_stopped_ranks,
)
from repro.hooks import CompressionHookState, StepRecord, WorkerCompression, compression_hook
from repro.schedule import RatioWarmup

FAIL_ENV = "GRADCOMP_FAIL_AT_STEP"  # test hook: "STEP:RANK" kills that rank once
NAN_ENV = "GRADCOMP_NAN_AT_STEP"  # test hook: "STEP:RANK" makes that rank's loss NaN once


def poisoned(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """The loss, or NaN where NAN_ENV names this step and rank (fault-injection tests)."""
    spec = os.environ.get(NAN_ENV)
    if spec and tuple(int(x) for x in spec.split(":")) == (step, rank):
        return loss * float("nan")
    return loss


def ratio_at(cfg, step: int) -> float | None:
    """DGC warm-up: the ratio decays exponentially from warmup_ratio to ratio
    (repro.schedule.RatioWarmup)."""
    c = cfg.compressor
    if c.ratio is None:
        return None
    return RatioWarmup(c.ratio, c.warmup_steps, c.warmup_ratio, c.start_step).at(step)


def get_rng() -> dict[str, Any]:
    """This process's random state: torch (CPU and, where present, CUDA) and Python."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def network_of(cfg, base_latency_us: float = 0.0) -> Network:
    """The cluster a run's steps are projected onto. A run on an emulated network is
    projected onto links of that kind (gloo over TCP on tc-shaped links, with the link's
    own latency `base_latency_us` measured on it: Network.emulated_link), so its
    projection can be set beside what it measured."""
    cl = cfg.cluster
    if cl.network == "emulated":
        return Network.emulated_link(cl.target_workers, cl.bandwidth_gbps, cl.latency_ms,
                                     base_latency_us=base_latency_us)
    return Network(workers=cl.target_workers, bandwidth_gbps=cl.bandwidth_gbps, latency_us=cl.latency_us)


def projected_comm_s(records: list[StepRecord], network: Network) -> tuple[float, float]:
    """(projected seconds of this step's exchanges, projected seconds if all were dense)
    on the target cluster: each tensor's collectives charged as they ran (an index
    allgather and a value allreduce as those two; an unequal allgather at its padded
    size), from the bytes each really moved."""
    comm = dense = 0.0
    for r in records:
        dense += network.allreduce_s(r.numel * 4)
        if r.collectives:
            comm += network.pattern_s(r.collectives)
        else:
            comm += network.allreduce_s(r.bytes_sent)
    return comm, dense


def wandb_group(cfg) -> str | None:
    """The run's W&B group: logger.group, else its group= (None for the plain "default",
    which would lump unrelated runs together; a sweep sets logger.group to its own)."""
    if cfg.logger.group:
        return str(cfg.logger.group)
    return None if str(cfg.group) == "default" else str(cfg.group)


def summarise_records(records: list[StepRecord]) -> dict[str, float]:
    out: dict[str, float] = {"bytes_sent": float(sum(r.bytes_sent for r in records))}
    out["compress_s"] = sum(r.encode_s + r.decode_s for r in records)
    comp = [r for r in records if r.compressed]
    sel = [(float(r.selected), float(r.target)) for r in comp if r.selected is not None and r.target]
    if sel:
        out["estimation_quality"] = sum(s for s, _ in sel) / sum(t for _, t in sel)
        # The ratio the compressor really targeted this step (DGC warm-up shows here).
        out["target_ratio"] = sum(t for _, t in sel) / sum(
            r.numel for r in comp if r.selected is not None and r.target)
    uni = [(float(r.union), r.numel) for r in comp if r.union is not None]
    if uni:
        out["density"] = sum(u for u, _ in uni) / sum(n for _, n in uni)
    out["compressed_fraction"] = sum(r.numel for r in comp) / max(1, sum(r.numel for r in records))
    return out


class Trainer:
    """State and loop shared by both modes; subclasses implement `exchange_step`."""

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
        self.ckpt_dir = os.path.join(run_dir, "checkpoints")
        self.last_checkpoint_t = time.perf_counter()

    # -- pieces both modes use ---------------------------------------------------------
    def make_compression(self, rank: int, world: int, names: dict[int, str]) -> WorkerCompression:
        cfg = self.cfg
        selector = self.selector()
        plan = self.plan
        feedback: Any = plan.feedback
        if feedback == "momentum":
            from compressors import MomentumCorrection

            feedback = MomentumCorrection(plan.correction_momentum, plan.correction_nesterov)
        kwargs = dict(feedback=feedback, seed=cfg.seed, selector=selector,
                      min_numel=cfg.compressor.min_numel, measure=True,
                      granularity=plan.granularity, local_clip=plan.local_clip,
                      nonfinite=cfg.nonfinite)
        if isinstance(self, DDPTrainer):
            return CompressionHookState(self.compressor, model=self.model_for_names, **kwargs)
        return WorkerCompression(self.compressor, rank, world, names=names, **kwargs)

    def selector(self) -> EfficiencySelector | None:
        """DRAGONN's efficiency-aware selection (Eq. 1), decided once for every worker: its
        T_comp profiled once, on the run's device and at the target cluster's number of
        workers (decoding grows with it; the network term is the target's), on rank 0,
        and broadcast, so every rank and simulated worker compresses the same tensors (a
        profile per rank would put the cut-off at a different size on each, and ranks
        would issue mismatched collectives)."""
        if not self.cfg.compressor.efficiency_aware:
            return None
        if getattr(self, "_selector", None) is None:
            selector = None
            if self.rank == 0:
                profile = profile_compressor(self.compressor, sizes=(2**10, 2**14, 2**17),
                                             repeats=2, workers=self.network.workers,
                                             device=str(self.device))
                selector = EfficiencySelector(self.network, profile,
                                              sent_fraction(self.compressor))
            self._selector = from_rank0(selector)
        return self._selector

    def apply_schedule(self, compressions: list[WorkerCompression]) -> None:
        r = ratio_at(self.cfg, self.step)
        if r is not None and hasattr(self.compressor, "ratio"):
            self.compressor.ratio = r
        enabled = self.step >= self.cfg.compressor.start_step
        log = self.cfg.logger.log_every and self.step % self.cfg.logger.log_every == 0
        for c in compressions:
            c.enabled = enabled
            c.measure = bool(log)

    def batches(self):
        """Endless per-rank batches, resumable at (epoch, batch_in_epoch)."""
        while True:
            it = self.task.train_batches(self.rank_for_data, self.world_size, self.epoch)
            for i, batch in enumerate(it):
                if i < self.batch_in_epoch:
                    continue
                self.batch_in_epoch = i + 1
                yield batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def setup_optim(self) -> None:
        self.optimizer = self.task.make_optimizer(self.model.parameters())
        if self.plan.optimizer == "momentum_corrected_sgd":
            # The gradient's momentum is in the feedback: SGD keeps it for weight decay only.
            from repro.optim import MomentumCorrectedSGD

            base = self.optimizer
            self.optimizer = MomentumCorrectedSGD(
                [{"params": g["params"], "weight_decay": g["weight_decay"]}
                 for g in base.param_groups],
                lr=base.defaults["lr"], momentum=self.plan.correction_momentum,
                nesterov=self.plan.correction_nesterov)
        steps_per_epoch = getattr(self.task, "steps_per_epoch", None)
        if callable(steps_per_epoch):
            steps_per_epoch = steps_per_epoch(self.world_size)
        self.scheduler = self.task.make_scheduler(self.optimizer, steps_per_epoch or 100)

    def clip(self) -> None:
        """Clipping of the aggregate; with DGC's local clipping it happened on each worker
        before accumulation instead (WorkerCompression.clip_locally)."""
        if self.plan.global_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.plan.global_clip)

    def maybe_fail(self) -> None:
        spec = os.environ.get(FAIL_ENV)
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        fail_step, fail_rank = (int(x) for x in spec.split(":"))
        if self.step == fail_step and self.rank == fail_rank:
            os._exit(17)

    def evaluate(self) -> dict[str, float]:
        result = self.task.evaluate(self.model_for_eval, max_batches=self.cfg.eval_batches)
        return {f"eval/{k}": float(v) for k, v in result.items()}

    def reached_target(self, value: float) -> bool:
        return value >= self.task.target if self.task.higher_is_better else value <= self.task.target

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "model": self.model_for_eval.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": get_rng(),
            "wall_time": self.wall_offset + (time.perf_counter() - self.t_start),
            "best": self.best,
        }

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch_in_epoch = sd["step"], sd["epoch"], sd["batch_in_epoch"]
        self.model_for_eval.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.scheduler is not None and sd["scheduler"] is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        set_rng(sd["rng"])
        self.wall_offset = sd["wall_time"]
        self.best = sd["best"]

    def checkpoint_files(self) -> list[str]:
        """The files a checkpoint of this run must hold for this process to resume."""
        return ["trainer.pt"]

    def latest_checkpoint(self) -> str | None:
        """The newest complete, unaltered checkpoint made under this run's config (a bad
        one is skipped with a warning naming the file: repro.checkpoints; so is one that
        passes its checksums but not the safe loader), or None. Only a checkpoint whose
        steps metrics.jsonl covers is taken (`metrics_gap`); when the newest does not
        and no older one is left, MetricsGap names the missing steps. With real ranks
        rank 0 decides and every rank resumes from the same one (or raises the same error)."""
        path: Any = None
        if self.is_main:
            try:
                path = self.find_checkpoint()
            except MetricsGap as exc:
                path = exc
        path = from_rank0(path)
        if isinstance(path, MetricsGap):
            raise path
        return path

    def find_checkpoint(self) -> str | None:
        """latest_checkpoint's choice, on rank 0."""
        from repro import checkpoints

        cfg_hash = checkpoints.config_hash(self.cfg)
        needed = self.checkpoint_files()
        path = checkpoints.find(self.ckpt_dir, cfg_hash, needed, loadable=True)
        gap = None if path is None else self.metrics_gap(upto=checkpoints.step_of(path))
        if gap is None:
            return path
        older = checkpoints.find(self.ckpt_dir, cfg_hash, needed, max_step=gap[0],
                                 loadable=True)
        if older is not None:
            warnings.warn(f"resuming from {older}, not {path}: {gap[1]}", RuntimeWarning,
                          stacklevel=2)
            return older
        raise MetricsGap(f"{path} cannot be resumed: {gap[1]}; nothing was run. Restore that "
                         "file, or start the run afresh with --restart")

    def logged_steps(self, upto: int) -> list[int]:
        """The steps below `upto` that leave a line in metrics.jsonl: every
        logger.log_every-th, each one ending with an evaluation, and the last."""
        cfg = self.cfg
        every, evals = cfg.logger.log_every, cfg.eval_every
        return [s for s in range(min(upto, cfg.steps))
                if (every and s % every == 0) or (evals and (s + 1) % evals == 0)
                or s == cfg.steps - 1]

    def metrics_gap(self, upto: int | None = None) -> tuple[int, str] | None:
        """(first step whose line metrics.jsonl lacks, what is missing) among the steps
        below `upto` (all) that leave one, or None when it holds all of them."""
        from repro.logging import METRICS_FILE, parse_metrics

        path = os.path.join(self.run_dir, METRICS_FILE)
        records = parse_metrics(path)[0] if os.path.exists(path) else []
        have = {r["step"] for r in records}
        missing = [s for s in self.logged_steps(self.cfg.steps if upto is None else upto)
                   if s not in have]
        if not missing:
            return None
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        return missing[0], (f"{path} lacks the lines of {len(missing)} step(s) ({shown}): it "
                            "was truncated, replaced or deleted")

    @staticmethod
    def atomic_save(obj: Any, path: str) -> None:
        from repro import checkpoints

        checkpoints.save(obj, path)

    @staticmethod
    def load_file(path: str) -> Any:
        from repro import checkpoints

        return checkpoints.load(path)

    def publish_checkpoint(self, path: str) -> None:
        """Seal a fully written checkpoint (its manifest) and point LATEST at it."""
        from repro import checkpoints

        checkpoints.finish(path, checkpoints.config_hash(self.cfg))

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from repro.logging import MetricsWriter, WandbLogger, progress

        cfg = self.cfg
        self.setup_optim()
        self.setup_compression()
        self.t_start = time.perf_counter()
        resumed = self.resume()
        resumed_from = self.step if resumed else None
        writer = wandb = None
        if self.is_main:
            os.makedirs(self.ckpt_dir, exist_ok=True)
            writer = MetricsWriter(self.run_dir, resume_step=(self.step - 1) if resumed else None,
                                   wall_offset=self.wall_offset if resumed else None)
            if cfg.logger.wandb:
                from omegaconf import OmegaConf

                wandb = WandbLogger(
                    OmegaConf.to_container(cfg, resolve=True), project=cfg.logger.project,
                    group=wandb_group(cfg), name=os.path.basename(self.run_dir),
                    run_dir=self.run_dir, entity=cfg.logger.entity,
                    tags=list(cfg.logger.tags), notes=cfg.logger.notes,
                    # W&B steps only go up: what an earlier attempt logged is not logged again
                    logged_through=writer.previous_last_step if resumed else None,
                )
        batches = self.batches()
        global_batch = None
        final = None
        bar = progress(range(self.step, cfg.steps), desc=os.path.basename(self.run_dir),
                       enabled=self.is_main and cfg.logger.progress)
        for _ in bar:
            self.maybe_fail()
            self.apply_schedule(self.compressions)
            comm_clock.pop()
            t0 = time.perf_counter()
            loss, samples = self.exchange_step(batches)
            # nonfinite=skip: every worker agreed to skip this step (GradScaler-style):
            # no update, no schedule step, error feedback as it was.
            skipped = getattr(self.compressions[0], "skipped", False)
            if not skipped:
                self.clip()
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            self.after_update()
            step_s = time.perf_counter() - t0
            comm_s = comm_clock.pop()
            global_batch = samples * self.world_size
            all_records = [c.pop_records() for c in self.compressions]
            records = all_records[0]
            # Simulated workers run one after the other in this process: the step holds
            # every worker's forward/backward and compression, not one worker's.
            serial_compress_s = sum(r.encode_s + r.decode_s for recs in all_records for r in recs)
            logging_step = cfg.logger.log_every and self.step % cfg.logger.log_every == 0
            metrics = None
            if logging_step:
                metrics = self.step_metrics(loss, step_s, comm_s, global_batch, records,
                                            serial_compress_s)
                if skipped:
                    metrics["skipped"] = 1
            self.step += 1
            last = self.step == cfg.steps
            if last or (cfg.eval_every and self.step % cfg.eval_every == 0):
                # The final evaluation goes into the last step's record: one line per step.
                metrics = self.add_eval(metrics or {})
                if last:
                    final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
            if metrics is not None and self.is_main:
                writer.log(self.step - 1, **metrics)
                if wandb is not None:
                    wandb.log(self.step - 1, metrics)
            stop, due = self.step_flags()
            stop = stop and not last  # a signal at the last step: the run just finishes
            # The last step is kept (checkpoint_at_end): a finished run given more steps
            # goes on from it.
            if stop or due or (last and cfg.checkpoint_at_end) or (cfg.checkpoint_every
                                       and self.step % cfg.checkpoint_every == 0):
                self.save_checkpoint()
                self.checkpoint_saved()
            if stop:
                break
        if self.step < cfg.steps:  # stopped by a signal (repro.stopping), a checkpoint here
            if self.is_main:
                writer.close()
                if wandb is not None:
                    wandb.finish()
            return {"steps": self.step, "interrupted": True}
        if final is None:  # relaunched after the last checkpoint: its record is on file already
            final = self.add_eval({})
        summary = {
            "steps": self.step, "wall_time_s": self.wall_offset + time.perf_counter() - self.t_start,
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
        if self.is_main:
            # Throughput over every logged step, read back from metrics.jsonl (the steps of
            # earlier attempts included): total samples / total step time; and the rest of
            # what the summary line prints (final loss, k̂/k, density beside its target).
            from repro.logging import METRICS_FILE, parse_metrics, run_results

            summary.update(writer.throughput().summary())
            records = parse_metrics(os.path.join(self.run_dir, METRICS_FILE))[0]
            summary.update(run_results(records, cfg.compressor.ratio))
        if self.is_main:
            # summary.json, then DONE (both written whole or not at all): DONE means the
            # summary is complete. If either write fails (disk full) neither is left, so
            # the run never looks finished, and the same command finishes it.
            from repro import checkpoints

            try:
                gap = self.metrics_gap()
                if gap is not None:  # another writer, or a hand, took lines away
                    raise MetricsGap(f"{self.run_dir} is not marked finished: {gap[1]}; start "
                                     "the run afresh with --restart")
                writer.write_summary(summary)
                checkpoints.write_text(os.path.join(self.run_dir, "DONE"), f"{self.step}\n")
            except OSError as exc:
                summary_path = os.path.join(self.run_dir, "summary.json")
                if os.path.exists(summary_path):
                    os.remove(summary_path)
                raised = checkpoints.write_error(
                    getattr(exc, "path", None) or exc.filename or self.run_dir, exc,
                    "the run is not marked finished (no summary.json, no DONE)")
                if raised is None:
                    raise
                raise raised from exc
            finally:
                writer.close()
                if wandb is not None:
                    wandb.finish()
            checkpoints.remove_stale_temps_under(self.run_dir)  # left by killed attempts
            checkpoints.prune(self.ckpt_dir, cfg.keep_checkpoints)  # and a prune cut short
        return summary

    def after_update(self) -> None:
        """Once the step's update is applied (real ranks: the replica check)."""

    def local_flags(self) -> tuple[bool, bool]:
        """(this process was asked to stop by a signal, a checkpoint is due by time)."""
        from repro import stopping

        every = self.cfg.checkpoint_every_s
        due = bool(every) and time.perf_counter() - self.last_checkpoint_t >= every
        return stopping.requested() is not None, due

    def step_flags(self) -> tuple[bool, bool]:
        """(stop after this step, write a checkpoint now), the same on every worker."""
        return self.local_flags()

    def checkpoint_saved(self) -> None:
        """After a checkpoint was sealed: its clock restarts, rank 0 prunes old ones."""
        self.last_checkpoint_t = time.perf_counter()
        if self.is_main:
            from repro import checkpoints

            checkpoints.prune(self.ckpt_dir, self.cfg.keep_checkpoints)

    def compression_step(self) -> int:
        """The step index the exchanges use (seeds, cyclic leaders): steps skipped for a
        NaN/Inf do not count, so a skipped step is as if it never happened."""
        return self.step - getattr(self.compressions[0], "skipped_steps", 0)

    def add_eval(self, metrics: dict[str, Any]) -> dict[str, Any]:
        result = self.evaluate() if self.is_main else {}
        metrics.update(result)
        key = f"eval/{self.task.metric}"
        if key in result and "time_to_target_s" not in self.best and self.reached_target(result[key]):
            self.best["time_to_target_s"] = self.wall_offset + time.perf_counter() - self.t_start
            self.best["steps_to_target"] = self.step
        return metrics

    def step_metrics(self, loss: float, step_s: float, comm_s: float, global_batch: int,
                     records: list[StepRecord], serial_compress_s: float) -> dict[str, Any]:
        """One step's metrics. compute_s and compress_s are ONE worker's (worker 0's
        compression; with simulated workers, whose passes run one after the other here,
        compute_s is the step's remaining time divided by the workers), so the projected
        step of a simulated run is a real worker's step, not n workers' in turn."""
        m: dict[str, Any] = {"loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
        m.update(summarise_records(records))
        # On each worker's link, by ring algorithms at this run's worker count (the
        # payload, bytes_sent, only compares compressors at 2 workers).
        m["wire_bytes"] = sum(wire_bytes_per_worker(r.collectives, self.world_size)
                              for r in records)
        m["step_s"] = step_s
        m["comm_s"] = comm_s
        serial = len(self.compressions)
        m["compute_s"] = max(0.0, (step_s - comm_s - serial_compress_s) / serial)
        # The run's rate is total samples / total step time (repro.throughput), from
        # `samples`; the per-step rate is for plots over steps only.
        m["samples"] = global_batch
        m["samples_per_s"] = global_batch / step_s if step_s > 0 else None
        res = self.compressions[0].residuals()
        if res:
            m["ef_norm"] = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(res))))
        ratio = ratio_at(self.cfg, self.step)
        if ratio is not None:
            m["ratio"] = ratio
        proj_comm, proj_dense = projected_comm_s(records, self.network)
        proj_step = m["compute_s"] + m["compress_s"] + proj_comm
        m["projected/comm_s"] = proj_comm
        per_worker = global_batch / self.world_size
        m["projected/step_s"] = proj_step
        m["projected/samples_per_s"] = per_worker * self.network.workers / proj_step if proj_step > 0 else None
        dense_step = m["compute_s"] + proj_dense
        m["projected/speedup_vs_dense"] = dense_step / proj_step if proj_step > 0 else None
        return m


class BuiltinAllreduce:
    """Stands in for the hook state when DDP's own allreduce exchanges the gradients
    (comm_hook=false): every parameter goes dense in fp32, nothing to schedule or save."""

    def __init__(self, model: torch.nn.Module):
        self.enabled = True
        self.measure = False
        self.records = [
            StepRecord(name=n, numel=p.numel(), compressed=False, selected=None, target=None,
                       union=None, bytes_sent=p.numel() * p.element_size(), encode_s=0.0,
                       decode_s=0.0, collectives=(("allreduce", p.numel() * p.element_size()),))
            for n, p in model.named_parameters() if p.requires_grad
        ]

    def pop_records(self) -> list[StepRecord]:
        return self.records

    def residuals(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


class DDPTrainer(Trainer):
    """One real rank: a DDP model whose comm hook runs the compressor."""

    def __init__(self, run_dir: str, rank: int, world_size: int):
        super().__init__(run_dir, rank, world_size)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [torch.cuda.current_device()] if self.device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids)
        self.model_for_names = self.ddp
        self.model_for_eval = self.model
        self.rank_for_data = rank
        if self.cfg.cluster.network == "emulated":
            from repro.netcheck import probe_alpha_us

            # every rank, here: the link's own latency, for the projection onto this link
            self.network = network_of(self.cfg, base_latency_us=probe_alpha_us())

    def setup_compression(self) -> None:
        self.hook_state = self.make_compression(self.rank, self.world_size, {})
        if self.cfg.comm_hook:
            self.ddp.register_comm_hook(self.hook_state, compression_hook)
            self.compressions = [self.hook_state]
        else:  # DDP's built-in allreduce: the baseline our hook's overhead is measured against
            self.compressions = [BuiltinAllreduce(self.model)]

    def after_update(self) -> None:
        every = self.cfg.cluster.replica_check_every
        if every and (self.step + 1) % every == 0:
            from repro.hooks import check_replicas

            check_replicas(self.model, step=self.step)

    def exchange_step(self, batches) -> tuple[float, int]:
        batch = next(batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss = poisoned(self.task.loss(self.ddp, batch), self.step, self.rank)
        loss.backward()
        # The step's stop and checkpoint flags travel with the loss: every rank takes the
        # same decision at the same step (step_flags), at no extra collective.
        value = torch.cat([loss.detach().reshape(1),
                           torch.tensor(self.local_flags(), dtype=loss.dtype, device=loss.device)])
        dist.all_reduce(value)
        self.agreed_flags = (bool(value[1] > 0), bool(value[2] > 0))
        return float(value[0]) / self.world_size, self.task.batch_samples(batch)

    def step_flags(self) -> tuple[bool, bool]:
        return self.agreed_flags

    def checkpoint_files(self) -> list[str]:
        return ["trainer.pt", *(f"rank{r}.pt" for r in range(self.world_size))]

    def resume(self) -> bool:
        path = self.latest_checkpoint()
        if path is None:
            return False
        self.load_checkpoint_state(self.load_file(os.path.join(path, "trainer.pt")))
        mine = self.load_file(os.path.join(path, f"rank{self.rank}.pt"))
        self.compressions[0].load_state_dict(mine["compression"])
        set_rng(mine["rng"])
        return True

    def save_checkpoint(self) -> None:
        """Rank 0 unseals the step's folder; every rank writes its own part, rank 0 the
        trainer's; rank 0 seals it once every part is complete. Each stage ends with every
        rank learning which ranks failed, so a rank whose write failed (disk full) stops
        all of them at once with its message, instead of leaving the others waiting at a
        barrier until cluster.timeout_s; rank 0 removes the unfinished folder."""
        from repro import checkpoints

        name = f"step_{self.step:08d}"
        path = os.path.join(self.ckpt_dir, name)
        error: BaseException | None = None

        def stage(work) -> list[tuple[int, str, bool]]:
            nonlocal error
            if error is None:
                try:
                    work()
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                    error = exc
            mine = None if error is None else (str(error), isinstance(error, OSError))
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, mine)
            return [(r, *e) for r, e in enumerate(every) if e is not None]

        def write_parts() -> None:
            # Every rank's own part: its error feedback / compressor state and its RNG.
            mine = {"compression": self.compressions[0].state_dict(), "rng": get_rng()}
            self.atomic_save(mine, os.path.join(path, f"rank{self.rank}.pt"))
            if self.is_main:
                self.atomic_save(self.checkpoint_state(), os.path.join(path, "trainer.pt"))

        failed = stage(lambda: checkpoints.begin(path) if self.is_main else None)
        if not failed:
            failed = stage(write_parts)
        if not failed:  # sealed only once every rank's file is complete
            failed = stage(lambda: self.publish_checkpoint(path) if self.is_main else None)
        if not failed:
            return
        if error is not None:
            raised = checkpoints.failure(path, error, remove=self.is_main)
            if raised is error:
                raise error
            raise raised from error
        if self.is_main:
            checkpoints.discard(path)
        text = "; ".join(f"rank {r}: {message}" for r, message, _ in failed)
        kind = checkpoints.OutputError if all(fs for _, _, fs in failed) else RuntimeError
        raise kind(f"rank {self.rank} stops: checkpoint {name} could not be written ({text})")


class SimulatedTrainer(Trainer):
    """n simulated workers in one process: n backward passes, one update.

    Each worker sees what a real DDP rank would: its own random stream (dropout), started
    from the same seed as every rank's, and rank 0's buffers (DDP broadcasts them before
    every forward), so n = 2 here equals a real 2-rank run step for step."""

    def __init__(self, run_dir: str):
        cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
        super().__init__(run_dir, 0, cfg.cluster.workers)
        self.model_for_eval = self.model
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.rank_for_data = 0
        self.worker_rng: list[dict[str, Any]] | None = None  # set at the first step or resume
        self.buffers = list(self.model.buffers())
        # Rank 0's buffers at the start of the step, and after rank 0's forward.
        self.buffers_start = [b.clone() for b in self.buffers]
        self.buffers_rank0 = [b.clone() for b in self.buffers]

    def setup_compression(self) -> None:
        names = {id(p): n for n, p in self.named}
        self.compressions = [self.make_compression(r, self.world_size, names) for r in range(self.world_size)]

    def batches(self):
        """One resumable stream per simulated worker, zipped."""
        while True:
            its = [self.task.train_batches(r, self.world_size, self.epoch) for r in range(self.world_size)]
            for i, group in enumerate(zip(*its)):
                if i < self.batch_in_epoch:
                    continue
                self.batch_in_epoch = i + 1
                yield group
            self.epoch += 1
            self.batch_in_epoch = 0

    def exchange_step(self, batches) -> tuple[float, int]:
        group = next(batches)
        grads_per_worker = []
        losses = []
        if self.worker_rng is None:  # every real rank starts from the same seeded state
            self.worker_rng = [get_rng() for _ in range(self.world_size)]
        self.worker_rng[0] = get_rng()  # this process's own stream is rank 0's
        if self.buffers:
            torch._foreach_copy_(self.buffers_start, self.buffers)
        for rank, batch in enumerate(group):
            self.model.zero_grad(set_to_none=True)
            if rank and self.buffers:  # DDP: every rank's forward starts from rank 0's buffers
                torch._foreach_copy_(self.buffers, self.buffers_start)
            set_rng(self.worker_rng[rank])
            loss = poisoned(self.task.loss(self.model, batch), self.step, rank)
            loss.backward()
            self.worker_rng[rank] = get_rng()
            if rank == 0 and self.buffers and len(group) > 1:
                torch._foreach_copy_(self.buffers_rank0, self.buffers)
            losses.append(loss.detach())
            grads_per_worker.append([(n, p.grad) for n, p in self.named])
        if self.buffers and len(group) > 1:
            torch._foreach_copy_(self.buffers, self.buffers_rank0)
        set_rng(self.worker_rng[0])  # the process continues as rank 0 (evaluation)
        jobs, finishes = [], []
        step = self.compression_step()
        for comp, named in zip(self.compressions, grads_per_worker):
            job, finish = comp.step_job(named, step)
            jobs.append(job)
            finishes.append(finish)
        outcomes = drive(jobs)
        for finish, out in zip(finishes, outcomes):
            finish(out)
        for (_, p), (_, g) in zip(self.named, grads_per_worker[0]):
            p.grad = g
        total = losses[0].clone()
        for l_ in losses[1:]:
            total += l_
        return float(total) / self.world_size, self.task.batch_samples(group[0])

    def checkpoint_files(self) -> list[str]:
        return ["trainer.pt", "workers.pt"]

    def resume(self) -> bool:
        path = self.latest_checkpoint()
        if path is None:
            return False
        self.load_checkpoint_state(self.load_file(os.path.join(path, "trainer.pt")))
        workers = self.load_file(os.path.join(path, "workers.pt"))
        if len(workers) != self.world_size:
            raise ValueError(f"checkpoint {path} holds {len(workers)} simulated workers but "
                             f"cluster.workers={self.world_size}; restart the run (--restart)")
        for c, w in zip(self.compressions, workers):
            c.load_state_dict(w["compression"])
            # steps skipped for a NaN/Inf: the exchanges' step index (compression_step)
            c.skipped_steps = int(w.get("skipped_steps", 0))
        self.worker_rng = [w["rng"] for w in workers]
        set_rng(self.worker_rng[0])
        return True

    def save_checkpoint(self) -> None:
        """Unseal the step's folder, write its files, seal it. A failed write (disk full)
        removes the unfinished folder and raises an OutputError naming the file."""
        from repro import checkpoints

        name = f"step_{self.step:08d}"
        path = os.path.join(self.ckpt_dir, name)
        workers = [{"compression": c.state_dict(), "rng": rng, "skipped_steps": c.skipped_steps}
                   for c, rng in zip(self.compressions, self.worker_rng)]
        try:
            checkpoints.begin(path)
            self.atomic_save(workers, os.path.join(path, "workers.pt"))
            self.atomic_save(self.checkpoint_state(), os.path.join(path, "trainer.pt"))
            self.publish_checkpoint(path)
        except Exception as exc:
            raised = checkpoints.failure(path, exc)
            if raised is exc:
                raise
            raise raised from exc


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
        import copy

        super().setup_optim()
        self.sync_every = int(self.cfg.cluster.sync_every)
        self.replicas = [self.model] + [copy.deepcopy(self.model)
                                        for _ in range(self.world_size - 1)]
        own = self.model, self.optimizer, self.scheduler
        self.replica_optimizers = [self.optimizer]
        self.replica_schedulers = [self.scheduler]
        for replica in self.replicas[1:]:
            self.model = replica  # Trainer.setup_optim builds for self.model
            super().setup_optim()
            self.replica_optimizers.append(self.optimizer)
            self.replica_schedulers.append(self.scheduler)
        self.model, self.optimizer, self.scheduler = own

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
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            for _, p in named:
                p.grad = None
            loss = poisoned(self.task.loss(model, batch), self.step, rank)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append([(n, p.grad) for n, p in named])
        step = self.compression_step()
        jobs, finishes = [], []
        for comp, named in zip(self.compressions, grads):
            job, finish = comp.step_job(named, step)
            jobs.append(job)
            finishes.append(finish)
        for finish, out in zip(finishes, drive(jobs)):
            finish(out)  # sets each replica's .grad to its own worker's aggregate
        if not getattr(self.compressions[0], "skipped", False):
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

    def save_checkpoint(self) -> None:
        # Every worker's pass draws from this process's stream: that is each one's state.
        self.worker_rng = [get_rng()] * self.world_size
        super().save_checkpoint()


class MetricsGap(RuntimeError):
    """metrics.jsonl lacks steps a checkpoint or a finished run must have logged."""


def run_rank(run_dir: str, rank: int | None = None, world_size: int | None = None,
             init_method: str | None = None) -> dict[str, Any]:
    """Entry point of one real rank (spawned or under torchrun). When a collective fails
    because another rank died or hung (cluster.timeout_s), this rank stops with
    RankStopped naming the rank(s) that stopped answering. A SIGTERM / SIGINT stops every
    rank at the same step, after a checkpoint there (repro.stopping), and this returns."""
    from repro import stopping

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
