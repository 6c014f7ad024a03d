"""Llama/Qwen-style decoder with logical axis names on every parameter."""
from flax import nnx

from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.model.kv_cache import KVCache
from jaxrl_batch.model.masks import cache_mask, causal_mask, positions_from_valid
from jaxrl_batch.model.rope import RopeScaling
from jaxrl_batch.model.transformer import Transformer

__all__ = ["ModelConfig", "KVCache", "RopeScaling", "Transformer", "cache_mask", "causal_mask",
           "positions_from_valid", "sequence_logits"]


def sequence_logits(graphdef, params, tokens_BxT, valid_BxT):
  """Full causal forward over left/right-padded sequences: logits_BxTxV (float32) at every position."""
  model = nnx.merge(graphdef, params)
  logits_BxTxV, _ = model(tokens_BxT, positions_from_valid(valid_BxT), causal_mask(valid_BxT))
  return logits_BxTxV
