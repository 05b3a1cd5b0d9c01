"""Compression times measured on a GPU, for projections onto the papers' GPU clusters.

A projection onto a GPU cluster takes a compressor's encode + decode time from the
committed GPU benches (`results/bench/gpu-*/`, files written by `repro bench --device
cuda --json`), never from this CPU's: a CPU time is 10–100× a GPU's and only belongs in
a projection onto a cluster of CPUs. For a tensor of d elements the time is read from
the bench cells of the same compressor and ratio: at a measured size as measured, between
two measured sizes interpolated linearly in log(d)–log(time), outside the measured sizes
not at all (`NotCovered` says which sizes are covered and how to measure more).

Each value carries the GPU it was measured on and its file, so a figure can label it.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

MEASURE_HINT = ("measure it on a GPU: bash scripts/gpu_measure.sh sizes (repro bench --device "
                "cuda --sizes ...), then commit the JSON under results/bench/gpu-<model>-torch<v>/")


class NotCovered(LookupError):
    """No committed GPU bench covers this compressor, ratio and size."""


@dataclass(frozen=True)
class GpuTime:
    seconds: float  # encode + decode
    gpu: str  # e.g. "NVIDIA H200"
    source: str  # the bench file, relative to the results folder
    interpolated: bool

    @property
    def label(self) -> str:
        how = "interpolated between sizes measured" if self.interpolated else "measured"
        return f"compression {how} on an {self.gpu} ({self.source})"


@dataclass
class GpuBench:
    """Every committed GPU bench cell, by (compressor, ratio) and GPU: sorted
    [(numel, seconds, file)] (a size measured twice on one GPU: its first file's)."""

    cells: dict[tuple[str, float], dict[str, list[tuple[int, float, str]]]] = field(
        default_factory=dict)

    @classmethod
    def load(cls, results: str | Path | None = None) -> GpuBench:
        root = Path(results) if results is not None else Path(__file__).resolve().parent.parent / "results"
        bench = cls()
        for path in sorted(glob.glob(str(root / "bench" / "gpu-*" / "*.json"))):
            try:
                with open(path, encoding="utf-8") as f:
                    report = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(report, dict) or not isinstance(report.get("encode"), list):
                continue
            gpus = (report.get("machine") or {}).get("gpu") or ["a GPU"]
            rel = os.path.relpath(path, root)
            for cell in report["encode"]:
                if not str(cell.get("device", "")).startswith("cuda"):
                    continue
                try:
                    key = (str(cell["compressor"]), float(cell["ratio"]))
                    seconds = (float(cell["encode_ms"]) + float(cell.get("decode_ms") or 0.0)) / 1e3
                    numel = int(cell["numel"])
                except (KeyError, TypeError, ValueError):
                    continue
                per_gpu = bench.cells.setdefault(key, {}).setdefault(str(gpus[0]), [])
                if all(n != numel for n, _, _ in per_gpu):
                    per_gpu.append((numel, seconds, rel))
        for by_gpu in bench.cells.values():
            for values in by_gpu.values():
                values.sort()
        return bench

    def covered(self, compressor: str, ratio: float) -> dict[str, tuple[int, int]]:
        """Per GPU, the smallest and largest measured size of this compressor and ratio."""
        by_gpu = self.cells.get((compressor, float(ratio)), {})
        return {gpu: (c[0][0], c[-1][0]) for gpu, c in by_gpu.items()}

    def time(self, compressor: str, ratio: float, numel: int) -> GpuTime:
        """encode + decode seconds of one tensor of `numel` elements on a GPU: from the
        GPU whose bench covers `numel` with the most sizes (the first by name on a tie)."""
        ranges = self.covered(compressor, ratio)
        if not ranges:
            raise NotCovered(f"no committed GPU bench of {compressor} at ratio {ratio:g}; "
                             + MEASURE_HINT)
        fit = [g for g, (lo, hi) in sorted(ranges.items()) if lo <= numel <= hi]
        if not fit:
            have = "; ".join(f"{g}: {lo:,}–{hi:,}" for g, (lo, hi) in sorted(ranges.items()))
            raise NotCovered(f"the GPU benches of {compressor} at ratio {ratio:g} cover "
                             f"{have} elements, not {numel:,} (no extrapolation); " + MEASURE_HINT)
        by_gpu = self.cells[(compressor, float(ratio))]
        gpu = max(fit, key=lambda g: len(by_gpu[g]))
        cells = by_gpu[gpu]
        for n, seconds, src in cells:
            if n == numel:
                return GpuTime(seconds, gpu, src, interpolated=False)
        below = max((c for c in cells if c[0] < numel), key=lambda c: c[0])
        above = min((c for c in cells if c[0] > numel), key=lambda c: c[0])
        t = (math.log(numel) - math.log(below[0])) / (math.log(above[0]) - math.log(below[0]))
        seconds = math.exp((1 - t) * math.log(below[1]) + t * math.log(above[1]))
        src = below[2] if below[2] == above[2] else f"{below[2]}, {above[2]}"
        return GpuTime(seconds, gpu, src, interpolated=True)
