"""SentencePiece tokenizers and the shared interface: loading, special ids, decoding, padding, chat templates and
the vocab check. Hugging Face tokenizers: test_hf_tokenizer.py."""
import os
import sys

import numpy as np
import pytest

import jaxrl_batch.text
from jaxrl_batch.text import tokenizer as tokenizer_lib
from jaxrl_batch.text.loading import load_tokenizer
from jaxrl_batch.text.spm_tokenizer import SentencePieceTokenizer, train_sentencepiece

CORPUS = ["the cat sat on the mat", "a dog ate 12 bones", "cats and dogs 345"] * 20


def _train(path, **options):
  return train_sentencepiece(CORPUS, path, vocab_size=40, hard_vocab_limit=False, **options)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("tok") / "t.model")


def test_special_ids_and_path(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok._sp.unk_id() == 3
  assert os.path.basename(tok.path) == "t.model"
  assert 20 <= tok.vocab_size <= 40


def test_encode_adds_no_specials_and_splits_digits(tok):
  ids = tok.encode("dog 12")
  assert tok.bos_id not in ids and tok.eos_id not in ids
  assert [tok._sp.id_to_piece(i) for i in tok.encode("12")][-2:] == ["1", "2"]


def test_decode_skips_pad_bos_eos(tok):
  ids = tok.encode("the cat")
  assert tok.decode([tok.pad_id, tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "the cat"
  assert tok.decode(np.array(ids, np.int32)) == "the cat"


def test_decode_rejects_ids_outside_vocab(tok):
  with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {tok.vocab_size}\\)"):
    tok.decode([4, tok.vocab_size])


def test_load_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    load_tokenizer(tmp_path / "missing.model")


def test_load_not_a_model(tmp_path):
  path = tmp_path / "bad.model"
  path.write_bytes(b"definitely not a protobuf")
  with pytest.raises(ValueError, match="not a SentencePiece model"):
    load_tokenizer(path)


@pytest.mark.parametrize("missing", ["pad_id", "eos_id"])
def test_load_requires_pad_and_eos(tmp_path, missing):
  with pytest.raises(ValueError, match=f"{missing}=-1.*Retrain"):
    _train(tmp_path / "t.model", **{missing: -1})


def test_train_is_deterministic_and_overwrites_atomically(tmp_path, tok):
  path = tmp_path / "t.model"
  path.write_bytes(b"old")
  again = _train(path)
  assert path.read_bytes() == open(tok.path, "rb").read()
  assert again.encode("the dog sat") == tok.encode("the dog sat")
  assert os.listdir(tmp_path) == ["t.model"]  # No temporary file left behind.


def test_left_pad():
  tokens, valid = tokenizer_lib.left_pad([[5, 6], [7], [], [8, 9, 4]], length=3, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 5, 6], [0, 0, 7], [0, 0, 0], [8, 9, 4]])
  np.testing.assert_array_equal(valid, [[0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 1, 1]])
  assert tokens.dtype == np.int32 and valid.dtype == bool


def test_left_pad_uses_pad_id_and_rejects_long_prompts():
  tokens, _ = tokenizer_lib.left_pad([[5]], length=2, pad_id=9)
  np.testing.assert_array_equal(tokens, [[9, 5]])
  with pytest.raises(ValueError, match="Prompt 1 has 3 tokens, longer than the buffer length 2"):
    tokenizer_lib.left_pad([[1], [1, 2, 3]], length=2, pad_id=0)


def test_check_vocab(tok):
  tokenizer_lib.check_vocab(tok, tok.vocab_size)
  with pytest.raises(ValueError, match=f"{tok.vocab_size} ids .* only {tok.vocab_size - 1} rows.*model.vocab_size"):
    tokenizer_lib.check_vocab(tok, tok.vocab_size - 1)


def test_load_dispatches_on_the_path(tok):
  assert isinstance(tok, SentencePieceTokenizer)
  loaded = load_tokenizer(tok.path)
  assert isinstance(loaded, SentencePieceTokenizer) and isinstance(loaded, tokenizer_lib.Tokenizer)
  assert loaded.encode("the dog sat") == tok.encode("the dog sat")


def test_json_path_without_tokenizers_package(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # Importing it now fails, as when it is not installed.
  monkeypatch.delitem(sys.modules, "jaxrl_batch.text.hf_tokenizer", raising=False)
  monkeypatch.delattr(jaxrl_batch.text, "hf_tokenizer", raising=False)
  with pytest.raises(ImportError, match="needs the `tokenizers` package: pip install"):
    load_tokenizer(tmp_path / "tokenizer.json")


def test_bos_ids(tok, tmp_path):
  assert tok.bos_ids == [tok.bos_id] == [1]
  no_bos = _train(tmp_path / "t.model", bos_id=-1, eos_id=1, unk_id=2)
  assert (no_bos.bos_id, no_bos.bos_ids) == (-1, [])


def test_chat_template_on_a_model_file(tok):
  assert tok.chat_template is None
  assert tok.apply_chat_template("the cat") == tok.apply_chat_template("the cat", "none") == "the cat"
  assert tok.apply_chat_template("hi", "chatml") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  with pytest.raises(ValueError, match="need a chat template, but .* has none and template='auto'"):
    tok.apply_chat_template([dict(role="user", content="the cat")])


def test_gemma_markers_as_user_defined_pieces_encode_to_one_id(tmp_path):
  markers = ["<start_of_turn>", "<end_of_turn>"]
  gemma = _train(tmp_path / "g.model", user_defined_symbols=markers)
  marker_ids = [gemma._sp.piece_to_id(m) for m in markers]
  ids = gemma.encode(gemma.apply_chat_template("the cat", "gemma"))
  assert [i for i in ids if i in marker_ids] == marker_ids + marker_ids[:1]
  assert gemma.decode(ids).count("<start_of_turn>") == 2  # User-defined pieces decode as text, not skipped.
