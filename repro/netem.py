"""An emulated network on one machine: each rank in its own network namespace, linked to
a switch of known speed.

    rank 0 ns: eth0 10.77.0.1 ─veth─ p0 ┐
    rank 1 ns: eth0 10.77.0.2 ─veth─ p1 ┼─ br0 (a bridge in the switch's namespace)
    ...                                 ┘

Every link is shaped with `tc` in both directions (a token bucket, `tbf`, at
`bandwidth_gbps`: a worker's NIC on a non-blocking switch) and, where `latency_ms` > 0,
delayed by `netem` on the rank's uplink (a one-way delay between any two ranks). The
ranks reach each other, and rank 0's rendezvous, over these links only: the addresses
live on links created inside the run's own namespaces, which have no default route, no
NAT and no link to the host's network.

Lifetime: `EmulatedNetwork` is a context manager; its namespaces (and with them every
link) are removed when the run ends, fails or is interrupted. A run killed outright
(SIGKILL) leaves them behind: each network writes a marker naming its owner process
(pid and start time) under MARKER_DIR, and the next network built on this machine
removes the namespaces of every marker whose owner no longer runs (`remove_leftovers`).
Namespaces without such a marker are never touched.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2's `ip` and `tc`, and a kernel
with the tbf qdisc (netem too where latency_ms > 0). `check_available` says in one line
what is missing; nothing is created then.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "gcr"  # namespace names: gcr<pid>x<n>-<rank> and gcr<pid>x<n>-sw
MARKER_DIR = "/run/gradcomp-netem"
SUBNET = "10.77.0"
IFACE = "eth0"  # the rank's interface inside its namespace (GLOO_SOCKET_IFNAME)
MAX_WORKERS = 250
CLONE_NEWNET = 0x40000000


class NetworkUnavailable(ValueError):
    """The emulated network cannot be built on this machine; the message says why (a
    ValueError, as for any setting this machine cannot honour: one line, no traceback)."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        msg = (done.stderr or done.stdout).strip().splitlines()
        raise NetworkUnavailable(f"`{' '.join(cmd)}` failed: {msg[0] if msg else done.returncode}")
    return done


def burst_bytes(bandwidth_gbps: float) -> int:
    """tbf's bucket: 1 ms at the link's rate, at least 32 KiB (a few TSO segments), so a
    link never sends more than about a millisecond ahead of its rate."""
    return max(32 * 1024, int(bandwidth_gbps * 1e9 / 8 * 1e-3))


_available: dict[bool, str | None] = {}


def check_available(latency: bool = False) -> None:
    """Raise NetworkUnavailable (one line: what is missing and how to get it) unless this
    process can build an emulated network; with latency=True the netem qdisc must exist
    too. Probed once per process, with a namespace that is removed again."""
    if latency not in _available:
        _available[latency] = _probe(latency)
    if _available[latency] is not None:
        raise NetworkUnavailable(_available[latency])


def _probe(latency: bool) -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ("cluster.network=emulated needs root (network namespaces and tc); run as root "
                "or use cluster.network=host")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"cluster.network=emulated needs iproute2 ({' and '.join(missing)} not found); "
                "install it: apt-get install iproute2")
    name = f"{PREFIX}{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", name])
    except NetworkUnavailable as exc:
        return f"cannot create a network namespace ({exc}); cluster.network=emulated is unavailable here"
    try:
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        if _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
                 "burst", "32kb", "latency", "50ms"], check=False).returncode:
            return ("this kernel has no tbf qdisc (CONFIG_NET_SCH_TBF), which cluster.network=emulated "
                    "uses to set the link rate")
        if latency and _run(["tc", "-n", name, "qdisc", "replace", "dev", "lo", "root", "netem",
                             "delay", "1ms"], check=False).returncode:
            return ("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), which adds "
                    "cluster.latency_ms; set cluster.latency_ms=0 (the links' own latency only)")
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return None


# -- owners and leftovers -------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid, it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(marker: dict[str, Any]) -> bool:
    return _start_time(int(marker["pid"])) == marker.get("start_time")


def remove_leftovers() -> list[str]:
    """Remove the namespaces of every network whose owner process no longer runs (the
    proof: its marker names a pid and start time that match no running process). Returns
    the namespaces removed."""
    removed: list[str] = []
    try:
        markers = sorted(os.listdir(MARKER_DIR))
    except OSError:
        return removed
    for entry in markers:
        path = os.path.join(MARKER_DIR, entry)
        try:
            with open(path, encoding="utf-8") as f:
                marker = json.load(f)
            if _owner_alive(marker):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a marker this module wrote whole: not proof of anything
        for name in marker.get("namespaces", []):
            if (isinstance(name, str) and name.startswith(PREFIX)
                    and _run(["ip", "netns", "del", name], check=False).returncode == 0):
                removed.append(name)
        with contextlib.suppress(OSError):
            os.remove(path)
    return removed


def existing_namespaces() -> list[str]:
    """Names of the network namespaces this module's prefix marks, as `ip netns` lists them."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(PREFIX)]


# -- the network ---------------------------------------------------------------------------
_counter = iter(range(1, 1 << 30))


@dataclass
class EmulatedNetwork:
    """`workers` namespaces joined through a shaped switch (module docstring)."""

    workers: int
    bandwidth_gbps: float
    latency_ms: float = 0.0
    tag: str = field(default="", init=False)
    namespaces: list[str] = field(default_factory=list, init=False)
    switch: str = field(default="", init=False)
    marker: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) \
                or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers={self.workers!r}: an emulated network links 1 to "
                             f"{MAX_WORKERS} ranks")
        if not self.bandwidth_gbps > 0:  # inf: unshaped links (the host's own capacity)
            raise ValueError(f"bandwidth_gbps={self.bandwidth_gbps!r} must be a number > 0")
        if not 0 <= self.latency_ms < float("inf"):
            raise ValueError(f"latency_ms={self.latency_ms!r} must be a finite number >= 0")

    # -- addresses and entry -----------------------------------------------------------
    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def namespace(self, rank: int) -> str:
        return self.namespaces[rank]

    def exec_prefix(self, rank: int) -> list[str]:
        """Run a command inside rank's namespace: `ip netns exec NAME cmd...`."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def describe(self) -> dict[str, Any]:
        return {"network": "emulated", "workers": self.workers,
                "bandwidth_gbps": self.bandwidth_gbps if self.shaped else None,
                "latency_ms": self.latency_ms,
                "qdisc": "+".join(q for q, on in (("tbf", self.shaped), ("netem", self.latency_ms))
                                  if on) or "none",
                "burst_bytes": burst_bytes(self.bandwidth_gbps) if self.shaped else None,
                "mtu": 1500}

    # -- building and removing ----------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        check_available(latency=self.latency_ms > 0)
        remove_leftovers()
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        names = [f"{self.tag}-{r}" for r in range(self.workers)]
        os.makedirs(MARKER_DIR, mode=0o700, exist_ok=True)
        self.marker = os.path.join(MARKER_DIR, f"{self.tag}.json")
        from repro.durable import write_text

        write_text(self.marker, json.dumps({"pid": os.getpid(), "start_time": _start_time(os.getpid()),
                                            "namespaces": [*names, self.switch]}))
        try:
            self._build(names)
        except BaseException:
            self.destroy()
            raise

    @property
    def shaped(self) -> bool:
        return self.bandwidth_gbps != float("inf")

    def _build(self, names: list[str]) -> None:
        shape: list[str] = []
        if self.shaped:
            rate = f"{self.bandwidth_gbps * 1e3:.6g}mbit"
            shape = ["tbf", "rate", rate, "burst", str(burst_bytes(self.bandwidth_gbps)),
                     "latency", "100ms"]
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        self.namespaces.append(sw)  # removed with the others on failure
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for rank, ns in enumerate(names):
            _run(["ip", "netns", "add", ns])
            self.namespaces.insert(rank, ns)
            port = f"p{rank}"
            _run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port,
                  "netns", sw])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", IFACE])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            if shape:
                _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *shape])  # downlink
            if self.latency_ms > 0 and not shape:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", "netem", "delay",
                      f"{self.latency_ms:g}ms", "limit", "100000"])
            elif self.latency_ms > 0:
                # netem delays the uplink, tbf below it sets the rate
                _run(["tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", "handle", "1:",
                      "netem", "delay", f"{self.latency_ms:g}ms", "limit", "100000"])
                _run(["tc", "-n", ns, "qdisc", "add", "dev", IFACE, "parent", "1:1",
                      "handle", "10:", *shape])
            elif shape:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", *shape])  # uplink

    def destroy(self) -> None:
        """Remove every namespace (and with it every link) of this network; idempotent."""
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        self.namespaces = []
        if self.marker:
            with contextlib.suppress(OSError):
                os.remove(self.marker)
            self.marker = ""


def enter(namespace: str) -> None:
    """Move the calling process (its thread; call it before any other thread starts)
    into a network namespace made by EmulatedNetwork."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def emulated(workers: int, bandwidth_gbps: float, latency_ms: float = 0.0
             ) -> Iterator[EmulatedNetwork]:
    """`with emulated(4, 1.0) as net:` an emulated network for the block's duration. A
    SIGTERM (a scheduler's stop) would end the process without unwinding, so while the
    block runs in the main thread and nobody else handles SIGTERM, it raises SystemExit
    instead: the block unwinds and the network is removed."""
    import signal
    import threading

    net = EmulatedNetwork(workers, bandwidth_gbps, latency_ms)
    previous = None
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with net:
            yield net
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def wait_reachable(net: EmulatedNetwork, timeout_s: float = 5.0) -> None:
    """Block until the links are up (a bridge port forwards after it comes up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = _run(["ip", "-n", net.switch, "-br", "link", "show", "master", "br0"]).stdout
        if out and all("UP" in line or "UNKNOWN" in line for line in out.splitlines()):
            return
        if time.monotonic() > deadline:
            raise NetworkUnavailable(f"the emulated links did not come up within {timeout_s} s")
        time.sleep(0.02)
