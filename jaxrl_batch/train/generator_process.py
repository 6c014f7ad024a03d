"""Generation in a process of its own, pinned to CPU cores of its own (`rollout_mesh.process_cores`).

On a CPU host, two device sets of one process share one XLA thread pool, so a disaggregated rollout mesh overlaps
little with the update. Here the generator is a child process (`python -m jaxrl_batch.train.generator_process`)
with its own JAX runtime on the cores `rollout_mesh.process_cores` (e.g. "0"); the learner's threads move to the
other cores. After every update the learner ships the policy's weights to it as host arrays over a socket pair;
the child generates and scores the step's rollouts with the same `Collector` and returns them as host arrays, which
are uploaded to the learner's devices. `RemoteGenerator` has `Collector.collect`'s signature: `AsyncCollector`
drives it from its host thread, so the queue, the policy versions and exact resume are the same as in-process.
Tokens are those the in-process collector samples for the same policy and step (keys depend only on seed and step).
"""
import copy
import json
import os
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

import jax
import ml_collections

from jaxrl_batch.rl.rollouts import Rollouts
from jaxrl_batch.runtime import sharding, transfer
from jaxrl_batch.train.collector import Collector
from jaxrl_batch.train.setup import Experiment

READY, GENERATE, ROLLOUTS, ERROR, CLOSE = "ready", "generate", "rollouts", "error", "close"


def parse_cores(spec: str) -> set[int]:
  """CPU ids of a `taskset`-style list, e.g. "0", "0,2", "0-3"."""
  cores = set()
  for part in filter(None, (p.strip() for p in str(spec).split(","))):
    low, _, high = part.partition("-")
    if not (low.isdigit() and (not high or high.isdigit())):
      raise ValueError(f"rollout_mesh.process_cores={spec!r}: give CPU ids like '0', '0,2' or '0-3'.")
    cores.update(range(int(low), int(high or low) + 1))
  return cores


def _pin_threads(cores: set[int]) -> None:
  """Moves every thread of this process (the XLA pool's included) onto `cores`."""
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cores)
    except (ProcessLookupError, PermissionError):
      pass  # A thread that ended meanwhile.


def _child_env() -> dict:
  """The parent's environment without a forced host device count: the child runs on one CPU device."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


class RemoteGenerator:
  """The step's rollouts from the child process, uploaded to the learner experiment's devices."""

  def __init__(self, config, learner_exp, cores: str):
    """Starts the child on `cores` with `config` (the run's; its `rollout_mesh` data/fsdp/tensor/expert shape the
    child's mesh) and waits until it is ready; moves the learner's threads to the other allowed cores."""
    self.exp = learner_exp
    self._cores = parse_cores(cores)
    self._allowed = os.sched_getaffinity(0)
    learner_cores = self._allowed - self._cores
    if not self._cores or max(self._cores) >= os.cpu_count() or not learner_cores:
      raise ValueError(f"rollout_mesh.process_cores={cores!r}: the generator needs CPU ids below {os.cpu_count()} "
                       f"that leave the learner at least one of its cores {sorted(self._allowed)}.")
    parent, child = socket.socketpair()
    self._process = subprocess.Popen(
        [sys.executable, "-m", "jaxrl_batch.train.generator_process", str(child.fileno()),
         ",".join(map(str, sorted(self._cores)))], pass_fds=(child.fileno(),), env=_child_env())
    child.close()
    self._conn = Connection(parent.detach())
    self._conn.send(json.dumps(dict(config=config.to_dict())))
    self._receive(READY)
    _pin_threads(learner_cores)

  def _receive(self, kind: str):
    try:
      message = self._conn.recv()
    except EOFError as e:
      raise RuntimeError(f"The generator process exited (code {self._process.wait()}); its log is above.") from e
    if message[0] == ERROR:
      raise RuntimeError(f"The generator process failed:\n{message[1]}")
    assert message[0] == kind, message[0]
    return message[1:]

  def collect(self, graphdef, params, step: int):
    """`Collector.collect`'s (rollouts, stats) for `step`, sampled by the child with `params`."""
    del graphdef  # The child holds its own graph definition.
    leaves = transfer.to_host("publish", jax.tree.leaves(params))
    self._conn.send((GENERATE, step, leaves))
    arrays, stats = self._receive(ROLLOUTS)
    device = transfer.to_device("rollouts", arrays,
                                {k: sharding.batch_sharding(self.exp.mesh, v.ndim) for k, v in arrays.items()})
    return Rollouts(**device), stats

  def close(self) -> None:
    """Stops the child and gives this process its cores back."""
    try:
      self._conn.send((CLOSE,))
    except OSError:
      pass
    self._process.wait(timeout=60)
    self._conn.close()
    _pin_threads(self._allowed)


def serve(conn: Connection, cores: set[int]) -> None:
  """The child: builds the run's experiment on its own device(s) and answers GENERATE requests until CLOSE."""
  os.sched_setaffinity(0, cores)  # Before the XLA runtime starts its threads: they inherit it.
  config = copy.deepcopy(ml_collections.ConfigDict(json.loads(conn.recv())["config"]))
  config.mesh.update({k: config.rollout_mesh[k] for k in ("data", "fsdp", "tensor", "expert")})
  exp = Experiment.create(config)
  collector = Collector(exp)
  graphdef, abstract = exp.abstract_params(adapters=True)  # The policy the learner publishes.
  shapes, treedef = jax.tree.flatten(abstract)
  conn.send((READY,))
  while True:
    message = conn.recv()
    if message[0] == CLOSE:
      return
    _, step, leaves = message
    params = jax.tree.unflatten(treedef, [jax.device_put(x, s.sharding) for x, s in zip(leaves, shapes)])
    rollouts, stats = collector.collect(graphdef, params, step)
    arrays = transfer.to_host("rollouts", {k: v for k, v in rollouts._asdict().items() if v is not None})
    conn.send((ROLLOUTS, arrays, stats))


def main(argv: list[str]) -> None:
  conn = Connection(int(argv[1]))
  try:
    serve(conn, parse_cores(argv[2]))
  except Exception:  # pylint: disable=broad-except
    conn.send((ERROR, traceback.format_exc()))
    raise
  finally:
    conn.close()


if __name__ == "__main__":
  main(sys.argv)
