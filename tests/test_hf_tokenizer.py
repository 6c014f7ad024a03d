"""Hugging Face tokenizer.json tokenizers: a byte-level BPE built in the test, loaded through `load_tokenizer`."""
import json
import os

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from jaxrl_batch.text import hf_tokenizer  # noqa: E402
from jaxrl_batch.text import tokenizer as tokenizer_lib  # noqa: E402
from jaxrl_batch.text.loading import load_tokenizer  # noqa: E402

CORPUS = ["the cat sat on the mat", "héllo wörld, 日本語 🙂", "a dog ate 12 bones\n\tand 345 more"] * 10
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",  # chatml (Qwen)
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",  # llama3
            "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",  # gemma
            "<s>", "</s>"]  # mistral, llama2
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def bpe():
  """A byte-level BPE trained on CORPUS; ids 0..13 are SPECIALS."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def _write(directory, bpe, **config):
  """Writes tokenizer.json and a tokenizer_config.json holding `config`; returns the directory."""
  os.makedirs(directory, exist_ok=True)
  bpe.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  return directory


@pytest.fixture(scope="module")
def qwen(bpe, tmp_path_factory):
  """Qwen-style: no BOS, no PAD, eos <|im_end|>, a chatml template."""
  return load_tokenizer(_write(tmp_path_factory.mktemp("qwen"), bpe, bos_token=None,
                                             eos_token="<|im_end|>", chat_template=CHATML))


def test_load_directory_or_file(qwen, bpe):
  assert isinstance(qwen, hf_tokenizer.HFTokenizer)
  assert os.path.basename(qwen.path) == "tokenizer.json"
  again = load_tokenizer(qwen.path)
  assert again.encode("the cat") == qwen.encode("the cat") == bpe.encode("the cat").ids
  assert qwen.vocab_size == bpe.get_vocab_size() <= 400


@pytest.mark.parametrize("text", ["the cat sat", "héllo wörld 日本語 🙂", "a\n\nb\tc\r\n", "  two  spaces  ", "",
                                  "unseen: ß ∑ 🚀"])
def test_round_trip(qwen, text):
  ids = qwen.encode(text)
  assert all(0 <= i < qwen.vocab_size for i in ids)
  assert qwen.decode(ids) == text
  assert qwen.decode(np.array(ids, np.int32)) == text


def test_no_bos_and_pad_falls_back_to_eos(qwen, bpe):
  assert qwen.bos_id == -1 and qwen.bos_ids == []
  assert qwen.eos_id == qwen.pad_id == bpe.token_to_id("<|im_end|>")


def test_special_token_text_encodes_to_its_id_and_decode_skips_it(qwen, bpe):
  ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == bpe.token_to_id("<|im_start|>") and ids[-1] == qwen.eos_id
  assert qwen.decode(ids) == "user\nhi"
  assert qwen.encode("the cat") == bpe.encode("the cat", add_special_tokens=False).ids  # Nothing added.


def test_decode_rejects_ids_outside_vocab(qwen):
  with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {qwen.vocab_size}\\)"):
    qwen.decode([5, qwen.vocab_size])


def test_llama3_style_specials(bpe, tmp_path):
  tok = load_tokenizer(_write(tmp_path, bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                            pad_token={"content": "<|end_of_text|>", "special": True}))
  assert tok.bos_ids == [bpe.token_to_id("<|begin_of_text|>")]
  assert (tok.eos_id, tok.pad_id) == (bpe.token_to_id("<|eot_id|>"), bpe.token_to_id("<|end_of_text|>"))
  assert tok.chat_template is None and tok.apply_chat_template("2+2=") == "2+2="


def test_special_tokens_map_fills_in_missing_keys(bpe, tmp_path):
  _write(tmp_path, bpe, eos_token="<eos>")
  with open(tmp_path / "special_tokens_map.json", "w", encoding="utf-8") as f:
    json.dump(dict(bos_token="<bos>", eos_token="</s>"), f)
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id) == (bpe.token_to_id("<bos>"), bpe.token_to_id("<eos>"))


def test_chat_template_from_config(qwen):
  assert qwen.chat_template == CHATML
  assert qwen.apply_chat_template("2+2?") == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
  assert qwen.apply_chat_template("2+2?", "none") == "2+2?"
  assert qwen.apply_chat_template("2+2?", "gemma") == "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"


def test_chat_template_file_and_named_list(bpe, tmp_path):
  _write(tmp_path, bpe, eos_token="<eos>", chat_template=[dict(name="tool_use", template="{{ '<|im_start|>' }}"),
                                                           dict(name="default", template="{{ '<start_of_turn>' }}")])
  assert load_tokenizer(tmp_path).chat_template == "{{ '<start_of_turn>' }}"
  (tmp_path / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
  assert load_tokenizer(tmp_path).chat_template == CHATML


def test_check_vocab_counts_added_special_tokens(qwen, bpe, tmp_path):
  tokenizer_lib.check_vocab(qwen, qwen.vocab_size)
  bpe = tokenizers.Tokenizer.from_str(bpe.to_str())
  bpe.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>"])
  grown = load_tokenizer(_write(tmp_path, bpe, eos_token="<|im_end|>"))
  assert grown.vocab_size == qwen.vocab_size + 2 == grown.encode("<|fim_suffix|>")[0] + 1
  with pytest.raises(ValueError, match=f"{grown.vocab_size} ids \\(largest {grown.vocab_size - 1}, special tokens "
                                       f"included\\) .* only {qwen.vocab_size} rows.*model.vocab_size >= "):
    tokenizer_lib.check_vocab(grown, qwen.vocab_size)


def test_load_errors(bpe, tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json.*or a SentencePiece .model file"):
    load_tokenizer(tmp_path)
  (tmp_path / "bad.json").write_text("not json")
  with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
    load_tokenizer(tmp_path / "bad.json")
  _write(tmp_path / "no_eos", bpe, bos_token="<s>")
  with pytest.raises(ValueError, match="no EOS token.*eos_token"):
    load_tokenizer(tmp_path / "no_eos")
  _write(tmp_path / "typo", bpe, eos_token="<|im_emd|>")
  with pytest.raises(ValueError, match="eos_token='<\\|im_emd\\|>' .* not in the tokenizer's vocabulary"):
    load_tokenizer(tmp_path / "typo")


# Shipped templates (Qwen2.5 without its tool branch, Llama 3.0, Gemma 3 for text, Mistral v0.1, Llama 2 chat),
# rendered by transformers' Jinja for the parity test.
TEMPLATES = {
    "chatml": (None, "<|im_end|>", """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")),
    "gemma": ("<bos>", "<eos>", """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""),
    "mistral": ("<s>", "</s>", (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] "
        "== 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
        "roles are supported!') }}{% endif %}{% endfor %}")),
    "llama2": ("<s>", "</s>", (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
        "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")),
}
TURNS = [dict(role="user", content=" 2+2? "), dict(role="assistant", content="4\n"),
         dict(role="user", content="And 3+3, héllo 🙂?")]
CONVERSATIONS = [[dict(role="user", content="Hi\nthere")], TURNS, [dict(role="system", content="Be brief.")] + TURNS]


@pytest.mark.parity
@pytest.mark.parametrize("family", TEMPLATES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_parity_with_transformers(bpe, tmp_path, family, conversation):
  """Our "auto" rendering equals transformers' Jinja rendering of the shipped template, after BOS; so do the ids."""
  transformers = pytest.importorskip("transformers")
  messages = CONVERSATIONS[conversation]
  if family == "mistral" and messages[0]["role"] == "system":
    pytest.skip("Mistral v0.1's template refuses system messages.")
  bos, eos, template = TEMPLATES[family]
  directory = _write(tmp_path, bpe, bos_token=bos, eos_token=eos, chat_template=template)
  ours = load_tokenizer(directory)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  text = ours.apply_chat_template(messages)
  assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (bos or "") + text
  ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
  assert ids == ours.bos_ids + ours.encode(text)
