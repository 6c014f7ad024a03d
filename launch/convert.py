r"""Converts Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE checkpoints to our format (orbax params +
model_config.json) and back.

  python -m launch.convert --hf_dir=/ckpt/Qwen2.5-0.5B-Instruct --out=/tmp/qwen05
  python -m launch.convert --direction=export --ckpt_dir=/tmp/qwen05 --out=/tmp/qwen05_hf
  python -m launch.convert --direction=export --ckpt_dir=/tmp/run/checkpoints --params_key=params \
      --model_config=/tmp/run/config.json --out=/tmp/run_hf --dtype=bfloat16
  # a run with config.lora: a PEFT adapter directory; --merged: the full checkpoint of the merged weights
  python -m launch.convert --direction=export --ckpt_dir=/tmp/lora_run/checkpoints --params_key=params \
      --model_config=/tmp/lora_run/config.json --out=/tmp/lora_run_adapter [--merged]

Import loads each tensor sharded over --mesh (data,fsdp,tensor[,expert]; one size may be -1; expert, default 1,
splits MoE experts, e.g. --mesh=1,-1,1,8) and writes the layout of a cached base policy (see
jaxrl_batch/hf/converted.py). Export writes safetensors + config.json that
`transformers.AutoModelForCausalLM.from_pretrained` loads, with the source's tokenizer files when known.
"""
import jax
from absl import app, flags, logging

from jaxrl_batch.hf import export_hf, import_hf
from jaxrl_batch.runtime import sharding
from launch import list_flags, logs

flags.DEFINE_enum("direction", "import", ["import", "export"], "import: HF -> ours; export: ours -> HF.")
flags.DEFINE_string("hf_dir", None, "import: the Hugging Face checkpoint directory to read.")
flags.DEFINE_string("ckpt_dir", None, "export: a converted directory, base policy, or a run's checkpoints/.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string("model_config", None, "export: ModelConfig JSON or a run's config.json "
                    "(default: CKPT_DIR/model_config.json).")
flags.DEFINE_string("params_key", None, "export: key of the params in the checkpointed state ('params' for runs).")
flags.DEFINE_bool("merged", False, "export of a run with LoRA adapters: write the merged full checkpoint instead of "
                  "a PEFT adapter directory.")
flags.DEFINE_integer("step", None, "export: checkpoint step (default: latest).")
flags.DEFINE_string("dtype", None, "Parameter dtype written: float32 or bfloat16 (import default: float32; "
                    "export default: the checkpoint's).")
flags.DEFINE_list("mesh", ["1", "-1", "1"], "Mesh sizes data,fsdp,tensor[,expert] the params are sharded over "
                  "(expert, default 1, splits MoE experts; one size may be -1).")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (multi-host).")
list_flags.integers("mesh", -1, "a mesh axis size (-1 takes the remaining devices)", "1,-1,1")
flags.mark_flags_as_required(["out"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if FLAGS.distributed:
    jax.distributed.initialize()
  logs.setup()
  try:
    mesh = sharding.make_mesh(**sharding.mesh_sizes(",".join(FLAGS.mesh), sep=","))
  except ValueError as e:
    raise app.UsageError(f"--mesh: {e}") from None
  if FLAGS.direction == "import":
    if not FLAGS.hf_dir:
      raise app.UsageError("--direction=import needs --hf_dir.")
    cfg = import_hf(FLAGS.hf_dir, FLAGS.out, mesh=mesh, dtype=FLAGS.dtype or "float32")
  else:
    if not FLAGS.ckpt_dir:
      raise app.UsageError("--direction=export needs --ckpt_dir.")
    cfg = export_hf(FLAGS.ckpt_dir, FLAGS.out, model_config=FLAGS.model_config, step=FLAGS.step,
                    params_key=FLAGS.params_key, mesh=mesh, dtype=FLAGS.dtype, merged=FLAGS.merged)
  logging.info("Wrote %s (%.2fM parameters): %s", FLAGS.out, cfg.num_params() / 1e6, cfg)


if __name__ == "__main__":
  app.run(main)
