"""Host time per call of DGC's and DRAGONN's CUDA steps: 200 calls with no synchronisation
inside the loop (what the Python side costs to issue each step), and the same with the
device's time (a synchronisation after the loop). Needs a CUDA device; from the repository
root:  python scripts/bench_gpu_host.py OUT.json [NUMEL (26000000)]
results/bench/tenth-session-gpu/host-{26M,128M}.json are one run each (H100, torch 2.11;
their sample_kth rows timed a radix-select threshold since reverted)."""
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from compressors import _native, dragonn  # noqa: E402
from compressors._native import gpu  # noqa: E402
from compressors.dgc import sample_threshold  # noqa: E402


def host(fn, reps=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) / reps * 1e6, 1), round((t2 - t0) / reps * 1e6, 1)


n = int(sys.argv[2]) if len(sys.argv) > 2 else 26_000_000
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, device="cuda", generator=g) * 1e-3
k = int(n * 0.001)
m = 4 * k
s = max(n // 100, 10_000)
top = max(1, s // 1000)
layout = dragonn.priority_layout(n)
words = torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64, device="cuda")
sample = gpu.sample_abs(x, s, words)
t = sample_threshold(x, 0.001, k, 0.01, 10, g).reshape(1)
seeds = dragonn.draw_hash_seeds(g, "cuda")
small = torch.zeros(16, device="cuda")
r = {}
r["empty_torch_op (small.add_(1))"] = host(lambda: small.add_(1))
r["randint2"] = host(lambda: torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64,
                                           device="cuda"))
r["supports"] = host(lambda: _native.supports(x))
r["sample_abs"] = host(lambda: gpu.sample_abs(x, s, words))
r["sample_kernel_launch_only"] = host(lambda: gpu._sample_kernel[gpu._grid(s, 1024)](
    x, n, s, words, 0, sample, BLOCK=1024, K_PTR=True))
r["topk"] = host(lambda: torch.topk(sample, top, sorted=False))
r["topk.values.min"] = host(lambda: torch.topk(sample, top, sorted=False).values.min())
r["kthvalue"] = host(lambda: torch.kthvalue(sample, s - top + 1))
r["sort"] = host(lambda: torch.sort(sample))
r["clamp_min"] = host(lambda: t.clamp_min(1e-45))
r["sample_threshold"] = host(lambda: sample_threshold(x, 0.001, k, 0.01, 10, g))
r["full_m"] = host(lambda: torch.full((m,), -1, dtype=torch.int64, device="cuda"))
r["dragonn_encode"] = host(lambda: gpu.dragonn_encode(x, t, m, *layout, seeds))
r["native.dragonn_encode"] = host(lambda: _native.dragonn_encode(x, t, m, *layout, seeds))
r["select_device_t"] = host(lambda: gpu.select(x, t), reps=50)
r["stats"] = host(lambda: gpu.stats(x), reps=50)
for key, v in r.items():
    print(f"{key:36s} host {v[0]:9.1f} us   host+device {v[1]:9.1f} us", flush=True)
json.dump(r, open(sys.argv[1], "w"), indent=1)
