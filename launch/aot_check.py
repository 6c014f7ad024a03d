r"""Compiles one RL step's programs for a TPU slice you do not have and says whether each fits in HBM.

  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-1.5b,mesh=1x4x1 \
      --config.micro_batch_size=8 --topology=v5p:2x2x1 --prompt_tokens=512 --response_tokens=3584 \
      --out=/tmp/aot_qwen15
  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --topology=v5e:2x2 \
      --programs=update --out=/tmp/aot_tiny

No weights, no data, no TPU: libtpu (`pip install "jax[tpu]"`) compiles for --num_slices slices of --topology
(v5e:2x2, v5p:2x2x1, v6e:4x4, ...; the config's mesh must use their chips) the same jitted programs the trainer runs
(`train.aot`): update, score, reference, rollout, those the config's step runs. Prints a table (GiB per chip,
the compiler's flops, bytes accessed, optimal seconds, compile seconds) and a verdict per program with the knobs
that would help; writes --out/aot_check.json (docs/scaling.md lists its fields). --prompt_tokens and
--response_tokens give the step's lengths; without both, they are computed as the trainer does, which reads the
tokenizer and the task's data. Exit status 0 whatever the verdicts; 1 where a program failed to compile for a
reason other than memory.
"""
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiling needs no device, and takes none from a job.

from absl import app, flags, logging  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from jaxrl_batch.train import aot  # pylint: disable=wrong-import-position
from launch import logs, runtime  # pylint: disable=wrong-import-position

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("topology", None, "TPU slice to compile for: <chip>:<XxY[xZ]>, e.g. v5p:2x2x1, v5e:2x2, v6e:4x4.")
flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multi-slice over the data-centre network).")
flags.DEFINE_string("out", None, "Directory for aot_check.json.")
flags.DEFINE_list("programs", list(aot.PROGRAMS), f"Programs to compile, among {','.join(aot.PROGRAMS)}.")
flags.DEFINE_integer("prompt_tokens", 0, "Prompt length in tokens (prompt_len); 0 = the trainer's (needs the "
                     "tokenizer and the task's data).")
flags.DEFINE_integer("response_tokens", 0, "Response budget in tokens (response_len); 0 = the trainer's.")
flags.mark_flags_as_required(["config", "topology", "out"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logs.setup()
  report = aot.check(FLAGS.config, FLAGS.topology, FLAGS.num_slices, FLAGS.programs, FLAGS.prompt_tokens,
                     FLAGS.response_tokens,
                     log=lambda p: logging.info("%s: %s (%.1f s)", p.name, p.verdict, p.compile_seconds or 0.0))
  os.makedirs(FLAGS.out, exist_ok=True)
  path = os.path.join(FLAGS.out, "aot_check.json")
  with open(path, "w") as f:
    json.dump(report.to_json(), f, indent=2)
  print(report.table())
  logging.info("Wrote %s.", path)
  return 1 if any(p.status == "error" for p in report.programs) else 0


if __name__ == "__main__":
  app.run(main, flags_parser=runtime.parse_flags)
