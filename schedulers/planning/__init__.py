"""Offline planning tool chain: profile CSV, pipeline DAG, planner, plan/frontier files, plots."""
