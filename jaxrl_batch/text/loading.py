"""`load_tokenizer(path)`: the tokenizer a path names, SentencePiece or Hugging Face."""
from __future__ import annotations

import os

from jaxrl_batch.text.spm_tokenizer import SentencePieceTokenizer
from jaxrl_batch.text.tokenizer import Tokenizer


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """A directory holding `tokenizer.json`, or a `.json` file: a Hugging Face tokenizer (needs the `hf` extra).
  Anything else: a SentencePiece model file. Raises if the file is missing, unreadable, or lacks EOS (or PAD, for
  SentencePiece)."""
  path = os.fspath(path)
  if not (os.path.isdir(path) or path.endswith(".json")):
    return SentencePieceTokenizer.from_model_file(path)
  try:
    from jaxrl_batch.text import hf_tokenizer  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    if e.name != "tokenizers":
      raise
    raise ImportError(f"{path!r} is a Hugging Face tokenizer, which needs the `tokenizers` package: "
                      "pip install -e '.[hf]'.") from e
  return hf_tokenizer.HFTokenizer.from_pretrained(path)
