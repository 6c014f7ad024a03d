r"""Fault injection against `launch.train`: kill -9 at random points (several times in a row), SIGTERM, a second
process on the same workdir, and SIGTERM to one host of a two-process (`--distributed`) run. Every faulted run is
then rerun to its end and its rows compared with an uninterrupted run's (the deterministic fields: steps, samples,
rewards, lengths, gradient norms, losses, held-out accuracy); the two-process case with an uninterrupted two-process
run's (its reductions run in another order than one process's).

  python -m launch.fault_injection --trials=5 --kills=3 --workdir=/tmp/faults --out=/tmp/faults.json
  python -m launch.fault_injection --cases=distributed_sigterm --workdir=/tmp/faults --out=/tmp/faults_mp.json

The member is the arithmetic debug member (`configs/grpo_arith.py:debug`): it earns rewards and moves its parameters
from the first steps, so a resume that lost any run state would change the rows. Writes
--out (JSON): per case what was done, the exit codes, the step resumed from and whether the rows match.
"""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags, logging

from jaxrl_batch.train import rundir
from launch import list_flags

flags.DEFINE_string("workdir", None, "Directory of the runs (one subdirectory per case) and the shared base policy.")
flags.DEFINE_string("out", "fault_injection.json", "Output JSON path.")
flags.DEFINE_integer("trials", 5, "kill -9 trials.")
flags.DEFINE_integer("kills", 3, "kill -9 per trial, each at a random point of the (re)run, before the final rerun.")
flags.DEFINE_integer("sample_budget", 640, "Samples per run (32 per step).")
flags.DEFINE_integer("seed", 0, "Seed of the random kill points.")
CASES = ("kill", "sigterm", "two_processes", "distributed_sigterm")
flags.DEFINE_list("cases", list(CASES), f"Cases to run, of {CASES}.")
list_flags.choices("cases", CASES)
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(workdir: str) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug", f"--workdir={workdir}",
         "--config.mesh.data=1", f"--config.sft.cache_dir={os.path.join(FLAGS.workdir, 'base')}",
         f"--config.sample_budget={FLAGS.sample_budget}"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def launch_distributed(workdir: str) -> list[subprocess.Popen]:
  """`launch.train --distributed` as two processes of one CPU device each (one mesh over both), logs appended to
  `<workdir>_process_<i>.log`."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  procs = []
  for i in range(2):
    with open(f"{workdir}_process_{i}.log", "a") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug", f"--workdir={workdir}",
           "--config.mesh.data=-1", f"--config.sft.cache_dir={os.path.join(FLAGS.workdir, 'base')}",
           f"--config.sample_budget={FLAGS.sample_budget}", "--distributed", f"--coordinator=127.0.0.1:{port}",
           "--num_processes=2", f"--process_id={i}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


def _logs(workdir: str) -> list[str]:
  out = []
  for i in range(2):
    with open(f"{workdir}_process_{i}.log") as f:
      out.append(f.read())
  return out


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
  return dict(kills=kills, final_exit=code, final_resumed_from=resumed_from(out), as_expected=code == 0)


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
              final_resumed_from=resumed_from(rerun),
              as_expected=proc.returncode == 143 and f"saving the checkpoint of step {last}" in out and code == 0)


def two_processes_case(workdir: str) -> dict:
  first = launch(workdir)
  while not os.path.exists(rundir.metrics_path(workdir)) and first.poll() is None:
    time.sleep(0.1)
  second = launch(workdir)
  out2, _ = second.communicate()
  first.communicate()
  return dict(first_exit=first.returncode, second_exit=second.returncode,
              second_named_holder=f"in use by pid {first.pid}" in out2,
              as_expected=first.returncode == 0 and second.returncode == 1 and f"in use by pid {first.pid}" in out2)


def distributed_sigterm_case(workdir: str, reference: str) -> dict:
  """SIGTERM to process 1 of two once step 5 is logged (a preempted VM of a pod): JAX's preemption service tells
  every process, they agree on a step (`reached_preemption_sync_point`), save it and exit; then both rerun to the
  end. `reference` gets an uninterrupted two-process run first (the caller compares the rows with it)."""
  for p in launch_distributed(reference):
    p.wait()
  procs = launch_distributed(workdir)
  while (not any(r.get("step", 0) >= 5 for r in rundir.read_metrics(workdir))
         if os.path.exists(rundir.metrics_path(workdir)) else True) and all(p.poll() is None for p in procs):
    time.sleep(0.1)
  sent = time.time()
  procs[1].send_signal(signal.SIGTERM)
  exits = [p.wait() for p in procs]
  exited_s = time.time() - sent
  last = max(r["step"] for r in rundir.read_metrics(workdir))
  logs = _logs(workdir)
  for p in launch_distributed(workdir):
    p.wait()
  rerun = _logs(workdir)
  both_saved = all(f"saving the checkpoint of step {last}" in log for log in logs)
  return dict(exits=exits, exit_after_s=round(exited_s, 2), last_step_logged=last, both_saved=both_saved,
              final_resumed_from=resumed_from(rerun[0][len(logs[0]):]),
              as_expected=exits == [143, 143] and both_saved and last < FLAGS.sample_budget // 32)


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

  def record(name: str, workdir: str, result: dict, reference_rows: list[dict] = ref_rows) -> None:
    mismatch = rundir.rows_mismatch(reference_rows, rundir.read_metrics(workdir))
    result.update(case=name, rows_match_reference=mismatch is None)
    report["cases"].append(result)
    logging.info("%s: %s", name, result)
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=2)

  for i in range(FLAGS.trials if "kill" in FLAGS.cases else 0):
    workdir = os.path.join(FLAGS.workdir, f"kill_{i}")
    record(f"kill_{i}", workdir, kill_trial(workdir, span_s, rng))
  if "sigterm" in FLAGS.cases:
    workdir = os.path.join(FLAGS.workdir, "sigterm")
    record("sigterm", workdir, sigterm_case(workdir))
  if "two_processes" in FLAGS.cases:
    workdir = os.path.join(FLAGS.workdir, "two_processes")
    record("two_processes", workdir, two_processes_case(workdir))
  if "distributed_sigterm" in FLAGS.cases:
    workdir, two_process_reference = (os.path.join(FLAGS.workdir, d) for d in ("distributed_sigterm",
                                                                               "distributed_reference"))
    record("distributed_sigterm", workdir, distributed_sigterm_case(workdir, two_process_reference),
           rundir.read_metrics(two_process_reference))
  ok = report["reference_matches_rerun"] and all(c["rows_match_reference"] for c in report["cases"])
  expected = all(c["as_expected"] for c in report["cases"])
  logging.info("Wrote %s: %d cases, rows match the uninterrupted run in all: %s; exits and saves as expected in "
               "all: %s (%.0f s).", FLAGS.out, len(report["cases"]), ok, expected, time.time() - start)


if __name__ == "__main__":
  app.run(main)
