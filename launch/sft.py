r"""Supervised warm start: trains (or reuses) the cached base policy that RL starts from.

  python -m launch.sft --config=configs/grpo_arith.py --workdir=/tmp/arith_base

The base policy is cached under `config.sft.cache_dir` (default ~/.cache/jaxrl_batch/base/<key>), keyed by the
model, task, SFT settings, seed and tokenizer; `launch.train` reuses it. --workdir overrides the cache location.
With --distributed (launch/runtime.py) every host runs the same command and the cache must be on a shared
filesystem.
"""
from absl import app, flags
from ml_collections import config_flags

from jaxrl_batch.train import sft
from jaxrl_batch.train.setup import Experiment
from launch import runtime

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("workdir", None, "Where to write the base checkpoint (default: the shared cache).")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  runtime.setup()
  exp = Experiment.create(FLAGS.config)
  exp.log_layout()
  sft.load_or_train(exp, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main, flags_parser=runtime.parse_flags)
