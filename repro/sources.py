"""Gradient sources for `repro measure`, the benchmarks and the property tests.

Synthetic sources draw, per step, one gradient per worker whose every coordinate has
exactly the named marginal distribution, while workers stay correlated: coordinate i of
worker r takes the value of a draw shared by all workers with probability `shared`, and
its own independent draw otherwise. So each worker's |g| is what the SIDCo fit models
assume, and workers' top indices overlap only partly, as real gradients' do.

| source     | signed value                                         | |g| follows            |
|------------|------------------------------------------------------|-------------------------|
| laplace    | Laplace(0, b)                                        | exponential (SIDCo-E)   |
| normal     | N(0, σ²)                                             | half-normal             |
| student-t  | Student-t with ν = 3 degrees of freedom              | heavy, GP tail (SIDCo-GP)|
| gamma      | random sign · Gamma(shape 0.5, scale)                | gamma (SIDCo-P)         |
| lognormal  | random sign · LogNormal(μ, σ = 1.5)                  | log-normal (THC Fig. 10)|
| file:PATH  | a saved tensor (every worker) or list of per-worker tensors |                 |

`zeros` = F makes a fraction F of a synthetic gradient's coordinates exact zeros, in
every worker's gradient at every step, at positions drawn once from the seed (like the
rows of an embedding that no batch touches, or sparse features): the gradients that
break fits which count the zeros in (SIDCo's first stage). The other coordinates keep
the values they have without zeros.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import torch

SYNTHETIC = ("laplace", "normal", "student-t", "gamma", "lognormal")
SCALE = 1e-3  # gradients are small numbers; the scale matters only for fp16 tests


def _draw(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, generator=g) * SCALE
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    if kind == "laplace":
        # Inverse CDF of Laplace(0, 1).
        x = -torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())
        return (x * SCALE).float()
    if kind == "student-t":
        nu = 3.0
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = torch.zeros(n, dtype=torch.float64)
        for _ in range(int(nu)):  # ν = 3 standard normals squared: a few vector ops
            chi2 += torch.randn(n, generator=g, dtype=torch.float64) ** 2
        return (z / torch.sqrt(chi2 / nu) * SCALE).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    if kind == "gamma":
        # Gamma(0.5) = χ²₁ / 2: the square of a normal, halved.
        z = torch.randn(n, generator=g)
        return sign * (0.5 * z * z) * SCALE
    if kind == "lognormal":
        z = torch.randn(n, generator=g)
        return sign * torch.exp(1.5 * z) * SCALE
    raise ValueError(f"unknown source {kind!r}; choose one of {', '.join(SYNTHETIC)} or file:PATH")


def check_zeros(zeros: float, what: str = "zeros") -> float:
    """The fraction of exact zeros as a float in [0, 1), or a ValueError naming `what`."""
    bad_type = isinstance(zeros, bool) or not isinstance(zeros, (int, float))
    if bad_type or not 0.0 <= zeros < 1.0:  # (NaN fails the comparison)
        raise ValueError(f"{what}={zeros!r} is out of range: it is the fraction of "
                         "coordinates that are exact zeros, 0 ≤ F < 1")
    return float(zeros)


@functools.lru_cache(maxsize=8)
def zero_positions(size: int, seed: int, zeros: float) -> torch.Tensor | None:
    """The positions (int64, ascending) of the round(zeros·size) coordinates that are
    exact zeros in every worker's gradient at every step of a synthetic source: drawn
    once from the seed, by a generator of their own (the values elsewhere are those
    drawn without zeros). None when there are none."""
    count = round(check_zeros(zeros) * size)
    if count == 0:
        return None
    # a stream apart from the steps' (seed·1_000_003 + step, step ≥ 0)
    g = torch.Generator().manual_seed(-1 - seed)
    return torch.randperm(size, generator=g)[:count].sort().values


def synthetic(kind: str, size: int, workers: int, seed: int, step: int, shared: float = 0.5,
              zeros: float = 0.0) -> list[torch.Tensor]:
    """One step's gradients (float32, length `size`) for `workers` workers; with `zeros`
    = F, round(F·size) of the coordinates (zero_positions) exact zeros in each."""
    if kind not in SYNTHETIC:
        raise ValueError(f"unknown source {kind!r}; choose one of {', '.join(SYNTHETIC)} or file:PATH")
    if size < 1 or workers < 1:
        raise ValueError(f"size ({size}) and workers ({workers}) must be ≥ 1")
    if not 0.0 <= shared <= 1.0:
        raise ValueError(f"shared={shared} must lie in [0, 1]")
    positions = zero_positions(size, seed, check_zeros(zeros))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    common = _draw(kind, size, g)
    grads = []
    for _ in range(workers):
        own = _draw(kind, size, g)
        take_common = torch.rand(size, generator=g) < shared
        grad = torch.where(take_common, common, own)
        if positions is not None:
            grad.index_fill_(0, positions, 0.0)
        grads.append(grad)
    return grads


def load_file(path: str, workers: int) -> list[torch.Tensor]:
    """A saved tensor (copied to every worker) or a list/tuple of per-worker tensors."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"gradient file {path!r} does not exist (source file:PATH)")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        return [obj.reshape(-1).float().clone() for _ in range(workers)]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        if len(obj) < workers:
            raise ValueError(f"{path} holds {len(obj)} per-worker tensors but {workers} workers were asked for")
        sizes = {t.numel() for t in obj}
        if len(sizes) != 1:
            raise ValueError(f"{path}: per-worker tensors differ in size: {sorted(sizes)}")
        return [t.reshape(-1).float().clone() for t in obj[:workers]]
    raise ValueError(f"{path} must hold a tensor or a list of tensors, found {type(obj).__name__}")


def stream(source: str, size: int, workers: int, steps: int, seed: int = 0,
           zeros: float = 0.0) -> Iterator[list[torch.Tensor]]:
    """`steps` per-step gradient lists from a source name (synthetic or file:PATH);
    `zeros`: the fraction of exact zeros of a synthetic source (see synthetic)."""
    if source.startswith("file:"):
        if check_zeros(zeros):
            raise ValueError(f"zeros={zeros} applies to synthetic sources only, not {source}")
        grads = load_file(source[5:], workers)
        for _ in range(steps):
            yield [t.clone() for t in grads]
        return
    for step in range(steps):
        yield synthetic(source, size, workers, seed, step, zeros=zeros)
