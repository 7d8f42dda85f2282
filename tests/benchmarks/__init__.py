"""The benchmark scripts' logic, run without a GPU."""
