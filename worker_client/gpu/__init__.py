"""The GPU layer: NVML facades, the frequency controller side process, energy measurement."""
