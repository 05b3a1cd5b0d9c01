"""The Triton kernels of compressors/kernels/cuda.py (the CUDA paths of the threshold
sparsifiers), checked two ways:

- everywhere (CI has no GPU): tests/kernels/interpreted_gpu_checks.py runs the same kernels under
  Triton's CPU interpreter on CPU tensors, in a fresh Python (TRITON_INTERPRET=1 must be
  set before triton is imported), against the torch expressions they replace: positions,
  values, counts and statistics at thresholds equal to elements, ragged last blocks, the
  sample positions, DRAGONN's slots with collisions;
- on a CUDA device (marked gpu): every compressor that uses them selects exactly what its
  pure-torch reference path selects on the same device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compressors
from compressors import Session, drive

TESTS = Path(__file__).parent


def _triton_version() -> tuple[int, ...]:
    try:
        import triton
    except ImportError:  # torch builds without CUDA ship no triton: nothing to check
        return (0, 0)
    return tuple(int(p) for p in triton.__version__.split(".")[:2])


# Triton's interpreter before 3.8 cannot run a loop bounded by a kernel argument (the
# statistics' final reduction); torch 2.14.1 (the pinned version) ships 3.8. The compiled
# kernels are checked on any Triton by the gpu tests below.
@pytest.mark.skipif(_triton_version() < (3, 8),
                    reason="needs Triton >= 3.8 and its interpreter (absent or older here)")
@pytest.mark.heavy
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(TESTS / "interpreted_gpu_checks.py")],
        cwd=TESTS.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


# Every kernel in the variants the compressors launch, compiled for an H100 (sm_90) by
# Triton's own compiler and ptxas, which ship with it: what the interpreter cannot show
# (types that do not unify across branches or loop iterations, lowering failures) shows
# here, with no GPU. (kernel, "argument:type ...", constexpr variants).
def _compile_cases():
    return [case for kernel, args, variants in _kernel_cases()
            for case in _with_narrow_sizes(kernel, args, variants)]


def _with_narrow_sizes(kernel, args, variants):
    # Triton types an int argument by its value: n (and a capacity) below 2^31 is i32.
    # SIDCo's device kernels run at both widths (the speculative read only below 2^31),
    # and a pool's capacities can be narrow while n is not.
    yield kernel, args, variants
    if kernel.__name__ in ("_later_stats_kernel", "_compact_kernel"):
        def narrow(names):
            return " ".join(a.replace(":i64", ":i32") if a.split(":")[0] in names else a
                            for a in args.split())
        yield kernel, narrow({"n", "cap", "base_cap"}), variants
        if kernel.__name__ == "_compact_kernel":
            yield kernel, narrow({"cap", "base_cap"}), variants


def _kernel_cases():
    from compressors.kernels import cuda as gpu
    from compressors.kernels import cuda_sidco as gpu_sidco

    x_n = "x_ptr:*fp32 n:i64"
    b, sub, tiles = gpu.BLOCK, gpu.SUB, gpu.TILES
    flags2 = [(a, c) for a in (False, True) for c in (False, True)]
    return [
        (gpu._sub_counts_kernel, f"{x_n} t:fp32 counts_ptr:*i32 nsub:i64 flag_ptr:*i64",
         [dict(STRICT=s, CHECK=c, BLOCK=b, SUB=sub, T_PTR=False) for s, c in flags2]),
        (gpu._sub_counts_kernel, f"{x_n} t:*fp32 counts_ptr:*i32 nsub:i64 flag_ptr:*i64",
         [dict(STRICT=s, CHECK=c, BLOCK=b, SUB=sub, T_PTR=True) for s, c in flags2]),
        (gpu._select_kernel, f"{x_n} t:fp32 counts_ptr:*i32 ends_ptr:*i64 idx_ptr:*i64 "
         "val_ptr:*fp32 map_ptr:*i64",
         [dict(STRICT=s, VALUES=v, MAPPED=m, SUB=sub, T_PTR=False)
          for s in (False, True) for v, m in flags2]),
        (gpu._select_kernel, f"{x_n} t:*fp32 counts_ptr:*i32 ends_ptr:*i64 idx_ptr:*i64 "
         "val_ptr:*fp32 map_ptr:*fp32", [dict(STRICT=False, VALUES=True, MAPPED=False,
                                              SUB=sub, T_PTR=True)]),
        (gpu._count_kernel, f"{x_n} t:fp32 out_ptr:*i64",
         [dict(STRICT=s, BLOCK=b, TILES=tiles) for s in (False, True)]),
        (gpu._stats_kernel, f"{x_n} above:fp32 shift_bits:i64 out_ptr:*fp64",
         [dict(HAS_ABOVE=a, SQUARES=q, EXTREMES=e, LOGS=lg, NONZEROS=False, BLOCK=b,
               TILES=tiles) for a, q in flags2 for e, lg in flags2]
         # SIDCo's first reads: the nonzeros alone, with and without squares
         + [dict(HAS_ABOVE=False, SQUARES=q, EXTREMES=False, LOGS=False, NONZEROS=True,
                 BLOCK=b, TILES=tiles) for q in (False, True)]),
        (gpu._stats_final_kernel, "part_ptr:*fp64 rows:i32 out_ptr:*fp64", [dict(R=2048)]),
        (gpu._nonfinite_kernel, f"{x_n} out_ptr:*i32", [dict(BLOCK=b, TILES=tiles)]),
        (gpu._sample_kernel, f"{x_n} s:i64 k0:i64 k1:i64 out_ptr:*fp32",
         [dict(BLOCK=gpu.SMALL_BLOCK, K_PTR=False)]),
        (gpu._sample_kernel, f"{x_n} s:i64 k0:*i64 k1:i64 out_ptr:*fp32",
         [dict(BLOCK=gpu.SMALL_BLOCK, K_PTR=True)]),
        (gpu._dragonn_write_kernel, "keys_ptr:*i64 nk:i64 m:i64 s0:i64 s1:i64 index_bits:i64 "
         "priority_shift:i64 packed_ptr:*i64", [dict(BLOCK=gpu.SMALL_BLOCK)]),
        (gpu._dragonn_fused_kernel, f"{x_n} t_ptr:*fp32 seeds_ptr:*i64 m:i64 index_bits:i64 "
         "priority_shift:i64 packed_ptr:*i64 found_ptr:*i64",
         [dict(CHECK=c, BLOCK=gpu.FUSED_BLOCK, CHUNK=gpu.FUSED_CHUNK) for c in (False, True)]),
        (gpu._dragonn_take_kernel, "packed_ptr:*i64 m:i64 index_bits:i64 acc_ptr:*fp32 "
         "values_ptr:*fp32", [dict(VALUES=v, BLOCK=gpu.SMALL_BLOCK) for v in (False, True)]),
        (gpu_sidco._later_stats_kernel, f"{x_n} n_ptr:*i64 t32_ptr:*fp32 board_ptr:*i64 "
         "slot:i32 out_ptr:*fp64 done_ptr:*i64 slot_out:i32 want_bits:i64 left:i32 "
         "mid_ptr:*fp64 mid_rows:i32 w:fp32 u:fp32 pa:fp32 u_bits:i64",
         [dict(HAS_ABOVE=a, SQUARES=q, N_PTR=p, MID=m, BLOCK=b, TILES=tiles,
               R=gpu_sidco.FUSED_REDUCE)
          for a, q in flags2 for p in (False, True) for m in (False, True)]),
        (gpu_sidco._first_fit_kernel, "part_ptr:*fp64 rows:i32 board_ptr:*i64 t32_ptr:*fp32 "
         "ratio_bits:i64 stages:i32 first_bits:i64 first_log_bits:i64",
         [dict(GP=g, R=gpu_sidco.REDUCE) for g in (False, True)]),
        # n < 2^31 (gpu_sidco.SPEC_LIMIT): n and the capacities are passed as i32
        (gpu_sidco._spec_read_kernel, "x_ptr:*fp32 n:i32 w:fp32 u:fp32 pa:fp32 u_bits:i64 "
         "pa_bits:i64 pa_slot:i32 part_ptr:*fp64 mid_ptr:*fp64 claim_ptr:*i64 "
         "tiles_ptr:*i64 win_ptr:*fp32 cap_w:i32 pos_ptr:*i32 val_ptr:*fp32 cap_p:i32 "
         "board_ptr:*i64 t32_ptr:*fp32",
         [dict(SQUARES=q, MID_SQUARES=m, LOGS=lg, BLOCK=gpu_sidco.SPEC_BLOCK)
          for q, m in flags2 for lg in (False, True)]),
        (gpu_sidco._spec_order_kernel, "tiles_ptr:*i64 ends_ptr:*i64 claim_ptr:*i64 "
         "win_in:*fp32 pos_in:*i32 val_in:*fp32 cap_w:i32 cap_p:i32 win_ptr:*fp32 "
         "pos_ptr:*i64 val_ptr:*fp32 totals_ptr:*i64", [dict(BLOCK=gpu_sidco.ORDER_BLOCK)]),
        (gpu_sidco._compact_kernel, f"{x_n} n_ptr:*i64 t32_ptr:*fp32 slot:i32 "
         "words_ptr:*i64 pos_ptr:*i64 val_ptr:*fp32 map_ptr:*i64 cap:i64 count_ptr:*i64 "
         "board_ptr:*i64 base_slot:i32 base_n_ptr:*i64 base_cap:i64",
         [dict(STRICT=not f, MAPPED=m, N_PTR=p, FINAL=f, HAS_BASE=h,
               BLOCK=gpu_sidco.COMPACT_BLOCK, SPIN=gpu_sidco.SPIN_LIMIT)
          for f, h in ((False, False), (True, False), (True, True)) for m, p in flags2]),
    ]


def _launch_options(kernel, constants) -> dict:
    # the options SIDCo's device kernels are launched with (compressors/kernels/cuda_sidco)
    from compressors.kernels import cuda_sidco as gpu_sidco

    if kernel is gpu_sidco._spec_read_kernel:
        return {"num_warps": gpu_sidco.SPEC_WARPS,
                **({"maxnreg": gpu_sidco.SPEC_MAXNREG} if constants["LOGS"] else {})}
    if kernel is gpu_sidco._spec_order_kernel:
        return {"num_warps": gpu_sidco.ORDER_WARPS}
    if kernel is gpu_sidco._compact_kernel:
        return {"num_warps": gpu_sidco.COMPACT_WARPS}
    return {}


def _can_compile_for_cuda() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return True


# The pinned torch's CUDA build ships Triton with its NVIDIA backend and ptxas; a CPU-only
# torch has no Triton, and the CUDA paths are then never taken.
@pytest.mark.skipif(not _can_compile_for_cuda(), reason="no Triton with a CUDA backend here")
def test_triton_kernels_compile_for_an_h100_without_one():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    compiled = 0
    for kernel, args, variants in _compile_cases():
        names = kernel.arg_names
        signature = dict(a.split(":") for a in args.split())
        assert list(signature) == names[:len(signature)], (kernel.__name__, names)
        for constants in variants:
            assert set(constants) == set(names[len(signature):]), kernel.__name__
            full = {**signature, **{c: "constexpr" for c in constants}}
            out = triton.compile(ASTSource(fn=kernel, signature=full, constexprs=constants),
                                 target=target, options=_launch_options(kernel, constants))
            assert out.asm.get("cubin"), f"{kernel.__name__} {constants}: no binary"
            compiled += 1
    assert compiled >= 70


def _laplace(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


# ----------------------------------------------------------------------------------------
# On a CUDA device: the compressors' Triton paths against their torch reference paths.


def _run(name: str, grads: list[torch.Tensor], ratio: float):
    session = Session(compressors.build(name, ratio=ratio), world_size=1, feedback="none",
                      seed=11, measure=False)
    return [drive([session.exchange("g", g, step)])[0] for step, g in enumerate(grads)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p", "dgc", "dragonn", "mstopk",
                                  "hard_threshold", "redsync", "gaussianksgd"])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_cuda_paths_select_what_the_reference_selects(monkeypatch, name, ratio):
    from compressors.kernels import ops

    grads = [_laplace(3_000_017, seed=s).cuda() for s in range(3)]
    assert ops.supports(grads[0])
    fast = _run(name, grads, ratio)
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        assert not ops.supports(grads[0])
        slow = _run(name, grads, ratio)
    for f, s in zip(fast, slow):
        assert f.sent.indices.numel() > 0
        assert torch.equal(f.sent.indices, s.sent.indices)
        assert torch.equal(f.sent.values, s.sent.values)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_p", "dgc", "dragonn", "hard_threshold",
                                  "redsync"])
def test_cuda_folded_check_raises_and_changes_nothing(name):
    # The NaN/Inf check folded into the CUDA kernels' first read (DRAGONN's fused write
    # included, whose result otherwise stays on the device until the send): the Session's
    # error, the worker's stream put back, and a finite gradient exchanged as without it.
    grad = _laplace(1_000_003, seed=4).cuda()

    def session(check: bool) -> Session:
        return Session(compressors.build(name, ratio=0.01), world_size=1, feedback="none",
                       seed=2, measure=False, check_finite=check)

    folded, unfolded = session(True), session(False)
    for step in range(2):
        a = drive([folded.exchange("g", grad, step)])[0]
        b = drive([unfolded.exchange("g", grad, step)])[0]
        assert torch.equal(a.sent.indices, b.sent.indices)
        assert torch.equal(a.sent.values, b.sent.values)
    for pos, bad in ((0, float("nan")), (grad.numel() - 1, float("-inf"))):
        broken = grad.clone()
        broken[pos] = bad
        before = folded.generator(grad.device).get_state()
        with pytest.raises(FloatingPointError, match="gradient 'g' contains"):
            drive([folded.exchange("g", broken, 2)])
        assert torch.equal(folded.generator(grad.device).get_state(), before)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
def test_cuda_sidco_keeps_its_thresholds_on_the_device(monkeypatch, name):
    # SIDCo on CUDA takes the device-side stages (its check on this GPU passed), which
    # select what the host-driven stages select, over steps whose stage count adapts
    from compressors.kernels import sidco_pipeline

    grads = [_laplace(3_000_017, seed=s).cuda() for s in range(8)]
    s = compressors.build(name, ratio=0.001)
    assert sidco_pipeline.device_stages_usable(grads[0].device, s)
    taken = []  # per step: whether its first read was speculative (None: not tried)
    real = sidco_pipeline.select_device

    def spy(*args, **kwargs):
        found = real(*args, **kwargs)
        if not kwargs:  # (not the redo of a step whose speculation missed)
            taken.append(found[2])
        return found

    monkeypatch.setattr(sidco_pipeline, "select_device", spy)
    device = _run(name, grads, 0.001)
    assert len(taken) == len(grads) and True in taken
    monkeypatch.setattr(sidco_pipeline, "device_stages_usable", lambda *args: False)
    host = _run(name, grads, 0.001)
    for d, h in zip(device, host):
        assert torch.equal(d.sent.indices, h.sent.indices)
        assert torch.equal(d.sent.values, h.sent.values)


@pytest.mark.gpu
def test_cuda_compactions_in_one_pass_equal_nonzero():
    # SIDCo's one-pass compactions (decoupled look-back), whose tiles run concurrently
    # only on a GPU: thousands of tiles, from acc, from a pool, and the final selection
    from compressors.kernels import cuda_sidco as dev

    acc = _laplace(20_000_003, seed=5).cuda()
    a = acc.abs()
    t = [float(a.kthvalue(int(q * acc.numel())).values) for q in (0.5, 0.93, 0.999)]
    stages = dev.Stages(acc, 3)
    for slot, value in enumerate(t):
        stages.set(slot, value)
    pool = stages.compact(stages.source(), 0, 0.0, cap=acc.numel())
    inner = stages.compact(pool, 1, 0.0, cap=acc.numel() // 8)
    out = stages.final(inner, 2, inner, 1)
    flags, total, _ = stages.read()
    assert flags == 0
    for got, want in ((pool, a > t[0]), (inner, a > t[1])):
        want = torch.nonzero(want).squeeze(1)
        assert int(got.count) == want.numel()
        assert torch.equal(got.positions[:want.numel()], want)
        assert torch.equal(got.values[:want.numel()], acc[want])
    want = torch.nonzero(a >= t[2]).squeeze(1)
    assert total == want.numel() > 0
    assert torch.equal(out.positions[:total], want) and torch.equal(out.values[:total], acc[want])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1_000_003, 1 << 27])
def test_cuda_l2_norm_is_the_float64_norm_and_stays_on_the_device(n):
    from compressors.kernels import ops

    x = (_laplace(n, seed=n % 997) * 1e22).cuda()  # its squares overflow float32
    got = ops.l2_norm(x)
    assert got.device == x.device and got.dtype == torch.float64 and got.shape == (1,)
    want = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert torch.equal(ops.l2_norm(x), got)  # the same bits each call
