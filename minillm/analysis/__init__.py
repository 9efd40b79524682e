"""Analysis: workloads (who arrives when, asking for how much), the serving metrics computed from what
the engine recorded, and a learned output-length predictor.
"""
