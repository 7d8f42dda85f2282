"""What is specific to one backend: the C++ CPU op, Triton (interpreted), CUDA (under the SIMT harness, or a GPU)."""
