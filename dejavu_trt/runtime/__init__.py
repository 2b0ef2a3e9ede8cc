"""Engine packages and the executors that run them (CPU reference fallback, CUDA graphs)."""
