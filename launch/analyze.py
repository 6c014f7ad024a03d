r"""Analyses a batch study: does a larger batch reach the target accuracy sooner?

  python -m launch.analyze --workdir=/tmp/study --target=0.9
  python -m launch.analyze --workdir=/tmp/study --target=0.9 --reference=sqrt_b128 --smooth=3
  python -m launch.analyze --workdir=/tmp/study --target=0.95 --metric=eval_pass_at_k   # runs with eval.num_samples

--workdir holds one run per subdirectory `<rule>_b<batch>_s<seed>/` (each a launch.train --workdir). Writes
analysis.json, report.md and PNG plots into it, and prints the decision table.
"""
import os

from absl import app, flags

from jaxrl_batch.analysis import analyze
from jaxrl_batch.analysis.report import decision_table

flags.DEFINE_string("workdir", None, "Study directory: one launch.train run per subdirectory.")
flags.DEFINE_float("target", None, "Value (0..1) of --metric to reach.")
flags.DEFINE_string("metric", "eval_accuracy", "Evaluation field to analyse: eval_accuracy (greedy), or, for runs "
                    "with eval.num_samples > 0, eval_pass1, eval_pass_at_k, eval_maj_at_k.")
flags.DEFINE_string("reference", None, "Reference member '<rule>_b<batch>'; default: smallest sqrt batch.")
flags.DEFINE_integer("smooth", 1, "Odd number of evaluation points in the centred moving average (1 = none).")
flags.DEFINE_float("invariance_tol", 0.05, "Largest accuracy gap to the reference curve inside a family range.")
flags.DEFINE_string("noise_run", None, "A run directory whose logged gradient noise scale (e.g. the reference member "
                    "with --config.rl.noise_split=True) is compared with the study's samples penalties.")
flags.mark_flags_as_required(["workdir", "target"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  analysis = analyze(FLAGS.workdir, FLAGS.target, FLAGS.reference, FLAGS.smooth, FLAGS.invariance_tol,
                     FLAGS.metric, FLAGS.noise_run)
  print(decision_table(analysis))
  print("\n".join(os.path.join(FLAGS.workdir, name) for name in analysis["files"]))


if __name__ == "__main__":
  app.run(main)
