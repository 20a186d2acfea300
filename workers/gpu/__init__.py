"""The GPU backend: CuPy arrays, cuBLAS and the fused CUDA kernels (docs/GPU.md).

* ``backend``: the only module that imports cupy; ``run_gpu`` and the generic and fused paths;
* ``launch``: the thin launcher of ``kernels/attention.cu`` (kernel choice, argument packing);
* ``plan``: how the fused kernels cut one shard's work (pure Python);
* ``kernels/``: the CUDA source and its CPU emulation header for tests.

Importing this package imports nothing from cupy: ``workers.api`` imports
``workers.gpu.backend`` only for cupy inputs.
"""
