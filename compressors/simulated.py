"""n simulated workers in one process (THC Section 8.3), run in lock step.

Each worker is a Session running the same compressor; every round, the n requests are
combined in memory exactly as the collective would combine them, with the same aliasing
as torch.distributed: AllReduce and Broadcast write their result into each rank's own
request tensor (the answer is that tensor), AllGather answers a fresh list.
Deterministic, single process, no threads.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from compressors.base import Compressor, Outcome, Segment
from compressors.feedback import ErrorFeedback
from compressors.requests import AllGather, AllReduce, Broadcast, Request, as_round
from compressors.session import Session


def _combine(requests: Sequence[Request]) -> list[Any]:
    """Answer one request position across all n workers."""
    first = requests[0]
    kind = type(first)
    if any(type(r) is not kind for r in requests):
        names = sorted({type(r).__name__ for r in requests})
        raise RuntimeError(f"workers disagree on the collective of this round: {names}")
    n = len(requests)
    if isinstance(first, AllReduce):
        ops = {r.op for r in requests}
        shapes = {tuple(r.tensor.shape) for r in requests}
        if len(ops) != 1 or len(shapes) != 1:
            raise RuntimeError(f"AllReduce mismatch across workers: ops {ops}, shapes {shapes}")
        # Sum in rank order, pairwise left to right, as a two-rank ring does.
        total = requests[0].tensor.clone()
        for r in requests[1:]:
            if first.op == "sum":
                total.add_(r.tensor)
            elif first.op == "max":
                torch.maximum(total, r.tensor, out=total)
            else:
                torch.minimum(total, r.tensor, out=total)
        for r in requests:
            r.tensor.copy_(total)
        return [r.tensor for r in requests]
    if isinstance(first, AllGather):
        dtypes = {r.tensor.dtype for r in requests}
        if len(dtypes) != 1:
            raise RuntimeError(f"AllGather dtype mismatch across workers: {dtypes}")
        gathered = [r.tensor.clone() for r in requests]
        return [list(gathered) for _ in range(n)]
    if isinstance(first, Broadcast):
        srcs = {r.src for r in requests}
        if len(srcs) != 1:
            raise RuntimeError(f"Broadcast source mismatch across workers: {srcs}")
        src = first.src
        for i, r in enumerate(requests):
            if i != src:
                r.tensor.copy_(requests[src].tensor)
        return [r.tensor for r in requests]
    raise TypeError(f"unknown request {kind.__name__}")


def drive_one(gen: Generator[Any, Any, Any], answer: Callable[[Any], Any]) -> Any:
    """Run ONE worker's generator to its end, each yielded request or round answered by
    answer(item) (torch.distributed collectives, a one-rank group for timing, a fake
    group for profiling); its return value."""
    reply: Any = None
    while True:
        try:
            item = gen.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = answer(item)


def drive(generators: Sequence[Generator[Any, Any, Any]]) -> list[Any]:
    """Advance n worker generators in lock step until all return; their return values."""
    n = len(generators)
    answers: list[Any] = [None] * n
    while True:
        items: list[Any] = []
        finished: list[Any] = []
        for gen, ans in zip(generators, answers):
            try:
                items.append(gen.send(ans))
            except StopIteration as stop:
                finished.append(stop.value)
        if finished:
            if len(finished) != n:
                raise RuntimeError(
                    f"{len(finished)} of {n} workers finished while others still requested "
                    "collectives: the protocol's rounds depend on local data"
                )
            return finished
        rounds = [as_round(it) for it in items]
        sizes = {len(r[0]) for r in rounds}
        if len(sizes) != 1:
            raise RuntimeError(f"workers yielded rounds of different lengths: {sorted(sizes)}")
        per_position = [_combine([r[0][j] for r in rounds]) for j in range(sizes.pop())]
        answers = []
        for w in range(n):
            ans = tuple(pos[w] for pos in per_position)
            answers.append(ans if rounds[w][1] else ans[0])


class SimulatedGroup:
    """n Sessions of one compressor, stepped together on per-worker gradients."""

    def __init__(
        self,
        compressor: Compressor,
        world_size: int,
        feedback: str | ErrorFeedback | None = "default",
        seed: int = 0,
        check_finite: bool = True,
        measure: bool = True,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be ≥ 1, got {world_size}")
        self.compressor = compressor
        self.world_size = world_size
        self.sessions = [
            Session(compressor, rank=r, world_size=world_size, feedback=feedback, seed=seed,
                    check_finite=check_finite, measure=measure)
            for r in range(world_size)
        ]
        self.step_count = 0

    def step(
        self,
        grads: Sequence[torch.Tensor],
        name: str = "grad",
        step: int | None = None,
        layout: tuple[Segment, ...] | None = None,
    ) -> list[Outcome]:
        """One exchange of `grads[r]` from every worker r; the outcomes in rank order.
        The inputs are not modified."""
        if len(grads) != self.world_size:
            raise ValueError(f"expected {self.world_size} gradients (one per worker), got {len(grads)}")
        shapes = {tuple(g.shape) for g in grads}
        if len(shapes) != 1:
            raise ValueError(f"workers' gradients differ in shape: {sorted(shapes)}")
        s = self.step_count if step is None else step
        gens = [
            sess.exchange(name, g, s, layout=layout)
            for sess, g in zip(self.sessions, grads)
        ]
        outcomes = drive(gens)
        self.step_count = s + 1
        return outcomes
