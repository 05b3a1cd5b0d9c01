"""python -m compressors.kernels: build the C++ library now and say where it is."""

import sys

from compressors.kernels import build

lib = build.load()
if lib is None:
    print(f"native kernels unavailable: {build.error() or 'disabled by GRADCOMP_NATIVE'}",
          file=sys.stderr)
    raise SystemExit(1)
print(f"native kernels loaded from {lib._name}")
