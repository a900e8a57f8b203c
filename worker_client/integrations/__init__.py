"""Adapters that run third-party pipeline engines through the Perseus hook."""
