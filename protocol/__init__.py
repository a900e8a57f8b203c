"""The protocol: Redis key names, message models, errors, job store and the scheduler contract."""
