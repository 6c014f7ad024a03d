"""RL post-training of LLMs in JAX.

`from_pretrained` and `save_pretrained` (Hugging Face checkpoints, see `jaxrl_batch.hf`) import on first use, so
the `hf` extra (safetensors) is needed only by code that calls them.
"""

_HF_EXPORTS = ("from_pretrained", "save_pretrained")


def __getattr__(name):
  if name in _HF_EXPORTS:
    from jaxrl_batch.hf import convert  # pylint: disable=import-outside-toplevel
    return getattr(convert, name)
  raise AttributeError(f"module 'jaxrl_batch' has no attribute {name!r}")

