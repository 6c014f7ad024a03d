"""Decode attention, over a dense or a paged KV cache: plain-jnp references that define the semantics, XLA
implementations and Pallas kernels (Triton for GPU, Mosaic for TPU)."""
from jaxrl_batch.kernels.decode_attention import (
  BACKENDS,
  decode_attention,
  decode_attention_pallas,
  decode_attention_reference,
  decode_attention_triton,
  decode_attention_xla,
  default_backend,
)
from jaxrl_batch.kernels.paged_attention import (
  paged_decode_attention,
  paged_decode_attention_pallas,
  paged_decode_attention_reference,
  paged_decode_attention_xla,
)
from jaxrl_batch.kernels.tpu_decode_attention import decode_attention_mosaic, paged_decode_attention_mosaic

__all__ = ["BACKENDS", "decode_attention", "decode_attention_mosaic", "decode_attention_pallas",
           "decode_attention_reference", "decode_attention_triton", "decode_attention_xla", "default_backend",
           "paged_decode_attention",
           "paged_decode_attention_mosaic", "paged_decode_attention_pallas", "paged_decode_attention_reference",
           "paged_decode_attention_xla"]
