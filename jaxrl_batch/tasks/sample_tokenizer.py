"""Rebuilds `assets/samples_bpe.model`: a 400-piece byte-fallback BPE trained on the bundled sample files, used by
`model=tiny_random` configs to run GSM8K/MATH/Countdown end to end without a downloaded tokenizer.

  python -m jaxrl_batch.tasks.sample_tokenizer
"""
import glob
import json
import os

from jaxrl_batch.text.spm_tokenizer import train_sentencepiece

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
PATH = os.path.join(ASSETS, "samples_bpe.model")


def sample_texts() -> list[str]:
  """Every string field of every bundled sample row."""
  texts = []
  for path in sorted(glob.glob(os.path.join(ASSETS, "samples", "*.jsonl"))):
    with open(path) as f:
      texts += [str(value) for line in f for value in json.loads(line).values()]
  return texts


if __name__ == "__main__":
  train_sentencepiece(sample_texts(), PATH, vocab_size=400, model_type="bpe", byte_fallback=True,
                      hard_vocab_limit=False)
