"""Branching a run: a new run directory that starts from another run's checkpoint, with settings changed.

The way on when a run diverged (or to try a change from a point of a run) without rewriting that run's record: the
new directory receives the source's checkpoint at the chosen step, its metrics.jsonl and samples.jsonl rows up to
that step, and a config.json whose `branched_from` names the source, the step and the changed fields. From then on it
is an ordinary run: a rerun resumes it. The source directory is only read.

A branch may change anything the saved state still fits (learning rate and schedule, clipping, KL, sampling,
cadences); a change of what the state holds (model shape, algorithm, critic) is refused before anything is written.
"""
import dataclasses
import logging
import os
import shutil

import jax
from jax.experimental import multihost_utils

from jaxrl_batch.runtime.checkpointing import Checkpointer, all_finite
from jaxrl_batch.runtime.distributed import is_main_process
from jaxrl_batch.train import rundir, samples_log


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a branch starts: a run directory and a checkpoint step of it (None = its latest)."""
  workdir: str
  step: int | None = None

  def matches(self, record: dict) -> bool:
    """Whether a `branched_from` record of config.json came from this origin."""
    return (record.get("workdir") == os.path.abspath(self.workdir)
            and (self.step is None or record.get("step") == self.step))


def pending(origin: Origin | None, workdir: str) -> bool:
  """Whether `workdir` is still to be seeded from `origin`: it holds no checkpoint, and no run other than that
  branch. ValueError when it holds another run (the branch needs a directory of its own)."""
  if origin is None:
    return False
  saved = rundir.read_config(workdir)
  record = (saved or {}).get("branched_from")
  if saved is not None and not (record and origin.matches(record)):
    raise ValueError(f"--workdir {workdir} already holds a run{' branched from ' + record['workdir'] if record else ''}"
                     f": a branch from {origin.workdir} needs a new --workdir. Nothing was changed.")
  steps = os.listdir(rundir.checkpoints_dir(workdir)) if os.path.isdir(rundir.checkpoints_dir(workdir)) else []
  return not any(name.isdigit() for name in steps)


def seed(origin: Origin, workdir: str, abstract_state, carries_rollouts: bool, resolved_config: dict) -> int:
  """Fills the empty run directory `workdir` from `origin`; returns the step it starts from.

  `abstract_state`: the new run's train state as ShapeDtypeStructs (with shardings); the source checkpoint must
  restore into it and hold finite values. `resolved_config`: the new run's config.json content, to which the
  `branched_from` record is added. Writes config.json, then metrics.jsonl (the source's rows up to the step), then
  checkpoints/ in one rename, so that an interrupted seeding is redone whole by a rerun.
  """
  source = os.path.abspath(origin.workdir)
  saved = rundir.read_config(source)
  if saved is None:
    raise FileNotFoundError(f"--branch_from={origin.workdir} holds no run (no {rundir.CONFIG}): point it at the "
                            "run directory to branch from.")
  if not os.path.isdir(rundir.checkpoints_dir(source)):
    raise FileNotFoundError(f"--branch_from={origin.workdir} has no {rundir.CHECKPOINTS}/ to branch from.")
  checkpointer = Checkpointer(rundir.checkpoints_dir(source))
  try:
    steps = checkpointer.all_steps()
    step = steps[-1] if origin.step is None and steps else origin.step
    if step not in steps:
      raise FileNotFoundError(f"{checkpointer.directory} has no checkpoint at step {step} (it holds "
                              f"{steps or 'none'}): pick one of those with --branch_step.")
    path = checkpointer.step_path(step)
    try:
      state, meta = checkpointer.restore(abstract_state, step)
    except Exception as e:  # noqa: BLE001  (orbax raises many types for a state that does not fit)
      raise ValueError(f"The checkpoint {path} does not fit this config ({type(e).__name__}: "
                       f"{(str(e).strip().splitlines() or [''])[0][:300]}). A branch may change hyperparameters "
                       "(learning rate, clipping, KL, sampling) but not what the state holds (model shape, algorithm, "
                       "critic). Nothing was changed.") from e
  finally:
    checkpointer.close()
  if not bool(all_finite(state)):
    raise ValueError(f"The checkpoint {path} holds non-finite values: branch from an earlier step ({steps}). "
                     "Nothing was changed.")
  if carries_rollouts != ("rollouts" in meta):
    raise ValueError(f"The checkpoint {path} {'holds' if 'rollouts' in meta else 'lacks'} rollouts in flight, which "
                     "this config does not carry: keep rollout.partial and rl.max_staleness as in the source run.")
  changed = rundir.config_diff(saved["config"], resolved_config["config"])
  record = dict(workdir=source, step=step, samples=meta["samples"], changed=changed)
  if is_main_process():
    rundir.write_config(workdir, dict(resolved_config, branched_from=record))
    logs = ((rundir.METRICS, rundir.MetricsLog(workdir)), (samples_log.SAMPLES, samples_log.SamplesLog(workdir, 0)))
    for name, log in logs:  # The source's rows up to the step.
      if os.path.exists(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(workdir, name))
        log.truncate_after(step)
    staging = rundir.checkpoints_dir(workdir) + ".branching"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(path, os.path.join(staging, str(step)))
    shutil.rmtree(rundir.checkpoints_dir(workdir), ignore_errors=True)  # Empty: `pending` checked it.
    os.rename(staging, rundir.checkpoints_dir(workdir))
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("branch seeded")
  logging.info("Branched from %s at step %d (%d samples); changed: %s.", path, step, meta["samples"],
               "; ".join(changed) or "nothing")
  return step

