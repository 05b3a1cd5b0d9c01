"""CLT-k: cyclic local top-k (Chen et al., ScaleCom, NeurIPS 2020), as DEFT compares it.

The step's leader (rank = step mod n) runs top-k on its own |acc| and broadcasts the k
indices; every worker allreduces its acc's values at those indices and divides by n. The
aggregate always holds exactly k coordinates (no gradient build-up), at the price of the
other workers idling while the leader selects over the whole gradient (DEFT, Section 3.1).
Error feedback zeroes the k sent coordinates on every worker.
"""

from __future__ import annotations

import time

import torch

from compressors.kernels import ops
from compressors.base import (
    Compressor,
    Context,
    Exchange,
    Outcome,
    Pattern,
    SparseSent,
    check_ratio,
    index_dtype,
    target_k,
)
from compressors.registry import register
from compressors.requests import AllReduce, Broadcast


@register("cltk")
class CyclicLocalTopK(Compressor):
    """CLT-k with density `ratio` (default 0.01, DEFT's setting for Top-k and CLT-k).

    Outcome: selected = target = union = k on every worker (the leader's selection is
    the one every worker applies); extra["select_s"] = the leader's top-k time (0 on the
    others), extra["leader"] = the step's leader.
    """

    pattern = Pattern.LEADER_BROADCAST
    sparse = True
    default_feedback = "residual"
    # The leader's top-k runs over the whole gradient, as DEFT compares it.
    default_granularity = "model"

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio(ratio)

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        k = target_k(numel, self.ratio)
        select_s = 0.0
        if ctx.is_leader:
            t0 = time.perf_counter()
            indices = torch.topk(ops.abs_into_workspace(acc), k,
                                 sorted=False).indices.to(index_dtype(numel))
            if ctx.measure and acc.is_cuda:
                torch.cuda.synchronize(acc.device)
            select_s = time.perf_counter() - t0
        else:
            # Non-leaders know k, so a buffer of the right shape receives the broadcast.
            indices = torch.empty(k, dtype=index_dtype(numel), device=acc.device)
        if ctx.world_size > 1:
            indices = yield Broadcast(indices, src=ctx.leader)
        indices_long = indices.long()
        values = acc.index_select(0, indices_long)
        total = yield AllReduce(values.clone())
        if ctx.world_size > 1:
            total.div_(ctx.world_size)
        aggregate = ctx.aggregate_buffer(numel, acc.dtype, acc.device)
        aggregate.index_copy_(0, indices_long, total)
        return Outcome(
            aggregate=aggregate,
            sent=SparseSent(indices, values),
            selected=k,
            target=k,
            union=k,
            extra={"select_s": select_s, "leader": ctx.leader},
        )

    def sent_elements(self, numel: int) -> int:
        return target_k(numel, self.ratio)
