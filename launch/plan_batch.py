r"""Recommends a batch size: T(B) = S(B) / R(B) from a throughput sweep and the S(B) fit of an analysed study.

  python -m launch.analyze --workdir=/tmp/arith_study --target=0.9
  python -m launch.plan_batch --config=configs/grpo_arith.py --workdir=/tmp/arith_study --rule=sqrt \
      --batches=32,64,128,256,512,1024 --learn_batches=64,256

The sweep trains each batch's member (built as launch.study builds it: batch=B,lr_rule=RULE,seed=0) in
WORKDIR/throughput/b<B>/ (resumable; a run shorter than these flags ask for is moved aside and rerun) for the
compiling step, --warmup steps, then max(--steps - 1, --min_samples / B) timed steps, whose R is measured as the
analysis measures it (--repeats rounds of all batches, pooled, in b<B>.r<k>/ after the first); S(B) = S_min (1 +
B / B_noise) is fitted to the rule's synchronous members in WORKDIR/analysis.json (only those at --learn_batches,
if given, so that the others test the prediction). Writes WORKDIR/plan.json and WORKDIR/plan.md (predicted vs
measured T and its error).
"""
import json
import os

from absl import app, flags

from jaxrl_batch.analysis import planner
from jaxrl_batch.study.runner import throughput_sweep
from launch import list_flags, logs

flags.DEFINE_string("config", None, "Config file of the study, optionally with base args.")
flags.DEFINE_string("workdir", None, "Study directory holding analysis.json (run launch.analyze first).")
flags.DEFINE_string("rule", "sqrt", "The family rule to plan for.")
flags.DEFINE_list("batches", ["32", "64", "128", "256", "512", "1024"], "Batches of the throughput sweep.")
flags.DEFINE_integer("steps", 4, "Training steps per swept batch besides the warm-up (the first, compiling, is not "
                     "timed).")
flags.DEFINE_integer("warmup", 5, "Untimed steps after the compiling one (XLA:CPU still compiles rarer shapes).")
flags.DEFINE_integer("min_samples", 1024, "Timed samples per swept batch at least: small batches run more steps.")
flags.DEFINE_integer("repeats", 1, "Rounds of the sweep (each batch once per round, pooled): more rounds average "
                     "out the drift of a shared machine.")
flags.DEFINE_list("learn_batches", [], "Batches whose members the S(B) fit uses (default: every member that reached "
                  "the target).")
flags.DEFINE_multi_string("set", [], "key=value override applied to every swept run (as in launch.study).")
list_flags.integers("batches", 1, "rollouts per step", "32,64,128")
list_flags.integers("learn_batches", 1, "rollouts per step of analysed members", "64,256")
list_flags.overrides("set")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logs.setup()
  path = os.path.join(FLAGS.workdir, "analysis.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing: run `python -m launch.analyze --workdir={FLAGS.workdir} "
                            "--target=...` first.")
  with open(path) as f:
    analysis = json.load(f)
  measured = {m["batch"]: (m["samples_to_target"], m["time_to_target_s"])
              for m in analysis["members"] if m["rule"] == FLAGS.rule and not m.get("staleness")}
  swept = throughput_sweep(FLAGS.config, os.path.join(FLAGS.workdir, "throughput"),
                           [int(b) for b in FLAGS.batches], FLAGS.rule, FLAGS.steps, FLAGS.set,
                           warmup=FLAGS.warmup, min_samples=FLAGS.min_samples, repeats=FLAGS.repeats)
  learn = [int(b) for b in FLAGS.learn_batches] or None
  sweep = dict(steps=FLAGS.steps, warmup=FLAGS.warmup, min_samples=FLAGS.min_samples, repeats=FLAGS.repeats)
  result = dict(planner.plan(swept, measured, learn), rule=FLAGS.rule, target=analysis["target"], sweep=sweep)
  with open(os.path.join(FLAGS.workdir, "plan.json"), "w") as f:
    json.dump(result, f, indent=2)
  table = planner.render(result)
  with open(os.path.join(FLAGS.workdir, "plan.md"), "w") as f:
    f.write(table)
  print(table, end="")
  print(f"Wrote {os.path.join(FLAGS.workdir, 'plan.json')} and plan.md.")

if __name__ == "__main__":
  app.run(main)
