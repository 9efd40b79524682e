"""Speculative decoding: the proposers that guess ahead and the acceptance rule that keeps what the
target model agrees with.
"""
