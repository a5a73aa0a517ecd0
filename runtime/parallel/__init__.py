"""Tensor parallelism: sharding a built Llama across ranks and running it from one engine."""
