"""Tokenizers behind one interface: `Tokenizer.load(path)`, prompt padding and the vocab check.

Two kinds, chosen by `Tokenizer.load` from the path: SentencePiece `.model` files (Llama 2, Gemma, Mistral; our
own, written by `train_sentencepiece`) and Hugging Face `tokenizer.json` files or their directories (Llama 3, Qwen;
`jaxrl_batch.hf_tokenizer`, which needs the `hf` extra). The trainer needs PAD (to fill buffers) and EOS (to stop
sampling); BOS is optional: a prompt is `bos_ids + encode(text)`.

Id convention used by `train_sentencepiece`: pad=0, bos=1, eos=2, unk=3.
"""
from __future__ import annotations

import abc
import io
import os
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from jaxrl_batch import chat_template as chat_template_lib


class Tokenizer(abc.ABC):
  """Text <-> ids of one model; build it with `Tokenizer.load(path)`. Every id is in [0, vocab_size)."""

  @staticmethod
  def load(path: str | os.PathLike) -> Tokenizer:
    """A directory holding `tokenizer.json`, or a `.json` file: a Hugging Face tokenizer. Anything else: a
    SentencePiece model file. Raises if the file is missing, unreadable, or lacks EOS (or PAD, for SentencePiece)."""
    path = os.fspath(path)
    if not (os.path.isdir(path) or path.endswith(".json")):
      return SentencePieceTokenizer.from_model_file(path)
    try:
      from jaxrl_batch import hf_tokenizer  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError as e:
      if e.name != "tokenizers":
        raise
      raise ImportError(f"{path!r} is a Hugging Face tokenizer, which needs the `tokenizers` package: "
                        "pip install -e '.[hf]'.") from e
    return hf_tokenizer.HFTokenizer.from_pretrained(path)

  @property
  @abc.abstractmethod
  def path(self) -> str:
    """The file this tokenizer was loaded from."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids, special tokens included; every id is in [0, vocab_size)."""

  @property
  @abc.abstractmethod
  def bos_id(self) -> int:
    """Beginning-of-sequence id, or -1 if the tokenizer has none (never added by `encode`)."""

  @property
  @abc.abstractmethod
  def eos_id(self) -> int:
    """End-of-sequence id; the sampler stops at it."""

  @property
  @abc.abstractmethod
  def pad_id(self) -> int:
    """Padding id."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Encodes `text` to ids, adding no BOS/EOS."""

  @abc.abstractmethod
  def _decode(self, ids: list[int]) -> str:
    """Text of ids already checked to lie in [0, vocab_size), skipping special tokens."""

  @property
  def bos_ids(self) -> list[int]:
    """What a prompt starts with: `[bos_id]`, or `[]` for tokenizers without BOS (Qwen)."""
    return [] if self.bos_id < 0 else [self.bos_id]

  @property
  def chat_template(self) -> str | None:
    """The checkpoint's chat template text (Jinja), or None; SentencePiece files carry none."""
    return None

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes ids to text, skipping special tokens (PAD/BOS/EOS; for Hugging Face tokenizers, every added token
    marked special); accepts lists and 1-D int arrays."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"Token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}) of {self.path!r}; "
                       "the model's vocab_size exceeds the tokenizer's, so mask ids >= tokenizer.vocab_size.")
    return self._decode(ids)

  def apply_chat_template(self, messages: str | Sequence[chat_template_lib.Message], template: str = "auto",
                          add_generation_prompt: bool = True) -> str:
    """Prompt text of `messages` (a str is one user message) in `template`, without BOS (see
    `jaxrl_batch.chat_template`): encode it as `bos_ids + encode(text)`.

    `template`: "auto" (the family of this checkpoint's template; none if it has none), "none" (a str is returned
    as it is), or a family name from `chat_template.FAMILIES`.
    """
    chat = chat_template_lib.resolve(template, self.chat_template)
    if chat is not None:
      return chat.render(messages, add_generation_prompt)
    if not isinstance(messages, str):
      raise ValueError(f"Chat messages need a chat template, but {self.path!r} has none and template={template!r};"
                       f" name one of {chat_template_lib.FAMILIES}, or pass the prompt as a string.")
    return messages


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


def left_pad(token_lists: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-aligns prompts in a fixed-width buffer.

  Returns `(tokens_BxP, valid_BxP)`: int32 ids with `pad_id` on the left, and a bool mask that is True on real
  tokens. B = len(token_lists), P = length.
  """
  tokens_BxP = np.full((len(token_lists), length), pad_id, dtype=np.int32)
  valid_BxP = np.zeros((len(token_lists), length), dtype=bool)
  for row, ids in enumerate(token_lists):
    if len(ids) > length:
      raise ValueError(f"Prompt {row} has {len(ids)} tokens, longer than the buffer length {length}; "
                       "raise the prompt length or shorten the prompt.")
    if ids:
      tokens_BxP[row, length - len(ids):] = ids
      valid_BxP[row, length - len(ids):] = True
  return tokens_BxP, valid_BxP


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ValueError if the tokenizer emits ids outside a model embedding table of `model_vocab_size` rows."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(f"Tokenizer {tokenizer.path!r} has {tokenizer.vocab_size} ids (largest {tokenizer.vocab_size - 1}"
                     f", special tokens included) but the model's embedding has only {model_vocab_size} rows, so some "
                     f"ids would index outside it. Set model.vocab_size >= {tokenizer.vocab_size}, or use the "
                     "tokenizer the checkpoint was trained with.")
