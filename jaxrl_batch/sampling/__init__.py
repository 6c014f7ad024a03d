"""KV-cache generation with greedy / temperature / top-k / top-p sampling; `benchmark` and `roofline` measure it."""
from jaxrl_batch.sampling.generate import Rollout, generate
from jaxrl_batch.sampling.strategies import SamplingParams

__all__ = ["Rollout", "SamplingParams", "generate"]
