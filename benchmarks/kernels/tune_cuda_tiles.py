"""Tile sizes of the SIDCo device stages on a GPU: for each setting of the speculative
read's tile and warps, the compaction's tile and the look-back's window
(compressors/kernels/cuda_sidco.py: SPEC_BLOCK, SPEC_WARPS, COMPACT_BLOCK, LOOK_BACK), a
copy of the package with those constants runs SIDCo's encode in a fresh process (the
constants are compile-time), median of the repeats, next to the one-read floor and
torch.topk measured in the same process. THC's max-norm round is timed too.

    python benchmarks/kernels/tune_cuda_tiles.py --size 128M [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [  # (SPEC_BLOCK, SPEC_WARPS, COMPACT_BLOCK, LOOK_BACK)
    (4096, 8, 4096, 32),
    (4096, 8, 4096, 128),
    (8192, 8, 8192, 128),
    (16384, 16, 4096, 32),
    (16384, 16, 4096, 128),
    (16384, 16, 16384, 128),
    (16384, 8, 4096, 128),
    (32768, 16, 4096, 128),
]

CHILD = r"""
import json, sys, torch
import compressors
from compressors.session import Session
from compressors.kernels import ops
from repro.bench import exchange_once, parse_size, timed
dev = torch.device("cuda")
x = torch.randn(parse_size(sys.argv[1]), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
reps = int(sys.argv[2])
names = sys.argv[3].split(",")
med = lambda v: sorted(v)[len(v) // 2]
a = x.abs()
out = {"floor_ms": 1e3 * med([timed(lambda: a.sum(), dev) for _ in range(21)])}
del a
out["topk_ms"] = 1e3 * med([timed(lambda: torch.topk(x.abs(), max(1, x.numel() // 1000)), dev) for _ in range(reps)])
if "norm" in names:
    out["norm_f64_torch_ms"] = 1e3 * med([timed(lambda: torch.linalg.vector_norm(x, dtype=torch.float64), dev) for _ in range(reps)])
    out["norm_kernel_ms"] = 1e3 * med([timed(lambda: ops.l2_norm(x), dev) for _ in range(reps)])
    out["norm_rel_diff"] = abs(float(ops.l2_norm(x)) / float(torch.linalg.vector_norm(x, dtype=torch.float64)) - 1)
dest = torch.empty_like(x)
for name in names:
    if name == "norm":
        continue
    kw = {} if name.startswith("thc") else {"ratio": 0.001}
    s = Session(compressors.build(name, **kw), rank=0, world_size=1, feedback="none", seed=0,
                check_finite=False, measure=False)
    got = []
    for step in range(reps + 4):
        o, enc, dec = exchange_once(s, x, step, out=dest)
        if step >= 4:
            got.append(enc)
    out[name + "_ms"] = 1e3 * med(got)
    del s
print("RESULT " + json.dumps(out))
"""


def patched_copy(setting, where: Path) -> Path:
    spec_block, spec_warps, compact_block, look_back = setting
    dst = where / "pkg"
    shutil.copytree(ROOT / "compressors", dst / "compressors",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "repro", dst / "repro", ignore=shutil.ignore_patterns("__pycache__"))
    f = dst / "compressors" / "kernels" / "cuda_sidco.py"
    text = f.read_text()
    for name, value in (("SPEC_BLOCK", spec_block), ("SPEC_WARPS", spec_warps),
                        ("COMPACT_BLOCK", compact_block), ("LOOK_BACK", look_back)):
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, count=1, flags=re.MULTILINE)
        if n != 1:
            raise SystemExit(f"{name} not found in {f}")
    f.write_text(text)
    return dst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="128M")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--compressor", default="sidco_e,sidco_gp,sidco_p")
    p.add_argument("--settings", default=None, help="indices into SETTINGS, e.g. 0,3")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    chosen = SETTINGS if a.settings is None else [SETTINGS[int(i)] for i in a.settings.split(",")]
    rows = []
    first = True
    for setting in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            pkg = patched_copy(setting, Path(tmp))
            names = a.compressor + (",norm,thc" if first else "")
            r = subprocess.run([sys.executable, "-c", CHILD, a.size, str(a.repeats), names],
                               cwd=pkg, capture_output=True, text=True, check=False,
                               env={**__import__("os").environ, "PYTHONPATH": str(pkg)})
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not line:
            print(f"{setting}: failed rc={r.returncode}\n{r.stderr[-2000:]}", flush=True)
            continue
        got = json.loads(line[0][7:])
        got["setting"] = dict(zip(("SPEC_BLOCK", "SPEC_WARPS", "COMPACT_BLOCK", "LOOK_BACK"), setting))
        rows.append(got)
        fl = got["floor_ms"]
        parts = [f"{k[:-3]} {v:.3f} ({v / fl:.1f}x)" for k, v in got.items()
                 if k.endswith("_ms") and k != "floor_ms"]
        print(f"{setting}: floor {fl:.3f} ms; " + "; ".join(parts)
              + (f"; norm rel diff {got['norm_rel_diff']:.1e}" if "norm_rel_diff" in got else ""),
              flush=True)
        first = False
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
