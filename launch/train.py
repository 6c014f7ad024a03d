r"""Trains one member of a batch family with GRPO.

  python -m launch.train --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith
  python -m launch.train --config=configs/grpo_arith.py:batch=256,lr_rule=sqrt --workdir=/tmp/b256 \
      --config.sample_budget=81920

Rerunning the same command resumes from the latest checkpoint in --workdir.
"""
import jax
from absl import app, flags
from ml_collections import config_flags

from jaxrl_batch.trainer import Trainer
from launch import logs

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints/, metrics.jsonl, config.json.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (TPU pods, SLURM/GPU clusters).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if FLAGS.distributed:
    jax.distributed.initialize()
  logs.setup()
  Trainer(FLAGS.config, FLAGS.workdir).run()


if __name__ == "__main__":
  app.run(main)
