"""A simulated GPU (an importable NVML-like module) and simulated pipeline training on it."""
