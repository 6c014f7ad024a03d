"""The tokenizer interface, prompt padding and the vocab check.

Implementations: `spm_tokenizer.SentencePieceTokenizer` and `hf_tokenizer.HFTokenizer`; `loading.load_tokenizer(path)`
picks one from the path. The trainer needs PAD (to fill buffers) and EOS (to stop sampling); BOS is optional: a
prompt is `bos_ids + encode(text)`.
"""
from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import numpy as np

from jaxrl_batch.text import chat_template as chat_template_lib


class Tokenizer(abc.ABC):
  """Text <-> ids of one model; build it with `load_tokenizer(path)`. Every id is in [0, vocab_size)."""

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
    `jaxrl_batch.text.chat_template`): encode it as `bos_ids + encode(text)`.

    `template`: "auto" (the family of this checkpoint's template; none if it has none), "none" (a str is returned
    as it is), or a family name from `chat_template.FAMILIES`.
    """
    return chat_template_lib.render_prompt(chat_template_lib.resolve(template, self.chat_template), messages,
                                           add_generation_prompt, f"{self.path!r} has none and template={template!r}")


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
