"""Tests for the AdamW builder and its sample-based schedule."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxrl_batch.config import optim
from tests.close import assert_close


def _cfg(**overrides):
  cfg = ml_collections.ConfigDict(dict(
      base_lr=1e-4, base_batch=16, lr_rule="sqrt", lr=0.0, b1=0.9, b2=0.999, eps=1e-8,
      weight_decay=0.0, grad_clip=0.0, warmup_samples=2048, schedule="constant", final_lr_frac=0.1))
  cfg.update(overrides)
  return cfg


def test_sqrt_rule_sets_peak():
  opt = optim.make_optimizer(_cfg(), samples_per_update=64, sample_budget=10_000)
  assert opt.lr.lr == pytest.approx(2e-4)  # 1e-4 * sqrt(64/16)
  assert float(opt.schedule(32)) == pytest.approx(2e-4)  # 2048 samples: warmup done
  assert opt.lr.describe() == "lr=2e-4 (sqrt rule: 1e-4 * sqrt(64/16))"


def test_warmup_is_measured_in_samples():
  small = optim.make_optimizer(_cfg(), samples_per_update=16, sample_budget=10_000)
  large = optim.make_optimizer(_cfg(), samples_per_update=64, sample_budget=10_000)
  # 1024 of 2048 warmup samples: step 64 at B=16, step 16 at B=64 -> half of each member's peak.
  assert float(small.schedule(64)) == pytest.approx(0.5 * 1e-4)
  assert float(large.schedule(16)) == pytest.approx(0.5 * 2e-4)
  # Step 16 at B=16 is only 256 samples: 1/8 of the peak.
  assert float(small.schedule(16)) == pytest.approx(0.125 * 1e-4)
  assert float(small.schedule(0)) == 0.0


def test_cosine_decays_to_final_fraction_at_budget():
  cfg = _cfg(lr_rule="none", warmup_samples=1000, schedule="cosine", final_lr_frac=0.1)
  opt = optim.make_optimizer(cfg, samples_per_update=100, sample_budget=10_000)
  assert float(opt.schedule(10)) == pytest.approx(1e-4)         # 1000 samples: peak
  assert float(opt.schedule(55)) == pytest.approx(0.55 * 1e-4)  # halfway: 0.1 + 0.9 * 0.5
  assert float(opt.schedule(100)) == pytest.approx(0.1 * 1e-4)  # budget reached
  assert float(opt.schedule(200)) == pytest.approx(0.1 * 1e-4)  # held after the budget


def test_explicit_lr_overrides_rule():
  opt = optim.make_optimizer(_cfg(lr=1e-3, warmup_samples=0), samples_per_update=64,
                             sample_budget=10_000)
  assert opt.lr.overridden
  assert float(opt.schedule(0)) == pytest.approx(1e-3)


@pytest.mark.parametrize("overrides, match", [
    (dict(schedule="linear"), r"Unknown schedule 'linear'"),
    (dict(schedule="cosine", warmup_samples=20_000), "sample_budget > warmup_samples"),
    (dict(final_lr_frac=1.5), "final_lr_frac must be in"),
    (dict(grad_clip=-1.0), "grad_clip must be >= 0"),
])
def test_rejects_bad_config(overrides, match):
  with pytest.raises(ValueError, match=match):
    optim.make_optimizer(_cfg(**overrides), samples_per_update=16, sample_budget=10_000)


def _reference_schedule(peak_lr, samples_per_update, warmup_samples, kind, sample_budget, final_lr_frac):
  """The hand-written jnp schedule that the optax schedules replaced, evaluated in samples: the reference."""
  def schedule(step):
    samples = jnp.asarray(step, jnp.float32) * samples_per_update
    warmup = jnp.minimum(samples / warmup_samples, 1.0) if warmup_samples > 0 else 1.0
    if kind == "constant":
      return peak_lr * warmup
    progress = jnp.clip((samples - warmup_samples) / (sample_budget - warmup_samples), 0.0, 1.0)
    cosine = final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return peak_lr * warmup * cosine
  return schedule


# The shipped members (configs/grpo_arith.py): B0 = 128, lr0 = 5e-5, warmup 1024 samples; (32, 4) is B = 32 with
# configs/ppo_arith.py's 2 epochs x 2 mini-batches, 8 samples per update.
SHIPPED_MEMBERS = [(128, 1), (64, 1), (256, 1), (512, 1), (32, 4)]


def _shipped(batch, updates_per_batch, rule, warmup_samples, schedule="constant", sample_budget=49_152):
  cfg = _cfg(base_lr=5e-5, base_batch=128, lr_rule=rule, lr=-1.0, grad_clip=1.0, warmup_samples=warmup_samples,
             schedule=schedule, final_lr_frac=0.1)
  opt = optim.make_optimizer(cfg, batch, sample_budget, updates_per_batch)
  ref = _reference_schedule(opt.lr.lr, batch / updates_per_batch, warmup_samples, schedule, sample_budget, 0.1)
  return opt, ref


@pytest.mark.parametrize("warmup_samples", [1024, 0])
@pytest.mark.parametrize("rule", ["sqrt", "none", "linear", "adam_sde"])
@pytest.mark.parametrize("batch, updates_per_batch", SHIPPED_MEMBERS)
def test_constant_schedule_is_bitwise_the_reference(batch, updates_per_batch, rule, warmup_samples):
  opt, ref = _shipped(batch, updates_per_batch, rule, warmup_samples)
  counts = jnp.arange(51, dtype=jnp.int32)  # optax passes an int32 count.
  expected = np.asarray(jnp.broadcast_to(ref(counts), counts.shape), np.float32)
  for got in (np.float32([opt.schedule(n) for n in range(51)]), jax.jit(opt.schedule)(counts)):
    np.testing.assert_array_equal(np.asarray(jnp.broadcast_to(got, counts.shape), np.float32), expected)


def test_constant_schedule_trains_bitwise_as_the_reference():
  # A rerun or resumed job must see the same parameters: 40 AdamW updates through warmup and beyond.
  opt, ref = _shipped(64, 1, "sqrt", 1024)
  b1, b2, eps = opt.adam
  ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(ref, b1=b1, b2=b2, eps=eps, weight_decay=0.0))
  grads = jax.random.normal(jax.random.key(0), (40, 5))  # Norms around 2: most are clipped.
  paths = []
  for tx in (opt.tx, ref_tx):
    params = jnp.zeros(5)  # Params of the size of one update keep a one-ulp change of the lr visible.
    state, path = tx.init(params), []
    for g in grads:
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      path.append(np.asarray(params))
    paths.append(np.stack(path))
  np.testing.assert_array_equal(paths[0], paths[1])


@pytest.mark.parametrize("warmup_samples", [1024, 0])
@pytest.mark.parametrize("batch, updates_per_batch", SHIPPED_MEMBERS)
def test_cosine_schedule_matches_the_reference(batch, updates_per_batch, warmup_samples):
  opt, ref = _shipped(batch, updates_per_batch, "sqrt", warmup_samples, schedule="cosine")
  counts = jnp.arange(49_152 // batch * updates_per_batch + 10, dtype=jnp.int32)  # Past the budget: held.
  assert_close(jax.jit(opt.schedule)(counts), ref(counts), 2e-6)


def test_cosine_schedule_with_fractional_phases_matches_the_reference():
  # 1000 / 96 warmup and 9000 / 96 decay updates: the phase boundaries fall between updates.
  cfg = _cfg(lr_rule="none", warmup_samples=1000, schedule="cosine")
  opt = optim.make_optimizer(cfg, samples_per_update=96, sample_budget=10_000)
  ref = _reference_schedule(1e-4, 96, 1000, "cosine", 10_000, 0.1)
  counts = jnp.arange(120, dtype=jnp.int32)
  assert_close(opt.schedule(counts), ref(counts), 2e-6)


@pytest.mark.parametrize("schedule, warmup_samples, samples_per_update, updates_per_batch", [
    ("constant", 1024, 128, 1), ("constant", 0, 64, 1), ("constant", 1024, 32, 4), ("constant", 1000, 96, 1),
    ("cosine", 1024, 128, 1), ("cosine", 0, 256, 1), ("cosine", 1024, 32, 4), ("cosine", 1000, 96, 1),
])
def test_lr_at_is_the_schedule_on_the_host(schedule, warmup_samples, samples_per_update, updates_per_batch):
  cfg = _cfg(warmup_samples=warmup_samples, schedule=schedule)
  opt = optim.make_optimizer(cfg, samples_per_update, 10_000, updates_per_batch)
  for n in range(10_000 // samples_per_update * updates_per_batch + 10):
    lr = opt.lr_at(n)
    assert type(lr) is float
    assert lr == pytest.approx(float(opt.schedule(n)), rel=1e-6), n


def _numpy_adamw(params, grads_list, lr, b1, b2, eps, wd):
  m, v = np.zeros_like(params), np.zeros_like(params)
  for t, g in enumerate(grads_list, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    params = params - lr * (update + wd * params)
  return params


def test_adamw_with_clipping_matches_numpy():
  cfg = _cfg(base_lr=0.01, lr_rule="none", b2=0.99, eps=1e-3, weight_decay=0.1, grad_clip=1.0,
             warmup_samples=0)
  tx = optim.make_optimizer(cfg, samples_per_update=16, sample_budget=10_000).tx
  params = jnp.array([1.0, -2.0])
  state = tx.init(params)
  grads = [jnp.array([3.0, 4.0]), jnp.array([0.1, -0.2])]  # norm 5 -> clipped to [0.6, 0.8]; norm 0.22 kept
  after = []
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = params + updates
    after.append(np.asarray(params))
  assert_close(after[0], [0.98901664, -2.00798752], 1e-6)
  assert_close(after[1], [0.98019577, -2.01067554], 1e-6)
  expected = _numpy_adamw(np.array([1.0, -2.0]), [np.array([0.6, 0.8]), np.array([0.1, -0.2])],
                          lr=0.01, b1=0.9, b2=0.99, eps=1e-3, wd=0.1)
  assert_close(after[1], expected, 1e-6)
