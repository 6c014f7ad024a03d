"""A run's inputs that are wrong say what is wrong and how to fix it, and change nothing: a damaged config.json."""
import os

import pytest

from jaxrl_batch.train import rundir


@pytest.mark.parametrize("content", [b"garbage{{", b'{"config": ', b"[1, 2]", b"\xff\xfe{"])
def test_damaged_config_json_is_named_with_the_fix_and_left_as_is(tmp_path, content):
  path = tmp_path / rundir.CONFIG
  path.write_bytes(content)
  (tmp_path / rundir.METRICS).write_text('{"step": 0, "samples": 0, "eval_accuracy": 0.5}\n')
  before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
  with pytest.raises(ValueError, match=rf"{path} (is not valid JSON|holds a JSON list).*Restore it from a backup"):
    rundir.read_config(str(tmp_path))
  assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
