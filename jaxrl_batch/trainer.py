"""The RL loop: rollouts -> rewards -> advantages -> GRPO/PPO updates, with evaluation, checkpoints and metrics.

No algorithm math lives here. Every step's prompts and sampling randomness are functions of (seed, step), so the
data position and RNG state of a run are its step count: a resumed run replays exactly.
"""
import dataclasses
import json
import logging
import math
import os
import time

import jax
import ml_collections
import numpy as np

from jaxrl_batch import sft
from jaxrl_batch.checkpointing import Checkpointer
from jaxrl_batch.collect import Collector
from jaxrl_batch.distributed import is_main_process
from jaxrl_batch.evaluation import eval_accuracy
from jaxrl_batch.experiment import Experiment
from jaxrl_batch.metrics import MetricsLog
from jaxrl_batch.optim import make_optimizer
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.critic import init_critic
from jaxrl_batch.rl.kl_control import KLController
from jaxrl_batch.rl.learner import Learner
from jaxrl_batch.rl.noise_scale import NoiseScale
from jaxrl_batch.rl.update import Models

# Fields that may change when a run resumes; any other difference from workdir/config.json is refused.
RESUMABLE_FIELDS = ("log_every_steps", "eval_every_samples", "checkpoint_every_samples", "sft")


def config_diff(saved: dict, new: dict, prefix: str = "") -> list[str]:
  """Dotted names of fields whose values differ between two config dicts (ignoring RESUMABLE_FIELDS)."""
  diffs = []
  for key in sorted(set(saved) | set(new)):
    name = prefix + key
    if not prefix and key in RESUMABLE_FIELDS:
      continue
    a, b = saved.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += config_diff(a, b, name + ".")
    elif json.dumps(a) != json.dumps(b):
      diffs.append(f"{name}: {a!r} -> {b!r}")
  return diffs


def _json_config(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json())


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


MAX_IDLE_STEPS = 20  # Consecutive steps without a trained rollout before the run stops with an error.

# Update metrics copied into metrics.jsonl rows (those of the actor are absent during the critic warm-up).
METRIC_KEYS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean",
               "grad_norm", "value_loss", "critic_grad_norm", "updates")


class Trainer:
  """Runs one member of a batch family to its sample budget in `workdir` (resuming if it holds a checkpoint)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.exp = Experiment.create(config, devices=devices)
    c = config
    self.algo = AlgoConfig.from_config(c)
    if self.algo.loss_agg == "constant" and not self.algo.loss_agg_constant:
      self.algo = dataclasses.replace(self.algo, loss_agg_constant=float(self.exp.response_len))
    self.num_prompts = c.batch_size // c.group_size
    self.total_steps = math.ceil(c.sample_budget / c.batch_size)  # Exact unless rows are dropped from the loss.
    updates = self.algo.updates_per_step
    self.optimizer = make_optimizer(c.optim, c.batch_size, c.sample_budget, updates)
    self.critic_optimizer = (make_optimizer(c.critic.optim, c.batch_size, c.sample_budget, updates)
                             if self.algo.critic else None)
    self.mini_batch_size = c.batch_size // self.algo.mini_batches
    self.num_micro = self.mini_batch_size // (c.micro_batch_size or self.mini_batch_size)
    self.noise_scale = NoiseScale()  # Restarts on resume: an EMA, not part of the training state.
    self.metrics = MetricsLog(os.path.join(self.workdir, "metrics.jsonl"))
    self.collector = Collector(self.exp, self.algo, self.num_prompts, c.group_size, c.seed)

  # -- run directory ---------------------------------------------------------------------------------------------

  def _resolved_config(self, base_dir: str) -> dict:
    derived = dict(num_prompts=self.num_prompts, total_steps=self.total_steps,
                   lr=self.optimizer.lr.lr, lr_derivation=self.optimizer.lr.describe(),
                   lr_overridden=self.optimizer.lr.overridden, adam_b1_b2_eps=self.optimizer.adam,
                   num_params=self.exp.model_cfg.num_params(), base_policy=base_dir)
    if self.critic_optimizer:
      derived.update(critic_lr=self.critic_optimizer.lr.lr, critic_lr_derivation=self.critic_optimizer.lr.describe())
    return dict(config=_json_config(self.config), derived=derived)

  def check_workdir(self) -> None:
    """Refuses to resume a workdir whose saved config differs from this one (before anything is written)."""
    path = os.path.join(self.workdir, "config.json")
    if not os.path.exists(path):
      return
    with open(path) as f:
      saved = json.load(f)["config"]
    diffs = config_diff(saved, _json_config(self.config))
    if diffs:
      raise ValueError(f"{self.workdir} holds a run with a different config ({'; '.join(diffs)}). Use a new "
                       "--workdir for a new configuration, or rerun with the saved config to resume.")

  # -- one step --------------------------------------------------------------------------------------------------

  def _train_step(self, state: dict, step: int):
    """Collect, prepare, update. Returns (state, metrics row without step/samples/wall_s, trained samples)."""
    rollouts, row = self.collector.collect(self.graphdef, state["params"], step)
    t0 = time.time()
    kl_coef = self.kl.coef
    with jax.set_mesh(self.exp.mesh):
      batch, stats = self.learner.prepare(state, rollouts, self.ref_params, kl_coef)
      actor_updates = max(step - self.algo.critic_warmup_steps, 0) * self.algo.updates_per_step
      lr = float(self.optimizer.schedule(actor_updates))
      state, out = self.learner.train(state, batch, step, kl_coef)
    row["update_s"] = time.time() - t0
    checked = [out["loss"]] + ([out["grad_norm"]] if "grad_norm" in out else [])
    if not all(np.isfinite(checked)):
      raise FloatingPointError(
          f"Non-finite loss ({out['loss']}) or gradient norm ({out.get('grad_norm')}) at step {step + 1}; stopping "
          f"before saving, so the last checkpoint in {self.checkpointer.directory} (step "
          f"{self.checkpointer.latest_step()}) is intact. Lower optim.base_lr / set optim.grad_clip, then rerun.")
    row.update(stats, lr=lr, kl_coef=kl_coef, noise_scale=self._noise_scale(out))
    row.update({k: out[k] for k in METRIC_KEYS if k in out})
    row.setdefault("kl", 0.0)
    row.setdefault("logp_gap_mean", out.get("logp_gap"))  # Sampler vs trainer, before this step's updates.
    self.kl.update(row["kl"], row["trained_samples"])
    return state, row, row.pop("trained_samples")

  def _noise_scale(self, out) -> float | None:
    """B_simple in rollouts (EMA over steps); None without micro-batching (it needs two batch sizes) or while the
    actor is frozen."""
    if self.num_micro < 2 or "grad_sq" not in out:
      return None
    b = self.mini_batch_size
    return self.noise_scale.update(out["micro_grad_sq"], out["grad_sq"], b // self.num_micro, b)

  # -- the loop --------------------------------------------------------------------------------------------------

  def _initial_state(self, base_params) -> dict:
    exp = self.exp
    state, critic_graphdef = dict(params=base_params), None
    if self.algo.critic:
      critic_graphdef, state["critic"] = init_critic(exp.model_cfg, base_params, self.algo.share_backbone,
                                                     self.algo.critic_layers, exp.mesh, self.config.sharding_rules)
    with jax.set_mesh(exp.mesh):
      state["opt_state"] = self.optimizer.tx.init(base_params)
      if self.algo.critic:
        state["critic_opt_state"] = self.critic_optimizer.tx.init(state["critic"])
    models = Models(self.graphdef, self.optimizer.tx, critic_graphdef,
                    self.critic_optimizer.tx if self.critic_optimizer else None)
    self.learner = Learner(self.algo, models, group_size=self.config.group_size,
                           micro_batch_size=self.config.micro_batch_size, seed=self.config.seed,
                           shard_batch=exp.shard_batch)
    return state

  def run(self) -> dict:
    """Trains to `sample_budget`; returns the last training row and the final eval accuracy."""
    c, exp, algo = self.config, self.exp, self.algo
    exp.log_layout()
    logging.info("%s: %d prompts x %d samples = %d rollouts per step, %d epoch(s) x %d mini-batch(es); about %d "
                 "steps for %d samples. %s", algo.algo.upper(), self.num_prompts, c.group_size, c.batch_size,
                 algo.epochs, algo.mini_batches, self.total_steps, c.sample_budget, self.optimizer.lr.describe())
    self.check_workdir()
    os.makedirs(self.workdir, exist_ok=True)
    self.graphdef, base_params, base_dir = sft.load_or_train(exp)
    # The reference policy is held only when a KL term exists.
    self.ref_params = jax.tree.map(lambda x: x.copy(), base_params) if algo.use_kl else None
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"))
    state = self._initial_state(base_params)
    progress = dict(step=0, samples=0, samples_generated=0, wall_s=0.0, kl_coef=algo.kl_coef)
    if self.checkpointer.latest_step() is not None:
      state, meta = self.checkpointer.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=x.sharding), state))
      progress.update(meta)
      self.metrics.truncate_after(progress["step"])
      logging.info("Resuming from step %d (%d samples, %.0fs) in %s.", progress["step"], progress["samples"],
                   progress["wall_s"], self.workdir)
    else:
      self.metrics.truncate_after(-1)  # Rows of an attempt that died before its first checkpoint.
      if is_main_process():  # Written whole, then renamed: other processes may be reading it (check_workdir).
        tmp = os.path.join(self.workdir, "config.json.tmp")
        with open(tmp, "w") as f:
          json.dump(self._resolved_config(base_dir), f, indent=2)
        os.replace(tmp, os.path.join(self.workdir, "config.json"))
    self.kl = KLController(progress["kl_coef"], algo.kl_target, algo.kl_horizon)
    try:
      return self._loop(state, progress)
    finally:
      self.checkpointer.close()  # Also on errors and Ctrl-C: pending asynchronous saves complete.

  def _loop(self, state: dict, progress: dict) -> dict:
    c, exp = self.config, self.exp
    step, samples, generated = progress["step"], progress["samples"], progress["samples_generated"]
    start = time.time()
    wall = lambda: progress["wall_s"] + time.time() - start
    eval_acc = next((r["eval_accuracy"] for r in reversed(self.metrics.read()) if "eval_accuracy" in r), None)
    if step == 0:
      eval_acc = eval_accuracy(exp, self.graphdef, state["params"])
      self.metrics.write(dict(step=0, samples=0, wall_s=wall(), eval_accuracy=eval_acc))
      logging.info("Step 0: held-out greedy accuracy %.3f (base policy).", eval_acc)
    first_step, row, idle = step, {}, 0
    while samples < c.sample_budget:
      state, row, trained = self._train_step(state, step)
      idle = idle + 1 if trained == 0 else 0
      if idle >= MAX_IDLE_STEPS:
        raise RuntimeError(f"No rollout entered the loss for {idle} steps (rl.overlong='mask' and every response "
                           f"was truncated at {exp.response_len} tokens): raise extra_response_tokens / the task's "
                           "response budget, or use rl.overlong='penalty'.")
      step, previous, samples = step + 1, samples, samples + trained
      generated += row.pop("samples_generated")
      row = dict(step=step, samples=samples, samples_generated=generated, wall_s=wall(), cold=step == first_step + 1,
                 **row)
      self.metrics.write(row)
      crossed = lambda every: every > 0 and samples // every > previous // every
      done = samples >= c.sample_budget
      if crossed(c.eval_every_samples) or done:
        eval_acc = eval_accuracy(exp, self.graphdef, state["params"])
        self.metrics.write(dict(step=step, samples=samples, wall_s=wall(), eval_accuracy=eval_acc))
      if step % c.log_every_steps == 0 or done:
        rate = (time.time() - start) / (step - first_step)
        steps_left = math.ceil(max(c.sample_budget - samples, 0) / c.batch_size)
        logging.info("step %d | samples %d/%d (%.0f%%) | reward %.3f | eval %s | len %.1f | %.2fs/step | ETA %s",
                     step, samples, c.sample_budget, 100 * samples / c.sample_budget, row["reward_mean"],
                     "-" if eval_acc is None else f"{eval_acc:.3f}", row["response_len_mean"], rate,
                     _format_eta(rate * steps_left))
      if crossed(c.checkpoint_every_samples) or done:
        self.checkpointer.save(step, state, dict(step=step, samples=samples, samples_generated=generated,
                                                 wall_s=wall(), kl_coef=self.kl.coef))
    logging.info("Done: %d steps, %d samples (%d generated), final held-out accuracy %s.", step, samples, generated,
                 eval_acc)
    return dict(row, eval_accuracy=eval_acc)
