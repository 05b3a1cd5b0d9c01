"""`repro bench` and its pieces. The `benchmark` tests run once as plain tests under the
default --benchmark-disable; `pytest --benchmark-enable tests/kernels/test_bench.py` times them."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import compressors
from compressors import Session, drive
from repro import bench
from repro.cli import main
from repro.sources import synthetic

NAMES = compressors.list_compressors()
SIZE = 100_000
RATIO = 0.01


@pytest.fixture(scope="module")
def grad() -> torch.Tensor:
    return synthetic("laplace", SIZE, 1, 0, 0)[0]


def _build(name: str, ratio: float = RATIO):
    accepts_ratio = "ratio" in compressors.default_params(name)
    return compressors.build(name, **({"ratio": ratio} if accepts_ratio else {}))


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_benchmark(benchmark, grad, name):
    """Every registered compressor runs under the benchmark driver, and the driver answers
    its requests exactly as the simulated driver does for one worker."""
    session = Session(_build(name), world_size=1, feedback="none", seed=5, check_finite=False,
                      measure=False)
    steps = itertools.count()
    outcome, enc, dec = benchmark(lambda: bench.exchange_once(session, grad, next(steps)))
    assert enc > 0 and dec >= 0
    assert outcome.aggregate.shape == (SIZE,) and bool(torch.isfinite(outcome.aggregate).all())
    # Same seed, same step, driven by compressors.simulated: identical aggregate.
    step = next(steps) - 1
    twin = Session(_build(name), world_size=1, feedback="none", seed=5, check_finite=False,
                   measure=False)
    if step > 0:  # replay the calls the benchmark made, so per-tensor state matches
        for s in range(step):
            drive([twin.exchange(bench.TENSOR_NAME, grad, s)])
    expected = drive([twin.exchange(bench.TENSOR_NAME, grad, step)])[0]
    assert torch.equal(outcome.aggregate, expected.aggregate)
    assert grad.equal(synthetic("laplace", SIZE, 1, 0, 0)[0])  # the input is untouched


def test_floor_benchmark(benchmark, grad):
    abs_grad = grad.abs()
    total = benchmark(torch.sum, abs_grad)
    assert float(total) == pytest.approx(float(torch.linalg.vector_norm(grad, 1)), rel=1e-5)


@pytest.mark.parametrize("workers", [2, 8])
@pytest.mark.parametrize("kind", ["batched", "dense"])
def test_decode_benchmark(benchmark, workers, kind):
    """Batched (one index_add) and dense per-rank decoding give the same mean."""
    k = bench.target_k(SIZE, RATIO)
    idx, val = bench.sparse_payloads(SIZE, k, workers, seed=1)
    fn = bench.batched_decode if kind == "batched" else bench.dense_per_rank_decode
    out = benchmark(fn, idx, val, SIZE, workers, torch.float32)
    ref = torch.zeros(SIZE, dtype=torch.float64)
    for i, v in zip(idx, val):
        ref[i.long()] += v.double()
    torch.testing.assert_close(out, (ref / workers).float(), rtol=1e-6, atol=1e-7)


def test_sparse_payloads_are_unique_in_range_and_overlap_partly():
    numel, k = 10_000, 1_000
    idx, val = bench.sparse_payloads(numel, k, 4, seed=0)
    assert len(idx) == len(val) == 4
    for i, v in zip(idx, val):
        assert i.dtype == torch.int32 and i.numel() == k == v.numel()
        assert int(i.min()) >= 0 and int(i.max()) < numel
        assert torch.unique(i).numel() == k
    union = torch.unique(torch.cat(idx)).numel()
    assert k < union < 4 * k


def test_parse_size():
    assert bench.parse_size("260000") == 260_000
    assert bench.parse_size("2.6M") == 2_600_000 == bench.parse_size("2.6e6")
    assert bench.parse_size("26m") == 26_000_000 and bench.parse_size("260k") == 260_000
    for bad in ("0", "abc", "2.5", "-3"):
        with pytest.raises(ValueError, match="size"):
            bench.parse_size(bad)


def test_quick_json_has_floor_topk_ratios_and_decoding(capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    rc = main(["bench", "--quick", "--sizes", "20000,30k", "--json", "--out", str(out_file),
               "--threads", "1", "--device", "cpu"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == report
    m = report["machine"]
    assert {"platform", "cpu", "torch", "threads", "devices"} <= set(m) and m["threads"] == 1
    sizes = [20_000, 30_000]
    assert [f["numel"] for f in report["floor"] if f["device"] == "cpu"] == sizes
    assert all(0 < f["sum_abs_min_ms"] <= f["sum_abs_ms"] for f in report["floor"])
    assert all(0 < f["l1_norm_min_ms"] <= f["l1_norm_ms"] for f in report["floor"])
    ratios = report["config"]["ratios"]
    assert ratios == list(bench.QUICK_RATIOS)
    expected_names = ["topk", *(n for n in bench.default_compressors() if n != "topk")]
    assert report["config"]["compressors"] == expected_names
    enc = report["encode"]
    for size in sizes:
        for ratio in ratios:
            cells = [e for e in enc if e["numel"] == size and e["ratio"] == ratio]
            assert [e["compressor"] for e in cells] == expected_names
            topk = cells[0]
            assert topk["encode_over_topk"] == 1.0 and topk["k_hat"] == topk["k"]
            for e in cells:
                assert 0 < e["encode_min_ms"] <= e["encode_ms"] and e["encode_over_floor"] > 0
                assert 0 <= e["decode_min_ms"] <= e["decode_ms"]
                assert e["encode_over_topk"] > 0 and e["speedup_over_topk"] > 0
                assert e["repeats"] == bench.QUICK_REPEATS
    dec = report["decode"]
    assert {(d["numel"], d["ratio"], d["workers"]) for d in dec} == {
        (s, r, w) for s in sizes for r in ratios for w in bench.QUICK_DECODE_WORKERS}
    assert all(0 < d["batched_min_ms"] <= d["batched_ms"] for d in dec)
    assert all(0 < d["dense_per_rank_min_ms"] <= d["dense_per_rank_ms"] for d in dec)


def test_table_output_and_compressor_without_ratio(capsys):
    rc = main(["bench", "--quick", "--sizes", "5000", "--compressor", "fp16,dgc",
               "--decode-workers", "2", "--repeats", "1", "--device", "cpu"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "floor sum(|x|)" in text and "batched (one index_add) vs dense per rank" in text
    fp16 = [line for line in text.splitlines() if line.startswith("fp16")]
    assert len(fp16) == 1 and fp16[0].split()[1] == "-"  # one row, no ratio
    assert sum(line.startswith("topk") for line in text.splitlines()) == len(bench.QUICK_RATIOS)


def test_capped_cells_are_reported_and_threads_restored():
    before = torch.get_num_threads()
    report = bench.run_bench(["topk"], sizes=[20_000], ratios=[0.01], repeats=5, threads=1,
                             devices="cpu", budget_s=1e-9, decode_workers=[2])
    assert torch.get_num_threads() == before
    assert all(e["repeats"] == 1 for e in report["encode"] + report["decode"])
    assert any("topk ratio 0.01" in c and "1 repeat(s) instead of 5" in c for c in report["capped"])
    assert any("decoding K=2" in c for c in report["capped"])


@pytest.mark.parametrize("argv, problem", [
    (["--compressor", "nosuch"], "unknown compressor 'nosuch'; registered:"),
    (["--ratios", "0"], "out of range"),
    (["--ratios", "0.1,2"], "out of range"),
    (["--sizes", "0"], "must be ≥ 1 element"),
    (["--sizes", "lots"], "is not a number of elements"),
    (["--repeats", "0"], "--repeats=0 must be an integer ≥ 1"),
    (["--threads", "0"], "--threads=0 must be an integer ≥ 1"),
    (["--budget", "0"], "--budget=0.0 must be > 0"),
    (["--decode-workers", "0"], "must be an integer ≥ 1"),
    (["--device", "tpu"], "device 'tpu'"),
    (["--source", "file:x.pt"], "unknown source"),
    (["--out", "/nonexistent/dir/bench.json"], "does not exist"),
])
def test_bad_input_exits_2_naming_the_problem(capsys, argv, problem):
    assert main(["bench", "--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("repro bench: error:") and problem in err
    assert err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on CPU-only machines")
def test_cuda_refused_without_a_gpu(capsys):
    assert main(["bench", "--quick", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_bench_runs():
    report = bench.run_bench(["topk", "dgc"], sizes=[100_000], ratios=[0.01], repeats=2,
                             devices="cuda", decode_workers=[2])
    assert all(e["device"].startswith("cuda") for e in report["encode"])
    assert all(e["encode_ms"] > 0 for e in report["encode"])


def test_fwht_floor_redsync_probes_and_native_flag():
    report = bench.run_bench(["redsync", "thc"], sizes=[20_000], ratios=[0.01], repeats=1,
                             threads=1, devices="cpu", decode_workers=[2])
    floor = report["floor"][0]
    assert floor["fwht_numel"] == 32_768 and 0 < floor["fwht_min_ms"] <= floor["fwht_ms"]
    assert isinstance(floor["native_kernels"], bool)
    cells = {e["compressor"]: e for e in report["encode"]}
    assert cells["redsync"]["probes"] >= 1 and cells["redsync"]["encode_per_probe_over_floor"] > 0
    assert cells["thc"]["encode_over_fwht"] > 0 and cells["topk"]["encode_over_fwht"] is None


def test_fixed_threshold_cells_get_the_lambda_that_keeps_the_ratio():
    x = synthetic("laplace", 100_000, 1, 0, 0)[0]
    cache: dict = {}
    params = bench.cell_params("hard_threshold", 0.001, x, cache)
    k = compressors.base.target_k(x.numel(), 0.001)
    assert int((x.abs() >= params["lam"]).sum()) == k  # continuous data: no ties
    assert bench.cell_params("hard_threshold", 0.001, x, cache) == params  # computed once
    assert bench.cell_params("sidco_e", 0.001, x, cache) == {"ratio": 0.001}
