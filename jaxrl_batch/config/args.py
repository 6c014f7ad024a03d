"""The one argument parser every config file uses: `--config=configs/x.py:batch=256,lr_rule=sqrt,debug`.

Types come from the defaults; unknown keys and values of the wrong type are errors; a bare `name` sets a bool
default to True.
"""
import difflib

import ml_collections


def convert(key: str, text: str, default):
  """`text` as a value of `default`'s type (a tuple: comma-separated strings); ValueError naming `key` if it does
  not parse."""
  if isinstance(default, tuple):
    return tuple(part.strip() for part in text.split(",") if part.strip())
  if isinstance(default, bool):
    if text.lower() in ("1", "true", "yes"):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"Config arg {key}={text!r}: expected a bool (true/false).")
  try:
    return type(default)(text)
  except ValueError:
    raise ValueError(f"Config arg {key}={text!r}: expected {type(default).__name__} like the default "
                     f"{default!r}.") from None


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k1=v1,k2,k3=v3' against `defaults`; returns a ConfigDict with every default filled in."""
  values = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, sep, text = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"Unknown config arg {key!r}; this config accepts {sorted(defaults)}.")
    if not sep:
      if not isinstance(defaults[key], bool):
        raise ValueError(f"Config arg {key!r} needs a value ({key}=...).")
      values[key] = True
    else:
      values[key] = convert(key, text.strip(), defaults[key])
  return ml_collections.ConfigDict(values)


def unknown_key(config: ml_collections.ConfigDict, key: str) -> str | None:
  """Why the dotted `key` names no field of `config` (its closest fields, or the group's), or None if it does."""
  node, path = config, key.split(".")
  for depth, name in enumerate(path):
    where = ".".join(path[:depth]) or "the config"
    if not isinstance(node, ml_collections.ConfigDict):
      return f"{where!r} is not a config group; it holds a {type(node).__name__}."
    if name not in node:
      close = difflib.get_close_matches(name, list(node.keys()), n=3)
      hint = f"did you mean {', '.join(close)}?" if close else f"{where} holds {', '.join(sorted(node.keys()))}."
      return f"unknown config key {key!r}: {where} has no field {name!r}; {hint}"
    node = node[name]
  return None


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
  """Applies 'a.b.c=value' strings in place; the key must exist and the value parses as its current type."""
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"Override {item!r} must look like key=value (e.g. sample_budget=4096).")
    problem = unknown_key(config, key.strip())
    if problem:
      raise ValueError(f"Override {item!r}: {problem}")
    node, path = config, key.strip().split(".")
    for name in path[:-1]:
      node = node[name]
    node[path[-1]] = convert(key, text.strip(), node[path[-1]])
