"""Many per-tensor sparsifier exchanges of ONE worker run as one.

Layer-wise compression (the papers' setting) selects per parameter tensor: its own k, its
own threshold, its own error feedback, compressor state and random stream. Run as one
Session exchange per tensor (and merged by compressors.multiplex), every tensor also pays
for a generator, its own payload, its own decode and its own bookkeeping: a fixed cost
per tensor that a DDP bucket of dozens of tensors pays dozens of times a step.

`sparse_batch` keeps everything that decides what is selected per tensor — each tensor's
Session prepares it (error feedback, Context) and its compressor selects on it with its
own k, state and stream, exactly as Sparsifier.protocol would — and does the rest once
for the batch: one payload of the selections at their offsets in the tensors laid end to
end (each tensor's count appended, so each rank's payload can be split back), one round,
one decode. What each tensor's aggregate, error feedback and Outcome hold is bit for bit
what its own exchange gives: the decode adds every rank's values at an index in rank
order and divides once, which does not depend on the batch. Where the tensors' aggregate
destinations lie end to end in one buffer (a DDP bucket) the batch decodes straight into
it; else into a workspace, and the caller copies each tensor's part out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from compressors.base import (
    Exchange,
    Outcome,
    SparseSent,
    Sparsifier,
    index_dtype,
    sparse_mean,
    union_size,
)
from compressors.requests import AllGather
from compressors.session import Session, Speculation

# This module is infrastructure, not an algorithm: the package loader skips it.


def batches(compressor: Any) -> bool:
    """Whether `compressor`'s per-tensor exchanges can run as one sparse_batch: a
    Sparsifier with the stock protocol (select, then a sparse allgather)."""
    return (isinstance(compressor, Sparsifier)
            and type(compressor).protocol is Sparsifier.protocol)


def _end_to_end(outs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `outs` where they lie end to end, in order, in one storage
    (the parameters' gradients in a DDP bucket), else None."""
    first = outs[0]
    size = first.element_size()
    at = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for t in outs:
        if (t.data_ptr() != at or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage):
            return None
        at += t.numel() * size
    total = sum(t.numel() for t in outs)
    return first.as_strided((total,), (1,), first.storage_offset())


def sparse_batch(sessions: Sequence[Session], names: Sequence[str],
                 grads: Sequence[torch.Tensor], step: int,
                 outs: Sequence[torch.Tensor | None] | None = None,
                 speculation: Speculation | None = None) -> Exchange[list[Outcome]]:
    """One worker's exchanges of `grads` (by `names`, each with its own Session, all of
    one Sparsifier, dtype and device), already checked finite, as one protocol: its
    Outcomes in order, each as the tensor's own Session.exchange(name, grad, step,
    finite_checked=True, out=out, speculation=speculation) would return it. Each
    Outcome's collectives are the two allgathers its own exchange would have made at the
    sizes it would have made them (what the records and the cost model read); the batch
    issues one round of two for all of them. encode_s is the tensor's own preparation and
    selection plus an equal share of packing the payload, decode_s an equal share of the
    batch's decode and feedback updates."""
    count = len(grads)
    outs = list(outs) if outs is not None else [None] * count
    compressor = sessions[0].compressor
    prepared, targets, selections, encode = [], [], [], []
    for sess, name, grad, out in zip(sessions, names, grads, outs):
        p = sess.prepare(name, grad, step, finite_checked=True, out=out,
                         speculation=speculation)
        targets.append(compressor.target(p.flat.numel()))
        selections.append(compressor.select(p.acc, targets[-1], p.ctx))
        prepared.append(p)
        encode.append(time.perf_counter() - p.started)
    t0 = time.perf_counter()
    numels = [p.flat.numel() for p in prepared]
    total = sum(numels)
    wire = index_dtype(total)
    device = prepared[0].acc.device
    local = [s.indices.to(index_dtype(n)) for s, n in zip(selections, numels)]
    counts = torch.tensor([i.numel() for i in local], dtype=torch.int64)
    starts = torch.tensor([0, *numels[:-1]], dtype=torch.int64).cumsum(0)
    # Each selection at its tensor's offset in the batch, then the counts: one payload.
    payload = torch.cat([*(i.to(wire) for i in local), counts.to(wire).to(device)])
    payload[:-count] += starts.repeat_interleave(counts).to(wire).to(device)
    values = torch.cat([s.values for s in selections])
    shared = time.perf_counter() - t0

    gathered, all_values = yield (AllGather(payload), AllGather(values))

    t0 = time.perf_counter()
    # Every rank's counts: one small read for the batch.
    table = torch.stack([g[-count:] for g in gathered]).tolist()
    region = _end_to_end(outs) if all(o is not None for o in outs) else None
    dtype = prepared[0].acc.dtype
    if region is None:
        region = torch.empty(total, dtype=dtype, device=device)
    sparse_mean([g[:-count] for g in gathered], all_values, total, len(gathered), dtype,
                out=region)
    aggregates = region.split(numels)
    longest = [max(column) for column in zip(*table)]
    value_size = values.element_size()
    measure = prepared[0].ctx.measure
    if measure:  # (each tensor's distinct coordinates over the ranks)
        per_rank = [g[:-count].split(row) for g, row in zip(gathered, table)]
    outcomes = []
    for j, (sess, name, p, chosen) in enumerate(zip(sessions, names, prepared, selections)):
        sent = SparseSent(local[j], chosen.values)
        sess.conclude(name, p.acc, sent, p.staged)
        index_bytes = longest[j] * local[j].element_size()
        outcomes.append(Outcome(
            aggregate=aggregates[j], sent=sent, selected=local[j].numel(),
            target=targets[j],
            union=union_size([parts[j] for parts in per_rank]) if measure else None,
            extra=dict(chosen.extra), bytes_sent=index_bytes + longest[j] * value_size,
            collectives=(("allgather", index_bytes), ("allgather", longest[j] * value_size)),
            rounds=1, encode_s=encode[j] + shared / count))
    decode = (time.perf_counter() - t0) / count
    for o in outcomes:
        o.decode_s = decode
    return outcomes
