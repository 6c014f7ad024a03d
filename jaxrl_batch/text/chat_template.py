"""Chat templates: a conversation as the text an instruction-tuned checkpoint was trained on.

Hugging Face checkpoints ship their template as Jinja (`chat_template` in tokenizer_config.json). We run no Jinja:
each family is a small hand-written renderer, and `"auto"` picks the family from markers in the checkpoint's
template text (an unrecognised template is an error, never guessed). Families, one user turn then the reply:

  chatml   <|im_start|>user\\nU<|im_end|>\\n<|im_start|>assistant\\nA<|im_end|>\\n         Qwen2, Qwen2.5, Qwen3
  llama3   <|start_header_id|>user<|end_header_id|>\\n\\nU<|eot_id|>... (U, A stripped)     Llama 3.0
  gemma    <start_of_turn>user\\nU<end_of_turn>\\n<start_of_turn>model\\nA<end_of_turn>\\n  Gemma 1-3
  mistral  [INST] U [/INST]A</s>                                                      Mistral v0.1/v0.2, Mixtral
  llama2   [INST] <<SYS>>\\nS\\n<</SYS>>\\n\\nU [/INST] A </s> (U, A stripped)             Llama 2 chat

Conventions:
- A conversation is an optional system message, then user and assistant messages alternating, user first. A
  plain string is one user message.
- The text never starts with BOS: the caller encodes it as `bos_ids + encode(text)`. (The Jinja templates write
  `bos_token` first; `transformers` output is `bos_token + render(...)`.)
- `add_generation_prompt` opens the assistant turn; mistral and llama2 have none (the prompt ends with [/INST]).
- gemma and mistral have no system role: the system text and a blank line go before the first user message, as
  Gemma 3's template does.
- Markers are written as text. `Tokenizer.encode` maps them to their ids for tokenizer.json tokenizers, and for
  SentencePiece models only where they are user-defined pieces (Gemma's `<start_of_turn>`), not control pieces
  (Llama 2's `<s>`, `</s>`): multi-turn llama2/mistral conversations need a tokenizer.json.

Not reproduced: Llama 3.1+'s "Cutting Knowledge Date" system preamble, Qwen3's thinking switch, tool calling, and
Mistral v0.3+ spacing (`U[/INST]`, which `"auto"` refuses). Qwen2/2.5's default system message ("You are Qwen,
...") is kept: `"auto"` reads it from the template text and uses it when a conversation has no system message.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": text}
Turn = tuple[str, str]  # (role, content)

# `detect` picks the first family whose markers all occur in the template text (llama2 templates contain [INST]).
_MARKERS = (("llama3", ("<|start_header_id|>",)), ("chatml", ("<|im_start|>",)), ("gemma", ("<start_of_turn>",)),
            ("llama2", ("<<SYS>>", " [/INST]")), ("mistral", ("[INST] ", " [/INST]")))
# A chatml system turn written as one literal, e.g. '<|im_start|>system\nYou are Qwen, ...<|im_end|>\n'.
_CHATML_DEFAULT_SYSTEM = re.compile(r"""['"]<\|im_start\|>system(?:\\n|\n)([^'"{}]+?)<\|im_end\|>""")


def _chatml(system: str | None, turns: list[Turn], generation_prompt: bool) -> str:
  turns = ([("system", system)] if system is not None else []) + turns
  text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
  return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _llama3(system: str | None, turns: list[Turn], generation_prompt: bool) -> str:
  turns = ([("system", system)] if system is not None else []) + turns
  text = "".join(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
                 for role, content in turns)
  return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation_prompt else "")


def _gemma(system: str | None, turns: list[Turn], generation_prompt: bool) -> str:
  text = ""
  for i, (role, content) in enumerate(turns):
    prefix = system + "\n\n" if i == 0 and system is not None else ""
    text += f"<start_of_turn>{'model' if role == 'assistant' else role}\n{prefix}{content.strip()}<end_of_turn>\n"
  return text + ("<start_of_turn>model\n" if generation_prompt else "")


def _mistral(system: str | None, turns: list[Turn], generation_prompt: bool) -> str:
  del generation_prompt  # The prompt ends with [/INST]; the reply follows directly.
  text = ""
  for i, (role, content) in enumerate(turns):
    if role == "user":
      prefix = system + "\n\n" if i == 0 and system is not None else ""
      text += f"[INST] {prefix}{content} [/INST]"
    else:
      text += f"{content}</s>"
  return text


def _llama2(system: str | None, turns: list[Turn], generation_prompt: bool) -> str:
  del generation_prompt  # The prompt ends with [/INST]; the reply follows after a space.
  text = ""
  for i, (role, content) in enumerate(turns):
    if role == "user":
      if i == 0 and system is not None:
        content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
      text += f"{'<s>' if i else ''}[INST] {content.strip()} [/INST]"
    else:
      text += f" {content.strip()} </s>"
  return text


_RENDERERS = dict(chatml=_chatml, llama3=_llama3, gemma=_gemma, mistral=_mistral, llama2=_llama2)
_END_OF_TURN = dict(chatml="<|im_end|>", llama3="<|eot_id|>", gemma="<end_of_turn>", mistral="</s>", llama2="</s>")
FAMILIES = tuple(_RENDERERS)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A family's format, with the system message used when a conversation has none (chatml only)."""

  family: str
  default_system: str | None = None

  def __post_init__(self):
    if self.family not in _RENDERERS:
      raise ValueError(f"Unknown chat template family {self.family!r}; choose one of {FAMILIES}.")
    if self.default_system is not None and self.family != "chatml":
      raise ValueError(f"default_system is a chatml feature; the {self.family} family has none.")

  @property
  def end_of_turn(self) -> str:
    """The marker that ends an assistant reply: sampling should stop at its id."""
    return _END_OF_TURN[self.family]

  def render(self, messages: str | Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The text of `messages` (a str is one user message), without BOS."""
    system, turns = _split(messages)
    return _RENDERERS[self.family](self.default_system if system is None else system, turns, add_generation_prompt)


def _split(messages: str | Sequence[Message]) -> tuple[str | None, list[Turn]]:
  """(system text or None, the other turns), checking roles: optional system, then user/assistant alternating."""
  if isinstance(messages, str):
    return None, [("user", messages)]
  turns = [(m["role"], m["content"]) for m in messages]
  system = turns.pop(0)[1] if turns and turns[0][0] == "system" else None
  roles = [role for role, _ in turns]
  if not roles or roles != [("user", "assistant")[i % 2] for i in range(len(roles))]:
    raise ValueError(f"Chat roles {roles} must be user, assistant, user, ... after an optional system message.")
  return system, turns


def detect(source: str) -> ChatTemplate:
  """The family of a Jinja chat template, from its markers; raises if none matches."""
  for family, markers in _MARKERS:
    if all(m in source for m in markers):
      if family != "chatml":
        return ChatTemplate(family)
      match = _CHATML_DEFAULT_SYSTEM.search(source)
      return ChatTemplate(family, match.group(1).replace("\\n", "\n") if match else None)
  raise ValueError(f"Unrecognised chat template (starts {source[:80]!r}); set the chat template to one of "
                   f"{FAMILIES} by name, or 'none' to use prompts as they are.")


def resolve(name: str, source: str | None) -> ChatTemplate | None:
  """The template `name` selects: a family, "none" (None: prompts used as they are), or "auto" (`detect` on the
  checkpoint's template text `source`; None when it has none, like a SentencePiece file or a base model)."""
  if name == "none" or (name == "auto" and source is None):
    return None
  if name == "auto":
    return detect(source)
  if name not in _RENDERERS:
    raise ValueError(f"Unknown chat template {name!r}; choose 'auto', 'none' or one of {FAMILIES}.")
  return ChatTemplate(name)


def render_prompt(chat: ChatTemplate | None, messages: str | Sequence[Message], add_generation_prompt: bool = True,
                  missing: str = "none is set") -> str:
  """Prompt text of `messages` (a str is one user message) in `chat`, without BOS; with no template (None) a str is
  used as it is. Every prompt the library encodes goes through here. `missing` says, in an error, why there is no
  template."""
  if chat is not None:
    return chat.render(messages, add_generation_prompt)
  if not isinstance(messages, str):
    raise ValueError(f"Chat messages need a chat template, but {missing}; name one of {FAMILIES}, or pass the "
                     "prompt as a string.")
  return messages
