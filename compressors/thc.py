"""THC, Tensor Homomorphic Compression (Li et al.): compressed values that sum.

`thc_uniform` (Algorithm 1): every worker quantises stochastically onto the SAME 2^b
uniform levels between the global min and max (one tiny allreduce), so the integer
levels of all workers can be summed without decompressing them; one decompression of
the sum, divided by n, is the unbiased mean estimate.

`thc` (Algorithms 2–3): the non-uniform version with THC's pre-processing.
 1. preliminary round: the max over workers of the gradients' norms, ℓ (allreduce MAX);
 2. randomized Hadamard transform R = H·D·x (x zero-padded to a power of two d', D a
    Rademacher diagonal drawn from a seed all ranks share, H orthonormal), scaled by
    √d'/ℓ so coordinates are ≈ N(0, 1), clamped to [−t_p, t_p], t_p = Φ⁻¹(1 − p/2);
 3. the clamped value is mapped to [0, g] and quantised stochastically (unbiased) onto
    the values of the optimal lookup table T (compressors.thc_table): the wire carries
    the b-bit index z, the aggregator sums the table VALUES T[z] (integers ≤ g), which
    is homomorphic: decompress(Σ T[z_i]) / n = mean of the decompressed contributions;
 4. one decompression: the grid back to the real line, ×ℓ/√d', inverse RHT, truncate.
Error feedback (Algorithm 3 line 22) keeps e = x − RHT⁻¹(X_i): the clamp AND the
quantisation error. So `sent` is this worker's own decompressed contribution.

Aggregation. `aggregation="allreduce"` sums the table values with one integer
allreduce: an allreduce sums what it carries, so the wire carries the values at the sum's
width (8 bits by default, as in the paper's prototype; Section 10 makes the same remark),
and `extra["index_bytes"]` reports the b-bit payload a parameter server receives.
`aggregation="ps"` models the paper's parameter server (Section 6): workers send the
packed b-bit indices (allgather; rank 0 plays the PS), rank 0 looks them up and sums,
and broadcasts the sum. It can simulate, as in Fig. 9:
- packet loss: each chunk of `chunk_size` coordinates is lost independently with
  probability `loss_rate`, on the way to the PS (that worker's chunk counts as a zero
  gradient) and/or on the way back (that worker uses a zero aggregate for the chunk,
  so workers' aggregates differ: the divergence the paper's per-epoch model
  synchronisation repairs; see `loss_direction`);
- stragglers: the PS drops `stragglers` randomly chosen workers each round and divides
  by the number it received (Section 8.3's "wait for the top n% of the workers").
All randomness of the simulation comes from the step's shared seed, so every rank
knows what the PS received (a real PS sends its count in the packet header).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compressors import _native
from compressors._native import thc_native
from compressors.base import (
    Compressor,
    Context,
    DecodedSent,
    DenseSent,
    Outcome,
    Pattern,
    Protocol,
    Sent,
)
from compressors.counter_stream import counter_hash, draw_seed, seed_words
from compressors.registry import register
from compressors.requests import AllGather, AllReduce, Broadcast
from compressors.session import mix_seed
from compressors.thc_table import check_config, get_table, threshold

# Integer types a collective can sum. int16 is missing on purpose: neither gloo nor
# NCCL reduces it ("Invalid scalar type" from gloo).
SUM_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
AGGREGATIONS = ("allreduce", "ps")
LOSS_DIRECTIONS = ("up", "down", "both")


# ---------------------------------------------------------------------------------------
# Building blocks (public: the tests and notebooks use them directly).
# ---------------------------------------------------------------------------------------


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fwht_(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Fast Walsh–Hadamard transform of the last dimension (a power of two), in place,
    in Sylvester order (scipy.linalg.hadamard). O(d log d): log2(d) butterfly stages of
    whole-tensor ops (or, for contiguous CPU float32/float64 tensors when the native
    kernels are available, one cache-blocked native pass over L2-sized blocks and one over
    column strips, with the same butterflies in the same order: the same bits). With
    `normalize` the transform is orthonormal (its own inverse)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht_ needs a power-of-two length, got {d}; zero-pad first")
    if not x.is_contiguous():
        raise ValueError("fwht_ works in place on a contiguous tensor")
    if _native.supports_cpu(x):  # cache-blocked, threaded: the same result bit for bit
        _native.fwht_(x)
        if normalize and d > 1:
            x.mul_(d**-0.5)
        return x
    rows = x.numel() // d if d else 0
    h = 1
    while h < d:
        pairs = x.view(rows, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        a.add_(b)  # a + b
        torch.sub(a, b, alpha=2, out=b)  # (a + b) − 2b = a − b, without a temporary
        h *= 2
    if normalize and d > 1:
        x.mul_(d**-0.5)
    return x


# The counter-based random stream (stochastic-rounding noise and RHT signs): h(i) keyed by
# a 64-bit seed, defined and explained in compressors/counter_stream.py (DGC/DRAGONN's
# threshold sample draws from it too).


def _native_stream(device) -> bool:
    return torch.device(device).type == "cpu" and thc_native.available()


def _hash_range(numel: int, seed: int, device) -> torch.Tensor:
    return counter_hash(torch.arange(numel, dtype=torch.int64, device=device), seed)


def hash_noise(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """u_0 … u_{numel−1} of the stream keyed by `seed` (float32 in [0, 1))."""
    if _native_stream(device):
        return thc_native.rng_fill(numel, seed, thc_native.NOISE)
    h = _hash_range(numel, seed, device)
    return (h >> 8).to(torch.float32).mul_(2.0**-24)


def rademacher(numel: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """±1 (float32) from `seed`: the RHT diagonal every rank computes identically
    (s_i = −1 where bit i mod 32 of h(⌊i/32⌋) is set)."""
    if _native_stream(device):
        return thc_native.rng_fill(numel, seed, thc_native.SIGNS)
    words = _hash_range(-(-numel // 32), seed, device)
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = (words[:, None] >> shifts).bitwise_and_(1).flatten()[:numel]
    return bits.to(torch.float32).mul_(-2).add_(1)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the last dimension of a uint8 tensor of b-bit values (< 2^bits) into bytes,
    least significant first: ceil(m·bits/8) bytes per row."""
    values = values.to(torch.uint8)
    if bits == 8:
        return values.clone()
    m = values.shape[-1]
    lead = values.shape[:-1]
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-m) % per
        if pad:
            values = torch.cat([values, values.new_zeros(*lead, pad)], dim=-1)
        groups = values.unflatten(-1, (-1, per))
        out = groups[..., 0].clone()
        for k in range(1, per):
            out.bitwise_or_(groups[..., k] << (k * bits))
        return out
    planes = torch.stack([(values >> j) & 1 for j in range(bits)], dim=-1).flatten(-2)
    pad = (-planes.shape[-1]) % 8
    if pad:
        planes = torch.cat([planes, planes.new_zeros(*lead, pad)], dim=-1)
    planes = planes.unflatten(-1, (-1, 8))
    out = planes[..., 0].clone()
    for k in range(1, 8):
        out.bitwise_or_(planes[..., k] << k)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` b-bit values of each row (uint8)."""
    if bits == 8:
        return packed[..., :numel]
    if 8 % bits == 0:
        per = 8 // bits
        mask = (1 << bits) - 1
        parts = torch.stack([(packed >> (k * bits)) & mask for k in range(per)], dim=-1)
        return parts.flatten(-2)[..., :numel]
    planes = torch.stack([(packed >> k) & 1 for k in range(8)], dim=-1).flatten(-2)
    planes = planes[..., : numel * bits].unflatten(-1, (numel, bits))
    out = planes[..., 0].clone()
    for j in range(1, bits):
        out.bitwise_or_(planes[..., j] << j)
    return out


def uniform_encode(
    x: torch.Tensor, lo: float, hi: float, bits: int, generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Homomorphic USQ (Definition 4.1): stochastic rounding of x onto the 2^b uniform
    levels of [lo, hi] shared by all workers; the level indices (uint8, in x's shape;
    written into `out`, a contiguous uint8 tensor of x's numel on x's device, if given).
    The noise is the counter-hash stream (over x's flattened positions) of one seed drawn
    from `generator`; contiguous CPU float32 takes one fused native pass, the same bits."""
    levels = 2**bits - 1
    step = (hi - lo) / levels
    x = x.to(torch.float32)
    if not float(torch.tensor(step, dtype=torch.float32)) > 0:  # constant: all at lo
        if out is not None:
            return out.zero_().view(x.shape)
        return torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    seed = draw_seed(generator)
    if _native.supports_cpu(x):
        return thc_native.uniform_encode(x, lo, step, levels, seed, out=out)
    u = torch.sub(x, lo).div_(step).clamp_(0, levels)
    noise = hash_noise(x.numel(), seed, x.device).view(x.shape)
    u.add_(noise).floor_().clamp_(max=levels)
    return u.to(torch.uint8) if out is None else out.view(x.shape).copy_(u)


def uniform_decode(
    level_sum: torch.Tensor, lo: float, hi: float, bits: int, workers: int
) -> torch.Tensor:
    """lo + (Σ levels / n)·(hi − lo)/(2^b − 1): one decompression of the summed levels."""
    step = (hi - lo) / (2**bits - 1)
    return _affine(level_sum, step, lo, workers, workers)


def interval_lut(table: torch.Tensor) -> torch.Tensor:
    """For each grid integer i in [0, g], the interval j with T[j] ≤ i < T[j+1] (the last
    interval for i = g), int32. Table values are integers, so ⌊v⌋ picks v's interval."""
    k = table.numel() - 1
    points = torch.arange(int(table[-1]) + 1, dtype=table.dtype, device=table.device)
    return (table[None, :] <= points[:, None]).sum(1).sub_(1).clamp_(0, k - 1).to(torch.int32)


def table_encode(
    grid_values: torch.Tensor,
    table: torch.Tensor,
    generator: torch.Generator | None = None,
    lut: torch.Tensor | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Stochastic quantisation of values in [0, g] onto the (float) table values, to the
    two neighbouring values with the probabilities that make it unbiased: E[T[z]] = v.
    Overwrites `grid_values` (1-D); returns the indices z (int32). The noise is the
    counter-hash stream keyed by `seed` (default: one seed drawn from `generator`).
    `lut`: interval_lut(table), if the caller caches it. (A lookup on ⌊v⌋: about 10x
    cheaper than the binary search of torch.searchsorted for 2^20 values on CPU.)"""
    if seed is None:
        if generator is None:
            raise ValueError("table_encode needs a generator or a seed for its noise")
        seed = draw_seed(generator)
    if lut is None:
        lut = interval_lut(table)
    j = lut.index_select(0, grid_values.to(torch.int32))
    gaps = table[1:] - table[:-1]
    frac = grid_values.sub_(table.index_select(0, j)).div_(gaps.index_select(0, j))
    noise = hash_noise(grid_values.numel(), seed, grid_values.device)
    return j.add_(noise < frac)


@dataclass
class RotatedGrid:
    """What all workers share in one THC step: the RHT's sign seed (the signs are the
    counter-hash stream of `seed`, identical on every rank), the max norm ℓ and the
    quantisation grid; encodes a worker's vector and decodes summed table values.
    On the native path the signs are computed inside the fused passes and never stored;
    the torch path materialises them once (`signs`)."""

    numel: int
    padded: int
    max_norm: float
    t_p: float
    granularity: int
    seed: int

    @classmethod
    def make(
        cls, numel: int, max_norm: float, p: float, granularity: int, seed: int, device=None
    ) -> RotatedGrid:
        # `device` is accepted for compatibility: the signs are computed where needed.
        padded = next_power_of_two(numel)
        return cls(numel, padded, float(max_norm), threshold(p), granularity, int(seed))

    @functools.cached_property
    def _signs_by_device(self) -> dict[str, torch.Tensor]:
        return {}

    def signs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The Rademacher diagonal D (padded length, float32 ±1) on `device`, cached."""
        key = str(torch.device(device))
        cache = self._signs_by_device
        if key not in cache:
            cache[key] = rademacher(self.padded, self.seed, device)
        return cache[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """√d'/ℓ · H·D·x (zero-padded, float32): coordinates ≈ N(0, 1). The copy into the
        padded buffer applies 1/ℓ and the signs in one pass (native) or two (torch):
        (x / ℓ)·s_i on the first numel coordinates, zeros after."""
        x = x.reshape(-1).to(torch.float32)
        if _native.supports_cpu(x):  # the copy happens inside the FWHT's first pass
            return thc_native.rotate(x, self.padded, self.max_norm, self.seed)
        buf = torch.zeros(self.padded, dtype=torch.float32, device=x.device)
        head = buf[: self.numel]
        torch.div(x, self.max_norm, out=head)
        head.mul_(self.signs(x.device)[: self.numel])
        # The unnormalised transform is the orthonormal one times √d': exactly the scale.
        return fwht_(buf, normalize=False)

    def encode(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        generator: torch.Generator,
        count_clamped: bool = False,
        lut: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """Table indices (int32, padded length) of x, and (if asked) how many
        coordinates were clamped. One noise seed is drawn from `generator`."""
        z, _, clamped = self.encode_values(x, table, generator, count_clamped=count_clamped,
                                           lut=lut)
        return z, clamped

    def encode_values(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        generator: torch.Generator,
        table_values: torch.Tensor | None = None,
        indices: bool = True,
        count_clamped: bool = False,
        lut: torch.Tensor | None = None,
        values_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
        """THC's encoding of x: rotate (pad, signs, FWHT, scale), clamp, stochastic
        rounding onto the float `table` with the noise of one seed drawn from `generator`.
        Returns (z: int32 indices or None when not `indices`; T[z] from `table_values`
        (the table in the sum's integer dtype) or None; the clamped count or None).
        On the CPU with the native library: two passes over one scratch buffer, the
        FWHT's, with the padded copy (1/ℓ, signs) inside the first and the quantisation
        (noise generated in the pass, only what is asked for written) inside the last;
        the same bits as the torch path."""
        seed = draw_seed(generator)
        x32 = x.reshape(-1).to(torch.float32)
        if _native.supports_cpu(x32) and (
                table.dtype == torch.float32 and table.device.type == "cpu"
                and (table_values is None or table_values.dtype in thc_native.VALUE_BYTES)):
            if lut is None:
                lut = interval_lut(table)
            gaps = (table[1:] - table[:-1]).contiguous()
            z, values, clamped = thc_native.rotate_encode(
                x32, self.padded, self.max_norm, self.seed, self.t_p, self.granularity,
                table.contiguous(), gaps, lut.contiguous(), seed, indices=indices,
                value_dtype=None if table_values is None else table_values.dtype,
                values_out=values_out)
            return z, values, (clamped if count_clamped else None)
        rotated = self.rotate(x32)
        clamped = int((rotated.abs() > self.t_p).sum()) if count_clamped else None
        grid_values = rotated.clamp_(-self.t_p, self.t_p).add_(self.t_p)
        grid_values.mul_(self.granularity / (2 * self.t_p)).clamp_(0, self.granularity)
        z = table_encode(grid_values, table, lut=lut, seed=seed)
        values = None if table_values is None else torch.index_select(
            table_values, 0, z, out=values_out)
        return (z if indices else None), values, clamped

    def decode(
        self,
        value_sum: torch.Tensor,
        count: float | torch.Tensor,
        divisor: float,
        chunk_size: int = 0,
        zero_chunks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        transient: bool = False,
    ) -> torch.Tensor:
        """(Σ of `count` workers' table values)/divisor back to the real line (float32,
        original length): the single decompression. `count` may be per chunk of
        `chunk_size`; `zero_chunks` marks chunks whose aggregate was lost (set to 0).
        `out` (float32, original length): where the fused native path writes the result
        (Context.destination); the other paths return a tensor of their own.
        `transient=True`: the fused native path may return a view of its per-thread
        scratch buffer, to be read before the thread's next THC call (no padded buffer)."""
        # grid value y ∈ [0, g] ↦ rotated coordinate y·2t_p/g − t_p ↦ ×ℓ/√d' ↦ H·(·)/√d'
        # (the orthonormal inverse): with the unnormalised transform, the factor is ℓ/d'.
        unit = self.max_norm / self.padded
        scale = 2 * self.t_p / self.granularity * unit
        offset = -self.t_p * unit
        if (zero_chunks is None and not isinstance(count, torch.Tensor)
                and value_sum.dtype in thc_native.VALUE_BYTES and value_sum.device.type == "cpu"
                and value_sum.is_contiguous() and value_sum.numel() == self.padded
                and thc_native.available()):
            # The affine map inside the FWHT's first pass, the signs inside its last: the
            # same float32 operations as _affine, fwht_ and the sign flip below.
            if transient and out is None:
                return thc_native.decode_in_scratch(value_sum, self.numel, scale / divisor,
                                                    offset * count / divisor, self.seed)
            return thc_native.decode(value_sum, self.numel, scale / divisor,
                                     offset * count / divisor, self.seed, out=out)
        out = _affine(value_sum, scale, offset, count, divisor, chunk_size)
        if zero_chunks is not None:
            _per_chunk(out, chunk_size, (~zero_chunks).to(out.dtype), "mul")
        fwht_(out, normalize=False)
        head = out[: self.numel]  # D⁻¹ = D, only where the result is kept
        if _native.supports_cpu(out) and out.dtype == torch.float32:
            thc_native.apply_signs_(out, self.numel, self.seed)
        else:
            head.mul_(self.signs(out.device)[: self.numel])
        return head


@dataclass
class RotatedSent(Sent):
    """THC's own contribution RHT⁻¹(X_i) (Algorithm 3 line 22), decoded from this worker's
    table values when asked: error feedback subtracts it straight from the fused native
    decode's per-thread scratch, with no padded buffer per step."""

    grid: RotatedGrid
    values: torch.Tensor  # T[Z_i], padded
    dtype: torch.dtype

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.sub_(self.grid.decode(self.values, 1, 1, transient=True).to(buffer.dtype))

    def dense(self, numel: int) -> torch.Tensor:
        return self.grid.decode(self.values, 1, 1).to(self.dtype)


def _affine(
    total: torch.Tensor,
    scale: float,
    offset: float,
    count: float | torch.Tensor,
    divisor: float,
    chunk_size: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(scale·Σ_i y_i + count·offset)/divisor in float32: the mean of `divisor` workers'
    decompressed values y·scale + offset, `count` of whom contributed (the others a zero
    gradient). `count` may be a tensor with one entry per chunk of `chunk_size`. `out`:
    a float32 tensor of total's size to write it into (else a new one)."""
    if out is None or out.numel() != total.numel():
        out = total.to(torch.float32, copy=True)
    else:
        out = out.view(total.shape).copy_(total)
    out.mul_(scale / divisor)
    if isinstance(count, torch.Tensor):
        _per_chunk(out, chunk_size, count.to(out.dtype).mul_(offset / divisor), "add")
    else:
        out.add_(offset * count / divisor)
    return out


def _per_chunk(t: torch.Tensor, chunk: int, per_chunk: torch.Tensor, op: str) -> None:
    """t[..., c·chunk:(c+1)·chunk] (op)= per_chunk[..., c], in place, by views."""
    m = t.shape[-1]
    full = m // chunk
    if full:
        body = t[..., : full * chunk].unflatten(-1, (full, chunk))
        getattr(body, f"{op}_")(per_chunk[..., :full, None])
    if m % chunk:
        getattr(t[..., full * chunk :], f"{op}_")(per_chunk[..., full : full + 1])


# ---------------------------------------------------------------------------------------
# The shared integer-sum machinery (allreduce or parameter server).
# ---------------------------------------------------------------------------------------


def _norm(acc: torch.Tensor) -> torch.Tensor:
    """||acc||₂ as a 1-element float64 tensor (no overflow of the norm). Contiguous CPU
    float32/float64: one native read pass (Σx² in double over fixed blocks, independent
    of the thread count); otherwise torch's float64 vector_norm. The two may differ in
    the last bits of the double; every rank uses the same path, and the allreduced max
    is what all ranks scale by."""
    if _native.supports_cpu(acc):
        return torch.tensor([math.sqrt(_native.stats(acc, squares=True).sumsq)],
                            dtype=torch.float64)
    return torch.linalg.vector_norm(acc, dtype=torch.float64).reshape(1)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class _Received:
    total: torch.Tensor  # the integer sum
    count: float | torch.Tensor  # contributions per coordinate (scalar or per chunk)
    divisor: int  # workers the mean is over
    lost_down: torch.Tensor | None  # chunks whose aggregate this worker lost
    received: int  # workers the PS heard from
    lost_up_chunks: int = 0  # chunks lost on the way to the PS (all workers)


class _IntegerSum(Compressor):
    """Homomorphic aggregation of small non-negative integers: the sum's dtype, the
    overflow check, the allreduce and the simulated parameter server."""

    pattern = Pattern.INTEGER_SUM
    bits: int

    def _init_aggregation(
        self,
        sum_dtype: str,
        aggregation: str,
        loss_rate: float,
        loss_direction: str,
        chunk_size: int,
        stragglers: int,
    ) -> None:
        if sum_dtype != "auto" and sum_dtype not in SUM_DTYPES:
            raise ValueError(
                f"sum_dtype={sum_dtype!r}: choose 'auto' or one of {', '.join(SUM_DTYPES)} "
                "(int16 is not offered: gloo and NCCL cannot reduce it)"
            )
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={aggregation!r}: choose 'allreduce' or 'ps' (parameter server)"
            )
        if (
            isinstance(loss_rate, bool)
            or not isinstance(loss_rate, (int, float))
            or not 0.0 <= loss_rate < 1.0
        ):
            raise ValueError(f"loss_rate={loss_rate!r} must be a probability in [0, 1)")
        if loss_direction not in LOSS_DIRECTIONS:
            raise ValueError(f"loss_direction={loss_direction!r}: choose 'up', 'down' or 'both'")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(
                f"chunk_size={chunk_size!r} must be a positive integer (coordinates per packet)"
            )
        if isinstance(stragglers, bool) or not isinstance(stragglers, int) or stragglers < 0:
            raise ValueError(
                f"stragglers={stragglers!r} must be a non-negative integer "
                "(workers dropped per round)"
            )
        if aggregation == "allreduce" and (loss_rate > 0 or stragglers > 0):
            raise ValueError(
                "packet loss and stragglers are simulated at the parameter server: "
                "set aggregation='ps' to use loss_rate or stragglers"
            )
        self.sum_dtype = sum_dtype
        self.aggregation = aggregation
        self.loss_rate = float(loss_rate)
        self.loss_direction = loss_direction
        self.chunk_size = chunk_size
        self.stragglers = stragglers
        if sum_dtype != "auto" and self._max_value() > torch.iinfo(SUM_DTYPES[sum_dtype]).max:
            raise ValueError(self._overflow_message(1, SUM_DTYPES[sum_dtype]))

    def _max_value(self) -> int:
        """The largest integer one worker contributes."""
        raise NotImplementedError

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def _sum_dtype(self, workers: int) -> torch.dtype:
        """The integer type of the sums; refuses (before any communication) a
        configuration whose sum of `workers` contributions overflows it."""
        biggest = workers * self._max_value()
        if self.sum_dtype == "auto":
            for dtype in SUM_DTYPES.values():
                if biggest <= torch.iinfo(dtype).max:
                    return dtype
            raise ValueError(self._overflow_message(workers, torch.int64))
        dtype = SUM_DTYPES[self.sum_dtype]
        if biggest > torch.iinfo(dtype).max:
            raise ValueError(self._overflow_message(workers, dtype))
        return dtype

    def _check_workers(self, workers: int) -> torch.dtype:
        if self.stragglers >= workers:
            raise ValueError(
                f"stragglers={self.stragglers} would drop every one of the {workers} workers; "
                f"use at most {workers - 1}"
            )
        return self._sum_dtype(workers)

    def _aggregate(
        self,
        indices: torch.Tensor | None,
        mine: torch.Tensor,
        values: torch.Tensor | None,
        dtype: torch.dtype,
        ctx: Context,
    ) -> Protocol:
        """Sum every worker's table values T[z] (identity table when `values` is None).
        `indices`: this worker's b-bit indices z (1-D; needed by the parameter server
        only); `mine`: its values T[z] (any integer dtype whose values fit `dtype`: they
        are cast to it on the wire)."""
        n = ctx.world_size
        numel = mine.numel()
        if self.aggregation == "allreduce":
            # A copy, in the sum's dtype: the allreduce overwrites its tensor, and `mine`
            # decodes `sent`.
            total = yield AllReduce(ctx.room("wire", numel, dtype, mine.device).copy_(mine))
            return _Received(total, n, n, None, n)

        chunks = -(-numel // self.chunk_size)
        gen = torch.Generator().manual_seed(mix_seed(ctx.shared_seed, "thc-ps"))
        dropped = torch.randperm(n, generator=gen)[: self.stragglers]
        lost = torch.rand(2, n, chunks, generator=gen) < self.loss_rate
        keep = torch.ones(n, chunks, dtype=torch.bool)
        keep[dropped] = False
        lossy_up = self.loss_rate > 0 and self.loss_direction in ("up", "both")
        lossy_down = self.loss_rate > 0 and self.loss_direction in ("down", "both")
        lost_up_chunks = 0
        if lossy_up:
            lost_up_chunks = int((keep & lost[0]).sum())  # of the workers not dropped
            keep &= ~lost[0]
        received = n - self.stragglers

        gathered = yield AllGather(pack_bits(indices.to(torch.uint8), self.bits))
        if ctx.rank == 0:  # the parameter server: look up, (lose), sum
            every = unpack_bits(torch.stack(gathered), self.bits, numel)
            if values is not None:
                contributions = values.index_select(0, every.flatten().int()).view(n, numel)
            else:
                contributions = every.to(dtype)
            if lossy_up or self.stragglers:
                mask = keep.to(device=contributions.device, dtype=dtype)
                _per_chunk(contributions, self.chunk_size, mask, "mul")
            total = contributions.sum(0, dtype=dtype)
        else:
            total = torch.empty(numel, dtype=dtype, device=mine.device)
        total = yield Broadcast(total, src=0)
        count: float | torch.Tensor = float(received)
        if lossy_up:
            count = keep.sum(0).to(mine.device)
        lost_down = lost[1, ctx.rank].to(mine.device) if lossy_down else None
        return _Received(total, count, received, lost_down, received, lost_up_chunks)

    def _extra(self, got: _Received, dtype: torch.dtype, payload: int) -> dict:
        """What metrics want beyond the request bytes: the b-bit upload a PS receives
        (`index_bytes`) and, over a PS, what arrived."""
        extra = {
            "sum_dtype": _name(dtype),
            "index_bytes": -(-payload * self.bits // 8),
            "aggregation": self.aggregation,
        }
        if self.aggregation == "ps":
            extra["received"] = got.received
            extra["lost_up_chunks"] = got.lost_up_chunks
            extra["lost_down_chunks"] = 0 if got.lost_down is None else int(got.lost_down.sum())
        return extra


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(
            f"bits={bits!r}: the bit budget per coordinate must be an integer in [1, 8]"
        )
    return bits


@register("thc_uniform")
class UniformTHC(_IntegerSum):
    """Uniform THC (Algorithm 1): global min/max, homomorphic USQ onto 2^b levels,
    integer sum, one decompression. Unbiased, so no error feedback by default (the
    paper's Algorithm 1 has none). `sum_dtype="auto"` picks the smallest integer type
    that holds n·(2^b − 1)."""

    default_feedback = "none"

    def __init__(
        self,
        bits: int = 4,
        sum_dtype: str = "auto",
        aggregation: str = "allreduce",
        loss_rate: float = 0.0,
        loss_direction: str = "both",
        chunk_size: int = 256,
        stragglers: int = 0,
    ):
        self.bits = _check_bits(bits)
        self._init_aggregation(
            sum_dtype, aggregation, loss_rate, loss_direction, chunk_size, stragglers
        )

    def _max_value(self) -> int:
        return 2**self.bits - 1

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        top = torch.iinfo(dtype).max
        fits = int(math.floor(math.log2(top // workers + 1))) if top // workers >= 1 else 0
        return (
            f"thc_uniform: {workers} workers summing {self.bits}-bit levels reach "
            f"{workers * self._max_value()}, which overflows {_name(dtype)} (max {top}); the "
            f"largest bit budget that fits {workers} workers is bits={min(fits, 8)}; "
            "or set sum_dtype='auto'"
        )

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        dtype = self._check_workers(ctx.world_size)
        x = acc.to(torch.float32)
        extremes = torch.stack([x.max(), x.min().neg()]).to(torch.float64)
        extremes = yield AllReduce(extremes, op="max")
        hi, lo = float(extremes[0]), -float(extremes[1])
        # the levels go into a room kept per tensor (error feedback reads them at the end
        # of the step, Context.room)
        levels = uniform_encode(x, lo, hi, self.bits, ctx.generator,
                                out=ctx.room("levels", x.numel(), torch.uint8, x.device))
        got = yield from self._aggregate(levels, levels, None, dtype, ctx)
        step = (hi - lo) / (2**self.bits - 1)
        mean = _affine(got.total, step, lo, got.count, got.divisor, self.chunk_size,
                       out=ctx.destination(acc.numel(), torch.float32, acc.device))
        if got.lost_down is not None:
            _per_chunk(mean, self.chunk_size, (~got.lost_down).to(mean.dtype), "mul")
        # the contribution is decoded from the levels only if asked (error feedback asks
        # within the step; the levels' room is rewritten by the next one)
        sent = DecodedSent(lambda: _affine(levels, step, lo, 1, 1).to(acc.dtype))
        extra = self._extra(got, dtype, acc.numel())
        return Outcome(aggregate=mean.to(acc.dtype), sent=sent, extra=extra)

    def sent_elements(self, numel: int) -> int:
        return numel


@register("thc")
class THC(_IntegerSum):
    """Non-uniform THC with RHT, support bounding and the optimal lookup table
    (Algorithm 3), paper defaults b = 4, g = 30, p = 1/32, 8-bit table sums.

    table: None for the optimal table of (bits, granularity, p) (stored in
    compressors/data/thc_tables.json, else solved on the fly), "symmetric" for the best
    mirror-symmetric one (the authors' published tables), or explicit values
    0 = T[0] < … < T[2^b − 1] = g.
    """

    default_feedback = "residual"

    def __init__(
        self,
        bits: int = 4,
        granularity: int = 30,
        p: float = 1 / 32,
        table: str | Sequence[int] | None = None,
        sum_dtype: str = "uint8",
        aggregation: str = "allreduce",
        loss_rate: float = 0.0,
        loss_direction: str = "both",
        chunk_size: int = 256,
        stragglers: int = 0,
    ):
        check_config(bits, granularity, p)
        self.bits = bits
        self.granularity = granularity
        self.p = float(p)
        self.table = self._resolve_table(table)
        self._init_aggregation(
            sum_dtype, aggregation, loss_rate, loss_direction, chunk_size, stragglers
        )
        self._tensors: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _resolve_table(self, table: str | Sequence[int] | None) -> tuple[int, ...]:
        if table is None:
            return get_table(self.bits, self.granularity, self.p)
        if isinstance(table, str):
            if table != "symmetric":
                raise ValueError(
                    f"table={table!r}: give None (optimal), 'symmetric' or the table values"
                )
            return get_table(self.bits, self.granularity, self.p, symmetric=True)
        values = tuple(int(v) for v in table)
        size = 2**self.bits
        if (
            len(values) != size
            or values[0] != 0
            or values[-1] != self.granularity
            or any(b <= a for a, b in zip(values, values[1:]))
        ):
            raise ValueError(
                f"table={list(table)!r} must hold {size} strictly increasing integers from 0 to "
                f"granularity={self.granularity} (0 = T[0] < … < T[{size - 1}] = g)"
            )
        return values

    def _max_value(self) -> int:
        return self.granularity

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        top = torch.iinfo(dtype).max
        largest = top // workers
        msg = (
            f"thc: {workers} workers × granularity {self.granularity} = "
            f"{workers * self.granularity} overflows the {_name(dtype)} table-value sums "
            f"(max {top}); the largest granularity that fits {workers} workers in "
            f"{_name(dtype)} is g={largest}"
        )
        if largest < 2**self.bits - 1:
            msg += f", below 2^bits − 1 = {2**self.bits - 1}, so lower bits too"
        return msg + "; or set sum_dtype='int32'"

    def _table_tensors(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The table as float32 (encoding), as the sum dtype (aggregation) and its
        interval lookup, per device."""
        key = (str(device), dtype)
        cached = self._tensors.get(key)
        if cached is None:
            as_int = torch.tensor(self.table, dtype=dtype, device=device)
            as_float = as_int.to(torch.float32)
            cached = self._tensors[key] = (as_float, as_int, interval_lut(as_float))
        return cached

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        dtype = self._check_workers(ctx.world_size)
        numel = acc.numel()
        # Preliminary round (Algorithm 3 lines 7-8). float64: no overflow of the norm.
        norm = _norm(acc)
        max_norm = float((yield AllReduce(norm, op="max"))[0])
        padded = next_power_of_two(numel)
        if max_norm == 0.0:  # every worker's gradient is zero (the same decision on all ranks)
            return Outcome(
                aggregate=torch.zeros_like(acc),
                sent=DenseSent(torch.zeros_like(acc)),
                extra={"d_padded": padded},
            )
        grid = RotatedGrid.make(numel, max_norm, self.p, self.granularity, ctx.shared_seed)
        table_f, table_int, lut = self._table_tensors(acc.device, dtype)
        # Y_i = T[Z_i] (Algorithm 3 line 15) straight from the encoding pass; the indices
        # themselves only travel to a parameter server.
        # T[Z_i] goes into a room kept per tensor (read by error feedback at the end of
        # the step); the allreduce's copy of it into another (Context.room)
        indices, mine, clamped = grid.encode_values(
            acc, table_f, ctx.generator, table_values=table_int,
            indices=self.aggregation == "ps", count_clamped=ctx.measure, lut=lut,
            values_out=ctx.room("values", padded, dtype, acc.device),
        )
        got = yield from self._aggregate(indices, mine, table_int, dtype, ctx)
        aggregate = grid.decode(got.total, got.count, got.divisor, self.chunk_size, got.lost_down,
                                out=ctx.destination(numel, torch.float32, acc.device))
        extra = self._extra(got, dtype, padded)
        extra.update(d_padded=padded, max_norm=max_norm)
        if clamped is not None:
            extra["clamped"] = clamped / padded
        return Outcome(aggregate=aggregate.to(acc.dtype),
                       sent=RotatedSent(grid, mine, acc.dtype), extra=extra)

    def sent_elements(self, numel: int) -> int:
        return next_power_of_two(numel)
