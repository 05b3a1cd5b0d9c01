"""Network cost model (DRAGONN Eq. 1, SIDCo/DEFT analyses) and efficiency-aware selection.

Times in seconds for one tensor of d elements of A bytes on K workers, latency α (s) and
bandwidth B (bytes/s):
    ring allreduce   T_full(d) = 2(K−1)(α + d·A / (K·B))
    allgather        T_spr(d)  = (K−1)(α + γ·d·A / B)     γ = bytes sent / dense bytes
DRAGONN's rule compresses a tensor only if T_comp(d) < T_full(d) − T_spr(d), with T_comp the
compressor's measured encode + decode time, profiled as a function of d (least squares on
a + b·d over a few sizes).

The model is checked against collectives timed on emulated links of known speed (`repro
netcheck`, repro/netcheck.py): gloo over TCP is modelled with `algorithms="gloo"` and the
links' payload rate (`Network.emulated_link`); the projections onto the papers' GPU
clusters use the ring formulas above (NCCL), which no link on this machine can check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A 1500-byte MTU TCP/IPv4 segment with timestamps: 1448 payload bytes in a 1514-byte
# Ethernet frame (header included, as tc's qdiscs count it).
TCP_PAYLOAD = 1448
FRAME = 1514
ALGORITHMS = ("ring", "gloo")


@dataclass(frozen=True)
class Network:
    """A target cluster: K workers, per-link bandwidth in Gbit/s, latency in µs."""

    workers: int = 16
    bandwidth_gbps: float = 25.0
    latency_us: float = 5.0
    # Fraction of the link rate that carries payload (1.0: the rate is the payload rate).
    efficiency: float = 1.0
    # How the collectives are built. "ring": NCCL's rings, every link busy both ways at
    # once (allgather (K−1)(α + n/B)), broadcast pipelined as scatter + allgather. "gloo":
    # as gloo runs them over TCP, measured on emulated links (`repro netcheck`): its
    # allreduce is a ring, but its allgather moves each step's data one way and then the
    # other (2(K−1)(α + n/B)) and its broadcast sends the whole tensor from the root to
    # each rank in turn ((K−1)(α + n/B)).
    algorithms: str = "ring"

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be ≥ 1")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps={self.bandwidth_gbps} must be > 0")
        if self.latency_us < 0:
            raise ValueError(f"latency_us={self.latency_us} must be ≥ 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency} must be in (0, 1]")
        if self.algorithms not in ALGORITHMS:
            raise ValueError(f"algorithms={self.algorithms!r}; choose one of {', '.join(ALGORITHMS)}")

    @classmethod
    def emulated_link(cls, workers: int, bandwidth_gbps: float, latency_ms: float = 0.0,
                      base_latency_us: float = 0.0) -> Network:
        """gloo ranks on the links repro.netem builds: tbf counts whole Ethernet frames, so
        TCP moves TCP_PAYLOAD of every FRAME bytes of the rate (1448 of 1514 with a
        1500-byte MTU); α is the link's own per-step latency (`base_latency_us`: the
        kernel's and gloo's, measured on the link, repro.netcheck.probe_alpha_us) plus the
        netem delay added to each uplink."""
        return cls(workers=workers, bandwidth_gbps=bandwidth_gbps,
                   latency_us=base_latency_us + latency_ms * 1e3,
                   efficiency=TCP_PAYLOAD / FRAME, algorithms="gloo")

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second of one link."""
        return self.bandwidth_gbps * 1e9 / 8 * self.efficiency

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6

    def allreduce_s(self, nbytes: float) -> float:
        """Ring allreduce of `nbytes` per worker."""
        k = self.workers
        if k == 1:
            return 0.0
        return 2 * (k - 1) * (self.alpha + nbytes / (k * self.bytes_per_s))

    def allgather_s(self, nbytes_per_worker: float) -> float:
        """Allgather where every worker contributes `nbytes_per_worker` (`algorithms`)."""
        k = self.workers
        if k == 1:
            return 0.0
        step = self.alpha + nbytes_per_worker / self.bytes_per_s
        return (k - 1) * step * (2 if self.algorithms == "gloo" else 1)

    def broadcast_s(self, nbytes: float) -> float:
        """Ring: pipelined, as the scatter + allgather it is usually built from. gloo: the
        root sends the whole tensor to each other rank in turn."""
        if self.algorithms == "gloo":
            return (self.workers - 1) * (self.alpha + nbytes / self.bytes_per_s)
        return self.allreduce_s(nbytes) / 2

    def collective_s(self, kind: str, nbytes: float) -> float:
        """One collective of `nbytes` per worker: 'allreduce', 'allgather' (nbytes is each
        worker's padded payload) or 'broadcast'."""
        if kind == "allreduce":
            return self.allreduce_s(nbytes)
        if kind == "allgather":
            return self.allgather_s(nbytes)
        if kind == "broadcast":
            return self.broadcast_s(nbytes)
        raise ValueError(f"unknown collective {kind!r}; expected allreduce, allgather or broadcast")

    def pattern_s(self, collectives) -> float:
        """A tensor's exchange as it ran: the sum over its collectives ((kind, bytes per
        worker), Outcome.collectives). DEFT's index allgather + value allreduce is charged
        as those two, not as one allgather of all the bytes."""
        return sum(self.collective_s(kind, nbytes) for kind, nbytes in collectives)


def wire_bytes_per_worker(collectives, workers: int) -> float:
    """Bytes each worker's link carries (each way) for an exchange's collectives ((kind,
    payload bytes per worker), Outcome.collectives) on `workers` workers, by ring
    algorithms: an allreduce of n bytes moves 2(K−1)/K·n, an allgather of n-byte
    payloads (K−1)·n, a pipelined broadcast (K−1)/K·n. The payload a worker contributes
    ("bytes_sent") compares compressors at K = 2 only; this compares them at any K."""
    k = workers
    if k < 2:
        return 0.0
    share = {"allreduce": 2 * (k - 1) / k, "allgather": float(k - 1), "broadcast": (k - 1) / k}
    total = 0.0
    for kind, nbytes in collectives:
        if kind not in share:
            raise ValueError(f"unknown collective {kind!r}; expected allreduce, allgather or broadcast")
        total += share[kind] * nbytes
    return total


@dataclass
class LinearProfile:
    """T(d) ≈ intercept + slope·d, fitted from measurements (seconds)."""

    intercept: float
    slope: float
    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def __call__(self, numel: int) -> float:
        return max(0.0, self.intercept + self.slope * numel)

    @classmethod
    def fit(cls, sizes: list[int], seconds: list[float]) -> LinearProfile:
        if len(sizes) < 2:
            raise ValueError("a profile needs at least two sizes")
        x = torch.tensor(sizes, dtype=torch.float64)
        y = torch.tensor(seconds, dtype=torch.float64)
        a = torch.stack([torch.ones_like(x), x], dim=1)
        sol = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
        return cls(float(sol[0]), float(sol[1]), list(sizes), list(seconds))


def profile_compressor(compressor, sizes=(2**10, 2**14, 2**18, 2**20), repeats: int = 3,
                       workers: int = 2, device: str = "cpu") -> LinearProfile:
    """Measure encode + decode time of `compressor` (one simulated step of `workers`
    workers; the time of worker 0) at a few sizes, and fit T_comp(d)."""
    from compressors import SimulatedGroup

    measured = []
    for d in sizes:
        best = float("inf")
        g = torch.Generator().manual_seed(d)
        grads = [torch.randn(d, generator=g).to(device) for _ in range(workers)]
        group = SimulatedGroup(compressor, workers, feedback="none", measure=False)
        for r in range(repeats + 1):
            out = group.step(grads, name="profile", step=r)[0]
            if r:  # the first call warms up allocators and caches
                best = min(best, out.encode_s + out.decode_s)
        measured.append(best)
    return LinearProfile.fit(list(sizes), measured)


class EfficiencySelector:
    """DRAGONN Eq. 1: compress a tensor only where it saves time on `network`."""

    def __init__(self, network: Network, compression_profile: LinearProfile,
                 sent_fraction: float, element_bytes: int = 4):
        if not 0 < sent_fraction:
            raise ValueError(f"sent_fraction={sent_fraction} must be > 0")
        self.network = network
        self.profile = compression_profile
        self.sent_fraction = sent_fraction
        self.element_bytes = element_bytes

    def times(self, numel: int) -> dict[str, float]:
        dense = numel * self.element_bytes
        return {
            "full": self.network.allreduce_s(dense),
            "sparse": self.network.allgather_s(self.sent_fraction * dense),
            "compress": self.profile(numel),
        }

    def should_compress(self, numel: int) -> bool:
        t = self.times(numel)
        return t["compress"] < t["full"] - t["sparse"]

    def min_numel(self, upper: int = 2**31) -> int | None:
        """Smallest size worth compressing (binary search; None if none up to `upper`)."""
        if not self.should_compress(upper):
            return None
        lo, hi = 1, upper
        while lo < hi:
            mid = (lo + hi) // 2
            if self.should_compress(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def sent_fraction(compressor, numel: int = 2**20) -> float:
    """γ: bytes a worker sends / dense fp32 bytes, measured on one random tensor."""
    from compressors import SimulatedGroup

    g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    out = SimulatedGroup(compressor, 1, feedback="none", measure=False).step([g])[0]
    return out.bytes_sent / (numel * 4)
