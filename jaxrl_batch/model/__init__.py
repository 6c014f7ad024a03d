"""Llama/Qwen-style decoder with logical axis names on every parameter."""
from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.model.kv_cache import KVCache
from jaxrl_batch.model.logprobs import sequence_logits, sequence_logprobs, shifted_logprobs, token_logprobs
from jaxrl_batch.model.masks import (DecodeSpan, cache_mask, causal_mask, layout, positions_from_valid,
                                     segment_causal_mask)
from jaxrl_batch.model.paged_cache import PagedKVCache
from jaxrl_batch.model.rope import RopeScaling
from jaxrl_batch.model.transformer import Transformer

__all__ = ["DecodeSpan", "ModelConfig", "KVCache", "PagedKVCache", "RopeScaling", "Transformer", "cache_mask",
           "causal_mask", "layout", "positions_from_valid", "segment_causal_mask", "sequence_logits",
           "sequence_logprobs", "shifted_logprobs", "token_logprobs"]
