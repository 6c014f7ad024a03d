r"""Compiles one decode step of the continuous engine for a TPU slice at several concurrencies and sets the compiler's
figures beside the step's HBM roofline per chip (`train.decode_roofline`).

  python -m launch.decode_roofline --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-1.5b,mesh=1x1x4 \
      --topology=v5p:2x2x1 --concurrency=1,8,64,256 --prompt_tokens=512 --response_tokens=3584 --out=/tmp/roof15

No weights, no data, no accelerator (libtpu's compile-only devices, as launch.aot_check). Each concurrency is the
slots decoding at once on the whole slice (`sampling.slots` = concurrency / the data-parallel size), every slot live
at the cache's last slot. Prints a table (per chip: GB the compiler says the step accesses and its optimal ms, GB the
optimized program reads and writes in HBM, the roofline's GB (weights + kv) and ms, the ratios, the kv cache
held) and writes --out/decode_roofline.json.
"""
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiling needs no device.

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from jaxrl_batch.train import decode_roofline  # pylint: disable=wrong-import-position
from launch import list_flags, logs, runtime  # pylint: disable=wrong-import-position

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("topology", "v5p:2x2x1", "TPU slice to compile for: <chip>:<XxY[xZ]>.")
flags.DEFINE_list("concurrency", ["1", "8", "64", "256"], "Sequences decoding at once on the slice.")
flags.DEFINE_integer("prompt_tokens", 512, "Prompt length in tokens.", lower_bound=1)
flags.DEFINE_integer("response_tokens", 3584, "Response budget in tokens (the cache holds prompt + response - 1).",
                     lower_bound=1)
flags.DEFINE_string("out", None, "Directory for decode_roofline.json.")
flags.mark_flags_as_required(["config", "out"])
list_flags.integers("concurrency", 1, "sequences decoding at once", "1,8,64,256")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logs.setup()
  chip, points = decode_roofline.measure(FLAGS.config, FLAGS.topology, [int(c) for c in FLAGS.concurrency],
                                         FLAGS.prompt_tokens, FLAGS.response_tokens)
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "decode_roofline.json"), "w") as f:
    json.dump(dict(chip, points=[dict(dataclasses.asdict(p), ratio=p.ratio) for p in points]), f, indent=2)
  print(f"{chip['topology']} mesh {chip['mesh']} attention {chip['attention_backend']}; per chip:")
  print(decode_roofline.table(points))
  return 1 if any(p.error for p in points) else 0


if __name__ == "__main__":
  app.run(main, flags_parser=runtime.parse_flags)
