r"""Trains one member of a batch family with the algorithm its config names (`algo`: grpo or ppo).

  python -m launch.train --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith
  python -m launch.train --config=configs/grpo_arith.py:batch=256,lr_rule=sqrt --workdir=/tmp/b256 \
      --config.sample_budget=81920

Rerunning the same command resumes from the latest checkpoint in --workdir. SIGTERM or Ctrl-C saves a checkpoint
after the step in progress and exits with 128 + the signal's number (a second signal exits at once); a second
process on the same --workdir is refused, naming the first. On many hosts, every process runs the
same command with --distributed (launch/tpu_pod.sh, launch/slurm_gpu.sbatch); --workdir and --config.sft.cache_dir
must then be on a filesystem every host sees. Two processes on one machine (CPU, 2 devices each):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m launch.train --config=configs/grpo_arith.py:debug \
      --workdir=/tmp/mp --config.sft.cache_dir=/tmp/mp_base --distributed --coordinator=localhost:12355 \
      --num_processes=2 --process_id=0    # and the same with --process_id=1

With `--config.rollout_mesh.layout=auto` the run decodes in the fastest decode layout predicted on its devices
(`predict.step_time.run_layout`; the choice is logged and saved in config.json, which a rerun keeps).

A run's config is fixed. To go on from one of its checkpoints with something changed (after a divergence: a lower
learning rate, a tighter clip), branch it into a new directory; the source is only read:

  python -m launch.train --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith_lr5e-4 \
      --branch_from=/tmp/grpo_arith --branch_step=20 --config.optim.base_lr=5e-4
"""
from absl import app, flags
from ml_collections import config_flags

from jaxrl_batch.train.branch import Origin
from jaxrl_batch.train.trainer import Trainer
from launch import runtime

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints/, metrics.jsonl, config.json.")
flags.DEFINE_string("branch_from", "", "Run directory whose checkpoint a new --workdir starts from (train.branch).")
flags.DEFINE_integer("branch_step", -1, "The --branch_from checkpoint step to start from; -1 = its latest.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  runtime.setup()
  origin = None
  if FLAGS.branch_from:
    origin = Origin(FLAGS.branch_from, None if FLAGS.branch_step < 0 else FLAGS.branch_step)
  runtime.run_to_exit(lambda: Trainer(_config(), FLAGS.workdir, branch_from=origin).run())


def _config():
  """--config, with rollout_mesh.layout='auto' chosen before the run is built (as config.json saved it, on a
  resume). The prediction's modules are imported only then: a run that names its layout does without them."""
  if FLAGS.config.rollout_mesh.layout != "auto":
    return FLAGS.config
  from jaxrl_batch.predict import step_time  # pylint: disable=import-outside-toplevel
  return step_time.run_layout(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main, flags_parser=runtime.parse_flags)
