"""Hand-written chat templates: exact text per family, detection from Jinja markers, selection and role checks."""
import pytest

from jaxrl_batch.text import chat_template as ct

SYS_CHAT = [dict(role="system", content="Be brief."), dict(role="user", content=" 2+2? "),
            dict(role="assistant", content="4\n"), dict(role="user", content="And 3+3?")]

EXPECTED_PROMPT = {  # render("Hi\nthere") with the generation prompt.
    "chatml": "<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nHi\nthere<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nHi\nthere<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "[INST] Hi\nthere [/INST]",
    "llama2": "[INST] Hi\nthere [/INST]",
}
EXPECTED_CHAT = {  # render(SYS_CHAT) with the generation prompt.
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n 2+2? <|im_end|>\n"
              "<|im_start|>assistant\n4\n<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
             "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "[INST] Be brief.\n\n 2+2?  [/INST]4\n</s>[INST] And 3+3? [/INST]",
    "llama2": "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n 2+2? [/INST] 4 </s><s>[INST] And 3+3? [/INST]",
}


@pytest.mark.parametrize("family", ct.FAMILIES)
def test_render_one_prompt(family):
  assert ct.ChatTemplate(family).render("Hi\nthere") == EXPECTED_PROMPT[family]
  assert ct.ChatTemplate(family).render([dict(role="user", content="Hi\nthere")]) == EXPECTED_PROMPT[family]


@pytest.mark.parametrize("family", ct.FAMILIES)
def test_render_system_and_turns(family):
  assert ct.ChatTemplate(family).render(SYS_CHAT) == EXPECTED_CHAT[family]


def test_generation_prompt_is_optional():
  assert ct.ChatTemplate("chatml").render("x", add_generation_prompt=False) == "<|im_start|>user\nx<|im_end|>\n"
  assert ct.ChatTemplate("gemma").render("x", False) == "<start_of_turn>user\nx<end_of_turn>\n"
  assert ct.ChatTemplate("mistral").render("x", False) == "[INST] x [/INST]"


def test_default_system_applies_only_without_a_system_message():
  chat = ct.ChatTemplate("chatml", "You are Qwen.")
  assert chat.render("x").startswith("<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nx")
  assert chat.render(SYS_CHAT) == EXPECTED_CHAT["chatml"]
  with pytest.raises(ValueError, match="chatml feature"):
    ct.ChatTemplate("gemma", "You are Gemma.")


def test_end_of_turn():
  assert {f: ct.ChatTemplate(f).end_of_turn for f in ct.FAMILIES} == dict(
      chatml="<|im_end|>", llama3="<|eot_id|>", gemma="<end_of_turn>", mistral="</s>", llama2="</s>")


@pytest.mark.parametrize("messages", [
    [], [dict(role="system", content="s")], [dict(role="assistant", content="a")],
    [dict(role="user", content="u"), dict(role="user", content="u")],
    [dict(role="user", content="u"), dict(role="system", content="s")],
    [dict(role="tool", content="t")]])
def test_rejects_bad_role_order(messages):
  with pytest.raises(ValueError, match="must be user, assistant, user"):
    ct.ChatTemplate("chatml").render(messages)


# Excerpts of shipped templates, enough to carry each family's markers.
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
          "helpful assistant.<|im_end|>\\n' }}{%- endif %}")
CHATML = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
LLAMA3 = "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}"
GEMMA = "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
LLAMA2 = "{% set content = '<<SYS>>\\n' + system_message %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
MISTRAL = "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
MISTRAL_V3 = '{{- "[INST] " + message["content"] + "[/INST]" }}'


@pytest.mark.parametrize("source, expected", [
    (QWEN25, ct.ChatTemplate("chatml", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")),
    (CHATML, ct.ChatTemplate("chatml")), (LLAMA3, ct.ChatTemplate("llama3")), (GEMMA, ct.ChatTemplate("gemma")),
    (LLAMA2, ct.ChatTemplate("llama2")), (MISTRAL, ct.ChatTemplate("mistral"))])
def test_detect(source, expected):
  assert ct.detect(source) == expected


@pytest.mark.parametrize("source", [MISTRAL_V3, "{{ messages[0]['content'] }}"])
def test_detect_refuses_unknown_templates(source):
  with pytest.raises(ValueError, match="Unrecognised chat template.*'none'"):
    ct.detect(source)


def test_resolve():
  assert ct.resolve("none", LLAMA3) is None
  assert ct.resolve("auto", None) is None
  assert ct.resolve("auto", LLAMA3) == ct.ChatTemplate("llama3")
  assert ct.resolve("gemma", LLAMA3) == ct.ChatTemplate("gemma")  # A name wins over the checkpoint's template.
  assert ct.resolve("chatml", QWEN25) == ct.ChatTemplate("chatml")  # Only "auto" reads a default system message.
  with pytest.raises(ValueError, match="Unknown chat template 'vicuna'; choose 'auto', 'none' or one of"):
    ct.resolve("vicuna", None)
