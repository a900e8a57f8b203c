"""The power-limit optimizer (Zeus GlobalPowerLimitOptimizer semantics) and its profile store."""
