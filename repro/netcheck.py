"""`repro netcheck`: collectives timed on an emulated link beside the cost model's time.

For every (ranks K, link rate B) an emulated network (repro.netem) is built, K gloo
ranks are started inside it, and each collective is run through the suite's own driver
(repro.distributed.run: the path the DDP hook takes, unequal allgathers padded to the
longest after a gather of the lengths). A cell is one collective at one size:

- allreduce: every rank sums `numel` fp32 elements;
- allgather: every rank contributes `numel` elements;
- allgather_unequal: rank r contributes ⌈numel·(r+1)/K⌉ (the longest is `numel`);
- broadcast: rank 0 sends `numel` elements to all.

Each cell runs `warmup` untimed and `repeats` timed rounds; a round starts after a
barrier and lasts until the slowest rank returns (its time is the max over ranks). The
report gives the median with its 10th–90th percentile interval, the time the cost model
projects, and their ratio measured / projected per round. A cell of ≥ 8 MB "agrees"
when the ratio's whole interval lies within ±20%.

The projection is the larger of two terms, and each cell says which one bounds it:

- link: repro.costmodel.Network.emulated_link, gloo's collectives on links of the rate
  (payload 1448 of every 1514 bytes), with the per-step latency α measured on the
  network by a one-element allreduce (probe_alpha_us);
- host: the links of one machine are carried by its kernel and its cores, which move a
  limited number of bytes per second whatever the links' rate. For each K and
  collective, the same collective at the largest size on unshaped links (no tc) gives
  the host's rate; a cell's host term is the bytes all its links carry over that rate.

A host-bound cell measures this machine, not the emulated link: the figures measure on
links slow enough to be link-bound (repro.figures.common.LINK_GBPS).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

OPS = ("allreduce", "allgather", "allgather_unequal", "broadcast")
AGREEMENT = 0.20  # |measured / projected − 1| ≤ 20% on cells of ≥ AGREE_FROM_BYTES
AGREE_FROM_BYTES = 8_000_000


@dataclass
class Cell:
    workers: int
    bandwidth_gbps: float
    latency_ms: float
    alpha_us: float  # the model's per-step latency, measured on the link (probe_alpha_us)
    bound: str  # "link" or "host": the larger term of the projection
    link_s: float
    host_s: float
    op: str
    numel: int
    measured_s: float  # median over rounds
    measured_p10_s: float
    measured_p90_s: float
    projected_s: float
    ratio: float  # median over rounds of measured / projected
    ratio_p10: float
    ratio_p90: float
    samples_s: list[float]

    @property
    def nbytes(self) -> int:
        return self.numel * 4

    @property
    def judged(self) -> bool:
        return self.nbytes >= AGREE_FROM_BYTES

    @property
    def agrees(self) -> bool | None:
        """Within ±20% over the whole interval (None: the cell is below 8 MB)."""
        if not self.judged:
            return None
        return 1 - AGREEMENT <= self.ratio_p10 and self.ratio_p90 <= 1 + AGREEMENT

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(bytes=self.nbytes, agrees=self.agrees)
        return d


def _quantile(values: list[float], q: float) -> float:
    from repro.throughput import percentile

    return percentile(values, q)


# -- the ranks ---------------------------------------------------------------------------
def _unequal(numel: int, rank: int, world: int) -> int:
    return max(1, math.ceil(numel * (rank + 1) / world))


def _one(request):
    return (yield request)


def _time_cells(rank: int, world: int, cells: list[tuple[str, int]], warmup: int,
                repeats: int) -> list[list[float]]:
    """On each rank: every cell's round times (the max over ranks), in cell order."""
    import torch
    import torch.distributed as dist

    from compressors.requests import AllGather, AllReduce, Broadcast
    from repro import distributed

    out = [[probe_alpha_us()]]
    for op, numel in cells:
        n = _unequal(numel, rank, world) if op == "allgather_unequal" else numel
        tensor = torch.zeros(n, dtype=torch.float32)
        if op == "allreduce":
            request = AllReduce(tensor)
        elif op == "broadcast":
            request = Broadcast(tensor, src=0)
        else:
            request = AllGather(tensor)
        rounds = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            distributed.run(_one(request))
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                rounds.append(float(elapsed))
        out.append(rounds)
    return out


def probe_alpha_us(group=None, rounds: int = 21) -> float:
    """The per-step latency α of the model on this link, measured: the median time of a
    one-element allreduce (no bandwidth term) over its 2(K−1) ring steps, the largest
    over the ranks (every rank gets the same value). A collective of every rank of
    `group`: all must call it, at the same point."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world < 2:
        return 0.0
    one = torch.zeros(1)
    dist.barrier(group=group)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dist.all_reduce(one, group=group)
        times.append(time.perf_counter() - t0)
    alpha = torch.tensor([statistics.median(times) / (2 * (world - 1)) * 1e6], dtype=torch.float64)
    dist.all_reduce(alpha, op=dist.ReduceOp.MAX, group=group)
    return float(alpha)


def link_bytes(op: str, numel: int, workers: int) -> int:
    """Bytes all K ranks' links carry together for one cell (each byte counted once, on
    the link it leaves by): a ring allreduce 2(K−1)·n, an allgather K(K−1)·n (unequal:
    padded to the longest), gloo's broadcast (K−1)·n from the root."""
    n, k = numel * 4, workers
    if op == "allreduce":
        return 2 * (k - 1) * n
    if op in ("allgather", "allgather_unequal"):
        return k * (k - 1) * n
    if op == "broadcast":
        return (k - 1) * n
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


# -- the model ---------------------------------------------------------------------------
def projected_s(op: str, numel: int, network) -> float:
    """The cost model's time of one cell on `network` (repro.costmodel.Network)."""
    nbytes = numel * 4
    if op == "allreduce":
        return network.allreduce_s(nbytes)
    if op == "allgather":
        return network.allgather_s(nbytes)
    if op == "allgather_unequal":
        # the driver's two collectives: the lengths (8 bytes a rank), then the padded payloads
        return network.allgather_s(8) + network.allgather_s(nbytes)
    if op == "broadcast":
        return network.broadcast_s(nbytes)
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


# -- the check ---------------------------------------------------------------------------
def run(workers: list[int], bandwidths: list[float], sizes: list[int], ops: list[str],
        repeats: int = 5, warmup: int = 1, latency_ms: float = 0.0, out=print) -> list[Cell]:
    """Every (K, B) network in turn; cells in the order of sizes × ops."""
    from repro import netem
    from repro.costmodel import Network
    from repro.testing import run_ranks

    for k in workers:
        if k < 2:
            raise ValueError(f"--workers {k}: a collective needs ≥ 2 ranks")
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise ValueError(f"unknown collective(s) {', '.join(bad)}; choose from {', '.join(OPS)}")
    if repeats < 1 or warmup < 0:
        raise ValueError("--repeats must be ≥ 1 and --warmup ≥ 0")
    for b in bandwidths:
        if not 0 < b < math.inf:
            raise ValueError(f"--bandwidth-gbps {b}: a link rate must be a finite number > 0")
    netem.check_available(latency=latency_ms > 0)  # one line, before anything is built
    cells: list[Cell] = []
    plan = [(op, n) for n in sizes for op in ops]
    largest = max(sizes)
    for k in workers:
        t0 = time.perf_counter()
        with netem.emulated(k, math.inf) as net:  # unshaped: the host's own rate
            _, *host = run_ranks(_time_cells, k, [(op, largest) for op in ops], warmup, repeats,
                                 network=net, timeout=3600)[0]
        host_rate = {op: link_bytes(op, largest, k) / statistics.median(t)
                     for op, t in zip(ops, host)}
        out(f"netcheck: {k} ranks on unshaped links: "
            + ", ".join(f"{op} {8 * r / 1e9:.2f} Gbit/s in all" for op, r in host_rate.items())
            + f" ({time.perf_counter() - t0:.0f} s)")
        for b in bandwidths:
            t0 = time.perf_counter()
            with netem.emulated(k, b, latency_ms) as net:
                (alpha_us,), *rounds = run_ranks(_time_cells, k, plan, warmup, repeats,
                                                 network=net, timeout=3600)[0]
            model = Network.emulated_link(k, b, latency_ms, base_latency_us=alpha_us)
            for (op, n), samples in zip(plan, rounds):
                link = projected_s(op, n, model)
                host_s = link_bytes(op, n, k) / host_rate[op]
                proj = max(link, host_s)
                ratios = [s / proj for s in samples]
                cells.append(Cell(
                    workers=k, bandwidth_gbps=b, latency_ms=latency_ms, alpha_us=alpha_us,
                    bound="link" if link >= host_s else "host", link_s=link, host_s=host_s,
                    op=op, numel=n,
                    measured_s=statistics.median(samples),
                    measured_p10_s=_quantile(samples, 10), measured_p90_s=_quantile(samples, 90),
                    projected_s=proj, ratio=statistics.median(ratios),
                    ratio_p10=_quantile(ratios, 10), ratio_p90=_quantile(ratios, 90),
                    samples_s=samples))
            out(f"netcheck: {k} ranks at {b:g} Gbit/s done in {time.perf_counter() - t0:.0f} s")
    return cells


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:g} MB"


def table(cells: list[Cell]) -> list[str]:
    """The report as aligned text lines."""
    head = ("ranks", "Gbit/s", "collective", "size", "measured s [10-90%]", "projected s",
            "bound", "measured/projected [10-90%]", "±20%")
    rows = [head]
    for c in cells:
        verdict = {True: "yes", False: "NO", None: "(< 8 MB)"}[c.agrees]
        rows.append((str(c.workers), f"{c.bandwidth_gbps:g}", c.op, _mb(c.nbytes),
                     f"{c.measured_s:.4f} [{c.measured_p10_s:.4f}-{c.measured_p90_s:.4f}]",
                     f"{c.projected_s:.4f}", c.bound,
                     f"{c.ratio:.3f} [{c.ratio_p10:.3f}-{c.ratio_p90:.3f}]", verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def markdown(cells: list[Cell], command: str) -> str:
    """The report as a Markdown page: per (ranks, rate), each collective's measured /
    projected ratio at every size (with the bound: L link, H host), then the cells."""
    sizes = sorted({c.numel for c in cells})
    ops = list(dict.fromkeys(c.op for c in cells))
    by = {(c.workers, c.bandwidth_gbps, c.op, c.numel): c for c in cells}
    lines = ["# Collectives on an emulated link against the cost model", "",
             "Written by:", "", f"    {command}", "",
             "Each cell: measured / projected time, median over rounds [10th–90th percentile], "
             "and the term that bounds the projection (L: the link, H: this host's kernel and "
             "cores; repro/netcheck.py). " + summary_line(cells) + ".", ""]
    for op in ops:
        lines += [f"## {op}", "",
                  "| ranks | Gbit/s | " + " | ".join(_mb(4 * n) for n in sizes) + " |",
                  "|--:|--:|" + "--:|" * len(sizes)]
        for k, b in dict.fromkeys((c.workers, c.bandwidth_gbps) for c in cells):
            row = []
            for n in sizes:
                c = by.get((k, b, op, n))
                row.append("" if c is None else
                           f"{c.ratio:.2f} [{c.ratio_p10:.2f}–{c.ratio_p90:.2f}] "
                           f"{c.bound[0].upper()}")
            lines.append(f"| {k} | {b:g} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def summary_line(cells: list[Cell]) -> str:
    judged = [c for c in cells if c.judged]
    agree = sum(bool(c.agrees) for c in judged)
    link = [c for c in judged if c.bound == "link"]
    return (f"{agree} of {len(judged)} cells of ≥ 8 MB agree with the cost model within "
            f"±{AGREEMENT:.0%} over their 10-90% interval; of the {len(link)} link-bound "
            f"cells, {sum(bool(c.agrees) for c in link)} agree")


def report(cells: list[Cell], command: str) -> dict[str, Any]:
    """What --json writes: the machine, the command, the model and every cell."""
    import os

    import torch

    from repro import netem

    return {
        "command": command,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpu_count": os.cpu_count(),
                    "cpu": platform.processor() or platform.machine()},
        "link": {k: v for k, v in netem.EmulatedNetwork(2, 1.0).describe().items()
                 if k in ("qdisc", "mtu")},
        "model": "max(link, host); link: repro.costmodel.Network.emulated_link (algorithms=gloo): allreduce "
                 "2(K-1)(a + n/(K B')), allgather 2(K-1)(a + n/B'), broadcast (K-1)(a + n/B'); "
                 "B' = link rate x 1448/1514 (TCP payload per Ethernet frame); a = alpha_us, "
                 "measured per network by a one-element allreduce (probe_alpha_us) plus the "
                 "netem delay; host: link_bytes / the rate of the same collective at the largest "
                 "size on unshaped links",
        "agreement": {"within": AGREEMENT, "from_bytes": AGREE_FROM_BYTES},
        "summary": summary_line(cells),
        "cells": [c.as_dict() for c in cells],
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    from repro.durable import write_text

    write_text(path, json.dumps(data, indent=1) + "\n")


# -- compressor exchanges on a link --------------------------------------------------------
def _time_exchanges(rank: int, world: int, names: list[str], sizes: list[int], ratio: float,
                    warmup: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """On each rank: every (compressor, size)'s round times, the max over ranks, of one
    whole exchange (encode, collectives, decode) of a Laplace gradient of that size,
    through the distributed driver, without error feedback."""
    import torch
    import torch.distributed as dist

    import compressors
    from compressors.session import Session
    from repro import distributed, sources

    out: dict[str, list[float]] = {}
    for name in names:
        params = {} if "ratio" not in compressors.default_params(name) else {"ratio": ratio}
        compressor = compressors.build(name, **params)
        for size in sizes:
            grad = sources.synthetic("laplace", size, world, seed, 0)[rank]
            session = Session(compressor, rank, world, feedback="none", measure=False)
            rounds = []
            for i in range(warmup + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                distributed.run(session.exchange("grad", grad, step=i))
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    rounds.append(float(elapsed))
            out[f"{name}:{size}"] = rounds
    return out


def exchange_times(names: list[str], sizes: list[int], ratio: float, workers: int,
                   bandwidth_gbps: float, repeats: int = 5, warmup: int = 1,
                   seed: int = 0) -> dict[tuple[str, int], list[float]]:
    """Round times (s) of whole compressor exchanges on `workers` gloo ranks joined by an
    emulated link of `bandwidth_gbps` (repro.netem), by (compressor, size)."""
    from repro import netem
    from repro.testing import run_ranks

    with netem.emulated(workers, bandwidth_gbps) as net:
        got = run_ranks(_time_exchanges, workers, list(names), list(sizes), ratio, warmup,
                        repeats, seed, network=net, timeout=3600)[0]
    return {(key.rsplit(":", 1)[0], int(key.rsplit(":", 1)[1])): v for key, v in got.items()}
