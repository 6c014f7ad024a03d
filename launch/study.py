r"""Runs a batch family at equal sample budgets: every rule x batch x seed in its own run directory.

  python -m launch.study --config=configs/grpo_arith.py --batches=64,128,256,512 --rules=sqrt,none --seeds=3 \
      --workdir=/tmp/arith_study
  python -m launch.analyze --workdir=/tmp/arith_study --target=0.9
  python -m launch.study --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --batches=16,32 --rules=sqrt \
      --workdir=/tmp/gsm8k_tiny_study   # a CPU smoke study of two members
  python -m launch.study --config=configs/grpo_arith.py --batches=128,256 --rules=sqrt --staleness=0,1,2,4 \
      --set=rl.old_logp=trainer --set=rl.tis_cap=2 --workdir=/tmp/arith_staleness   # asynchronous RL

Each member's config is the config file's get_config(base args + batch=B,lr_rule=R,seed=S), the arguments every
family config accepts. Rerunning the command skips finished members and resumes unfinished ones. Without
--batches/--rules, the members come from the config file's sweep(). `--set=key=value` (repeatable) overrides a
field in every member, e.g. `--set=sample_budget=16384`. With --distributed (launch/runtime.py) every host runs the
same command; the study directory must then be on a filesystem every host sees.
"""
from absl import app, flags

from jaxrl_batch.config.family import RULES
from jaxrl_batch.study.runner import run_study
from launch import list_flags, runtime

flags.DEFINE_string("config", None, "Config file, optionally with base args (`configs/grpo_arith.py:debug`).")
flags.DEFINE_string("workdir", None, "Study directory; one subdirectory per member.")
flags.DEFINE_list("batches", [], "Rollouts per update of each member (default: the config's sweep()).")
flags.DEFINE_list("rules", [], "Learning-rate rules: none, linear, sqrt, adam_sde (default: the config's sweep()).")
flags.DEFINE_integer("seeds", 1, "Seeds per member (0 .. seeds-1).")
flags.DEFINE_list("staleness", ["0"], "rl.max_staleness of the members: steps generation runs ahead of the learner "
                  "(0 = synchronous); a further axis of the study.")
flags.DEFINE_multi_string("set", [], "key=value override applied to every member (repeatable).")
list_flags.integers("batches", 1, "rollouts per step", "64,128,256")
list_flags.choices("rules", RULES)
list_flags.integers("staleness", 0, "steps generation runs ahead of the learner", "0,1,2")
list_flags.overrides("set")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  runtime.setup()
  runtime.run_to_exit(lambda: run_study(FLAGS.config, FLAGS.workdir, [int(b) for b in FLAGS.batches], FLAGS.rules,
                                        FLAGS.seeds, FLAGS.set, staleness=[int(k) for k in FLAGS.staleness]))


if __name__ == "__main__":
  app.run(main)
