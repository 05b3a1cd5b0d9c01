"""A bucket's per-tensor sparsifier exchanges run as one (compressors.batched): every
tensor still selected alone, so the aggregates, the error feedback, the compressor states
and random streams and the per-tensor records are bit for bit those of one exchange per
tensor (CompressionOptions.batch=False), on 3 simulated workers, over several steps."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import drive
from compressors.batched import batches
from repro.compression import WorkerCompression

WORKERS = 3
STEPS = 4
# name, numel: an embedding whose rows are mostly untouched (zero), a layer with ReLU
# zeros, a 3-element bias (below min_numel: reduced densely, between compressed ones), a
# weight, a gradient that is zero on one step, a vector.
TENSORS = (("embedding", 4000), ("conv", 2304), ("bias", 3), ("fc", 1500),
           ("idle", 600), ("norm", 64))
MIN_NUMEL = 16


def _batched_names() -> list[str]:
    out = []
    for name in compressors.list_compressors():
        comp = compressors.build(name, **_params(name))
        if batches(comp):
            out.append(name)
    return out


def _params(name: str) -> dict:
    return {"ratio": 0.02} if "ratio" in compressors.default_params(name) else {}


def _gradients(worker: int, step: int, bucket: bool) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    parts = []
    for name, numel in TENSORS:
        t = torch.randn(numel, generator=g) * (1 + 0.5 * worker)
        if name == "embedding":
            rows = t.view(-1, 16)
            rows[torch.rand(rows.shape[0], generator=g) > 0.1] = 0
        elif name == "conv":
            t.clamp_(min=0)
        elif name == "idle" and step == 2:
            t.zero_()
        parts.append(t)
    if bucket:  # views of one flat buffer, as DDP hands a bucket's gradients
        flat = torch.cat(parts)
        parts = list(flat.split([n for _, n in TENSORS]))
    return [(name, t) for (name, _), t in zip(TENSORS, parts)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _run(name: str, batch: bool, bucket: bool, **options) -> list:
    comp = compressors.build(name, **_params(name))
    workers = [WorkerCompression(comp, r, WORKERS, granularity="layer", batch=batch,
                                 measure=True, min_numel=MIN_NUMEL, **options)
               for r in range(WORKERS)]
    history = []
    for step in range(STEPS):
        grads = [_gradients(r, step, bucket) for r in range(WORKERS)]
        jobs = [w.layerwise(g, step) for w, g in zip(workers, grads)]
        for (_, finish), result in zip(jobs, drive([job for job, _ in jobs])):
            finish(result)
        records = [sorted((r.name, r.compressed, r.selected, r.target, r.union, r.bytes_sent,
                           r.collectives) for r in w.pop_records()) for w in workers]
        history.append({"aggregate": [t.clone() for _, t in grads[0]], "records": records,
                        "state": [w.state_dict() for w in workers],
                        "residuals": [w.parameter_residuals() for w in workers]})
    return history


@pytest.mark.parametrize("bucket", [True, False], ids=["bucket_views", "separate_tensors"])
@pytest.mark.parametrize("feedback", ["default", "none"])
@pytest.mark.parametrize("name", _batched_names())
def test_batched_exchange_is_bit_for_bit_one_exchange_per_tensor(name, feedback, bucket,
                                                                 monkeypatch):
    import repro.compression

    ran = []
    real = repro.compression.sparse_batch

    def counted(sessions, names, *args, **kwargs):
        ran.append(tuple(names))
        return real(sessions, names, *args, **kwargs)

    monkeypatch.setattr(repro.compression, "sparse_batch", counted)
    alone = _run(name, False, bucket, feedback=feedback)
    assert not ran
    together = _run(name, True, bucket, feedback=feedback)
    compressed = tuple(n for n, numel in TENSORS if numel >= MIN_NUMEL)
    assert ran == [compressed] * (STEPS * WORKERS), "the batched path did not run"
    for step, (a, b) in enumerate(zip(alone, together)):
        for what in a:
            assert _same(a[what], b[what]), f"{name}, step {step}: {what} differs"


@pytest.mark.parametrize("name,feedback", [("topk", "none"), ("dgc", "none"),
                                           ("sidco_e", "none"), ("dgc", "default"),
                                           ("gaussianksgd", "default")])
def test_batched_exchange_skips_a_nonfinite_step_as_one_exchange_per_tensor(name, feedback):
    """nonfinite='skip' with a NaN on one worker at step 1, the agreement riding on the
    exchange's first collective (so the batch runs speculatively: selections drawn,
    feedback staged): it is abandoned on every worker, compressor states, random streams
    and error feedback stay as they were, and later steps go on bit for bit as without
    batching."""
    def run(batch: bool):
        comp = compressors.build(name, **_params(name))
        workers = [WorkerCompression(comp, r, WORKERS, granularity="layer", batch=batch,
                                     feedback=feedback, nonfinite="skip")
                   for r in range(WORKERS)]
        for w in workers:
            w.fold_agreement = True  # (on the CPU only exchanges without feedback fold)
        out = []
        for step in range(4):
            grads = [_gradients(r, step, True) for r in range(WORKERS)]
            if step == 1:
                grads[2][3][1][7] = float("nan")
            jobs = [w.step_job(g, step) for w, g in zip(workers, grads)]
            for (_, finish), result in zip(jobs, drive([job for job, _ in jobs])):
                finish(result)
            out.append(([w.skipped for w in workers], [t.clone() for _, t in grads[0]],
                        [w.state_dict() for w in workers]))
        return out

    alone, together = run(False), run(True)
    assert [s for s, _, _ in together] == [[False] * 3, [True] * 3, [False] * 3, [False] * 3]
    assert _same(alone, together)
