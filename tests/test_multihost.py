"""Two processes on localhost form one 4-device mesh (2 CPU devices each, gloo collectives) and train like one process
over 4 devices: the same base policy, metrics and train state after a training step, to float32 rounding."""
import contextlib
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.close import assert_close
from tests.helpers import ROOT, debug_config, xla_flags

pytestmark = pytest.mark.slow  # it starts the processes of a multi-host run

# One step of 32 rollouts in 2 shuffled mini-batches (so the batch is gathered and re-sharded), without warmup. The
# base policy has 4 SFT steps and earns no task reward: the overlong penalty gives groups of mixed lengths an
# advantage, so the step has a policy gradient.
# Adam's first update is about lr * sign(g), so a gradient element of rounding size may move by up to lr in one run
# and not the other: a small lr keeps that inside the comparison's tolerance.
OVERRIDES = {"mesh.data": -1, "sample_budget": 32, "optim.warmup_samples": 0, "optim.lr": 2.5e-5,
             "rl.mini_batches": 2, "rl.overlong": "penalty", "sft.steps": 4, "task.num_eval": 16}
TIMEOUT_S = 240  # For the processes to finish once the single-process run is done.
# Reductions over the 4 devices run in another order through gloo: values agree to float32 rounding, not bitwise.
COMPARED = ("loss", "policy_loss", "entropy", "grad_norm", "returns_mean", "reward_mean", "response_len_mean",
            "eval_accuracy", "samples", "updates")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _processes(directory, num_processes=2):
  """`launch.train --distributed` as `num_processes` processes of 2 CPU devices each; yields their log paths.

  Leaving the block waits for them; a failure or a hang kills them all (SIGKILL: JAX turns SIGTERM into a
  preemption notice) and fails.
  """
  port = _free_port()
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
  logs = [directory / f"process_{i}.log" for i in range(num_processes)]
  procs = []
  try:
    for i, log in enumerate(logs):
      with open(log, "w") as out:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug",
             f"--workdir={directory / 'run'}", f"--config.sft.cache_dir={directory / 'base'}", *flags,
             "--distributed", f"--coordinator=127.0.0.1:{port}", f"--num_processes={num_processes}",
             f"--process_id={i}"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    yield logs
    deadline = time.time() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
      assert time.time() < deadline, f"{num_processes} processes still running after {TIMEOUT_S}s"
      time.sleep(0.2)
    for p, log in zip(procs, logs):
      assert p.poll() == 0, log.read_text()[-4000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _arrays(directory):
  """Every array of an orbax item directory, as numpy, keyed by path (whatever devices wrote it)."""
  with contextlib.closing(ocp.PyTreeCheckpointer()) as ckptr:
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), ckptr.metadata(directory).item_metadata)
    tree = ckptr.restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_two_processes_train_like_one(tmp_path):
  multi, single = tmp_path / "multi", tmp_path / "single"
  multi.mkdir()
  with _processes(multi) as logs:
    # The single-process run over 4 devices goes on meanwhile, with its own base cache.
    Trainer(debug_config(str(single / "base"), **OVERRIDES), str(single / "run"), devices=jax.devices()[:4]).run()
  out0, out1 = (log.read_text() for log in logs)
  assert "processes: 2; mesh {'data': 4, 'fsdp': 1, 'expert': 1, 'tensor': 1}" in out0
  assert "step 1 |" in out0 and "step 1 |" not in out1  # Progress lines from process 0 only.

  # Every row once (process 1 writes nothing), with the single run's values.
  a, b = rundir.read_metrics(str(single / "run")), rundir.read_metrics(str(multi / "run"))
  assert [sorted(r) for r in a] == [sorted(r) for r in b]
  for key in COMPARED:
    # Sums that can cancel to near 0 (the losses, of advantages of mean 0; the mean return, of rewards of either
    # sign) are compared at their terms' size, about 1 (advantages of unit std, rewards of at most about 1 in size,
    # token weights summing to 1); the others at the largest of their rows.
    scale = 1.0 if key in ("loss", "policy_loss", "returns_mean") else None
    assert_close([r.get(key, -1) for r in b], [r.get(key, -1) for r in a], 1e-5, scale=scale, err_msg=key)
  assert b[1]["policy_loss"] != 0 and b[1]["grad_norm"] > 0

  # The base policy both processes trained and saved, and the train state after the step.
  for part in ("base", "run/checkpoints"):
    found = [os.path.relpath(d, single / part) for d, _, files in os.walk(single / part) if "_METADATA" in files]
    assert found, part
    for item in found:
      want, got = _arrays(single / part / item), _arrays(multi / part / item)
      assert want.keys() == got.keys() and len(want) > 10
      for key in want:
        assert_close(got[key], want[key], 5e-5, err_msg=f"{part}/{item}{key}")
