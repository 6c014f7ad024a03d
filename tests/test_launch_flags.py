"""Every list-valued flag of every launcher refuses a bad item while flags are parsed, naming the flag, the item and
the fix (`launch.list_flags`), and accepts its default."""
import json
import os
import subprocess
import sys

import pytest
from absl import flags

from jaxrl_batch.study.runner import sweep_steps
from launch import list_flags
from tests.helpers import ROOT

# In a child process: imports each launcher in turn (their flag names overlap, so one at a time, the flags of
# launch.* deleted after) and sets each list-valued flag to its default, then to a bad item; prints {module: {flag: error or None}}.
_PROBE = r"""
import glob, importlib, json, os, sys
from absl import flags
FLAGS, report = flags.FLAGS, {}
for path in sorted(glob.glob("launch/*.py")):
  name = "launch." + os.path.basename(path)[:-3]
  if name in ("launch.__init__", "launch.list_flags"):
    continue
  importlib.import_module(name)
  own = FLAGS.get_flags_for_module(name)
  report[name] = {}
  for flag in own:
    if isinstance(flag, flags.MultiFlag) or isinstance(flag.parser, flags.ListParser):
      setattr(FLAGS, flag.name, flag.default)  # The default must pass.
      try:
        setattr(FLAGS, flag.name, ["nonsense!"])
        report[name][flag.name] = None
      except flags.IllegalFlagValueError as e:
        report[name][flag.name] = str(e)
  for module in [m for m in sys.modules if m.startswith("launch.")]:  # The next launcher imports its own.
    for flag in FLAGS.get_flags_for_module(module):
      delattr(FLAGS, flag.name)
    del sys.modules[module]
print(json.dumps(report))
"""


def test_every_list_flag_of_every_launcher_refuses_a_bad_item():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=env, check=True)
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  checked = {(module, name): error for module, names in report.items() for name, error in names.items()}
  assert ("launch.plan_batch", "batches") in checked and ("launch.study", "set") in checked
  unchecked = sorted(key for key, error in checked.items() if error is None)
  assert not unchecked, f"list flags that accept any item: {unchecked}"
  for (module, name), error in checked.items():
    assert f"--{name}" in error and "'nonsense!'" in error and f"e.g. --{name}=" in error, (module, error)


def test_list_flag_errors_name_the_item_and_the_fix():
  values = flags.FlagValues()
  flags.DEFINE_list("batches", ["32"], "Batches.", flag_values=values)
  list_flags.integers("batches", 1, "rollouts per step", "32,64", flag_values=values)
  values(["prog"])
  with pytest.raises(flags.IllegalFlagValueError, match=r"--batches.*item '0' is below 1; each item is rollouts per "
                     r"step, an integer >= 1\. Fix or remove it, e\.g\. --batches=32,64\."):
    values(["prog", "--batches=0,32"])
  with pytest.raises(flags.IllegalFlagValueError, match=r"item 'abc' is not an integer"):
    values(["prog", "--batches=32,abc"])
  values(["prog", "--batches=64,128"])
  assert values.batches == ["64", "128"]


def test_sweep_steps_refuses_a_batch_below_one():
  with pytest.raises(ValueError, match=r"batch=0: a throughput sweep's batches are rollouts per step"):
    sweep_steps(0, steps=4, warmup=5, min_samples=1024)
  assert sweep_steps(32, steps=4, warmup=5, min_samples=1024) == 1 + 5 + 32
