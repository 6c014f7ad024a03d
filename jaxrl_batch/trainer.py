"""The RL loop: rollouts -> rewards -> advantages -> GRPO update, with evaluation, checkpoints and metrics.

No algorithm math lives here. Every step's prompts and sampling randomness are functions of (seed, step), so the
data position and RNG state of a run are its step count: a resumed run replays exactly.
"""
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_batch import sft
from jaxrl_batch.checkpointing import Checkpointer
from jaxrl_batch.evaluation import eval_accuracy, safe_rewards
from jaxrl_batch.experiment import Experiment
from jaxrl_batch.metrics import MetricsLog
from jaxrl_batch.optim import make_optimizer
from jaxrl_batch.rl import grpo
from jaxrl_batch.rl.advantages import group_advantages, zero_std_group_frac
from jaxrl_batch.rl.noise_scale import NoiseScale
from jaxrl_batch.sampling import generate

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


class Trainer:
  """Runs one member of a batch family to its sample budget in `workdir` (resuming if it holds a checkpoint)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.exp = Experiment.create(config, devices=devices)
    c = config
    self.num_prompts = c.batch_size // c.group_size
    self.total_steps = math.ceil(c.sample_budget / c.batch_size)
    self.optimizer = make_optimizer(c.optim, c.batch_size, c.sample_budget)
    self.loss_cfg = grpo.GRPOLossConfig(clip_eps=c.grpo.clip_eps, kl_coef=float(c.grpo.kl_coef),
                                        temperature=c.sampling.temperature or 1.0)
    self.num_micro = c.batch_size // (c.micro_batch_size or c.batch_size)
    self.noise_scale = NoiseScale()  # Restarts on resume: an EMA, not part of the training state.
    self.metrics = MetricsLog(os.path.join(self.workdir, "metrics.jsonl"))

  # -- run directory ---------------------------------------------------------------------------------------------

  def _resolved_config(self, base_dir: str) -> dict:
    return dict(config=_json_config(self.config),
                derived=dict(num_prompts=self.num_prompts, total_steps=self.total_steps,
                             lr=self.optimizer.lr.lr, lr_derivation=self.optimizer.lr.describe(),
                             lr_overridden=self.optimizer.lr.overridden, adam_b1_b2_eps=self.optimizer.adam,
                             num_params=self.exp.model_cfg.num_params(),
                             base_policy=base_dir))

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

  def _rollout(self, params, step: int):
    """Samples group_size responses for each of this step's prompts. Returns (rollout, prompts, problems)."""
    c, exp = self.config, self.exp
    problems = exp.task.train_problems(c.seed, step, self.num_prompts)
    tokens, valid = (np.repeat(x, c.group_size, axis=0) for x in exp.encode_prompts(problems))
    tokens, valid = exp.shard_batch((tokens, valid))
    rng = jax.random.fold_in(jax.random.key(c.seed), step)
    with jax.set_mesh(exp.mesh):
      rollout = generate(self.graphdef, params, tokens, valid, rng, max_new_tokens=exp.response_len,
                         eos_id=exp.tokenizer.eos_id, pad_id=exp.tokenizer.pad_id, sampling=exp.sampling)
    return jax.block_until_ready(rollout), (tokens, valid), [p for p in problems for _ in range(c.group_size)]

  def _train_step(self, params, opt_state, step: int):
    c, exp = self.config, self.exp
    t0 = time.time()
    rollout, (tokens, valid), problems = self._rollout(params, step)
    t1 = time.time()
    completions = exp.decode_responses(np.asarray(rollout.tokens_BxN), np.asarray(rollout.mask_BxN))
    rewards_B, errors, first_error = safe_rewards(exp.task, completions, problems)
    if errors:
      logging.warning("Step %d: the reward function raised on %d samples (scored 0); first: %s", step, errors,
                      first_error)
    adv_B = group_advantages(jnp.asarray(rewards_B), c.group_size, c.grpo.normalize_std)
    t2 = time.time()
    with jax.set_mesh(exp.mesh):
      batch = grpo.rollout_batch(tokens, valid, rollout, exp.shard_batch(adv_B))
      if self.ref_params is not None:
        batch = grpo.reference_logprobs(self.ref_params, batch, graphdef=self.graphdef,
                                        temperature=self.loss_cfg.temperature)
      lr = float(self.optimizer.schedule(step))
      params, opt_state, out = grpo.update(params, opt_state, batch, graphdef=self.graphdef,
                                           tx=self.optimizer.tx, cfg=self.loss_cfg, num_micro=self.num_micro)
    out = jax.device_get(out)
    t3 = time.time()
    if not (np.isfinite(out["loss"]) and np.isfinite(out["grad_norm"])):
      raise FloatingPointError(
          f"Non-finite loss ({out['loss']}) or gradient norm ({out['grad_norm']}) at step {step + 1}; stopping "
          f"before saving, so the last checkpoint in {self.checkpointer.directory} (step "
          f"{self.checkpointer.latest_step()}) is intact. Lower optim.base_lr / set optim.grad_clip, then rerun.")
    lengths = np.asarray(rollout.lengths_B)
    row = dict(rollout_s=t1 - t0, reward_s=t2 - t1, update_s=t3 - t2, lr=lr,
               reward_mean=float(rewards_B.mean()), reward_std=float(rewards_B.std()),
               response_len_mean=float(lengths.mean()), truncated_frac=float(np.asarray(rollout.truncated_B).mean()),
               zero_std_group_frac=float(zero_std_group_frac(jnp.asarray(rewards_B), c.group_size)),
               reward_errors=errors, kl=out["kl"], clip_frac=out["clip_frac"], entropy=out["entropy"],
               grad_norm=out["grad_norm"], loss=out["loss"], policy_loss=out["policy_loss"],
               ratio_mean=out["ratio_mean"], logp_gap_mean=out["logp_gap"], noise_scale=self._noise_scale(out))
    return params, opt_state, row

  def _noise_scale(self, out) -> float | None:
    """B_simple in rollouts (EMA over steps); None without micro-batching (it needs two batch sizes)."""
    if self.num_micro < 2:
      return None
    b = self.config.batch_size
    return self.noise_scale.update(float(out["micro_grad_sq"]), float(out["grad_norm"]) ** 2, b // self.num_micro, b)

  # -- the loop --------------------------------------------------------------------------------------------------

  def run(self) -> dict:
    """Trains to `sample_budget`; returns the last training row and the final eval accuracy."""
    c, exp = self.config, self.exp
    exp.log_layout()
    logging.info("GRPO: %d prompts x %d samples = %d rollouts per update; %d steps for %d samples. %s",
                 self.num_prompts, c.group_size, c.batch_size, self.total_steps, c.sample_budget,
                 self.optimizer.lr.describe())
    self.check_workdir()
    os.makedirs(self.workdir, exist_ok=True)
    self.graphdef, base_params, base_dir = sft.load_or_train(exp)
    self.ref_params = jax.tree.map(jnp.copy, base_params) if self.loss_cfg.kl_coef > 0 else None
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"))
    with jax.set_mesh(exp.mesh):
      opt_state = self.optimizer.tx.init(base_params)
    state = dict(params=base_params, opt_state=opt_state)
    if self.checkpointer.latest_step() is not None:
      state, meta = self.checkpointer.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=x.sharding), state))
      step, samples, wall_offset = meta["step"], meta["samples"], meta["wall_s"]
      self.metrics.truncate_after(step)
      logging.info("Resuming from step %d (%d samples, %.0fs) in %s.", step, samples, wall_offset, self.workdir)
    else:
      step, samples, wall_offset = 0, 0, 0.0
      self.metrics.truncate_after(-1)  # Rows of an attempt that died before its first checkpoint.
      with open(os.path.join(self.workdir, "config.json"), "w") as f:
        json.dump(self._resolved_config(base_dir), f, indent=2)
    try:
      return self._loop(state["params"], state["opt_state"], step, samples, wall_offset)
    finally:
      self.checkpointer.close()  # Also on errors and Ctrl-C: pending asynchronous saves complete.

  def _loop(self, params, opt_state, step: int, samples: int, wall_offset: float) -> dict:
    c, exp = self.config, self.exp
    start = time.time()
    wall = lambda: wall_offset + time.time() - start
    eval_acc = next((r["eval_accuracy"] for r in reversed(self.metrics.read()) if "eval_accuracy" in r), None)
    if step == 0:
      eval_acc = eval_accuracy(exp, self.graphdef, params)
      self.metrics.write(dict(step=0, samples=0, wall_s=wall(), eval_accuracy=eval_acc))
      logging.info("Step 0: held-out greedy accuracy %.3f (base policy).", eval_acc)
    first_step, row = step, {}
    while step < self.total_steps:
      params, opt_state, row = self._train_step(params, opt_state, step)
      step, samples = step + 1, samples + c.batch_size
      row = dict(step=step, samples=samples, wall_s=wall(), cold=step == first_step + 1, **row)
      self.metrics.write(row)
      crossed = lambda every: every > 0 and samples // every > (samples - c.batch_size) // every
      if crossed(c.eval_every_samples) or step == self.total_steps:
        eval_acc = eval_accuracy(exp, self.graphdef, params)
        self.metrics.write(dict(step=step, samples=samples, wall_s=wall(), eval_accuracy=eval_acc))
      if step % c.log_every_steps == 0 or step == self.total_steps:
        rate = (time.time() - start) / (step - first_step)
        logging.info("step %d/%d | samples %d/%d (%.0f%%) | reward %.3f | eval %s | len %.1f | %.2fs/step | ETA %s",
                     step, self.total_steps, samples, c.sample_budget, 100 * samples / c.sample_budget,
                     row["reward_mean"], "-" if eval_acc is None else f"{eval_acc:.3f}", row["response_len_mean"],
                     rate, _format_eta(rate * (self.total_steps - step)))
      if crossed(c.checkpoint_every_samples) or step == self.total_steps:
        self.checkpointer.save(step, dict(params=params, opt_state=opt_state),
                               dict(step=step, samples=samples, wall_s=wall()))
    logging.info("Done: %d steps, %d samples, final held-out accuracy %s.", step, samples, eval_acc)
    return dict(row, eval_accuracy=eval_acc)
