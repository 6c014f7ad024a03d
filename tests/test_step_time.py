"""`predict.step_time`: a member's step predicted from its programs compiled for a TPU slice (libtpu's compile-only
devices): the parts add up as the engine's schedule and the loop counts say, and decode being bandwidth-bound at low
concurrency, a 4x larger batch is predicted to train more rollouts per second; `launch.plan_batch --topology`
plans with those predictions."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.predict import decode_layouts, engine_time, lengths, step_time
from jaxrl_batch import aot
from jaxrl_batch.runtime import topologies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, RESPONSE = 32, 32


def _lengths(batch: int, seed: int = 0):
  return np.random.default_rng(seed).integers(1, RESPONSE + 1, batch)


def _config(batch: int, **sampling):
  """tiny_random with one layer (its programs compile in less time; a step's parts and schedule are per program, not
  per layer) at `batch` rollouts, with `sampling` settings."""
  config = grpo_gsm8k_qwen.get_config(f"model=tiny_random,batch={batch}")
  config.model.num_layers = 1
  config.sampling.update(sampling)
  return config


@pytest.mark.slow
def test_the_step_is_its_programs_times_the_engines_schedule(compile_only_tpu):
  compile_only_tpu("v5e:2x2")
  config = _config(16, engine="continuous", slots=2, chunk=4)
  lengths = _lengths(16)
  got = step_time.predict(config, "v5e:2x2", lengths, prompt_len=PROMPT, response_len=RESPONSE)
  schedule = engine_time.continuous(lengths, slots=8, chunk=4, max_new_tokens=RESPONSE, prompt_len=PROMPT,
                                    group_size=4, backend="pallas")
  assert got.schedules == (schedule,) and got.decode_steps == schedule.decode_steps > 0
  assert got.rollout_spread == 1.0  # a topology's published rates: no spread measured
  decode, prefill, update = (got.programs[name].seconds for name in ("decode", "prefill", "update"))
  assert got.rollout.decode_s == pytest.approx(schedule.decode_steps * decode)
  assert got.rollout.prefill_s == pytest.approx(prefill)  # one prefill of the step's 4 prompts
  assert "reference" not in got.programs and got.reference_s == 0.0  # rl.kl_coef = 0
  assert got.update_s == pytest.approx(update * 2)  # 16 rollouts in micro-batches of 8
  assert got.seconds == pytest.approx(got.rollout.seconds + got.score_s + got.update_s)
  assert got.samples_per_s == pytest.approx(16 / got.seconds)


@pytest.mark.slow
def test_a_larger_batch_decodes_more_rows_a_step_at_nearly_the_same_cost(compile_only_tpu):
  """Static engine: the step of 64 rows costs less than 4 steps of 16 (the weights are read once a step)."""
  compile_only_tpu("v5e:2x2")
  small, large = (step_time.predict(_config(b), "v5e:2x2", _lengths(b), prompt_len=PROMPT, response_len=RESPONSE)
                  for b in (16, 64))
  assert large.programs["decode"].seconds < 4 * small.programs["decode"].seconds
  assert large.samples_per_s > small.samples_per_s


@pytest.mark.slow
def test_a_decode_layout_of_its_own_gathers_no_weights_a_step_and_adds_its_reshard(compile_only_tpu):
  """Trained fully sharded (fsdp 4), the model decoded in the trainer's layout gathers its weights in every decode
  step; decoded with the weights whole on each chip (rollout_mesh.layout='own', data 4) it gathers none, and the step
  adds the reshard that lays the policy out, once."""
  compile_only_tpu("v5e:2x2")
  trainer = _config(16, engine="continuous", slots=2, chunk=4)
  trainer.mesh.update(data=1, fsdp=4)
  own = ml_collections.ConfigDict(trainer.to_dict())
  own.rollout_mesh.update(layout="own", data=4)
  drawn = _lengths(16)
  a, b = (step_time.predict(c, "v5e:2x2", drawn, prompt_len=PROMPT, response_len=RESPONSE) for c in (trainer, own))
  assert a.programs["decode"].collective_bytes > 0 and a.reshard_s == 0.0 and "reshard" not in a.programs
  assert b.programs["decode"].collective_bytes == 0 and b.programs["prefill"].collective_bytes == 0
  reshard = b.programs["reshard"]
  assert reshard.collective_bytes > 0 and b.reshard_s == pytest.approx(reshard.running(1, 1)) and b.reshard_s > 0
  assert b.schedules == a.schedules  # 2 slots on each of 4 shards either way
  assert b.update_s == pytest.approx(a.update_s) and b.rollout.decode_s < a.rollout.decode_s
  assert b.seconds == pytest.approx(b.reshard_s + b.rollout.seconds + b.score_s + b.reference_s + b.update_s)
  assert b.to_json()["reshard_s"] == b.reshard_s and a.to_json()["reshard_s"] == 0.0


@pytest.mark.slow
def test_the_plan_compares_every_decode_layout_of_the_chips_and_keeps_the_fastest(compile_only_tpu):
  """Trained with fsdp 4 on 4 chips, a member decodes in the trainer's layout or on data 4, data 2 x tensor 2 or
  tensor 4 (4 heads): each predicted as `predict` predicts it, fastest first; the step returned is the fastest."""
  compile_only_tpu("v5e:2x2")
  config = _config(16, engine="continuous", slots=2, chunk=4)
  config.mesh.update(data=1, fsdp=4)
  drawn = _lengths(16)
  got = step_time.compare_layouts(config, "v5e:2x2", drawn, prompt_len=PROMPT, response_len=RESPONSE)
  mesh = lambda **sizes: dict(dict(data=1, fsdp=1, tensor=1, expert=1), **sizes)
  assert sorted((t.layout, sorted(t.rollout_mesh.items())) for t in got.layouts) == sorted(
      (layout, sorted(m.items())) for layout, m in (("trainer", mesh(fsdp=4)), ("own", mesh(data=4)),
                                                    ("own", mesh(data=2, tensor=2)), ("own", mesh(tensor=4))))
  seconds = [t.seconds for t in got.layouts]
  assert not any(t.refused for t in got.layouts) and seconds == sorted(seconds)
  assert (got.layout, got.rollout_mesh, got.seconds) == (got.layouts[0].layout, got.layouts[0].rollout_mesh,
                                                        seconds[0])
  data4 = step_time.predict(decode_layouts.with_layout(config, "own", data=4), "v5e:2x2", drawn, prompt_len=PROMPT,
                            response_len=RESPONSE)
  entry = next(t for t in got.layouts if t.rollout_mesh == data4.rollout_mesh)
  assert (entry.seconds, entry.reshard_s, entry.rollout_s) == pytest.approx(
      (data4.seconds, data4.reshard_s, data4.rollout.seconds))
  trainer = next(t for t in got.layouts if t.layout == "trainer")
  assert trainer.reshard_s == 0.0 and got.layout == "own" and got.seconds < trainer.seconds
  assert got.to_json()["layouts"][0] == dataclasses.asdict(got.layouts[0])


@pytest.mark.slow
def test_a_generator_on_chips_of_its_own_runs_beside_the_learner_after_the_publish(compile_only_tpu):
  """rollout_mesh.devices = 2 of v5e:2x2 (rl.max_staleness = 1): the learner's programs on 2 chips, the rollout on
  the other 2 beside them; the step is the publish (the policy's bytes a generator chip receives, at the chip's
  link rate one way) and the longer of the two. Its meshes compared: data 2 and tensor 2 of the generator's chips."""
  topology = compile_only_tpu("v5e:2x2")
  config = _config(16, engine="continuous", slots=4, chunk=4)
  config.rl.max_staleness = 1
  config.rollout_mesh.update(devices=2, data=2)
  drawn = _lengths(16)
  got = step_time.predict(config, "v5e:2x2", drawn, prompt_len=PROMPT, response_len=RESPONSE)
  assert got.overlapped and got.rollout_mesh == dict(data=2, fsdp=1, expert=1, tensor=1)
  generator = aot.AbstractStep.build(aot.abstract_experiment(config, topology.devices, PROMPT, RESPONSE),
                                     topology.devices).generation
  sent = aot.per_chip_bytes(generator.sampler_params)
  assert got.publish_s == pytest.approx(sent / (topologies.CHIPS["v5e"].interconnect_bytes_per_s / 2))
  assert got.seconds == pytest.approx(got.publish_s + max(got.rollout.seconds, got.learner_s)) and got.learner_s > 0
  schedule = engine_time.continuous(drawn, slots=8, chunk=4, max_new_tokens=RESPONSE, prompt_len=PROMPT,
                                    group_size=4, backend="pallas")  # 4 slots on each of 2 shards
  assert got.schedules == (schedule,)
  compared = step_time.compare_layouts(config, "v5e:2x2", drawn, prompt_len=PROMPT, response_len=RESPONSE)
  assert sorted(t.rollout_mesh["tensor"] for t in compared.layouts) == [1, 2]
  assert all(t.layout == "trainer" and not t.refused for t in compared.layouts)


@pytest.mark.slow
def test_an_auto_layout_is_the_fastest_predicted_and_a_resumed_run_keeps_its_own(tmp_path, compile_only_tpu):
  """rollout_mesh.layout='auto': `step_time.choose_layout` gives the config in the fastest layout `compare_layouts`
  predicts with every response at the budget; `launch.train` resolves it so (`step_time.run_layout`), or, for a run
  that has a config.json, as the run chose it."""
  compile_only_tpu("v5e:2x2")
  config = _config(16, engine="continuous", slots=2, chunk=4)
  config.mesh.update(data=1, fsdp=4)
  config.rollout_mesh.layout = "auto"
  chosen, layouts = step_time.choose_layout(config, "v5e:2x2", prompt_len=PROMPT, response_len=RESPONSE)
  seconds = [t.seconds for t in layouts]
  assert len(layouts) == 4 and seconds == sorted(seconds) and not any(t.refused for t in layouts)
  assert (chosen.rollout_mesh.layout, chosen.mesh.fsdp) == ("own", 4)
  assert {k: chosen.rollout_mesh[k] for k in layouts[0].rollout_mesh} == layouts[0].rollout_mesh
  assert step_time.choose_layout(chosen, "v5e:2x2", prompt_len=PROMPT, response_len=RESPONSE) == (chosen, ())
  workdir = tmp_path / "run"
  workdir.mkdir()
  saved = ml_collections.ConfigDict(config.to_dict())
  saved.rollout_mesh.update(layout="own", data=2, tensor=2)
  (workdir / "config.json").write_text(json.dumps(dict(config=saved.to_dict(), derived={})))
  assert step_time.run_layout(config, str(workdir)).rollout_mesh.to_dict() == saved.rollout_mesh.to_dict()
  with pytest.raises(ValueError, match="launch.train"):
    step_time.predict(config, "v5e:2x2", _lengths(16), prompt_len=PROMPT, response_len=RESPONSE)


def test_lengths_must_be_one_a_rollout():
  with pytest.raises(ValueError, match="one a rollout"):
    step_time.predict(_config(16), "v5e:2x2", _lengths(8), prompt_len=PROMPT, response_len=RESPONSE)
  with pytest.raises(ValueError, match="one a rollout"):  # prompts' lengths of another shape than the responses'
    step_time.predict(_config(16), "v5e:2x2", _lengths(16), prompt_len=PROMPT, response_len=RESPONSE,
                      prompt_lengths_B=np.full((2, 16), PROMPT))
  with pytest.raises(ValueError, match=r"Prompt lengths must be in \[1, 32\]"):
    step_time.predict(_config(16), "v5e:2x2", _lengths(16), prompt_len=PROMPT, response_len=RESPONSE,
                      prompt_lengths_B=np.full(16, PROMPT + 1))


@pytest.mark.slow
def test_plan_batch_predicts_r_on_a_topology_without_training(tmp_path, compile_only_tpu):
  """`launch.plan_batch --topology --compare_layouts`: rows marked predicted, R = B / the predicted step (in the
  fastest decode layout), the decision rule's factors, the S(B) fit from analysis.json as without it; no run
  directory is made."""
  compile_only_tpu("v5e:2x2")
  analysis = dict(target=0.5, members=[dict(batch=b, rule="sqrt", samples_to_target=s, time_to_target_s=None)
                                       for b, s in ((16, 640), (32, 768))])
  (tmp_path / "analysis.json").write_text(json.dumps(analysis))
  cmd = [sys.executable, "-m", "launch.plan_batch", "--config=configs/grpo_gsm8k_qwen.py:model=tiny_random",
         f"--workdir={tmp_path}", "--topology=v5e:2x2", "--batches=16,32", "--prompt_tokens=32",
         "--response_tokens=32", "--lengths=lognormal:12:0.7", "--set=model.num_layers=1", "--compare_layouts"]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  plan = json.loads((tmp_path / "plan.json").read_text())
  assert plan["sweep"]["topology"] == "v5e:2x2" and plan["s_min"] == pytest.approx(512)  # S = 512 (1 + B / 64)
  rows = {r["batch"]: r for r in plan["rows"]}
  for batch, row in rows.items():
    assert row["predicted"] and row["throughput_samples_per_s"] == pytest.approx(batch / row["step"]["seconds"])
    assert row["step"]["decode_steps"] > 0 and row["step"]["update_s"] > 0 and row["step"]["rollout_spread"] == 1.0
    # --compare_layouts: the recipe's data 4 (the trainer's), data 2 x tensor 2 and tensor 4; planned in the fastest.
    layouts = row["step"]["layouts"]
    assert len(layouts) == 3 and row["step"]["seconds"] == layouts[0]["seconds"] <= layouts[-1]["seconds"]
  assert rows[16]["throughput_gain"] == 1.0 and rows[32]["samples_penalty"] == pytest.approx(768 / 640)
  plan_md = (tmp_path / "plan.md").read_text()
  assert "R(B) predicted for v5e:2x2" in plan_md and "Decode layouts of batch 32, fastest first: " in plan_md
  assert sorted(os.listdir(tmp_path)) == ["analysis.json", "plan.json", "plan.md"]


def test_response_lengths_follow_the_stated_distribution_within_the_budget():
  drawn = lengths.response_lengths("lognormal:100:0.5", 20_000, 1024, seed=3)
  assert drawn.dtype == np.int64 and drawn.min() >= 1 and drawn.max() <= 1024
  assert np.median(drawn) == pytest.approx(100, rel=0.03)
  assert np.std(np.log(drawn)) == pytest.approx(0.5, rel=0.03)
  assert (lengths.response_lengths("lognormal:100:0.5", 50, 1024, seed=3) == drawn[:50]).all()  # seeded
  assert lengths.response_lengths("lognormal:100:3", 20_000, 64).max() == 64  # the tail clipped to the budget
  uniform = lengths.response_lengths("uniform:10:20", 10_000, 64)
  assert uniform.min() == 10 and uniform.max() == 20
  assert (lengths.response_lengths("fixed:7", 5, 64) == 7).all()
  for bad in ("lognormal:100", "normal:1:2", "fixed:x", "uniform:0:5"):
    with pytest.raises(ValueError, match="lognormal:MEDIAN:SIGMA"):
      lengths.response_lengths(bad, 4, 64)


def _run_dir(path, group_size: int, steps: list) -> str:
  """A run directory as far as its lengths go: config.json's group size, a training row per step of lengths, and an
  evaluation row (no lengths)."""
  (path / "config.json").write_text(json.dumps(dict(config={}, derived=dict(group_size=group_size))))
  rows = [dict(step=i + 1, reward_mean=0.5, response_lens=lens) for i, lens in enumerate(steps)]
  rows.insert(1, dict(step=1, eval_accuracy=0.5))
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_a_runs_lengths_are_replayed_a_whole_group_at_a_time(tmp_path):
  """run:DIR draws the run's prompt groups whole (with replacement, each as often), clipped to the budget."""
  groups = [(10, 11, 12, 13), (50, 50, 70, 49), (5, 5, 5, 5)]
  run = _run_dir(tmp_path, 4, [groups[0] + groups[1], groups[2]])
  drawn = lengths.response_lengths(f"run:{run}", 4_000, 60, seed=2)
  clipped = {tuple(min(n, 60) for n in g) for g in groups}
  drawn_groups = [tuple(g) for g in drawn.reshape(-1, 4).tolist()]
  assert set(drawn_groups) == clipped
  assert all(drawn_groups.count(g) == pytest.approx(1000 / 3, rel=0.12) for g in clipped)
  assert (lengths.response_lengths(f"run:{run}", 6, 60, seed=2) == drawn[:6]).all()  # seeded, the last group cut
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "response_le')  # a row torn by a crash of a run still training: skipped, as runs skip it
  assert (lengths.response_lengths(f"run:{run}", 6, 60, seed=2) == drawn[:6]).all()
  with pytest.raises(ValueError, match="no run there"):
    lengths.response_lengths(f"run:{tmp_path / 'absent'}", 4, 60)
  (tmp_path / "old").mkdir()
  with pytest.raises(ValueError, match="hold no `response_lens`"):
    lengths.response_lengths(f"run:{_run_dir(tmp_path / 'old', 4, [[]])}", 4, 60)
  with pytest.raises(ValueError, match="not its prompts'"):
    lengths.prompt_lengths(f"run:{run}", 4, 60)


def test_plan_batch_refuses_bad_lengths_before_it_writes(tmp_path):
  workdir = tmp_path / "plan"
  cmd = [sys.executable, "-m", "launch.plan_batch", "--config=configs/grpo_reasoning.py", f"--workdir={workdir}",
         "--topology=cpu", f"--lengths=run:{tmp_path / 'absent'}"]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode != 0 and "no run there" in done.stderr and not workdir.exists()


@pytest.mark.slow
def test_on_this_cpu_each_cache_bucket_is_timed_by_its_own_compiled_step():
  """The "cpu" target: this machine's devices at measured rates; the xla backend's buckets (64 and 127 slots for
  32 + 96 tokens) each timed by the step compiled at that length, the longer one reading more; the rollout taken
  above the programs' best by the decode step's spread measured here."""
  config = _config(16, engine="continuous", slots=2, chunk=8)
  lengths_DxB = np.random.default_rng(1).integers(40, 97, (2, 16))  # two draws of the step's lengths
  got = step_time.predict(config, step_time.CPU, lengths_DxB, prompt_len=PROMPT, response_len=96)
  rates = got.programs["decode"].rates
  assert rates.name == "this machine's CPU" and rates.matmul_flops_per_s > 0 and rates.memory_bytes_per_s > 0
  assert rates.kernel_level and got.programs["decode"].launch_s > 0  # timed kernel by kernel
  assert len(got.schedules) == 2
  assert set(got.decode_by_length) == {s.cache_length for d in got.schedules for s in d.segments} == {64, 127}
  assert got.decode_by_length[127].bytes_accessed > got.decode_by_length[64].bytes_accessed
  by_length = got.decode_by_length  # each chunk: one execution of the decode loop, its products set up once
  per_draw = [sum(by_length[s.cache_length].running(1, s.steps) for s in d.segments if s.steps) for d in got.schedules]
  assert all(p.setup_s > 0 for p in by_length.values())
  assert 1.0 < got.rollout_spread < 10  # the mean of the step's executions over their best
  assert got.rollout.decode_s == pytest.approx(got.rollout_spread * np.mean(per_draw))
  assert got.programs["decode"] is got.decode_by_length[127]
  assert got.decode_steps == np.mean([d.decode_steps for d in got.schedules])


def test_packed_micro_batches_hold_the_prompts_own_tokens_not_their_padding():
  """Rows of 32 + 96 = 128 tokens, 512 tokens (4 rows) a micro-batch: 16 responses of 60 tokens behind prompts of
  32 fill a row each (92 tokens): 16 rows, 4 micro-batches; behind prompts of 4 tokens two share a row (64 + 64):
  8 rows, 2 micro-batches."""
  config = _config(16)
  config.micro_batch_size, config.micro_batch_tokens = 0, 512
  exp = aot.abstract_experiment(config, jax.devices("cpu")[:1], PROMPT, 96)
  assert exp.packing.length == 128 and exp.packing.rows == 4
  responses = np.full(16, 60)
  assert step_time._micro_batches(exp, responses, np.full(16, PROMPT), 16) == 4  # pylint: disable=protected-access
  assert step_time._micro_batches(exp, responses, np.full(16, 4), 16) == 2  # pylint: disable=protected-access
