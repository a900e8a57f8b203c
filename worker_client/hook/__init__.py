"""The training hook: PerseusOptimizer, its Redis session and where it gets energy from."""
