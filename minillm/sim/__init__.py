"""Simulation: the modeled clock and GPU cost model, the simulated executor that runs the real scheduler
without a model, and replicas and disaggregation at scale.
"""
