"""The worker side of a step: the runner that turns a scheduler's decision into tensors, the sampler,
and tensor parallelism over several processes.
"""
