"""`repro measure` and repro.measure.measure: the reported metrics mean what they say."""

from __future__ import annotations

import json
import math

import pytest
import torch

import compressors
from repro.cli import main
from repro.measure import measure, parse_params, parse_value

SIZE = 20_000
FIELDS = {
    "compressor", "params", "feedback", "ratio", "numel", "workers", "steps", "source",
    "zeros", "k_ratio_mean", "k_ratio_p5", "k_ratio_p95", "density_mean", "nmse_mean",
    "ef_norm_rel_final", "ef_norm_rel_mean", "bytes_per_worker", "bytes_fraction", "rounds",
    "encode_ms", "decode_ms", "wire_bytes_per_worker",
}


def test_fields_and_exact_values_for_topk_and_none():
    res = measure(["topk", "none"], ratio=0.01, workers=3, size=SIZE, steps=3)
    assert [r["compressor"] for r in res] == ["topk", "none"]
    topk, none = res
    assert set(topk) == FIELDS and set(none) == FIELDS
    k = int(SIZE * 0.01)
    # Exact top-k selects exactly k: k̂/k is 1 at every step and worker.
    assert topk["k_ratio_mean"] == topk["k_ratio_p5"] == topk["k_ratio_p95"] == 1.0
    # int32 indices + float32 values, k of each, per worker.
    assert topk["bytes_per_worker"] == k * (4 + 4)
    assert topk["bytes_fraction"] == pytest.approx(k * 8 / (4 * SIZE))
    # Independent selections overlap only partly: the union is between k and n·k.
    assert k / SIZE < topk["density_mean"] <= 3 * k / SIZE
    assert 0 < topk["nmse_mean"] < 10
    assert topk["feedback"] == "residual" and topk["ef_norm_rel_final"] > 0
    assert topk["encode_ms"] > 0 and topk["decode_ms"] > 0 and topk["rounds"] == 1
    # No compression: the aggregate is the exact mean, every coordinate touched.
    assert none["nmse_mean"] < 1e-12
    assert none["density_mean"] == 1.0
    assert none["k_ratio_mean"] is None and none["ratio"] is None
    assert none["ef_norm_rel_final"] is None  # no error feedback by default
    assert none["bytes_per_worker"] == 4 * SIZE and none["bytes_fraction"] == 1.0
    # On each worker's link (ring, 3 workers): an allgather carries the 2 others'
    # payloads, an allreduce 2(K-1)/K = 4/3 of the tensor.
    assert topk["wire_bytes_per_worker"] == pytest.approx(2 * k * 8)
    assert none["wire_bytes_per_worker"] == pytest.approx(4 / 3 * 4 * SIZE)


def test_nmse_matches_a_direct_computation():
    """Random-k without feedback on one step: NMSE computed by hand from the same draw."""
    from repro import sources

    res = measure(["randomk"], ratio=0.1, workers=2, size=SIZE, steps=1, feedback="none",
                  seed=3)[0]
    grads = sources.synthetic("laplace", SIZE, 2, 3, 0)
    group = compressors.SimulatedGroup(compressors.build("randomk", ratio=0.1), 2,
                                       feedback="none", seed=3)
    agg = group.step(grads, name="grad", step=0)[0].aggregate
    mean = (grads[0] + grads[1]) / 2
    expected = float(((agg - mean) ** 2).sum() / (mean**2).sum())
    assert res["nmse_mean"] == pytest.approx(expected, rel=1e-5)
    # Shared-seed indices: the union is exactly k.
    assert res["density_mean"] == pytest.approx(int(SIZE * 0.1) / SIZE)


def test_topk_density_builds_up_with_workers():
    """DEFT's gradient build-up: workers' top-k sets overlap partly, so the union grows."""
    two = measure(["topk"], ratio=0.01, workers=2, size=SIZE, steps=2)[0]["density_mean"]
    eight = measure(["topk"], ratio=0.01, workers=8, size=SIZE, steps=2)[0]["density_mean"]
    assert eight > 1.5 * two


def test_param_reaches_only_compressors_that_accept_it():
    res = measure(["randomk", "topk"], ratio=0.01, workers=2, size=SIZE, steps=1,
                  params={"unbiased": True})
    assert res[0]["params"]["unbiased"] is True
    assert "unbiased" not in res[1]["params"]
    with pytest.raises(ValueError, match="none of the selected compressors accepts 'bogus'"):
        measure(["topk"], size=SIZE, steps=1, params={"bogus": 1})


def test_ratio_none_keeps_each_compressors_default():
    res = measure(["topk"], ratio=None, workers=2, size=SIZE, steps=1)[0]
    assert res["ratio"] == compressors.default_params("topk")["ratio"]


def test_parse_values():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("0.5") == 0.5 and parse_value("1e-3") == 1e-3
    assert parse_value("True") is True and parse_value("false") is False
    assert parse_value("none") is None and parse_value("bfloat16") == "bfloat16"
    assert parse_params(["a=1", "b = x"]) == {"a": 1, "b": "x"}
    with pytest.raises(ValueError, match="key=value"):
        parse_params(["novalue"])


def test_cli_json_parses_and_param_reaches_compressor(capsys):
    rc = main(["measure", "--compressor", "fp16", "--compressor", "topk", "--size", "5000",
               "--steps", "2", "--workers", "2", "--param", "dtype=bfloat16", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)["results"]
    assert [r["compressor"] for r in out] == ["fp16", "topk"]
    assert out[0]["params"]["dtype"] == "bfloat16"
    # bf16 on the wire: 2 bytes per element; the ratio is ignored by fp16.
    assert out[0]["bytes_per_worker"] == 2 * 5000 and out[0]["ratio"] is None
    assert out[0]["k_ratio_mean"] is None
    assert out[1]["ratio"] == 0.01


def test_cli_table_shows_dash_for_compressors_without_ratio(capsys):
    rc = main(["measure", "--compressor", "topk,fp16", "--size", "4000", "--steps", "1",
               "--workers", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("fp16"))
    assert row.split()[1] == "-"  # ratio column
    assert "1.000 [1.000, 1.000]" in next(line for line in lines if line.startswith("topk"))


@pytest.mark.parametrize("argv, problem", [
    (["--compressor", "nosuch"], "unknown compressor 'nosuch'; registered:"),
    (["--ratio", "0"], "out of range"),
    (["--ratio", "1.5"], "out of range"),
    (["--workers", "0"], "workers=0 must be ≥ 1"),
    (["--size", "0"], "size=0 must be ≥ 1"),
    (["--steps", "0"], "steps=0 must be ≥ 1"),
    (["--source", "cauchy"], "unknown source 'cauchy'"),
    (["--source", "file:/nonexistent/grads.pt"], "does not exist"),
    (["--param", "bogus=1"], "accepts 'bogus'"),
    (["--param", "ratio=2"], "out of range"),
    (["--compressor", "fp16", "--feedback", "momentum"], "not a sparsifier"),
    (["--zeros", "1"], "--zeros=1.0 is out of range"),
    (["--zeros", "-0.1"], "--zeros=-0.1 is out of range"),
    (["--zeros", "nan"], "--zeros=nan is out of range"),
    (["--zeros", "0.5", "--source", "file:/nonexistent/grads.pt"], "does not exist"),
])
def test_cli_bad_input_exits_2_naming_the_problem(capsys, argv, problem):
    assert main(["measure", "--size", "1000", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("repro measure: error:") and problem in err
    assert err.count("\n") == 1  # one clean line, no traceback


def test_unknown_name_lists_registered_names(capsys):
    assert main(["measure", "--compressor", "topk,nosuch"]) == 2
    err = capsys.readouterr().err
    for name in compressors.list_compressors():
        assert name in err


def test_file_source_single_tensor_and_per_worker_list(tmp_path):
    g = torch.Generator().manual_seed(0)
    single = torch.randn(3000, generator=g)
    torch.save(single, tmp_path / "one.pt")
    res = measure(["none", "topk"], workers=3, steps=2, source=f"file:{tmp_path / 'one.pt'}",
                  size=999_999)
    assert res[0]["numel"] == 3000
    # Every worker holds the same gradient: identical top-k sets, union = k.
    assert res[1]["density_mean"] == pytest.approx(30 / 3000)
    assert res[0]["nmse_mean"] < 1e-12

    per_worker = [torch.randn(40, 50, generator=g) for _ in range(3)]
    torch.save(per_worker, tmp_path / "list.pt")
    res = measure(["topk"], ratio=0.1, workers=2, steps=1, source=f"file:{tmp_path / 'list.pt'}")
    assert res[0]["numel"] == 2000
    assert 200 / 2000 < res[0]["density_mean"] <= 400 / 2000
    # One step, residual feedback, topk: the aggregate equals the mean of each worker's
    # top-200 values, checked directly.
    agg = torch.zeros(2000)
    for t in per_worker[:2]:
        flat = t.reshape(-1)
        idx = flat.abs().topk(200).indices
        agg[idx] += flat[idx] / 2
    mean = (per_worker[0] + per_worker[1]).reshape(-1) / 2
    expected = float(((agg - mean) ** 2).sum() / (mean**2).sum())
    assert res[0]["nmse_mean"] == pytest.approx(expected, rel=1e-5)

    torch.save([torch.randn(10)], tmp_path / "short.pt")
    with pytest.raises(ValueError, match="1 per-worker tensors but 2 workers"):
        measure(["topk"], workers=2, steps=1, source=f"file:{tmp_path / 'short.pt'}")
    torch.save(torch.tensor([1.0, math.nan]), tmp_path / "nan.pt")
    with pytest.raises(FloatingPointError, match="NaN"):
        measure(["topk"], workers=2, steps=1, source=f"file:{tmp_path / 'nan.pt'}")


def test_compressors_compared_on_the_same_gradients():
    """Running two compressors together gives each the result it gets alone."""
    together = measure(["topk", "randomk"], workers=2, size=SIZE, steps=2)
    alone = measure(["randomk"], workers=2, size=SIZE, steps=2)
    assert together[1]["nmse_mean"] == alone[0]["nmse_mean"]
    assert together[1]["ef_norm_rel_final"] == alone[0]["ef_norm_rel_final"]


def test_zeros_are_exact_and_fixed_across_workers_and_steps():
    """--zeros F: round(F·d) coordinates exactly zero in every worker's gradient at every
    step, at the same positions (drawn once from the seed, another seed other positions);
    the other coordinates keep the values drawn without zeros."""
    from repro import sources

    plain = sources.synthetic("laplace", SIZE, 3, 5, 2)
    steps = [sources.synthetic("laplace", SIZE, 3, 5, step, zeros=0.9) for step in range(3)]
    zero = steps[0][0] == 0
    assert int(zero.sum()) == round(0.9 * SIZE)
    for grads in steps:
        for g in grads:
            assert torch.equal(g == 0, zero)
    for g, p in zip(steps[2], plain):
        assert torch.equal(g[~zero], p[~zero])
    other = sources.synthetic("laplace", SIZE, 1, 6, 0, zeros=0.9)[0] == 0
    assert not torch.equal(other, zero)
    assert torch.equal(sources.synthetic("laplace", SIZE, 2, 5, 0, zeros=0.0)[1],
                       sources.synthetic("laplace", SIZE, 2, 5, 0)[1])
    for bad in (1.0, -0.1, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match="out of range"):
            sources.synthetic("laplace", SIZE, 1, 0, 0, zeros=bad)


def test_zeros_k_ratio_is_the_mean_over_workers_and_steps(tmp_path):
    """measure's k_ratio_mean with --zeros is the mean over every worker and step of
    selected/target of a simulated group fed the same gradients; the result names the
    fraction; a file: source refuses it."""
    from repro import sources

    res = measure(["sidco_e"], ratio=0.01, workers=3, size=SIZE, steps=4, zeros=0.9, seed=2)[0]
    group = compressors.SimulatedGroup(compressors.build("sidco_e", ratio=0.01), 3, seed=2)
    quality = []
    for step in range(4):
        grads = sources.synthetic("laplace", SIZE, 3, 2, step, zeros=0.9)
        quality += [o.selected / o.target for o in group.step(grads, name="grad", step=step)]
    assert res["zeros"] == 0.9
    assert res["k_ratio_mean"] == pytest.approx(sum(quality) / len(quality), rel=1e-12)
    assert 0.8 <= res["k_ratio_mean"] <= 1.25
    torch.save(torch.randn(100), tmp_path / "g.pt")
    with pytest.raises(ValueError, match="synthetic sources only"):
        measure(["topk"], workers=2, steps=1, source=f"file:{tmp_path / 'g.pt'}", zeros=0.5)


def test_cli_zeros_reach_the_results_and_the_table(capsys):
    assert main(["measure", "--compressor", "topk", "--size", "4000", "--steps", "1",
                 "--workers", "2", "--zeros", "0.75", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["results"][0]
    assert out["zeros"] == 0.75
    # Top-k of the nonzeros only: every nonzero of the aggregate is one of them
    assert out["density_mean"] <= 0.25
    assert main(["measure", "--compressor", "topk", "--size", "4000", "--steps", "1",
                 "--workers", "2", "--zeros", "0.75"]) == 0
    assert "0.75 of the coordinates exact zeros" in capsys.readouterr().out.splitlines()[0]
