"""The test suite, one folder per layer: ``ops`` (the public ops on every backend against the
reference), ``backends`` (what is specific to the C++, Triton and CUDA backends), ``nn`` (the
models and modules), ``distributed`` (data, tensor and pipeline parallel training, checkpoints),
``hf`` (the transformers integration), ``benchmarks`` (the benchmark scripts' logic). Shared
helpers live in :mod:`tests.support`, shared fixtures in ``tests/conftest.py``."""
