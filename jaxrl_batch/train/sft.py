"""Supervised warm start: cross-entropy on formatted (prompt, completion) examples, cached as a base policy.

RL needs a policy that sometimes succeeds; this trains one from scratch on the task's own examples. The result is
cached under a key of everything it depends on (model, task, SFT settings, seed, tokenizer), so every member of a
batch family starts from the same base. In a multi-process run every process takes part in training it (one
global program) and in orbax's save and restore of the cache, which must be on a filesystem every host sees.
"""
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_batch.model import ModelConfig, policy_logprobs
from jaxrl_batch.rl import losses
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.runtime import streams
from jaxrl_batch.runtime.checkpointing import Checkpointer
from jaxrl_batch.runtime.preemption import Stopped
from jaxrl_batch.tasks import SCORING_FIELDS
from jaxrl_batch.train.evaluation import eval_accuracy
from jaxrl_batch.train.setup import Experiment


def sft_arrays(exp: Experiment, problems, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens_BxT, valid_BxT, loss_mask_BxT) with T = prompt_len + response_len; loss on completion + EOS."""
  tokens_BxP, valid_BxP = exp.encode_prompts(problems)
  tok = exp.tokenizer
  answers = [tok.encode(exp.task.sft_example(p, rng)[1]) + [exp.stop_id] for p in problems]
  if max(map(len, answers)) > exp.response_len:
    raise ValueError(f"An SFT completion of {max(map(len, answers))} tokens is longer than the response budget "
                     f"({exp.response_len} tokens); raise task.max_response_tokens (0 = the longest completion) or "
                     "extra_response_tokens.")
  tokens_BxN = np.full((len(problems), exp.response_len), tok.pad_id, np.int32)
  valid_BxN = np.zeros(tokens_BxN.shape, bool)
  for row, ids in enumerate(answers):
    tokens_BxN[row, : len(ids)] = ids
    valid_BxN[row, : len(ids)] = True
  tokens = np.concatenate([tokens_BxP, tokens_BxN], axis=1)
  valid = np.concatenate([valid_BxP, valid_BxN], axis=1)
  loss_mask = np.concatenate([np.zeros_like(valid_BxP), valid_BxN], axis=1)
  return tokens, valid, loss_mask


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "packing"), donate_argnums=(0, 1))
def sft_step(params, opt_state, tokens_BxT, valid_BxT, loss_mask_BxT, *, graphdef, tx,
             packing: packing_lib.Packing | None = None):
  """One Adam step on the mean next-token cross-entropy over `loss_mask` tokens, in one forward or, with
  `packing`, over packed micro-batches (gradients accumulated). Returns (params, opt, loss)."""
  def loss_fn(p, tokens, valid, loss_mask, segment_ids=None, positions=None):  # summed: / the batch's count
    logp = policy_logprobs(graphdef, p, tokens, valid, 1.0, segment_ids, positions)
    return -losses.masked_token_sum_mean(logp, loss_mask, jnp.sum(loss_mask_BxT))

  if packing is None:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BxT, valid_BxT, loss_mask_BxT)
  else:
    plan = packing_lib.plan(valid_BxT, packing=packing)
    segment_ids, positions = plan.segment_ids_MxRxL, plan.positions_MxRxL
    tokens, loss_mask = (packing_lib.pack(plan, x) for x in (tokens_BxT, loss_mask_BxT))

    def accumulate(i, total):
      micro = (tokens[i], segment_ids[i] > 0, loss_mask[i], segment_ids[i], positions[i])
      return jax.tree.map(jnp.add, total, jax.value_and_grad(loss_fn)(params, *micro))

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    loss, grads = jax.lax.fori_loop(0, plan.num_micro, accumulate, zeros)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


# Model settings that change memory or speed, not values: a base policy trained under others is the same policy.
MEMORY_SETTINGS = ("logits_chunk", "remat", "attention", "moe_chunk")
# Model fields the recipes list since every ModelConfig field is in `config.model`, which base-policy keys made before
# did not hold: at their defaults they stay out of the key (a dense model's MoE fields too), so those keys stay valid.
KEY_OMITS_AT_DEFAULT = ("qkv_bias", "qk_norm", "rope_scaling", "mlp_only_layers", "routing_replay")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_d_ff", "norm_topk_prob", "decoder_sparse_step")


def cache_key(exp: Experiment) -> str:
  """Hash of everything the base policy depends on. How rewards are scored (`tasks.SCORING_FIELDS`: timeouts,
  workers, streaming, the failure limit) is not: those fields enter at their defaults, so changing them reuses the
  base (and the keys of caches made before they were left out stay valid)."""
  with open(exp.tokenizer.path, "rb") as f:
    tokenizer_hash = hashlib.sha256(f.read()).hexdigest()
  c = exp.config
  sft = {k: v for k, v in c.sft.items() if k != "cache_dir"}
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  omitted = KEY_OMITS_AT_DEFAULT + (() if c.model.num_experts else MOE_FIELDS)
  model = {k: v for k, v in c.model.items()
           if k not in MEMORY_SETTINGS and not (k in omitted and v == defaults[k])}
  task = {k: SCORING_FIELDS[k] if k in SCORING_FIELDS else v for k, v in c.task.to_dict().items()}
  key = dict(model=model, task=task, sft=sft, seed=c.seed, tokenizer=tokenizer_hash,
             response_len=exp.response_len)
  if exp.chat is not None:  # Only then: the keys of existing caches stay valid.
    key["chat_template"] = dataclasses.asdict(exp.chat)
  blob = json.dumps(key, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def base_dir(exp: Experiment) -> str:
  if not exp.config.sft.cache_dir and jax.process_count() > 1:
    raise ValueError("Several processes save and restore the base policy together: set --config.sft.cache_dir to "
                     "a directory every host sees (the default is under each host's home).")
  root = exp.config.sft.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_batch", "base")
  return os.path.join(root, cache_key(exp))


class StoppedInWarmStart(Stopped):
  """A signal stopped the run in its supervised warm start: at an SFT step boundary, where nothing of the warm start
  is cached yet (the base policy is saved only once trained), or once it was trained and cached in `cached`. Either
  way the run has no step yet."""

  def __init__(self, signum: int, sft_step: int, sft_steps: int, cached: str = ""):
    name = signal.Signals(signum).name
    super().__init__(signum, 0, cached, message=(
        f"Stopped on {name} once the warm start was trained and cached in {cached}, before the run's first "
        "step. Rerun the same command to start from it." if cached else
        f"Stopped on {name} at SFT step {sft_step} of {sft_steps}, before the warm start finished: the base policy "
        "is cached only once trained, so nothing of it was saved, and the run had not started. Rerun the same "
        "command to train the warm start again."))


def train(exp: Experiment, stop_signal=None):
  """Trains the base policy from scratch; returns (graphdef, params, held-out accuracy). `stop_signal()`: the signal
  that asked the run to stop, or None; checked before every SFT step (StoppedInWarmStart)."""
  c = exp.config.sft
  graphdef, params = exp.init_params(streams.init_seed(exp.config.seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(c.steps, c.warmup_steps + 1))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  with jax.set_mesh(exp.mesh):
    opt_state = tx.init(params)
  start = time.time()
  draw = getattr(exp.task, "sft_problems", exp.task.train_problems)  # A task may warm-start on its own mix.
  for step in range(c.steps):
    if stop_signal is not None and stop_signal():
      raise StoppedInWarmStart(stop_signal(), step, c.steps)
    problems = draw(streams.sft_prompt_seed(exp.config.seed), step, c.batch_size)
    batch = exp.shard_batch(sft_arrays(exp, problems, streams.sft_format_rng(exp.config.seed, step)))
    with jax.set_mesh(exp.mesh):
      params, opt_state, loss = sft_step(params, opt_state, *batch, graphdef=graphdef, tx=tx, packing=exp.packing)
    if (step + 1) % max(1, c.steps // 10) == 0 or step + 1 == c.steps:
      logging.info("SFT step %d/%d  loss %.4f  (%.0fs)", step + 1, c.steps, float(loss), time.time() - start)
  accuracy = eval_accuracy(exp, graphdef, params)
  logging.info("SFT done in %.0fs: held-out greedy accuracy %.3f.", time.time() - start, accuracy)
  return graphdef, params, accuracy


def pretrained(exp: Experiment):
  """The base policy read from the Hugging Face directory `config.init_from`, sharded as it loads."""
  from jaxrl_batch.hf.convert import from_pretrained  # The hf extra is needed only with init_from.
  path = exp.config.init_from
  cfg = exp.model_cfg
  _, graphdef, params = from_pretrained(path, mesh=exp.mesh, rules=exp.config.sharding_rules, dtype=cfg.dtype,
                                        param_dtype=cfg.param_dtype)
  logging.info("Base policy: %s (Hugging Face checkpoint, %.2fB parameters).", path, cfg.num_params() / 1e9)
  return graphdef, params, path


def load_or_train(exp: Experiment, directory: str | None = None, stop_signal=None):
  """The cached base policy for `exp` (training and caching it first if absent): (graphdef, params, path).
  `stop_signal`: see `train`."""
  if exp.config.init_from:
    return pretrained(exp)
  directory = directory or base_dir(exp)
  with _one_trainer(directory):
    return _load_or_train(exp, directory, stop_signal)


@contextlib.contextmanager
def _one_trainer(directory: str):
  """Processes that share a cache train each base policy once: the first holds `<directory>.lock` (flock, released
  by the kernel however its holder exits) while it trains and saves; the others wait for it, then reuse its result.
  A multi-process run's processes train it together instead (one global program), so they take no lock."""
  if jax.process_count() > 1:
    yield
    return
  os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
  fd = os.open(directory + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info("Another process is creating the base policy at %s: waiting for it.", directory)
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # Releases the lock.


def _load_or_train(exp: Experiment, directory: str, stop_signal):
  graphdef, abstract = exp.abstract_params()
  ckpt = Checkpointer(directory, max_to_keep=1)
  trained = ckpt.latest_step() is None
  try:
    if not trained:
      logging.info("Reusing the cached base policy at %s.", directory)
      params, meta = ckpt.restore(abstract)
      logging.info("Base policy held-out accuracy (at creation): %.3f.", meta["eval_accuracy"])
    else:
      logging.info("No cached base policy at %s: training it first (SFT, %d steps).", directory,
                   exp.config.sft.steps)
      graphdef, params, accuracy = train(exp, stop_signal)
      # In the layout a restore gives (the trainer's outputs may name the same layout otherwise: size-1 mesh axes
      # left out), so that a run holds the same arrays whether it trained its base or found it cached.
      params = jax.device_put(params, jax.tree.map(lambda s: s.sharding, abstract))
      ckpt.save(0, params, dict(eval_accuracy=accuracy, sft=exp.config.sft.to_dict(), tokenizer=exp.tokenizer.path))
  finally:
    ckpt.close()  # The save completes; also when a signal stopped the training.
  if trained and stop_signal is not None and stop_signal():  # It came during the evaluation or the save.
    raise StoppedInWarmStart(stop_signal(), exp.config.sft.steps, exp.config.sft.steps, cached=directory)
  return graphdef, params, directory
