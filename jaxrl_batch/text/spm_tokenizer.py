"""SentencePiece `.model` tokenizers (Llama 2, Gemma, Mistral; our own, written by `train_sentencepiece`).

Id convention used by `train_sentencepiece`: pad=0, bos=1, eos=2, unk=3.
"""
from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable

import sentencepiece as spm

from jaxrl_batch.text.tokenizer import Tokenizer


class SentencePieceTokenizer(Tokenizer):
  """A loaded SentencePiece model; PAD/BOS/EOS are its pad, bos and eos pieces."""

  def __init__(self, processor: spm.SentencePieceProcessor, path: str):
    self._sp = processor
    self._path = path
    self._special_ids = frozenset(i for i in (self.pad_id, self.bos_id, self.eos_id) if i >= 0)

  @classmethod
  def from_model_file(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
    """Loads a `.model` file; raises if it is missing, not a SentencePiece model, or lacks PAD or EOS."""
    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"Tokenizer model not found: {path!r}. Pass the path of a SentencePiece .model file, "
                              "or of a Hugging Face tokenizer.json or its directory.")
    processor = spm.SentencePieceProcessor()
    try:
      processor.Load(model_file=path)
    except (RuntimeError, OSError) as e:
      raise ValueError(f"{path!r} is not a SentencePiece model ({e}). Pass a .model file written by "
                       "SentencePieceTrainer (e.g. by jaxrl_batch.tokenizer.train_sentencepiece).") from e
    for name, token_id in (("pad_id", processor.pad_id()), ("eos_id", processor.eos_id())):
      if token_id < 0:
        raise ValueError(f"Tokenizer {path!r} has no {name[:-3].upper()} token ({name}=-1), which the trainer needs. "
                         f"Retrain it with `{name}=` set, e.g. train_sentencepiece(..., pad_id=0, eos_id=2).")
    return cls(processor, path)

  @property
  def path(self) -> str:
    """The `.model` file this tokenizer was loaded from."""
    return self._path

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def _decode(self, ids: list[int]) -> str:
    return self._sp.decode([i for i in ids if i not in self._special_ids])


def train_sentencepiece(texts: Iterable[str], out_path: str | os.PathLike, vocab_size: int,
                        **options) -> SentencePieceTokenizer:
  """Trains a SentencePiece model on `texts` and writes it atomically to `out_path`.

  Training is single-threaded and reads every sentence, so the same inputs give the same model. Defaults: ids
  pad=0, bos=1, eos=2, unk=3 and `split_digits=True`; `options` are SentencePieceTrainer options (e.g.
  `model_type`, `add_dummy_prefix`, `hard_vocab_limit`) and override the defaults.
  """
  out_path = os.fspath(out_path)
  kwargs = dict(pad_id=0, bos_id=1, eos_id=2, unk_id=3, split_digits=True, num_threads=1, minloglevel=2)
  kwargs.update(options)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, **kwargs)
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp_path = tempfile.mkstemp(dir=out_dir, suffix=".model.tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(model.getvalue())
    os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; the model is package data others must read.
    os.replace(tmp_path, out_path)
  except BaseException:
    os.unlink(tmp_path)
    raise
  return SentencePieceTokenizer.from_model_file(out_path)
