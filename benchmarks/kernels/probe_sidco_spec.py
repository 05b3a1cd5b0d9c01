"""What limits SIDCo's speculative first read on a GPU: the kernel alone
(cuda_sidco.Stages.speculate) timed on variants of its source, each in a fresh process
on a patched copy of the package: as shipped; without the decoupled look-back (offsets
left at zero: wrong output, timing only); with float32 instead of float64 partial sums;
both. One read with float64 sums (cuda.stats_partials) and a count are the references.

    python benchmarks/kernels/probe_sidco_spec.py --size 128M [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "compressors/kernels/cuda_sidco.py"
NO_LOOK_BACK = [("        before, found = _running_offsets(words, tile, local, SPIN)\n",
                 "        before = local * 0\n        found = True\n")]
FLOAT32_SUMS = [("        af = a.to(tl.float64)\n", "        af = a\n"),
                ("z = tl.where(above, af - u_bits.to(tl.int64).to(tl.float64, bitcast=True), 0.0)",
                 "z = tl.where(above, af - u, 0.0)")]
VARIANTS = {"as shipped": [], "no look-back": NO_LOOK_BACK, "float32 sums": FLOAT32_SUMS,
            "both": NO_LOOK_BACK + FLOAT32_SUMS}

CHILD = r"""
import json, sys, time, torch
from compressors.kernels import cuda as gpu, cuda_sidco as cs
from repro.bench import parse_size
dev = torch.device("cuda")
x = torch.randn(parse_size(sys.argv[1]), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
reps = int(sys.argv[2])
med = lambda v: 1e3 * sorted(v)[len(v) // 2]
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return time.perf_counter() - t
def spec(squares, logs):
    st = cs.Stages(x, 3)
    torch.cuda.synchronize()
    return timed(lambda: st.speculate(1.5, 2.5, 3.3, 2, squares, squares, logs, 0.15, 0.002))
out = {}
for name, sq, lg in (("spec_e", False, False), ("spec_gp", True, False), ("spec_p", False, True)):
    spec(sq, lg)
    out[name] = med([spec(sq, lg) for _ in range(reps)])
a = x.abs()
out["read_sum"] = med([timed(lambda: a.sum()) for _ in range(reps)])
out["stats_f64"] = med([timed(lambda: gpu.stats_partials(x, squares=True)) for _ in range(reps)])
out["count"] = med([timed(lambda: gpu.count(x, 3.3)) for _ in range(reps)])
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="128M")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = {}
    for name, edits in VARIANTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            pkg = Path(tmp)
            for d in ("compressors", "repro"):
                shutil.copytree(ROOT / d, pkg / d, ignore=shutil.ignore_patterns("__pycache__"))
            f = pkg / KERNEL
            text = f.read_text()
            for old, new in edits:
                if text.count(old) < 1:
                    raise SystemExit(f"{name}: {old!r} not in {KERNEL}")
                text = text.replace(old, new, 1)
            f.write_text(text)
            r = subprocess.run([sys.executable, "-c", CHILD, a.size, str(a.repeats)], cwd=pkg,
                               capture_output=True, text=True, check=False,
                               env={**os.environ, "PYTHONPATH": str(pkg)})
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not line:
            print(f"{name}: failed rc={r.returncode}\n{r.stderr[-1500:]}", flush=True)
            continue
        rows[name] = got = json.loads(line[0][7:])
        print(f"{name:>13}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in got.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
