"""`rollout_mesh.layout='own'` (`train.decode_layout`): colocated generation decodes on a mesh of its own shape over
the learner's devices, from the policy resharded into that mesh's layout once per step (or published in it, a step
ahead), and the run trains as the run that decodes in the trainer's layout does: synchronous, with partial rollouts
and asynchronous."""
import jax
import pytest

from jaxrl_batch.sampling import continuous
from jaxrl_batch.train import collector, placement, rundir
from jaxrl_batch.train.trainer import Trainer
from tests.close import assert_close
from tests.helpers import debug_config

# Fields a row takes from the sampled tokens alone: equal whatever the layout that computed the logits.
FROM_TOKENS = ("step", "samples", "samples_generated", "reward_mean", "reward_std", "response_len_mean",
               "response_len_max", "truncated_frac", "zero_std_group_frac", "useful_token_frac", "eval_accuracy")


def _run(tmp_path, base_cache, monkeypatch, name: str, **overrides):
  """The rows of two steps of the debug member on 4 devices (the trainer's mesh fsdp = 4), and the mesh shapes the
  rollouts' engine read the policy on (the static engine's, or the continuous engine's of partial rollouts)."""
  meshes = []

  def spy(original):
    def spied(graphdef, params, *args, **kwargs):
      meshes.append(dict(jax.tree.leaves(params)[0].sharding.mesh.shape))
      return original(graphdef, params, *args, **kwargs)
    return spied
  monkeypatch.setattr(collector, "sample_round", spy(collector.sample_round))
  monkeypatch.setattr(continuous, "decode", spy(continuous.decode))
  config = debug_config(base_cache, **{"mesh.data": 1, "mesh.fsdp": 4, **overrides})
  config.sample_budget = 2 * config.batch_size
  Trainer(config, str(tmp_path / name), devices=jax.devices()[:4]).run()
  monkeypatch.undo()
  return rundir.read_metrics(str(tmp_path / name)), meshes


@pytest.mark.parametrize("mode,own_slots", [
    ({}, {}),  # synchronous: the policy resharded by one program each step (`reshard_s`)
    # Sequences carried across steps, on 16 slots either way (4 a shard of fsdp 4, 8 of data 2 x tensor 2): where a
    # step cuts them depends on the slots.
    ({"rollout.partial": True, "sampling.engine": "continuous", "sampling.slots": 4}, {"sampling.slots": 8}),
    ({"rl.max_staleness": 1, "rl.old_logp": "trainer", "rl.tis_cap": 2.0}, {}),  # a step ahead: published in its layout
], ids=["synchronous", "partial", "async"])
def test_decoding_in_a_layout_of_its_own_trains_as_in_the_trainers(tmp_path, base_cache, monkeypatch, mode,
                                                                   own_slots):
  own, own_meshes = _run(tmp_path, base_cache, monkeypatch, "own", **{**mode, **own_slots}, **{
      "rollout_mesh.layout": "own", "rollout_mesh.data": 2, "rollout_mesh.fsdp": 1, "rollout_mesh.tensor": 2})
  trainer, trainer_meshes = _run(tmp_path, base_cache, monkeypatch, "trainer", **mode)
  assert trainer_meshes and {m["fsdp"] for m in trainer_meshes} == {4}
  rollouts = [m for m in own_meshes if m["fsdp"] == 1]  # The others: the evaluation's, in the trainer's layout.
  assert len(rollouts) >= 2 and all((m["data"], m["tensor"]) == (2, 2) for m in rollouts)
  assert all(m["fsdp"] == 4 for m in own_meshes if m["fsdp"] != 1)
  assert len(own) == len(trainer) and sum("loss" in r for r in own) == 2
  resharded = "rl.max_staleness" not in mode  # An asynchronous run publishes the policy in the engines' layout.
  for a, b in zip(own, trainer):
    assert set(a) - set(b) == ({"reshard_s"} if "loss" in a and resharded else set())
    assert a["reshard_s"] > 0 if "loss" in a and resharded else True
    assert {k: a[k] for k in FROM_TOKENS if k in a} == {k: b[k] for k in FROM_TOKENS if k in b}
    for k in ("loss", "policy_loss", "entropy", "grad_norm"):
      if k in b:  # Logits computed in another partition: the same values to rounding.
        assert_close(a[k], b[k], rtol=1e-4, err_msg=k)
    if "logp_gap_mean" in b:  # The engine's log-probs are the trainer's to rounding (nats), in either layout.
      assert a["logp_gap_mean"] < 1e-5 and b["logp_gap_mean"] < 1e-5
  trained = [r for r in trainer if "loss" in r]
  assert trained[-1]["reward_mean"] > 0 and trained[-1]["grad_norm"] > 0  # a member that learns


@pytest.mark.parametrize("overrides,message", [
    ({"rollout_mesh.layout": "fast"}, "choose 'trainer'"),
    ({"rollout_mesh.layout": "own", "rollout_mesh.devices": 2, "rl.max_staleness": 1}, "generation elsewhere"),
    ({"rollout_mesh.layout": "own", "rollout_mesh.process_cores": "0", "rl.max_staleness": 1}, "generation elsewhere"),
])
def test_a_layout_that_cannot_apply_is_refused_with_the_reason(overrides, message):
  config = debug_config("/nonexistent", **overrides)
  with pytest.raises(ValueError, match=message):
    placement.own_layout(config)
