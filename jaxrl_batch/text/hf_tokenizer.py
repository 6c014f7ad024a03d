"""Hugging Face `tokenizer.json` tokenizers (Llama 3, Qwen, ...) behind the `Tokenizer` interface.

Special tokens are named in `tokenizer_config.json` beside `tokenizer.json` (`special_tokens_map.json` fills in keys
it lacks): `eos_token` is required; `bos_token` may be null or absent (Qwen), and `bos_ids` is then empty; a missing
`pad_token` falls back to EOS, which is safe because padding is always masked (`left_pad`'s valid mask, the
sampler's mask ending at the first EOS). The chat template is `chat_template.jinja` beside them if present, else
`chat_template` in tokenizer_config.json (the entry named "default" when it is a list).
"""
from __future__ import annotations

import json
import os

import tokenizers

from jaxrl_batch.text.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("special_tokens_map.json", "tokenizer_config.json")  # Read in order; later keys win.
TEMPLATE_FILE = "chat_template.jinja"


class HFTokenizer(Tokenizer):
  """A `tokenizers.Tokenizer` with the special tokens and chat template of its config."""

  def __init__(self, tok: tokenizers.Tokenizer, path: str, *, bos_id: int, eos_id: int, pad_id: int,
               chat_template: str | None):
    self._tok = tok
    self._path = path
    self._bos_id, self._eos_id, self._pad_id = bos_id, eos_id, pad_id
    self._chat_template = chat_template
    self._vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
    """Loads a `tokenizer.json` file, or the one in directory `path`, with the config files beside it."""
    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(f"Tokenizer not found: {file!r}. Pass a Hugging Face tokenizer.json or its directory, "
                              "or a SentencePiece .model file (e.g. the directory's tokenizer.model).")
    try:
      tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-except  # tokenizers raises bare Exception.
      raise ValueError(f"{file!r} is not a Hugging Face tokenizer.json ({e}).") from e
    directory = os.path.dirname(file)
    config = {}
    for name in CONFIG_FILES:
      if os.path.isfile(os.path.join(directory, name)):
        with open(os.path.join(directory, name), encoding="utf-8") as f:
          config.update(json.load(f))
    bos_id, eos_id, pad_id = (_token_id(tok, config, key, file) for key in ("bos_token", "eos_token", "pad_token"))
    if eos_id < 0:
      raise ValueError(f"Tokenizer {file!r} has no EOS token, which the trainer needs to stop sampling. Name it as "
                       f'"eos_token" in {os.path.join(directory, CONFIG_FILES[1])!r}.')
    return cls(tok, file, bos_id=bos_id, eos_id=eos_id, pad_id=eos_id if pad_id < 0 else pad_id,
               chat_template=_chat_template(directory, config))

  @property
  def path(self) -> str:
    """The `tokenizer.json` file this tokenizer was loaded from."""
    return self._path

  @property
  def vocab_size(self) -> int:
    """Largest id + 1, added tokens included (ids need not be contiguous)."""
    return self._vocab_size

  @property
  def bos_id(self) -> int:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def pad_id(self) -> int:
    """PAD, or EOS when the config names no pad token."""
    return self._pad_id

  @property
  def chat_template(self) -> str | None:
    return self._chat_template

  def encode(self, text: str) -> list[int]:
    """Encodes `text` to ids, adding no BOS/EOS; special-token text (`<|im_start|>`) becomes its id."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def _decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=True)


def _token_id(tok: tokenizers.Tokenizer, config: dict, key: str, file: str) -> int:
  """Id of the token that `config[key]` names (a string or an {"content": ...} dict); -1 if absent or null."""
  token = config.get(key)
  if isinstance(token, dict):
    token = token.get("content")
  if token is None:
    return -1
  token_id = tok.token_to_id(token)
  if token_id is None:
    raise ValueError(f"{key}={token!r} in the tokenizer config beside {file!r} is not in the tokenizer's vocabulary.")
  return token_id


def _chat_template(directory: str, config: dict) -> str | None:
  """The template text: `chat_template.jinja`, else the config's (its "default" entry when there are several)."""
  if os.path.isfile(os.path.join(directory, TEMPLATE_FILE)):
    with open(os.path.join(directory, TEMPLATE_FILE), encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  return template
