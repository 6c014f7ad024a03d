"""The one argument parser every config file uses: `--config=configs/x.py:batch=256,lr_rule=sqrt,debug`.

Types come from the defaults; unknown keys and values of the wrong type are errors; a bare `name` sets a bool
default to True.
"""
import ml_collections


def convert(key: str, text: str, default):
  """`text` as a value of `default`'s type; ValueError naming `key` if it does not parse."""
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


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
  """Applies 'a.b.c=value' strings in place; the key must exist and the value parses as its current type."""
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"Override {item!r} must look like key=value (e.g. sample_budget=4096).")
    node, path = config, key.strip().split(".")
    for name in path[:-1]:
      if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
        raise ValueError(f"Override {item!r}: {name!r} is not a config group.")
      node = node[name]
    if path[-1] not in node:
      raise ValueError(f"Override {item!r}: unknown config key {key!r}.")
    node[path[-1]] = convert(key, text.strip(), node[path[-1]])
