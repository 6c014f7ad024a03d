"""The one argument parser every config file uses: `--config=configs/x.py:batch=256,lr_rule=sqrt,debug`.

Types come from the defaults; unknown keys and values of the wrong type are errors; a bare `name` sets a bool
default to True.
"""
import ml_collections


def _convert(key: str, text: str, default):
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
      values[key] = _convert(key, text.strip(), defaults[key])
  return ml_collections.ConfigDict(values)
