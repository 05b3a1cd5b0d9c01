"""The kernel layer under the algorithms: fused passes over gradients, picked per tensor.

    ops.py              the one front: each function picks the C++ kernels (CPU), the
                        Triton kernels (CUDA) or the torch twins, per tensor
    build.py            compiles csrc/ with the system compiler at first use, caches the
                        library (GRADCOMP_NATIVE_CACHE), checks its ABI version
    cpu.py, cpu_thc.py  ctypes bindings of csrc/kernels.cpp and csrc/thc_kernels.cpp
    cuda.py             Triton kernels (and the self-test each device passes first)
    reference.py        the pure-torch twins; counter_stream.py the shared random stream
    sidco_pipeline.py, cuda_sidco.py, dragonn_pipeline.py, thc_pipeline.py
                        the accelerated paths of single algorithms, which take what they
                        need of the algorithm (its fits, its grid) as arguments

Nothing here imports an algorithm module (tests/engine/test_imports.py). `python -m
compressors.kernels` builds the library and says where it is. GRADCOMP_NATIVE=0 turns
every kernel off (the torch twins run).
"""
