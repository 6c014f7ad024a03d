"""Tests for the AdamW builder and its sample-based schedule."""
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxrl_batch import optim


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
  np.testing.assert_allclose(after[0], [0.98901664, -2.00798752], rtol=1e-6)
  np.testing.assert_allclose(after[1], [0.98019577, -2.01067554], rtol=1e-6)
  expected = _numpy_adamw(np.array([1.0, -2.0]), [np.array([0.6, 0.8]), np.array([0.1, -0.2])],
                          lr=0.01, b1=0.9, b2=0.99, eps=1e-3, wd=0.1)
  np.testing.assert_allclose(after[1], expected, rtol=1e-6)
