"""Llama/Qwen-style decoder with logical axis names on every parameter."""
from jaxrl_batch.model.compute_copy import compute_copy
from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.model.kv_cache import KVCache
from jaxrl_batch.model.logprobs import (policy_logprobs, sequence_logits, sequence_logprobs, shifted_logprobs,
                                        token_logprobs, token_stats)
from jaxrl_batch.model.masks import (DecodeSpan, Segments, cache_mask, causal_mask, layout, positions_from_valid,
                                     segment_causal_mask, segments, training_layout)
from jaxrl_batch.model.paged_cache import PagedKVCache
from jaxrl_batch.model.rope import RopeScaling
from jaxrl_batch.model.transformer import Transformer

__all__ = ["DecodeSpan", "ModelConfig", "Segments", "KVCache", "PagedKVCache", "RopeScaling", "Transformer",
           "cache_mask", "causal_mask", "compute_copy", "layout", "policy_logprobs", "positions_from_valid",
           "segment_causal_mask", "segments", "sequence_logits", "sequence_logprobs", "shifted_logprobs",
           "token_logprobs", "token_stats", "training_layout"]
