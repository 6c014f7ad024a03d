r"""Compiles one RL step's programs for a TPU slice or GPU nodes you do not have and says whether each fits in memory.

  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-1.5b,mesh=1x4x1 \
      --config.micro_batch_size=8 --topology=v5p:2x2x1 --prompt_tokens=512 --response_tokens=3584 \
      --out=/tmp/aot_qwen15
  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --topology=v5e:2x2 \
      --programs=update --out=/tmp/aot_tiny
  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-7b,mesh=1x8x1 \
      --gpu=h100 --gpus=8 --programs=update --prompt_tokens=256 --response_tokens=16384 --out=/tmp/aot_h100

No weights, no data, no accelerator: libtpu (`pip install "jax[tpu]"`) compiles for --num_slices slices of
--topology (v5e:2x2, v5p:2x2x1, v6e:4x4, ...), or the JAX CUDA plugin (`pip install -e '.[cuda_aot]'`) for --num_nodes
nodes of --gpus GPUs --gpu (h100, h200, a100), the same jitted programs the trainer runs (`aot`): update,
score, reference, rollout, those the config's step runs; the config's mesh must use their chips. Give --topology or
--gpu, not both. Prints a table (GiB per chip, the compiler's flops, bytes accessed, optimal seconds, compile
seconds; GPU executables have no cost analysis) and a verdict per program with the knobs that would help; writes
--out/aot_check.json (docs/scaling.md lists its fields). On GPUs the verdict compares with the memory JAX's
allocator takes of each device: XLA_CLIENT_MEM_FRACTION of it (default 0.75), as this process's environment sets
it. --prompt_tokens and --response_tokens give the step's lengths; without both, they are computed as the trainer
does, which reads the tokenizer and the task's data. Exit status 0 whatever the verdicts; 1 where a program failed
to compile for a reason other than memory.
"""
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiling needs no device, and takes none from a job.

from absl import app, flags, logging  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from jaxrl_batch.runtime import topologies  # pylint: disable=wrong-import-position
from jaxrl_batch import aot  # pylint: disable=wrong-import-position
from launch import list_flags, logs, runtime  # pylint: disable=wrong-import-position

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("topology", None, "TPU slice to compile for: <chip>:<XxY[xZ]>, e.g. v5p:2x2x1, v5e:2x2, v6e:4x4.")
flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multi-slice over the data-centre network).")
flags.DEFINE_enum("gpu", None, sorted(topologies.GPUS), "GPU nodes to compile for instead of --topology: the GPU.")
flags.DEFINE_integer("gpus", 8, "GPUs per node (with --gpu).", lower_bound=1)
flags.DEFINE_integer("num_nodes", 1, "Nodes of --gpus GPUs (with --gpu).", lower_bound=1)
flags.DEFINE_string("out", None, "Directory for aot_check.json.")
flags.DEFINE_list("programs", list(aot.PROGRAMS), f"Programs to compile, among {','.join(aot.PROGRAMS)}.")
list_flags.choices("programs", aot.PROGRAMS)
flags.DEFINE_integer("prompt_tokens", 0, "Prompt length in tokens (prompt_len); 0 = the trainer's (needs the "
                     "tokenizer and the task's data).")
flags.DEFINE_integer("response_tokens", 0, "Response budget in tokens (response_len); 0 = the trainer's.")
flags.mark_flags_as_required(["config", "out"])
flags.register_multi_flags_validator(
    ["topology", "gpu"], lambda f: (f["topology"] is None) != (f["gpu"] is None),
    "Give exactly one of --topology (a TPU slice, e.g. v5p:2x2x1) and --gpu (GPU nodes, e.g. --gpu=h100 --gpus=8).")
flags.register_multi_flags_validator(
    ["topology", "num_nodes", "gpus"], lambda f: f["topology"] is None or (f["num_nodes"], f["gpus"]) == (1, 8),
    "--gpus and --num_nodes go with --gpu; a TPU topology's multi-slice is --num_slices.")
flags.register_multi_flags_validator(
    ["gpu", "num_slices"], lambda f: f["gpu"] is None or f["num_slices"] == 1,
    "--num_slices goes with --topology; GPU nodes are --num_nodes.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logs.setup()
  if FLAGS.gpu:  # A GPU node is a slice of '<gpu>:<GPUs per node>' (`runtime.topologies.compile_only`).
    topology, num_slices = f"{FLAGS.gpu}:{FLAGS.gpus}", FLAGS.num_nodes
  else:
    topology, num_slices = FLAGS.topology, FLAGS.num_slices
  report = aot.check(FLAGS.config, topology, num_slices, FLAGS.programs, FLAGS.prompt_tokens, FLAGS.response_tokens,
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
