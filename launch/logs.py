"""Logging set-up shared by the launchers: our progress lines at INFO, library chatter (orbax, jax) at WARNING."""
import logging as std_logging

from absl import logging

_QUIET_PACKAGES = ("/orbax/", "/jax/_src/")


def _keep(record) -> bool:
  return record.levelno >= std_logging.WARNING or not any(p in record.pathname for p in _QUIET_PACKAGES)


def setup() -> None:
  """Call from `main` (after absl installed its handlers)."""
  logging.set_verbosity(logging.INFO)
  for handler in std_logging.getLogger().handlers:
    handler.addFilter(_keep)
