"""The RL loop: rollouts -> rewards -> advantages -> GRPO/PPO updates, with evaluation, checkpoints and metrics.

No algorithm math lives here. Every step's prompts and sampling randomness are functions of (seed, step)
(`runtime.streams`), so the data position and RNG state of a run are its step count: a resumed run replays exactly.

A step crosses between host and device only as `runtime.transfer` names it: prompts up, response tokens down,
rewards up, and its metrics down once, one step late (fetched after the next step's rollout; at once before an
evaluation, a checkpoint or the end, and every step under the adaptive KL controller, which needs the step's KL).
The update is timed to completion (one blocking wait, no transfer) so that the phase clock is exact.

Nothing a run directory holds is lost: one process at a time (`workdir_lock`); SIGTERM or SIGINT checkpoint at the
next step boundary and stop (`runtime.preemption`); a checkpoint is never saved with non-finite state, and resume
falls back from an unusable latest checkpoint to the previous one; metrics rows are erased only past a checkpoint
the run resumes from. Rows at or before that checkpoint that are torn or missing (a crash or a full disk as a row
was written, a file cut by a copy or a host crash) are redone when they can be, the evaluation of the checkpoint's
step, and named in a warning when they cannot (`_check_log`).
"""
import json
import logging
import math
import os
import time

import jax
import ml_collections
import numpy as np

from jaxrl_batch.model import compute_copy
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.rl.kl_control import KLController
from jaxrl_batch.rl.noise_scale import NoiseScale
from jaxrl_batch.runtime import compile_clock, disk_space, sharding, streams, transfer
from jaxrl_batch.runtime.checkpointing import Checkpointer, all_finite, saved_steps
from jaxrl_batch.runtime.preemption import StopSignals, Stopped
from jaxrl_batch.train import branch, evaluation, placement, rundir, samples_log, sft, step_builder, step_row, writers
from jaxrl_batch.train.async_collector import AsyncCollector
from jaxrl_batch.train.decode_layout import ResharedCollector
from jaxrl_batch.train.workdir_lock import WorkdirLock


def _json_config(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json())


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _format_example(example: dict) -> str:
  """' | sample "<completion>" (reward r)', the completion cut to 60 characters, for the progress line."""
  return f" | sample {samples_log.shorten(example['completion'], 60)!r} (reward {example['reward']:.2f})"


MAX_IDLE_STEPS = 20  # Consecutive steps without a trained rollout before the run stops with an error.


def _crossed(previous: int, samples: int, every: int) -> bool:
  """Whether going from `previous` to `samples` samples crosses a multiple of `every` (0: never)."""
  return every > 0 and samples // every > previous // every


class Trainer:
  """Runs one member of a batch family to its sample budget in `workdir` (resuming if it holds a checkpoint)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None,
               branch_from: branch.Origin | None = None):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.branch_from = branch_from  # Seeds a new workdir from another run's checkpoint (`train.branch`).
    self.exp, self.collector = placement.build(config, devices)
    self.member = m = self.exp.member
    self.algo = m.algo
    self.optimizer, self.critic_optimizer = step_builder.optimizers(self.exp)
    self.noise_scale = NoiseScale()  # Restarts on resume: an EMA, not part of the training state.
    self.samples_log = samples_log.SamplesLog(self.workdir, config.log_samples_max_chars)
    evaluation.EvalConfig.from_config(config)  # A malformed `eval` group fails here, before the warm start.
    self.metrics = writers.open_writers(config, self.workdir, m)  # metrics.jsonl and config.writers' sinks.
    self.lock = WorkdirLock(self.workdir)
    self.kl = KLController(self.algo.kl_coef, self.algo.kl_target, self.algo.kl_horizon)
    self.checkpointer: Checkpointer | None = None  # Opened by `run`, with the base policy and the learner.
    self.graphdef = self.ref_params = self.learner = None
    self._pending = None  # (Progress, RolloutStats, Timing, device metrics) of a step: its row, once fetched.
    self._last_row = {}
    self._warned_uniform = False
    self._failed_reward_steps = 0  # Consecutive steps whose every sample's reward failed (`_check_rewards`).
    self._redo_eval = False  # The restored step's evaluation row is missing: `loop` evaluates it again.

  @property
  def _carries_rollouts(self) -> bool:
    """Whether rollouts in flight are run state (partial rollouts, or generation ahead of the learner)."""
    return self.collector.carries_rollouts

  # -- run directory ---------------------------------------------------------------------------------------------

  def _resolved_config(self, base_dir: str) -> dict:
    derived = dict(self.member.to_json(), num_params=self.exp.model_cfg.num_params(),
                   trainable_params=self.exp.trainable_params(), base_policy=base_dir)
    return dict(config=_json_config(self.config), derived=derived)

  def check_workdir(self) -> None:
    """Refuses to resume a workdir whose saved config differs from this one (before anything is written)."""
    saved = rundir.read_config(self.workdir)
    if saved is None:
      return
    diffs = rundir.config_diff(saved["config"], _json_config(self.config))
    if diffs:
      raise ValueError(f"{self.workdir} holds a run with a different config ({'; '.join(diffs)}). Use a new "
                       "--workdir for a new configuration, or rerun with the saved config to resume.")

  # -- one step --------------------------------------------------------------------------------------------------

  def _train_step(self, state: dict, step: int):
    """Collect, prepare, update. Returns (state, the step's `RolloutStats`, its `step_row.Timing`, device metrics)."""
    learner, start, compiled = self.learner, time.time(), compile_clock.seconds()
    rollouts, stats = self.collector.collect(self.graphdef, state["params"], step)
    self._flush()  # The previous step's metrics: computed by now, fetched one step late.
    t0 = time.time()
    replicated = sharding.replicated(self.exp.mesh)
    orders = learner.orders(step, self.member.batch_size)
    kl_coef, orders = transfer.to_device("kl_orders", (np.float32(self.kl.coef), orders),
                                         (replicated, [replicated] * len(orders)))
    with jax.set_mesh(self.exp.mesh):
      batch, prepared = learner.prepare(state, rollouts, self._reference(state), kl_coef)
      state, out = learner.train(state, batch, orders, step, kl_coef)
    state = jax.block_until_ready(state)
    actor_updates = max(step - self.algo.critic_warmup_steps, 0) * self.member.updates_per_step
    update_s, overlap_frac = time.time() - t0, None
    if isinstance(self.collector, AsyncCollector):
      # Generation (of a later step) and the update ran at once for this share of the step's wall time.
      step_s = time.time() - start
      busy = stats.rollout_s + stats.reward_s + update_s
      overlap_frac = min(max((busy - step_s) / step_s, 0.0), 1.0)
    timing = step_row.Timing(update_s=update_s, lr=self.optimizer.lr_at(actor_updates), kl_coef=self.kl.coef,
                             compile_s=compile_clock.seconds() - compiled, overlap_frac=overlap_frac)
    # prepare's figures over the update's: its logp_gap_mean (trainer log-probs recomputed) over the first update's.
    return state, stats, timing, dict(out, **prepared)

  def _flush(self) -> None:
    """Fetches the pending step's metrics (if any), checks them and writes its row."""
    if self._pending is None:
      return
    counters, stats, timing, device = self._pending
    self._pending = None
    out = transfer.to_host("metrics", device)
    checked = [out["loss"]] + ([out["grad_norm"]] if "grad_norm" in out else [])
    if not all(np.isfinite(checked)):
      raise FloatingPointError(
          f"Non-finite loss ({out['loss']}) or gradient norm ({out.get('grad_norm')}) at step {counters.step}. "
          + self._nan_advice())
    out = {k: float(v) for k, v in out.items()}
    update = step_row.UpdateMetrics.from_fetched(out, self.member.updates_per_step)
    noise = step_row.Noise.of(self.noise_scale.row(out, self.member.group_size, self.algo.noise_split))
    row = step_row.training_row(counters, stats, timing, noise, update)
    self.kl.update(update.kl, stats.trained_samples)
    self._warn_if_uniform(row)
    self.metrics.write(row)
    self._last_row = row

  def _flush_after_error(self) -> None:
    """Writes the last completed step's row (fetched one step late) when a later step fails, so that the run
    directory shows how far the run got; a failure to fetch it is logged, not raised over the first error."""
    try:
      self._flush()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("The row of the last completed step could not be written: %s", e)

  def _warn_if_uniform(self, row: dict) -> None:
    """Warns, once per process, when the policy's mean token entropy is within 5% of ln V (V = vocabulary rows): a
    policy collapsed to uniform, which samples noise and rarely recovers; a learning rate far too high does this."""
    max_entropy = math.log(self.exp.model_cfg.vocab_size)
    if self._warned_uniform or row.get("entropy") is None or row["entropy"] < 0.95 * max_entropy:
      return
    self._warned_uniform = True
    logging.warning(
        "Step %d: the policy's token entropy %.3f nats is %.0f%% of ln V = %.3f, the entropy of a uniform policy: it "
        "has collapsed and samples noise (lr %.3g). Such a run rarely recovers: stop it, and branch it from a "
        "checkpoint before the collapse (launch.train --branch_from, --branch_step) or start a new --workdir, with "
        "a lower optim.base_lr (or optim.lr) or a tighter optim.grad_clip.", row["step"], row["entropy"],
        100 * row["entropy"] / max_entropy, max_entropy, row["lr"])

  def _check_rewards(self, stats, step: int) -> None:
    """Stops the run (RuntimeError) at the `task.max_failed_reward_steps`-th consecutive step in which the reward
    function raised, returned a non-finite value or timed out on every sample: such steps learn nothing, and a run
    that went on would end with exit 0 and accuracy 0."""
    failed = 0 < stats.samples_generated <= stats.reward_errors + stats.reward_timeouts
    self._failed_reward_steps = self._failed_reward_steps + 1 if failed else 0
    limit = self.config.task.max_failed_reward_steps
    if not limit or self._failed_reward_steps < limit:
      return
    reward = self.exp.task.reward
    name = f"{getattr(reward, '__module__', '')}.{getattr(reward, '__qualname__', repr(reward))}"
    raise RuntimeError(
        f"The reward function {name} failed on every sample of {self._failed_reward_steps} consecutive steps, so "
        f"they learned nothing (step {step}: {stats.reward_errors} of {stats.samples_generated} raised or returned a "
        f"non-finite value, {stats.reward_timeouts} ran past task.reward_timeout_s); stopped at "
        f"task.max_failed_reward_steps={limit}. Each step's first error is logged above ('Step k: the reward "
        "function ...'). Fix the reward function, then rerun the same command: the run resumes from its last "
        "checkpoint (saved rows and checkpoints are kept). task.max_failed_reward_steps=0 never stops.")

  def _nan_advice(self) -> str:
    latest = self.checkpointer.latest_step()
    if latest is None:
      return ("Stopped before saving: there is no checkpoint yet. A rerun here repeats the same steps; start a new "
              "--workdir with a lower optim.base_lr or a tighter optim.grad_clip.")
    return (f"Stopped before saving: the last checkpoint in {self.checkpointer.directory} (step {latest}) holds "
            "finite state. A rerun here repeats the same steps (this directory's config is fixed); to train on from "
            f"step {latest} with a change, branch it into a new directory: python -m launch.train --config=<this "
            f"config> --workdir=<new dir> --branch_from={self.workdir} --config.optim.base_lr=<lower> (or "
            "--config.optim.grad_clip=<tighter>).")

  # -- the loop --------------------------------------------------------------------------------------------------

  def _reference(self, state: dict):
    """The frozen reference policy of the KL term (None without one): the base policy, held since the start, or
    with adapters the policy without their updates (`lora.base_policy`: the same base arrays)."""
    if not self.algo.use_kl or self.exp.lora is None:
      return self.ref_params
    return lora_lib.base_policy(state["params"])

  def start(self, signals: StopSignals | None = None) -> tuple[dict, dict]:
    """Opens the run: checks and writes the run directory, loads the base policy, restores the latest checkpoint.
    Returns (state, progress dict: step, samples, samples_generated, wall_s, kl_coef). A signal in `signals` stops
    a warm start in training (`sft.StoppedInWarmStart`)."""
    exp, algo = self.exp, self.algo
    exp.log_layout()
    logging.info("%s", self.member.describe())
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise FileExistsError(f"--workdir {self.workdir} is a file, not a directory: give a directory path.")
    os.makedirs(self.workdir, exist_ok=True)
    self.lock.acquire()
    self.check_workdir()
    seeding = branch.pending(self.branch_from, self.workdir)
    if not seeding:  # A branch's seeding replaces whatever an interrupted seeding left.
      rundir.check_resumable(self.workdir)
    stop_signal = None if signals is None else lambda: signals.received
    with transfer.scope("base_policy"):  # The warm start (trained or restored) moves whole trees.
      self.graphdef, base_params, base_dir = sft.load_or_train(exp, stop_signal=stop_signal)
    self.graphdef, policy = exp.policy(self.graphdef, base_params, streams.adapter_seed(self.config.seed))
    parts, state = step_builder.build(exp, self.graphdef, policy, (self.optimizer, self.critic_optimizer))
    self.learner, self.ref_params = parts.learner, parts.reference_policy(base_params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    if seeding:
      with transfer.scope("restore"):
        branch.seed(self.branch_from, self.workdir, abstract, self._carries_rollouts,
                    self._resolved_config(base_dir))
    self.checkpointer = Checkpointer(rundir.checkpoints_dir(self.workdir))
    progress = dict(step=0, samples=0, samples_generated=0, wall_s=0.0, kl_coef=algo.kl_coef)
    if self.checkpointer.latest_step() is not None:
      with transfer.scope("restore"):
        problem = lambda restored: None if bool(all_finite(restored)) else "non-finite parameters or optimizer state"
        state, meta = self.checkpointer.restore_usable(abstract, problem)
      if self._carries_rollouts:
        self.collector.load_state_dict(meta.pop("rollouts"))
      progress.update(meta)
      self.metrics.truncate_after(progress["step"])
      self.samples_log.truncate_after(progress["step"])
      logging.info("Resuming from step %d (%d samples, %.0fs) in %s.", progress["step"], progress["samples"],
                   progress["wall_s"], self.workdir)
      self._redo_eval = self._check_log(progress["step"], progress["samples"])
    else:
      self.metrics.truncate_after(-1)  # Rows of an attempt that died before its first checkpoint.
      self.samples_log.truncate_after(-1)
      rundir.write_config(self.workdir, self._resolved_config(base_dir))
    self.kl = KLController(progress["kl_coef"], algo.kl_target, algo.kl_horizon)
    return state, progress

  def _evaluates_at(self, previous: int | None, samples: int) -> bool:
    """Whether the step that took the run from `previous` samples (None: not known) to `samples` ends with an
    evaluation: each config.eval_every_samples crossed, and the last step."""
    crossed = previous is not None and _crossed(previous, samples, self.config.eval_every_samples)
    return crossed or samples >= self.member.sample_budget

  def _check_log(self, step: int, samples: int) -> bool:
    """Checks metrics.jsonl's rows against the checkpoint of `step` the run resumes from: rows are written before
    their step's checkpoint, but a file cut short (a host crash, a copy) loses rows at or before it. Warns, naming
    them, of the training and evaluation rows that cannot be redone. Returns whether the evaluation row of `step` is
    missing: it is redone from the restored state, the state that evaluation was made from."""
    rows = self.metrics.read()
    trained = {r["step"]: r["samples"] for r in rows if "reward_mean" in r}
    evaluated = {r["step"] for r in rows if "eval_accuracy" in r}
    last = max(trained, default=0)
    path, cause = self.metrics.log.path, "torn, or the file was cut short"
    if last < step:
      span = f"step {step}" if last + 1 == step else f"steps {last + 1} to {step}"
      logging.warning("%s lacks the training rows of %s (%s). They cannot be redone: the checkpoint of step %d that "
                      "the run resumes from holds the state after them, and a step's rollouts are not saved (nor can "
                      "an evaluation row of those steps). The log goes on without them.", path, span, cause, step)
    previous = lambda s: 0 if s == 1 else trained.get(s - 1)
    lost = [s for s in ([0] if step else []) + ([last] if 0 < last < step else [])
            if s not in evaluated and (s == 0 or self._evaluates_at(previous(s), trained[s]))]
    if lost:
      logging.warning("%s lacks the evaluation rows of steps %s (%s). They cannot be redone: the checkpoint of step "
                      "%d that the run resumes from holds a later state. The log goes on without them.", path,
                      ", ".join(map(str, lost)), cause, step)
    missing = step > 0 and step not in evaluated and self._evaluates_at(previous(step), samples)
    if missing:
      logging.warning("%s lacks the evaluation row of step %d (%s): evaluating the restored state of step %d again, "
                      "the state that evaluation was made from.", path, step, cause, step)
    return missing

  def run(self) -> dict:
    """Trains to `sample_budget`; returns the last training row and the final eval accuracy. Raises `Stopped`
    after saving a checkpoint when SIGTERM or SIGINT arrives (`runtime.preemption`), WorkdirBusy when another
    process holds the workdir, DiskFull when a write finds no room (saying where a rerun resumes)."""
    try:
      # Also while a pending save completes: a first signal cannot abandon it. The writers close on any exit.
      with StopSignals() as signals, self.metrics:
        state, progress = self.start(signals)
        try:
          return self.loop(state, progress, signals)
        except Exception:
          self._flush_after_error()
          raise
        finally:
          if isinstance(self.collector, AsyncCollector | ResharedCollector):
            self.collector.close()
          self.exp.scorer.close()
          self.checkpointer.close()  # Also on errors: a pending asynchronous save completes.
    except Exception as e:
      if not disk_space.is_full(e):
        raise
      raise disk_space.DiskFull.from_error(e, self._resumes_from()) from e
    finally:
      self.lock.release()

  def _resumes_from(self) -> str:
    """What a rerun of this run does, from the checkpoints on disk."""
    steps = saved_steps(rundir.checkpoints_dir(self.workdir))
    return (f"the run resumes from its checkpoint of step {steps[-1]}" if steps
            else "the run starts again from step 0 (there is no checkpoint yet)")

  def _evaluate(self, params) -> dict:
    """{eval_accuracy, eval_reward_errors} of `params` (`train.evaluation.evaluate`)."""
    with transfer.scope("eval"):
      return evaluation.evaluate(self.exp, self.graphdef, compute_copy(params, self.exp.model_cfg.compute_dtype))

  def _log_progress(self, counters: step_row.Progress, stats, eval_acc: float | None, step_s: float) -> None:
    """The progress line: samples, reward, held-out accuracy, response length, seconds per step, ETA, a sample."""
    m, samples, examples = self.member, counters.samples, stats.examples
    steps_left = math.ceil(max(m.sample_budget - samples, 0) / m.batch_size)
    logging.info("step %d | samples %d/%d (%.0f%%) | reward %.3f | eval %s | len %.1f | %.2fs/step | ETA %s%s",
                 counters.step, samples, m.sample_budget, 100 * samples / m.sample_budget, stats.reward_mean,
                 "-" if eval_acc is None else f"{eval_acc:.3f}", stats.response_len_mean, step_s,
                 _format_eta(step_s * steps_left), _format_example(examples[0]) if examples else "")

  def _save(self, state: dict, meta: dict) -> None:
    """A checkpoint of `state` with `meta` (progress; the rollouts in flight where they are run state), refused
    when the state is not finite."""
    with transfer.scope("checkpoint"):
      if self._carries_rollouts:
        meta["rollouts"] = self.collector.state_dict()  # The sequences or batches in flight: run state.
      if not bool(all_finite(state)):
        raise FloatingPointError(f"The parameters or optimizer state became non-finite at step {meta['step']}. "
                                 + self._nan_advice())
      self.checkpointer.save(meta["step"], state, meta)

  def loop(self, state: dict, progress: dict, signals: StopSignals | None = None) -> dict:
    """Steps from `progress` (see `start`) to the sample budget, or until `signals` asks to stop."""
    c, exp, m = self.config, self.exp, self.member
    step, samples, generated = progress["step"], progress["samples"], progress["samples_generated"]
    start = time.time()
    wall = lambda: progress["wall_s"] + time.time() - start
    eval_acc = next((r["eval_accuracy"] for r in reversed(self.metrics.read()) if "eval_accuracy" in r), None)
    if step == 0 or self._redo_eval:
      held_out = step_row.HeldOut(**self._evaluate(state["params"]))
      eval_acc = held_out.eval_accuracy
      self.metrics.write(step_row.eval_row(step, samples, wall(), held_out))
      logging.info("Step %d: held-out greedy accuracy %.3f (%s).", step, eval_acc,
                   "redone" if step else "base policy")
    first_step, idle = step, 0
    stop_at = c.stop_at_accuracy
    reached = lambda acc: rundir.reached_accuracy(acc, stop_at)
    while samples < m.sample_budget and not reached(eval_acc):
      state, stats, timing, device_metrics = self._train_step(state, step)
      trained = stats.trained_samples
      idle = idle + 1 if trained == 0 else 0
      if idle >= MAX_IDLE_STEPS:
        raise RuntimeError(f"No rollout entered the loss for {idle} steps (rl.overlong='mask' and every response "
                           f"was truncated at {exp.response_len} tokens): raise extra_response_tokens / the task's "
                           "response budget, or use rl.overlong='penalty'.")
      step, previous, samples = step + 1, samples, samples + trained
      generated += stats.samples_generated
      if c.log_samples_every_steps > 0 and step % c.log_samples_every_steps == 0:
        self.samples_log.write(step, samples, stats.examples)
      counters = step_row.Progress(step=step, samples=samples, samples_generated=generated, wall_s=wall(),
                                   cold=step == first_step + 1)
      self._pending = (counters, stats, timing, device_metrics)
      self._check_rewards(stats, step)
      done = samples >= m.sample_budget
      stop = signals is not None and signals.should_stop(step)
      evaluate = self._evaluates_at(previous, samples)
      save = _crossed(previous, samples, c.checkpoint_every_samples) or done or stop
      if evaluate or save or self.kl.target > 0:
        self._flush()
      if evaluate:
        held_out = step_row.HeldOut(**self._evaluate(state["params"]))
        eval_acc = held_out.eval_accuracy
        self.metrics.write(step_row.eval_row(step, samples, wall(), held_out))
        done = save = done or save or reached(eval_acc)
      if step % c.log_every_steps == 0 or done:
        self._log_progress(counters, stats, eval_acc, (time.time() - start) / (step - first_step))
      if save:
        self._save(state, dict(step=step, samples=samples, samples_generated=generated, wall_s=wall(),
                               kl_coef=self.kl.coef))
      if stop and not done:
        raise Stopped(signals.signum, step, self.checkpointer.directory)
    self._flush()
    logging.info("Done: %d steps, %d samples (%d generated), final held-out accuracy %s%s.", step, samples, generated,
                 eval_acc, f" (stop_at_accuracy={stop_at} reached)" if reached(eval_acc) else "")
    return dict(self._last_row, eval_accuracy=eval_acc)

