r"""Compiles one decode step of the continuous engine for a TPU slice at several concurrencies and sets the compiler's
figures beside the step's HBM roofline per chip (`aot.decode_roofline`).

  python -m launch.decode_roofline --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-1.5b,mesh=1x1x4 \
      --topology=v5p:2x2x1 --concurrency=1,8,64,256 --prompt_tokens=512 --response_tokens=3584 --out=/tmp/roof15

No weights, no data, no accelerator (libtpu's compile-only devices, as launch.aot_check). Each concurrency is the
slots decoding at once on the whole slice (`sampling.slots` = concurrency / the data-parallel size), every slot live
at the cache's last slot. Prints a table (per chip: GB the compiler says the step accesses and its optimal ms, GB the
optimized program reads and writes in HBM, the roofline's GB (weights + kv) and ms, the ratios, the kv cache
held) and writes --out/decode_roofline.json.

With --topology=cpu the step is compiled for this machine's CPU instead and both predicted (`predict.step_time`'s
kernel-level time at the rates measured here) and measured (run on zeros, best of --repeats), side by side: the check
of the prediction at the ~100M reference shape of `launch.bench_rollout` (its model set through --config.model.*):

  python -m launch.decode_roofline --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --topology=cpu \
      --config.model.vocab_size=32000 --config.model.d_model=768 --config.model.num_layers=8 \
      --config.model.num_heads=12 --config.model.num_kv_heads=4 --config.model.head_dim=64 --config.model.d_ff=2048 \
      --config.model.tie_embeddings=False --config.model.qkv_bias=False --concurrency=1,2,4,8,16,32,64 \
      --prompt_tokens=32 --response_tokens=64 --out=/tmp/roof_cpu
"""
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Nothing runs: compiling needs no device.

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from jaxrl_batch.predict import decode_check, step_time  # pylint: disable=wrong-import-position
from jaxrl_batch.aot import decode_roofline  # pylint: disable=wrong-import-position
from launch import list_flags, logs, runtime  # pylint: disable=wrong-import-position

config_flags.DEFINE_config_file("config", None, "Config file (`path.py:args`).", lock_config=True)
flags.DEFINE_string("topology", "v5p:2x2x1", "TPU slice to compile for: <chip>:<XxY[xZ]>, or cpu (this machine: the "
                    "step predicted and measured).")
flags.DEFINE_integer("repeats", 10, "With --topology=cpu: timed runs of each step (the best is kept).", lower_bound=1)
flags.DEFINE_list("concurrency", ["1", "8", "64", "256"], "Sequences decoding at once on the slice.")
flags.DEFINE_integer("prompt_tokens", 512, "Prompt length in tokens.", lower_bound=1)
flags.DEFINE_integer("response_tokens", 3584, "Response budget in tokens (the cache holds prompt + response - 1).",
                     lower_bound=1)
flags.DEFINE_string("out", None, "Directory for decode_roofline.json.")
flags.mark_flags_as_required(["config", "out"])
list_flags.integers("concurrency", 1, "sequences decoding at once", "1,8,64,256")
FLAGS = flags.FLAGS


def _on_this_cpu(concurrencies: list[int]) -> int:
  rates, points = decode_check.measure(FLAGS.config, concurrencies, FLAGS.prompt_tokens, FLAGS.response_tokens,
                                       FLAGS.repeats)
  records = [dict(concurrency=p.concurrency, cache_length=p.cache_length, predicted_s=p.predicted_s,
                  measured_s=p.measured_s, ratio=p.ratio, setup_s=p.program.setup_s, products_s=p.program.compute_s,
                  bytes_s=p.program.memory_s, launches_s=p.program.launch_s) for p in points]
  with open(os.path.join(FLAGS.out, "decode_roofline.json"), "w") as f:
    json.dump(dict(topology=step_time.CPU, rates=dataclasses.asdict(rates), points=records), f, indent=2)
  print(f"this machine's CPU ({rates.matmul_flops_per_s / 1e9:.0f} GFLOP/s square matmul, "
        f"{rates.memory_bytes_per_s / 1e9:.1f} GB/s, transposes {rates.transpose_bytes_per_s / 1e9:.1f} GB/s, "
        f"{rates.launch_s * 1e6:.2f} us a launch):")
  print(decode_check.table(points))
  return 0


def main(argv):
  del argv
  logs.setup()
  os.makedirs(FLAGS.out, exist_ok=True)
  concurrencies = [int(c) for c in FLAGS.concurrency]
  if FLAGS.topology == step_time.CPU:
    return _on_this_cpu(concurrencies)
  chip, points = decode_roofline.measure(FLAGS.config, FLAGS.topology, concurrencies, FLAGS.prompt_tokens,
                                         FLAGS.response_tokens)
  with open(os.path.join(FLAGS.out, "decode_roofline.json"), "w") as f:
    json.dump(dict(chip, points=[dict(dataclasses.asdict(p), ratio=p.ratio) for p in points]), f, indent=2)
  print(f"{chip['topology']} mesh {chip['mesh']} ({chip['layout']} layout) attention {chip['attention_backend']}; "
        "per chip:")
  print(decode_roofline.table(points))
  return 1 if any(p.error for p in points) else 0


if __name__ == "__main__":
  app.run(main, flags_parser=runtime.parse_flags)
