"""Error feedback, kept apart from the algorithms and selectable per run.

acc = compensate(grad); the compressor sends C(acc); update(acc, sent) keeps
residual = acc − sent. Buffers are allocated once per tensor and updated in place.

`stage` is compensate for an exchange the workers may still call off (a speculative
one, compressors.session.Speculation): the same values, written apart from the state
(into `spare` buffers), the new buffers returned to be committed once it went ahead.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from compressors.base import Sent, SparseSent

# spare(key, like): a buffer shaped like `like` for a staged value of state[key]
Spare = Callable[[str, torch.Tensor], torch.Tensor]


class ErrorFeedback(abc.ABC):
    name: str = ""
    # compensate() returns the gradient itself and writes nothing (the Session may then
    # leave the NaN/Inf check to the compressor: nothing is modified before it runs).
    passes_through: bool = False

    @abc.abstractmethod
    def compensate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The tensor to compress (flat). May be a persistent buffer of `state`."""

    @abc.abstractmethod
    def update(self, acc: torch.Tensor, sent: Sent, state: dict[str, Any]) -> None:
        """Keep what was not sent."""

    def residual(self, state: dict[str, Any]) -> torch.Tensor | None:
        """The error carried to the next step (for metrics), if any."""
        return None

    def check(self, compressor: Any) -> None:
        """Raise if this feedback cannot work with the compressor."""

    def stage(self, grad: torch.Tensor, state: dict[str, Any],
              spare: Spare) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """compensate without touching `state`: (acc, the buffers that replace state's
        once the exchange goes ahead), bit for bit what compensate computes; `spare(key,
        like)` gives a buffer like `like` to write into (a former one of `state[key]`).
        None where this feedback cannot (the caller then agrees before compensating)."""
        return None


class NoFeedback(ErrorFeedback):
    """Nothing is kept: for exact compressors and the ones their papers run without EF."""

    name = "none"
    passes_through = True

    def compensate(self, grad, state):
        return grad

    def update(self, acc, sent, state):
        pass

    def stage(self, grad, state, spare):
        return grad, {}


class Residual(ErrorFeedback):
    """Plain residual memory: residual ← acc − sent, acc = grad + residual."""

    name = "residual"

    def compensate(self, grad, state):
        residual = state.get("residual")
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            residual = state["residual"] = grad.clone()
            return residual
        return residual.add_(grad)

    def stage(self, grad, state, spare):
        residual = state.get("residual")
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            acc = grad.clone()
        else:  # residual + grad, as compensate's add_, written apart
            acc = torch.add(residual, grad, out=spare("residual", residual))
        return acc, {"residual": acc}

    def update(self, acc, sent, state):
        # acc IS state["residual"] (compensate returned it): subtracting in place leaves
        # exactly acc − sent there, without a new full-size buffer.
        sent.subtract_from(acc)

    def residual(self, state):
        return state.get("residual")


class MomentumCorrection(ErrorFeedback):
    """DGC momentum correction (Lin et al. 2018, Section 3.2): u ← m·u + g; v ← v + u;
    send sparse(v); both u and v are zeroed where sent (momentum factor masking). With
    `nesterov`, u ← m·(u + g); v ← v + u + g (the Nesterov form of DGC's code). This
    momentum takes the place of an SGD optimizer's, which must not apply momentum to the
    gradient again: the suite's trainer then steps with repro.optim.MomentumCorrectedSGD,
    whose momentum applies to weight decay only (repro.config.training_plan decides; an
    Adam task keeps Adam)."""

    name = "momentum"

    def __init__(self, momentum: float = 0.9, nesterov: bool = False):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
                0.0 <= momentum < 1.0):
            raise ValueError(f"momentum={momentum!r} must be a number in [0, 1)")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov={nesterov!r} must be True or False")
        self.momentum = float(momentum)
        self.nesterov = nesterov

    def check(self, compressor):
        if not compressor.sparse:
            raise ValueError(
                f"momentum correction masks the coordinates a sparsifier sent; "
                f"{compressor.name!r} is not a sparsifier: use feedback='residual'"
            )

    def compensate(self, grad, state):
        u = state.get("momentum")
        if u is None or u.shape != grad.shape or u.dtype != grad.dtype:
            if self.nesterov:
                state["momentum"] = grad.mul(self.momentum)
                state["velocity"] = state["momentum"] + grad
            else:
                state["momentum"] = grad.clone()
                state["velocity"] = grad.clone()
            return state["velocity"]
        velocity = state.get("velocity")
        if velocity is None:  # u alone so far: the tensor was reduced densely until now
            velocity = state["velocity"] = torch.zeros_like(grad)
        if self.nesterov:
            u.add_(grad).mul_(self.momentum)
            return velocity.add_(u).add_(grad)
        u.mul_(self.momentum).add_(grad)
        return velocity.add_(u)

    def stage(self, grad, state, spare):
        u = state.get("momentum")
        if u is None or u.shape != grad.shape or u.dtype != grad.dtype:
            fresh: dict[str, Any] = {}
            velocity = self.compensate(grad, fresh)  # new buffers only
            return velocity, fresh
        velocity = state.get("velocity")
        # The same operations as compensate's, in the same order, written apart.
        new_velocity = (torch.zeros_like(grad) if velocity is None
                        else spare("velocity", velocity))
        if self.nesterov:
            new_u = torch.add(u, grad, out=spare("momentum", u)).mul_(self.momentum)
            if velocity is None:
                acc = new_velocity.add_(new_u).add_(grad)
            else:
                acc = torch.add(velocity, new_u, out=new_velocity).add_(grad)
        else:
            new_u = torch.mul(u, self.momentum, out=spare("momentum", u)).add_(grad)
            if velocity is None:
                acc = new_velocity.add_(new_u)
            else:
                acc = torch.add(velocity, new_u, out=new_velocity)
        return acc, {"momentum": new_u, "velocity": acc}

    def update(self, acc, sent, state):
        if not isinstance(sent, SparseSent):
            raise TypeError("momentum correction needs a sparse contribution (SparseSent)")
        sent.subtract_from(acc)
        state["momentum"].index_fill_(0, sent.indices.long(), 0)

    def residual(self, state):
        return state.get("velocity")


def make_feedback(spec: str | ErrorFeedback | None, **params: Any) -> ErrorFeedback:
    """'none' | 'residual' | 'momentum' (or an instance) → ErrorFeedback."""
    if isinstance(spec, ErrorFeedback):
        return spec
    table = {"none": NoFeedback, None: NoFeedback, "residual": Residual, "momentum": MomentumCorrection}
    if spec not in table:
        raise ValueError(f"unknown feedback {spec!r}; choose one of: none, residual, momentum")
    return table[spec](**params)
