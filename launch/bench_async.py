r"""Step time of asynchronous RL against the synchronous loop, side by side in one process.

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m launch.bench_async --config=configs/grpo_arith.py \
      --runs=0,1,1@1 --steps=12 --set=extra_response_tokens=24 --out=/tmp/bench_async.json

Streamed rewards against rewards scored after the rollout, with a verifier that takes 5 ms per sample:

  python -m launch.bench_async --config=configs/grpo_arith.py:batch=32 --reward_ms=5 \
      --runs=0+task.stream_rewards=false,0,1+task.stream_rewards=false,1 \
      --set=sampling.engine=continuous,sampling.slots=8,extra_response_tokens=24

Trains the same member for --steps steps per run (no evaluation, no checkpoints; a short warm start, since speed
needs no skill). Every run's learner has the same devices: all but the most any run gives to generation. A run `k`
has rl.max_staleness=k on those (colocated); `k@n` adds the last n devices for generation
(`rollout_mesh.devices=n`); `+key=value` suffixes are overrides of that run alone. --reward_ms adds a sleep to
every reward call (a verifier's latency; a sleep releases the GIL as a subprocess or a remote verifier does).
Reports per run the median step time over the steps after the first 2 + k (compilation, and the steps whose
generation waited on it; a median, since a program compiled later, for a prompt or refill shape first met then,
falls in one run's timed steps and not another's), its mean, the medians of the rollout / reward / update seconds,
`overlap_frac` and the learner's and the generator's waits, the mean response length (equal lengths: equal work),
and the step time's ratio to the first run. Writes --out (JSON) and prints the table.
"""
import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from jaxrl_batch.config.args import apply_overrides
from jaxrl_batch.study.runner import load_config_module
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from launch import list_flags, logs

flags.DEFINE_string("config", "configs/grpo_arith.py", "Config file (`path.py:args`).")
flags.DEFINE_list("runs", ["0", "1"], "rl.max_staleness per run, `k@n` with n rollout devices, `+key=value` "
                  "overrides of that run; the first is the reference.")
flags.DEFINE_float("reward_ms", 0.0, "Milliseconds every reward call sleeps (a verifier's latency).")
flags.DEFINE_integer("steps", 12, "Steps per run (the first 2 + k are left out of the statistics).")
flags.DEFINE_list("set", [], "Config overrides key=value, applied to every run.")
flags.DEFINE_string("out", "bench_async.json", "Output JSON path.")
flags.DEFINE_string("workdir", None, "Where the runs go (default: a temporary directory).")
FLAGS = flags.FLAGS


def _run_problem(run: str) -> str | None:
  """What is wrong with a --runs item `k[@n][+key=value...]`, None if nothing is."""
  spec, *own = run.split("+")
  staleness, _, rollout_devices = spec.partition("@")
  if not staleness.isdigit():
    return "does not start with rl.max_staleness, an integer >= 0"
  if rollout_devices and not (rollout_devices.isdigit() and int(rollout_devices) >= 1):
    return "gives rollout devices after '@' that are not an integer >= 1"
  return next((f"has an override {o!r} that is not key=value" for o in own if "=" not in o), None)


list_flags.check_items("runs", _run_problem, "rl.max_staleness k, optionally @n rollout devices, then +key=value "
                       "overrides of that run", "0,1,1@1+rl.tis_cap=2")
list_flags.overrides("set")

WARMUP_STEPS = 2  # compilation; a run of staleness k also skips its next k (the generator waited on them)
FIELDS = ("rollout_s", "reward_s", "update_s", "overlap_frac", "rollout_wait_s", "update_wait_s")


def measure(workdir: str, run: str, learner_devices: list) -> dict:
  path, _, arg = FLAGS.config.partition(":")
  c = load_config_module(path).get_config(arg or None)
  spec, *own = run.split("+")
  staleness, _, rollout_devices = spec.partition("@")
  apply_overrides(c, ["sft.steps=50", "eval_every_samples=0", "stop_at_accuracy=0", "checkpoint_every_samples=0",
                      *FLAGS.set, *own, f"rl.max_staleness={staleness}",
                      f"rollout_mesh.devices={rollout_devices or 0}"])
  c.sample_budget = FLAGS.steps * c.batch_size
  run_dir = os.path.join(workdir, run.replace("@", "_on_").replace("+", "_").replace("=", "_"))
  trainer = Trainer(c, run_dir, devices=learner_devices + (jax.devices()[-c.rollout_mesh.devices:]
                                                           if rollout_devices else []))
  if FLAGS.reward_ms:
    reward = trainer.exp.task.reward

    def slow_reward(completion, problem):
      time.sleep(FLAGS.reward_ms / 1000)
      return reward(completion, problem)
    trainer.exp.task.reward = slow_reward
  trainer.run()
  rows = [r for r in rundir.read_metrics(run_dir) if "reward_mean" in r]
  skip = WARMUP_STEPS + c.rl.max_staleness
  walls = np.diff([0.0] + [r["wall_s"] for r in rows])[skip:]
  timed = rows[skip:]
  out = dict(run=run, steps=len(rows), step_s=float(np.median(walls)), step_s_mean=float(walls.mean()),
             response_len_mean=float(np.mean([r["response_len_mean"] for r in timed])))
  out.update({k: float(np.median([r.get(k, 0.0) for r in timed])) for k in FIELDS})
  return out


def main(argv):
  del argv
  logs.setup()
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="bench_async_")
  most = max(int(run.split("+")[0].partition("@")[2] or 0) for run in FLAGS.runs)
  learner_devices = jax.devices()[:jax.device_count() - most]
  if len(learner_devices) > 1 and any("process_cores" in run for run in FLAGS.runs):
    logging.warning("Every learner runs sharded over %d devices (all but the most a `k@n` run gives to generation), "
                    "the generator process on one: add a `1@%d` run for one learner device.", len(learner_devices),
                    jax.device_count() - 1)
  results = [measure(workdir, run, learner_devices) for run in FLAGS.runs]
  for r in results:
    r["step_ratio_vs_first"] = r["step_s"] / results[0]["step_s"]
  report = dict(config=FLAGS.config, overrides=FLAGS.set, steps=FLAGS.steps, reward_ms=FLAGS.reward_ms,
                devices=str(jax.devices()), results=results)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)
  width = max(len(r["run"]) for r in results)
  header = (f"{'run':>{width}} {'step_s':>8} {'ratio':>6} {'mean_s':>8} {'resp_len':>8} "
            + " ".join(f"{k:>14}" for k in FIELDS))
  lines = [header] + [f"{r['run']:>{width}} {r['step_s']:>8.3f} {r['step_ratio_vs_first']:>6.2f} "
                      f"{r['step_s_mean']:>8.3f} {r['response_len_mean']:>8.1f} "
                      + " ".join(f"{r[k]:>14.3f}" for k in FIELDS) for r in results]
  logging.info("Wrote %s\n%s", FLAGS.out, "\n".join(lines))


if __name__ == "__main__":
  app.run(main)
