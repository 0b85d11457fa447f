"""Parallel engines: the rank group (group.py), tensor parallelism (tensor_parallel.py, shard maths in
shard.py) and pipeline parallelism (pipeline_parallel.py)."""
