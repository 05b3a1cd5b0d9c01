"""The torch.distributed driver: runs ONE worker's protocol generator over real ranks.

Collectives on one process group must be issued in the same order on every rank. A
protocol with several rounds, run from future callbacks, would issue its later rounds
from whichever thread completes first, and two DDP buckets' protocols would interleave
differently on different ranks. So the driver runs every protocol on ONE dedicated
communication thread, jobs in submission order (DDP submits buckets in the same order
on all ranks), each job to completion. The hook gets a Future completed by that thread:
compression and communication still overlap with the rest of backward on the main
thread, as DDP intends.

Within a round, requests are issued asynchronously in order and then waited on. Unequal
AllGather lengths (threshold sparsifiers) are handled by gathering all of the round's
lengths in one small collective, padding to the longest, gathering, and trimming.
"""

import queue
import threading
import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from compressors.requests import AllGather, AllReduce, Broadcast, Request, as_round
from compressors.simulated import drive_one

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _Clock:
    """Wall time spent inside collectives (issue + wait), for the time breakdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def pop(self) -> float:
        with self._lock:
            s, self._seconds = self._seconds, 0.0
            return s


comm_clock = _Clock()


def _run_round(requests: tuple[Request, ...], group) -> list[Any]:
    t0 = time.perf_counter()
    try:
        return _issue_and_wait(requests, group)
    finally:
        comm_clock.add(time.perf_counter() - t0)


def _issue_and_wait(requests: tuple[Request, ...], group) -> list[Any]:
    world = dist.get_world_size(group)
    gathers = [r for r in requests if isinstance(r, AllGather)]
    lengths: list[list[int]] = []
    if gathers:
        device = gathers[0].tensor.device
        local = torch.tensor([r.tensor.numel() for r in gathers], dtype=torch.int64, device=device)
        every = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(every, local, group=group)
        table = torch.stack(every).cpu().tolist()  # [rank][request]
        lengths = [[table[rank][j] for rank in range(world)] for j in range(len(gathers))]

    works = []
    finishers = []
    g = 0
    for r in requests:
        if isinstance(r, AllReduce):
            works.append(dist.all_reduce(r.tensor, op=_OPS[r.op], group=group, async_op=True))
            finishers.append(lambda r=r: r.tensor)
        elif isinstance(r, Broadcast):
            src = dist.get_global_rank(group, r.src) if group is not None else r.src
            works.append(dist.broadcast(r.tensor, src=src, group=group, async_op=True))
            finishers.append(lambda r=r: r.tensor)
        elif isinstance(r, AllGather):
            sizes = lengths[g]
            g += 1
            longest = max(sizes)
            t = r.tensor
            outs = [torch.empty(longest, dtype=t.dtype, device=t.device) for _ in range(world)]
            if longest == 0:
                finishers.append(lambda outs=outs: [o[:0] for o in outs])
                continue
            padded = t
            if t.numel() < longest:
                padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
                padded[: t.numel()] = t
            works.append(dist.all_gather(outs, padded, group=group, async_op=True))
            finishers.append(lambda outs=outs, sizes=sizes: [o[:n] for o, n in zip(outs, sizes)])
        else:  # pragma: no cover - as_round already rejects these
            raise TypeError(type(r).__name__)
    for w in works:
        w.wait()
    return [f() for f in finishers]


def run(gen: Generator[Any, Any, Any], group=None) -> Any:
    """Drive a protocol generator to completion over `group`, in this thread."""
    def answer(item: Any) -> Any:
        requests, is_tuple = as_round(item)
        answers = _run_round(requests, group)
        return tuple(answers) if is_tuple else answers[0]

    return drive_one(gen, answer)


class CommThread:
    """One daemon thread that runs protocol jobs in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="gradcomp-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            gen, group, fut = self._jobs.get()
            try:
                value = run(gen, group)
            except BaseException as exc:  # surface it through the future
                fut.set_exception(exc)
            else:
                fut.set_result(value)

    def submit(self, gen: Generator[Any, Any, Any], group=None) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((gen, group, fut))
        return fut


_comm_thread: CommThread | None = None
_lock = threading.Lock()


def run_async(gen: Generator[Any, Any, Any], group=None) -> torch.futures.Future:
    """Queue a protocol generator on the communication thread; a Future of its result."""
    global _comm_thread
    with _lock:
        if _comm_thread is None:
            _comm_thread = CommThread()
    return _comm_thread.submit(gen, group)
