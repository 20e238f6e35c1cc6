"""Tensor parallelism: process groups, the communicator, sharded layers, rank launching."""
