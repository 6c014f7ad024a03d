"""KV-cache generation with greedy / temperature / top-k / top-p sampling by a static or a continuous engine;
`benchmark` and `roofline` measure it."""
from jaxrl_batch.sampling.continuous import EngineStats, generate_continuous
from jaxrl_batch.sampling.engine import rollout, static_stats
from jaxrl_batch.sampling.engine_settings import EngineSettings
from jaxrl_batch.sampling.generate import Rollout, generate
from jaxrl_batch.sampling.strategies import Strategy

__all__ = ["EngineSettings", "EngineStats", "Rollout", "Strategy", "generate", "generate_continuous", "rollout",
           "static_stats"]
