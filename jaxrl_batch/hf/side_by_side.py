"""Hugging Face transformers' `generate` on our weights, for side-by-side timing and token checks.

Needs the `parity` extra; torch and transformers are imported only when a function here is called.
"""
import tempfile

import numpy as np

from jaxrl_batch.hf.convert import save_pretrained
from jaxrl_batch.model import ModelConfig


def hf_model(cfg: ModelConfig, params):
  """transformers' model on our weights (exported to a temporary Hugging Face directory), in eval mode, in
  `cfg.dtype`; it never stops at an EOS id, so `generate` makes exactly max_new_tokens tokens."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as hf_dir:
    save_pretrained(cfg, params, hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, cfg.dtype))
  model.generation_config.eos_token_id = None
  return model.eval()


def hf_generate(model, prompt_BxP: np.ndarray, temperature: float):
  """`run(max_new_tokens)` -> tokens_Bx(P+N) (prompt included, a torch tensor) of `model.generate` on the unpadded
  prompts: greedy at temperature 0, else sampled from softmax(logits / temperature) without top-k or top-p."""
  import torch  # pylint: disable=import-outside-toplevel
  prompt = torch.as_tensor(prompt_BxP)
  sample = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature else dict(
      do_sample=False)

  def run(max_new_tokens: int):
    with torch.inference_mode():
      return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                            pad_token_id=0, **sample)

  return run
