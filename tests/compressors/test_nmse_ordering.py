"""THC Fig. 2b's ordering in one `repro measure` run: 2 workers, identical log-normal
gradients for every compressor (THC's NMSE setup, Appendix C.1), no error feedback so the
NMSE is the compressor's own. The paper reports TopK 10% ≈ 0.36 and TernGrad ≈ 15.7 on
real training gradients (THC below both); the numbers here are printed beside them."""

from __future__ import annotations

from repro.measure import measure

PAPER = {"topk": 0.36, "terngrad": 15.7}


def test_thc_below_topk_10_percent_below_terngrad():
    kwargs = dict(workers=2, size=2**14, steps=3, source="lognormal", seed=1, feedback="none")
    topk = measure("topk", ratio=0.1, **kwargs)[0]["nmse_mean"]
    terngrad, thc = (r["nmse_mean"] for r in measure(["terngrad", "thc"], ratio=None, **kwargs))
    print(f"\nNMSE, 2 workers, log-normal: topk10% {topk:.4g} (paper {PAPER['topk']}), "
          f"terngrad {terngrad:.4g} (paper {PAPER['terngrad']}), thc {thc:.4g}")
    assert thc < topk < terngrad
    # The paper's gap: TernGrad worse than Top-k 10% by more than an order of magnitude.
    assert terngrad > 10 * topk
