"""Checks of the launchers' list-valued flags (`flags.DEFINE_list`, repeatable `--set`): a bad item is refused while
the flags are parsed, in one line naming the flag, the item and the fix, instead of failing later inside the run (a
ZeroDivisionError for `--batches=0,32`, a bare "invalid literal for int()" for `--batches=32,abc`)."""
from collections.abc import Callable, Sequence

from absl import flags


def check_items(name: str, problem: Callable[[str], str | None], what: str, example: str,
                flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Registers a validator of the list flag --name: `problem(item)` says what is wrong with one item, None when
  nothing is; `what` says what an item is, `example` is a good value of the flag."""
  def checker(items) -> bool:
    for item in items or ():
      wrong = problem(item)
      if wrong:
        raise flags.ValidationError(f"item {item!r} {wrong}; each item is {what}. Fix or remove it, e.g. "
                                    f"--{name}={example}.")
    return True
  flags.register_validator(name, checker, flag_values=flag_values)


def integers(name: str, minimum: int, what: str, example: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Items of --name must be integers >= `minimum`."""
  def problem(item: str) -> str | None:
    try:
      value = int(item)
    except ValueError:
      return "is not an integer"
    return None if value >= minimum else f"is below {minimum}"
  check_items(name, problem, f"{what}, an integer >= {minimum}", example, flag_values)


def choices(name: str, allowed: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Items of --name must be among `allowed`."""
  check_items(name, lambda item: None if item in allowed else "is not a known choice", f"one of {', '.join(allowed)}",
              ",".join(allowed[:2]), flag_values)


def overrides(name: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Items of --name must be config overrides key=value."""
  check_items(name, lambda item: None if "=" in item and item.partition("=")[0].strip() else "has no key=value",
              "a config override key=value", "sample_budget=4096", flag_values)
