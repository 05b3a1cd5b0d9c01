"""gradcomp-repro's engine: drivers over torch.distributed, measurement, benchmarks, CLI."""
