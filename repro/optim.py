"""The optimizer step that goes with DGC's momentum correction.

With momentum correction (compressors.MomentumCorrection, `feedback="momentum"`) the
momentum is accumulated before sparsification, on each worker, and what is exchanged is
already the momentum-corrected update (Lin et al. 2018, Section 3.2; tensors reduced
densely get the same momentum on their aggregate, repro.hooks.WorkerCompression). The
optimizer must then not apply momentum to the gradient again: it applies it only to
weight decay, which is added after the exchange, as DGC's own optimizer does.

    p ← p − lr·(g + D),  D = wd·p with momentum: b ← m·b + wd·p; D = b
                         (Nesterov: D = wd·p + m·b)
"""

from __future__ import annotations

from typing import Any

import torch


class MomentumCorrectedSGD(torch.optim.Optimizer):
    """SGD for gradients that already carry momentum: plain SGD on the gradient, SGD with
    `momentum` (and `nesterov`) on the weight-decay term only."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if not lr >= 0.0:
            raise ValueError(f"lr={lr!r} must be ≥ 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must lie in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay!r} must be ≥ 0")
        if nesterov and momentum <= 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure: Any = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            wd, m, lr = group["weight_decay"], group["momentum"], group["lr"]
            grads = [p.grad for p in params]
            if wd:
                decay = torch._foreach_mul(params, wd)
                if m:
                    bufs = []
                    for p, d in zip(params, decay):
                        state = self.state[p]
                        buf = state.get("momentum_buffer")
                        if buf is None:
                            buf = state["momentum_buffer"] = d.clone()
                        else:
                            buf.mul_(m).add_(d)
                        bufs.append(buf)
                    if group["nesterov"]:
                        torch._foreach_add_(decay, bufs, alpha=m)
                    else:
                        decay = bufs
                torch._foreach_add_(params, decay, alpha=-lr)
            torch._foreach_add_(params, grads, alpha=-lr)
        return loss
