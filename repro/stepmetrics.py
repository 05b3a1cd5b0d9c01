"""What one training step's exchanges recorded (repro.hooks.StepRecord, one per tensor),
turned into the step's metrics, and the step projected onto the target cluster
(cluster.target_workers on links of cluster.bandwidth_gbps / latency) by the cost model.

Times are ONE worker's: with simulated workers, whose passes run one after the other in
one process, compute_s is the step's remaining time divided by the workers, so the
projected step of a simulated run is a real worker's step, not n workers' in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from repro.costmodel import Network, wire_bytes_per_worker

if TYPE_CHECKING:
    from repro.hooks import StepRecord


def network_of(cfg, base_latency_us: float = 0.0) -> Network:
    """The cluster a run's steps are projected onto. A run on an emulated network is
    projected onto links of that kind (gloo over TCP on tc-shaped links, with the link's
    own latency `base_latency_us` measured on it: Network.emulated_link), so its
    projection can be set beside what it measured."""
    cl = cfg.cluster
    if cl.network == "emulated":
        return Network.emulated_link(cl.target_workers, cl.bandwidth_gbps, cl.latency_ms,
                                     base_latency_us=base_latency_us)
    return Network(workers=cl.target_workers, bandwidth_gbps=cl.bandwidth_gbps,
                   latency_us=cl.latency_us)


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


def summarise_records(records: list[StepRecord]) -> dict[str, float]:
    out: dict[str, float] = {"bytes_sent": float(sum(r.bytes_sent for r in records))}
    out["compress_s"] = sum(r.encode_s + r.decode_s for r in records)
    comp = [r for r in records if r.compressed]
    sel = [(float(r.selected), float(r.target)) for r in comp
           if r.selected is not None and r.target]
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


def step_metrics(records: list[StepRecord], *, loss: float, lr: float, step_s: float,
                 comm_s: float, samples: int, serial_compress_s: float, serial: int,
                 world_size: int, network: Network, residuals: list[torch.Tensor],
                 ratio: float | None) -> dict[str, Any]:
    """One step's metrics from worker 0's `records`: `samples` over all workers,
    `serial_compress_s` the compression time of the `serial` workers this process ran in
    turn, `residuals` worker 0's error-feedback buffers, `ratio` the scheduled one."""
    m: dict[str, Any] = {"loss": loss, "lr": lr}
    m.update(summarise_records(records))
    # On each worker's link, by ring algorithms at this run's worker count (the
    # payload, bytes_sent, only compares compressors at 2 workers).
    m["wire_bytes"] = sum(wire_bytes_per_worker(r.collectives, world_size) for r in records)
    m["step_s"] = step_s
    m["comm_s"] = comm_s
    m["compute_s"] = max(0.0, (step_s - comm_s - serial_compress_s) / serial)
    # The run's rate is total samples / total step time (repro.throughput), from
    # `samples`; the per-step rate is for plots over steps only.
    m["samples"] = samples
    m["samples_per_s"] = samples / step_s if step_s > 0 else None
    if residuals:
        m["ef_norm"] = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(residuals))))
    if ratio is not None:
        m["ratio"] = ratio
    proj_comm, proj_dense = projected_comm_s(records, network)
    proj_step = m["compute_s"] + m["compress_s"] + proj_comm
    m["projected/comm_s"] = proj_comm
    m["projected/step_s"] = proj_step
    per_worker = samples / world_size
    m["projected/samples_per_s"] = (per_worker * network.workers / proj_step
                                    if proj_step > 0 else None)
    dense_step = m["compute_s"] + proj_dense
    m["projected/speedup_vs_dense"] = dense_step / proj_step if proj_step > 0 else None
    return m
