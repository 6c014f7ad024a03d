"""Asynchronous RL: generation runs up to k = `rl.max_staleness` steps ahead of the learner.

At step s the learner trains on the rollouts of step s while a host thread generates and scores those of step s + k
with the policy published after step s. Colocated (the collector's mesh is the learner's), the programs share the
devices and the host work (decoding responses, scoring them) overlaps the update; disaggregated (`rollout_mesh`:
disjoint devices), generation and update run at once, the policy is resharded onto the rollout devices when
published and the rollouts copied to the learner's when done; in a process of its own (`rollout_mesh.process_cores`,
`train.generator_process`), the weights are shipped to it as host arrays and the rollouts come back the same way.
Step s's rollouts were therefore sampled by the policy of step s - k (of step 0 for the first k steps): its policy
lag is min(s, k) steps, or that many times B rollouts (`policy_lag_samples_mean`). k = 0 is the synchronous loop
(`train.collector.Collector`, no thread).

The rollouts in flight (steps s+1 .. s+k at a checkpoint after step s) and the policy version that sampled each are
run state (`state_dict`): a resumed run trains on the very rollouts the uninterrupted one did. The learner corrects
for the lag with the loss's importance weights (`rl.old_logp='trainer'` with `rl.tis_cap`, the decoupled PPO
objective; see `rl.update`).
"""
import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from jaxrl_batch.model import compute_copy
from jaxrl_batch.rl.rollouts import Rollouts
from jaxrl_batch.runtime import sharding, transfer
from jaxrl_batch.train.collector import Collector
from jaxrl_batch.train.generator_process import RemoteGenerator
from jaxrl_batch.train.step_row import RolloutStats

# Rollouts fields saved with a checkpoint, and their dtypes (experts_BxTxLxK: int32 or absent).
_FIELDS = {"prompt_BxP": np.int32, "prompt_valid_BxP": bool, "tokens_BxN": np.int32, "logprobs_BxN": np.float32,
           "mask_BxN": bool, "rewards_B": np.float32, "trained_B": bool, "experts_BxTxLxK": np.int32}


class AsyncCollector:
  """`Collector.collect` with generation `max_staleness` steps ahead, on one host thread."""
  carries_rollouts = True

  def __init__(self, collector: Collector | RemoteGenerator, max_staleness: int, learner_mesh: jax.sharding.Mesh):
    """`collector` generates on its experiment's mesh (a `RemoteGenerator`: in its process, its rollouts uploaded
    to the learner's devices); `learner_mesh` is the update's."""
    if max_staleness < 1:
      raise ValueError(f"max_staleness={max_staleness}: the asynchronous collector runs >= 1 step ahead.")
    if jax.process_count() > 1:
      raise ValueError("rl.max_staleness > 0 generates on a host thread, whose collectives would interleave with "
                       "the learner's across processes: run it in one process (any number of devices), or set "
                       "rl.max_staleness=0.")
    self.collector, self.k = collector, max_staleness
    self.exp, self.mesh = collector.exp, learner_mesh
    self.colocated = collector.exp.mesh == learner_mesh
    # Generating on a mesh of its own: the policy published in that mesh's layout. Over the learner's devices
    # (rollout_mesh.layout='own') a leaf already in that layout must still be a new array: the update donates its own.
    self.layouts = None if self.colocated else self.exp.policy_shardings()
    self.same_devices = set(collector.exp.mesh.devices.flat) == set(learner_mesh.devices.flat)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
    self._queue: dict[int, tuple[int, object]] = {}  # step -> (policy version, Future or restored host batch)
    self._last_end = None  # When the generator finished its previous batch (for update_wait_s).

  def _generate(self, graphdef, params, step: int) -> tuple:
    """On the generator thread: the step's rollouts (on the learner's devices) and statistics, with how long the
    generator waited for this work (`update_wait_s`)."""
    start = time.time()
    idle = 0.0 if self._last_end is None else max(start - self._last_end, 0.0)
    rollouts, stats = self.collector.collect(graphdef, params, step)
    if not self.colocated:  # Onto the learner's devices (device to device).
      rollouts = jax.device_put(rollouts, jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, x.ndim), rollouts))
    rollouts = jax.block_until_ready(rollouts)
    self._last_end = time.time()
    return rollouts, dataclasses.replace(stats, update_wait_s=idle)

  def publish(self, params):
    """The policy for the generator, in the compute dtype (`model.compute_copy`): a copy on the learner's devices
    (the update donates its state), or put in the generator's layout (`Experiment.policy_shardings`) on its devices
    or, with rollout_mesh.layout='own', on the learner's."""
    dtype = self.exp.model_cfg.compute_dtype
    if self.colocated:
      return compute_copy(params, dtype, copy=True)
    return jax.device_put(compute_copy(params, dtype, copy=self.same_devices), self.layouts)

  def collect(self, graphdef, params, step: int) -> tuple[Rollouts, RolloutStats]:
    """Like `Collector.collect` for `step`, from the queue; first tops the queue up to step + k with `params`
    published (copied: the update donates its state) as policy version `step`."""
    published = None
    for t in range(step, step + self.k + 1):
      if t not in self._queue:
        if published is None:
          published = self.publish(params)
        self._queue[t] = (step, self._pool.submit(self._generate, graphdef, published, t))
    version, item = self._queue.pop(step)
    t0 = time.time()
    if isinstance(item, concurrent.futures.Future):
      rollouts, stats = item.result()
    else:
      rollouts, stats = self._upload(item)
    lag = step - version
    return rollouts, dataclasses.replace(stats, rollout_wait_s=time.time() - t0, policy_version=version,
                                         policy_lag_mean=float(lag), policy_lag_max=lag,
                                         policy_lag_samples_mean=float(lag * self.exp.member.batch_size))

  def _upload(self, saved: dict):
    """A restored batch back on the learner's devices, as the generator had left it."""
    arrays = {k: np.asarray(v, _FIELDS[k]) for k, v in saved["arrays"].items()}
    device = transfer.to_device("restore", arrays,
                                {k: sharding.batch_sharding(self.mesh, v.ndim) for k, v in arrays.items()})
    return Rollouts(**{k: device.get(k) for k in _FIELDS}), RolloutStats(**saved["stats"])

  def state_dict(self) -> dict:
    """The JSON-able run state: each batch in flight (waited for), its step, policy version, arrays and
    statistics."""
    batches = []
    for t in sorted(self._queue):
      version, item = self._queue[t]
      if isinstance(item, concurrent.futures.Future):
        rollouts, stats = item.result()
        fields = {k: v for k, v in rollouts._asdict().items() if v is not None}
        arrays = {k: v.tolist() for k, v in transfer.to_host("checkpoint_rollouts", fields).items()}
        item = dict(arrays=arrays, stats=stats.to_json())
        self._queue[t] = (version, item)
      batches.append(dict(step=t, version=version, **item))
    return dict(max_staleness=self.k, batches=batches)

  def load_state_dict(self, state: dict) -> None:
    if state["max_staleness"] != self.k:
      raise ValueError(f"The checkpoint holds rollouts of rl.max_staleness={state['max_staleness']}, this run has "
                       f"{self.k}: resume with the saved config.")
    self._queue = {b["step"]: (b["version"], dict(arrays=b["arrays"], stats=b["stats"])) for b in state["batches"]}

  def close(self) -> None:
    """Stops the generator thread: batches not started are dropped, the one running completes."""
    for _, item in self._queue.values():
      if isinstance(item, concurrent.futures.Future):
        item.cancel()
    self._pool.shutdown(wait=True)
    if isinstance(self.collector, RemoteGenerator):
      self.collector.close()
