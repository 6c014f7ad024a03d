r"""Fault injection against `launch.train`: kill -9 at random points (several times in a row), SIGTERM, and a second
process on the same workdir. Every faulted run is then rerun to its end and its rows compared with an uninterrupted
run's (the deterministic fields: steps, samples, rewards, lengths, gradient norms, losses, held-out accuracy).

  python -m launch.fault_injection --trials=5 --kills=3 --workdir=/tmp/faults --out=/tmp/faults.json

The member is the arithmetic debug member (`configs/grpo_arith.py:debug`): it earns rewards and moves its parameters
from the first steps, so a resume that lost any run state would change the rows. Writes
--out (JSON): per case what was done, the exit codes, the step resumed from and whether the rows match.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

from absl import app, flags, logging

from jaxrl_batch.train import rundir

flags.DEFINE_string("workdir", None, "Directory of the runs (one subdirectory per case) and the shared base policy.")
flags.DEFINE_string("out", "fault_injection.json", "Output JSON path.")
flags.DEFINE_integer("trials", 5, "kill -9 trials.")
flags.DEFINE_integer("kills", 3, "kill -9 per trial, each at a random point of the (re)run, before the final rerun.")
flags.DEFINE_integer("sample_budget", 640, "Samples per run (32 per step).")
flags.DEFINE_integer("seed", 0, "Seed of the random kill points.")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(workdir: str) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug", f"--workdir={workdir}",
         "--config.mesh.data=1", f"--config.sft.cache_dir={os.path.join(FLAGS.workdir, 'base')}",
         f"--config.sample_budget={FLAGS.sample_budget}"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(workdir: str) -> tuple[int, str]:
  proc = launch(workdir)
  out, _ = proc.communicate()
  return proc.returncode, out


def resumed_from(out: str) -> int | None:
  marker = "Resuming from step "
  return int(out.split(marker, 1)[1].split()[0]) if marker in out else None


def kill_trial(workdir: str, span_s: float, rng: random.Random) -> dict:
  """`--kills` SIGKILLs at random seconds into successive (re)runs, then a rerun to the end."""
  kills = []
  for _ in range(FLAGS.kills):
    proc = launch(workdir)
    delay = rng.uniform(0.0, span_s)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    rows = rundir.read_metrics(workdir) if os.path.exists(rundir.metrics_path(workdir)) else []
    kills.append(dict(after_s=round(delay, 2), last_step_logged=max((r["step"] for r in rows), default=None),
                      resumed_from=resumed_from(out)))
  code, out = finish(workdir)
  return dict(kills=kills, final_exit=code, final_resumed_from=resumed_from(out))


def sigterm_case(workdir: str) -> dict:
  proc = launch(workdir)
  while not any(r.get("step", 0) >= 5 for r in rundir.read_metrics(workdir)) and proc.poll() is None:
    time.sleep(0.1)
  sent = time.time()
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate()
  exited_s = time.time() - sent
  last = max(r["step"] for r in rundir.read_metrics(workdir))
  code, rerun = finish(workdir)
  return dict(exit=proc.returncode, exit_after_s=round(exited_s, 2), last_step_logged=last,
              said_saved=f"saving the checkpoint of step {last}" in out, final_exit=code,
              final_resumed_from=resumed_from(rerun))


def two_processes_case(workdir: str) -> dict:
  first = launch(workdir)
  while not os.path.exists(rundir.metrics_path(workdir)) and first.poll() is None:
    time.sleep(0.1)
  second = launch(workdir)
  out2, _ = second.communicate()
  first.communicate()
  return dict(first_exit=first.returncode, second_exit=second.returncode,
              second_named_holder=f"in use by pid {first.pid}" in out2)


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  rng = random.Random(FLAGS.seed)
  start = time.time()
  reference = os.path.join(FLAGS.workdir, "reference")
  finish(reference)  # also trains the shared base policy
  timing = os.path.join(FLAGS.workdir, "reference_timing")  # a second uninterrupted run, the base policy cached
  t0 = time.time()
  finish(timing)
  span_s = time.time() - t0  # kill points are drawn over a whole process's life, start-up included
  ref_rows = rundir.read_metrics(reference)
  report = dict(settings=dict(trials=FLAGS.trials, kills=FLAGS.kills, sample_budget=FLAGS.sample_budget,
                              kill_window_s=round(span_s, 1)),
                reference_matches_rerun=rundir.rows_mismatch(ref_rows, rundir.read_metrics(timing)) is None, cases=[])

  def record(name: str, workdir: str, result: dict) -> None:
    result.update(case=name, rows_match_reference=rundir.rows_mismatch(ref_rows, rundir.read_metrics(workdir)) is None)
    report["cases"].append(result)
    logging.info("%s: %s", name, result)
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=2)

  for i in range(FLAGS.trials):
    workdir = os.path.join(FLAGS.workdir, f"kill_{i}")
    record(f"kill_{i}", workdir, kill_trial(workdir, span_s, rng))
  workdir = os.path.join(FLAGS.workdir, "sigterm")
  record("sigterm", workdir, sigterm_case(workdir))
  workdir = os.path.join(FLAGS.workdir, "two_processes")
  record("two_processes", workdir, two_processes_case(workdir))
  ok = report["reference_matches_rerun"] and all(c["rows_match_reference"] for c in report["cases"])
  logging.info("Wrote %s: %d cases, rows match the uninterrupted run in all: %s (%.0f s).", FLAGS.out,
               len(report["cases"]), ok, time.time() - start)


if __name__ == "__main__":
  app.run(main)
