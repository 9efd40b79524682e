"""The core of one step: requests, the block pool, the KV cache manager, the scheduler and its policies.

Everything here decides; nothing here runs a model (that is ``minillm.worker``).
"""
