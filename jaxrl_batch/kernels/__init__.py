"""Hand-written accelerator kernels, each with a plain-jnp reference that defines its semantics."""
from jaxrl_batch.kernels.decode_attention import (decode_attention, decode_attention_pallas,
                                                  decode_attention_reference, default_backend)

__all__ = ["decode_attention", "decode_attention_pallas", "decode_attention_reference", "default_backend"]
