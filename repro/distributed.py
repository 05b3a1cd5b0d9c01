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
lengths in one small collective, padding to the longest, gathering, and trimming; that
collective also carries the round's header gathers (AllGather.header: the lengths of
batched payloads, the workers' finiteness verdicts), which need none of their own.

A rank joins the process group (`init_distributed`), from torchrun's environment or
spawn's arguments, and dies with the process that started it (`die_with_parent`). Its
`Heartbeat` in the group's store lets it say, when a collective fails, which ranks
stopped answering (RankStopped), where gloo's own error says only that a peer closed the
connection, or that the collective timed out.
"""

import atexit
import contextlib
import datetime
import os
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
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


def _is_header(r: Request) -> bool:
    return isinstance(r, AllGather) and r.header and r.tensor.dtype == torch.int64


def _issue_and_wait(requests: tuple[Request, ...], group) -> list[Any]:
    world = dist.get_world_size(group)
    gathers = [r for r in requests if isinstance(r, AllGather) and not _is_header(r)]
    headers = [r for r in requests if _is_header(r)]
    lengths: list[list[int]] = []
    carried: dict[int, list[torch.Tensor]] = {}
    if gathers or headers:
        # One collective for the round's metadata: each payload's length (the payloads
        # are padded to the longest) and the header gathers (AllGather.header), whose
        # answers are then read from the host copy of the table.
        device = (gathers or headers)[0].tensor.device
        local = torch.cat([
            torch.tensor([r.tensor.numel() for r in gathers], dtype=torch.int64),
            *(r.tensor.reshape(-1).cpu() for r in headers)]).to(device)
        every = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(every, local, group=group)
        table = torch.stack(every).cpu()  # [rank][payload length..., header...]
        n = len(gathers)
        sizes = table[:, :n].tolist()
        lengths = [[sizes[rank][j] for rank in range(world)] for j in range(n)]
        offset = n
        for r in headers:
            k = r.tensor.numel()
            carried[id(r)] = list(table[:, offset: offset + k].unbind(0))
            offset += k

    works = []
    finishers = []
    g = 0
    for r in requests:
        rows = carried.get(id(r))
        if rows is not None:
            finishers.append(lambda rows=rows: rows)
        elif isinstance(r, AllReduce):
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
    """One daemon thread that runs protocol jobs in submission order.

    It is ended before the interpreter finalises (`close`, registered with atexit): a
    job's Future callbacks (the hook's `.then`) run on this thread inside torch's C++
    frames, and a daemon thread that is still in them when finalisation starts is
    unwound by force and aborts the whole process ("terminate called without an active
    exception") after the script itself has finished."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._in_job = threading.Event()  # set while a job's collectives run
        self._thread = threading.Thread(target=self._loop, name="gradcomp-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            gen, group, fut = job
            self._in_job.set()
            try:
                value = run(gen, group)
            except BaseException as exc:  # noqa: BLE001 - surface it through the future
                self._in_job.clear()
                fut.set_exception(exc)
            else:
                self._in_job.clear()
                fut.set_result(value)

    def submit(self, gen: Generator[Any, Any, Any], group=None) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((gen, group, fut))
        return fut

    def close(self, timeout: float) -> bool:
        """Let the thread finish what it is doing and return, waiting at most `timeout`
        seconds; False if it is still running then. A thread inside a job's collectives
        is not waited for (a process ending there is failing: a peer is gone or hangs, and
        waiting would only delay the exit), only one completing a job's Future."""
        self._jobs.put(None)
        self._thread.join(0.0 if self._in_job.is_set() else timeout)
        return not self._thread.is_alive()


_comm_thread: CommThread | None = None
_lock = threading.Lock()
CLOSE_TIMEOUT_S = 10.0
_closed_at_exit = False  # whether close_comm_thread is registered with atexit


def run_async(gen: Generator[Any, Any, Any], group=None) -> torch.futures.Future:
    """Queue a protocol generator on the communication thread; a Future of its result."""
    global _comm_thread, _closed_at_exit
    with _lock:
        if _comm_thread is None:
            if not _closed_at_exit:
                atexit.register(close_comm_thread)
                _closed_at_exit = True
            _comm_thread = CommThread()
    return _comm_thread.submit(gen, group)


def close_comm_thread(timeout: float = CLOSE_TIMEOUT_S) -> bool:
    """End the communication thread (a later run_async starts a new one); True if it
    ended, or there was none."""
    global _comm_thread
    with _lock:
        thread, _comm_thread = _comm_thread, None
    if thread is None:
        return True
    return thread.close(timeout)


class RankStopped(RuntimeError):
    """Another rank stopped answering: it died, hung past cluster.timeout_s, or failed."""


class Heartbeat:
    """Each rank writes the time into the process group's store every `period` seconds
    from a daemon thread. When a collective fails, the ranks whose heartbeat stopped are
    the ones that stopped answering: the error can name them (gloo's own says only
    'Connection closed by peer', or times out)."""

    def __init__(self, rank: int, world_size: int, period: float):
        from torch.distributed import distributed_c10d

        self.rank, self.world_size, self.period = rank, world_size, period
        self.store = distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="gradcomp-heartbeat",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank: int, world_size: int, timeout_s: float) -> "Heartbeat | None":
        """A heartbeat for this rank, beating every tenth of the collectives' timeout (at
        least every 2 s); None where no other rank listens or there is no store."""
        if world_size <= 1:
            return None
        try:
            return cls(rank, world_size, min(2.0, timeout_s / 10))
        except Exception:  # noqa: BLE001 - no store to write to: no names in the error
            return None

    def _key(self, rank: int) -> str:
        return f"gradcomp/heartbeat/{rank}"

    def _beat(self) -> None:
        self.store.set(self._key(self.rank), repr(time.time()))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store went away: the run is ending
                return

    def stop(self) -> None:
        """End the beats and wait for the thread: no store call is in flight when the
        process group and its store are torn down."""
        self._stop.set()
        self._thread.join(timeout=self.period + 5)

    def read(self) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for r in range(self.world_size):
            try:
                out[r] = self.store.get(self._key(r)).decode()
            except Exception:  # noqa: BLE001 - unreadable: the store's host is gone
                out[r] = None
        return out

    def stopped(self) -> list[int]:
        """The ranks whose heartbeat does not move over a few periods (this one aside),
        leaving out those that, like this one, are stopping because of the failure (they
        say so in the store first, so their heartbeat ending does not count)."""
        with contextlib.suppress(Exception):  # the store's host is gone: nothing to say
            self.store.set(f"gradcomp/leaving/{self.rank}", "1")
        first = self.read()
        time.sleep(2.5 * self.period)
        second = self.read()
        return [r for r in range(self.world_size)
                if r != self.rank and (second[r] is None or second[r] == first[r])
                and not self._leaving(r)]

    def _leaving(self, rank: int) -> bool:
        try:
            return self.store.check([f"gradcomp/leaving/{rank}"])
        except Exception:  # noqa: BLE001
            return False

    def explain(self, exc: BaseException, step: int | str, timeout_s: float) -> RankStopped | None:
        """RankStopped naming the ranks that stopped answering, for a collective that
        failed with `exc` at `step`; None when every other rank is still beating."""
        gone = self.stopped()
        if not gone:
            return None
        return RankStopped(
            f"rank {self.rank}: a collective failed at step {step} because rank(s) "
            f"{', '.join(map(str, gone))} stopped answering (no heartbeat for "
            f"{2.5 * self.period:.0f} s; collectives wait at most cluster.timeout_s="
            f"{timeout_s:g} s). The failure: {str(exc).strip().splitlines()[0]}")


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (broadcast in the default process group where it
    has several ranks; elsewhere `value` itself): a decision taken once, for all."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


@contextlib.contextmanager
def naming_stopped_ranks(rank: int, world_size: int, timeout_s: float,
                         step: Callable[[], int | str], own: tuple[type, ...] = (),
                         own_names: tuple[str, ...] = ()) -> Iterator[Heartbeat | None]:
    """This rank's Heartbeat beats within the block; a collective that fails in it
    (RuntimeError, DistError) because other ranks stopped answering is raised as
    RankStopped naming them and `step()`. Errors of the kinds in `own`, or whose text
    names one of `own_names` (one rank's error carried to another), every rank raises
    itself: they pass as they are, as does every error where no heartbeat could start."""
    heartbeat = Heartbeat.start(rank, world_size, timeout_s)
    try:
        yield heartbeat
    except (RuntimeError, dist.DistError) as exc:
        if (heartbeat is None or isinstance(exc, (RankStopped, *own))
                or any(name in str(exc) for name in own_names)):
            raise
        stopped = heartbeat.explain(exc, step(), timeout_s)
        if stopped is None:
            raise
        raise stopped from exc
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def init_distributed(cfg, rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None) -> tuple[int, int]:
    """Join the process group: from torchrun's environment, or from spawn's arguments.
    Collectives wait at most cluster.timeout_s for the other ranks."""
    backend = cfg.cluster.backend
    timeout = datetime.timedelta(seconds=float(cfg.cluster.timeout_s))
    if rank is None:  # under torchrun
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The elastic agent's store outlives a relaunch, and with it the previous
            # attempt's keys (rank addresses): relaunched ranks would read a dead rank's
            # address. A per-attempt prefix keeps each attempt's rendezvous apart.
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world_size, is_master=False)
            store = dist.PrefixStore(f"gradcomp/attempt_{restart}", agent)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)  # env://
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    if cfg.cluster.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        cfg.cluster.device = f"cuda:{local}"
    return dist.get_rank(), dist.get_world_size()



def die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the process that started it (the launcher, or
    torchrun's agent) dies, so no rank outlives the launch that holds the run folder's
    lock (repro.runfolder). Elsewhere nothing changes."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
