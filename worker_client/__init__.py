"""Client side: the training hook, frequency control, energy measurement, power limits."""
