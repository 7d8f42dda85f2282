"""The transformers integration (attnres_kernels.hf) on tiny random models."""
