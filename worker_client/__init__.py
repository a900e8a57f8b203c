"""Beside training: the hook, the GPU layer, the power-limit optimizer and the simulated GPU."""
