"""DRAGONN's encoding (Algorithm 1, lines 4-11: the candidates above the threshold written
into a hashed memory of m slots, then the values at the surviving slots), fused where a
kernel takes the tensor:

- CUDA (Triton): one read of acc writes every candidate straight into its slot (the
  memory does not depend on the order the candidates come in), with the threshold and the
  hash seeds read on the device: no compaction and no host synchronisation before the
  send (cuda.dragonn_encode);
- CPU (C++): one selection pass writes the candidates and their values, then one loop
  over the candidates writes the memory and takes the surviving values from the
  selection's (the same integer operations as reference.write_slots; cpu.dragonn_slots);
- elsewhere the torch twin: the candidates by one comparison and a compaction, then
  reference.write_slots and a gather.

Every path writes the same slots and values for the same threshold and seeds.
"""

from __future__ import annotations

import torch

from compressors.kernels import cpu, ops, reference
from compressors.kernels.types import NonFinite


def encode(acc: torch.Tensor, threshold: torch.Tensor, m: int, seeds: torch.Tensor,
           check_finite: bool = False, expected: int = 0,
           ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """(slots: m int64 positions of acc, −1 where empty; values: acc there, 0 where empty;
    the candidates' count, an int or, on CUDA, a one-element device tensor) for flat acc,
    the threshold as a 0-dim tensor of acc's dtype on acc's device (|acc_i| ≥ threshold
    passes) and the two 32-bit hash seeds (an int64 tensor on acc's device).
    `check_finite`: NonFinite on a NaN or an Inf, found in the first read. `expected`:
    about how many pass (sizes the CPU selection's buffers)."""
    numel = acc.numel()
    fits = numel <= 2**32 and m < 2**31  # the kernels' integer ranges
    layout = reference.priority_layout(numel)
    if fits and ops.supports_cuda(acc):
        slots, values, found = ops._cuda().dragonn_encode(
            acc, threshold.reshape(1), m, *layout, seeds, check_finite=check_finite)
        if check_finite and int(found[1]):
            raise NonFinite("the tensor holds NaN or Inf")
        return slots, values, found[0]
    if ops.supports(acc):
        # one fused pass, no |acc| or mask buffer; the values beside
        candidates, found = ops.select(acc, float(threshold), reserve=expected,
                                       check_finite=check_finite, values=fits, signed=True)
        if fits:  # (on the CPU: CUDA took the path above)
            slots, values = cpu.dragonn_slots(candidates, m, *layout, tuple(seeds.tolist()),
                                              acc, key_values=found)
            return slots, values, candidates.numel()
    else:
        candidates = reference.flat_nonzero(acc.abs() >= threshold)
    slots = reference.write_slots(candidates, m, seeds, numel)
    values = acc.index_select(0, slots.clamp(min=0)).masked_fill_(slots < 0, 0)
    return slots, values, candidates.numel()
