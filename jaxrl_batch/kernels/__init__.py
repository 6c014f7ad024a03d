"""Decode attention: a plain-jnp reference that defines its semantics, an XLA implementation and a Pallas kernel."""
from jaxrl_batch.kernels.decode_attention import (BACKENDS, decode_attention, decode_attention_pallas,
                                                  decode_attention_reference, decode_attention_xla, default_backend)

__all__ = ["BACKENDS", "decode_attention", "decode_attention_pallas", "decode_attention_reference",
           "decode_attention_xla", "default_backend"]
