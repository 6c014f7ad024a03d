r"""GRPO on GSM8K-format math with a Qwen-shaped policy: the reference study's family shape on real hardware.

Members scale prompts per step (64 ... 4096) at group size 8; lr0 = 1e-6 at 128 prompts (B0 = 1,024 rollouts),
retuned by the sqrt rule. A member is chosen by `batch=` (rollouts per step) or `prompts=` (batch = prompts x group
size), `lr_rule=` and `seed=`, the arguments every family config shares. `model=` picks the policy:
  tiny_random     a 2-layer Qwen2-style model with the bundled sample tokenizer: runs end to end on a CPU on the
                  bundled sample data (a smoke run, not a learning result). Group size 4, B0 = 16 rollouts with
                  lr0 = 1e-4, 64 samples per member: batch=16 and batch=32 make a two-member study.
  qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b
                  shapes of the released checkpoints; set `init_from` to the Hugging Face directory (config.json,
                  *.safetensors, tokenizer.json) and `task.path` to your GSM8K JSONL file.
`mesh=DxFxT` sets the (data, fsdp, tensor) mesh; -1 takes the remaining devices.

Commands (from the repository root):
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --workdir=/tmp/gsm8k_tiny
  python -m launch.study --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --batches=16,32 --rules=sqrt \
      --workdir=/tmp/gsm8k_tiny_study
  python -m launch.analyze --workdir=/tmp/gsm8k_tiny_study --target=0.5
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-0.5b,prompts=128 --workdir=/tmp/q05 \
      --config.init_from=/data/Qwen2.5-0.5B-Instruct --config.task.path=/data/gsm8k/train.jsonl \
      --config.task.eval_path=/data/gsm8k/test.jsonl
  python -m launch.train --distributed --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-7b,mesh=1x-1x4 ...
"""
import ml_collections

from configs import grpo_arith
from jaxrl_batch.config.args import parse_arg
from jaxrl_batch.runtime import sharding
from jaxrl_batch.tasks import gsm8k
from jaxrl_batch.tasks.sample_tokenizer import PATH as SAMPLE_TOKENIZER

GROUP_SIZE = 8  # Samples per prompt.
BASE_PROMPTS = 128  # Prompts per step of the base member (B0 = 1,024 rollouts).
BASE_LR = 1e-6  # lr0 at B0.
TINY_GROUP_SIZE = 4  # The tiny_random smoke family: group size,
TINY_BASE_BATCH = 16  # B0 in rollouts (4 prompts),
TINY_BASE_LR = 1e-4  # and lr0 at B0.

QWEN2 = dict(qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6, dtype="bfloat16", param_dtype="bfloat16")
MODELS = {
    "tiny_random": dict(vocab_size=400, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                        tie_embeddings=True, qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6),
    "qwen2.5-0.5b": dict(vocab_size=151_936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                         d_ff=4864, tie_embeddings=True, **QWEN2),
    "qwen2.5-1.5b": dict(vocab_size=151_936, d_model=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         d_ff=8960, tie_embeddings=True, **QWEN2),
    "qwen2.5-7b": dict(vocab_size=152_064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       d_ff=18_944, tie_embeddings=False, **QWEN2),
}


def parse(arg: str | None) -> ml_collections.ConfigDict:
  return parse_arg(arg, model="tiny_random", batch=0, prompts=0, lr_rule="sqrt", seed=0, mesh="-1x1x1", debug=False)


def batch_size(batch: int, prompts: int, group_size: int, base_batch: int) -> int:
  """Rollouts per step from `batch=` and/or `prompts=` (batch = prompts x group size); `base_batch` without either."""
  if batch and prompts and batch != prompts * group_size:
    raise ValueError(f"batch={batch} and prompts={prompts} disagree: batch = prompts x group size {group_size} = "
                     f"{prompts * group_size}; give one of them.")
  return batch or prompts * group_size or base_batch


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: 'model=<tiny_random|qwen2.5-0.5b|qwen2.5-1.5b|qwen2.5-7b>,batch=<rollouts per step>,prompts=<per step>,
  lr_rule=<rule>,seed=<int>,mesh=<DxFxT>,debug' (debug = the tiny_random smoke run). Without `batch` or `prompts`,
  the member is the family's base."""
  arg = parse(arg)
  if arg.debug:
    arg.model = "tiny_random"
  if arg.model not in MODELS:
    raise ValueError(f"model={arg.model!r}: use one of {sorted(MODELS)}.")
  tiny = arg.model == "tiny_random"
  mesh = arg.mesh.split("x")
  if len(mesh) != 3:
    raise ValueError(f"mesh={arg.mesh!r}: write data x fsdp x tensor, e.g. 1x-1x1 or 2x4x1.")
  c = grpo_arith.get_config(f"lr_rule={arg.lr_rule},seed={arg.seed}")
  c.task = gsm8k.default_config()
  c.task.name = "gsm8k"  # JSONL rows {"question", "answer": "... #### N"}; task.path "" = the bundled sample.
  c.task.extraction = "flexible" if tiny else "strict"  # Reward: the number after '####' (strict) or the last one.
  c.tokenizer_path = SAMPLE_TOKENIZER if tiny else ""  # "" with init_from: the checkpoint's tokenizer.json.
  c.init_from = ""  # Hugging Face directory to start from instead of the supervised warm start.
  c.chat_template = "none" if tiny else "auto"  # Prompt wrapping: auto (from the tokenizer) | none | chatml | ...
  c.model = ml_collections.ConfigDict(MODELS[arg.model])
  c.mesh = ml_collections.ConfigDict(dict(data=int(mesh[0]), fsdp=int(mesh[1]), tensor=int(mesh[2])))
  c.sharding_rules = sharding.DEFAULT_RULES

  c.group_size = TINY_GROUP_SIZE if tiny else GROUP_SIZE  # The family scales prompts per step (P = B / G).
  base_batch = TINY_BASE_BATCH if tiny else BASE_PROMPTS * GROUP_SIZE
  c.batch_size = batch_size(arg.batch, arg.prompts, c.group_size, base_batch)
  c.micro_batch_size = 8 if tiny else 64
  c.rl.update(estimator="grpo", clip_low=0.2, clip_high=0.28, loss_agg="token_mean")
  c.sampling.temperature = 1.0
  c.optim.update(base_lr=TINY_BASE_LR if tiny else BASE_LR, base_batch=base_batch, lr_rule=arg.lr_rule,
                 warmup_samples=0, weight_decay=0.0, grad_clip=1.0)
  c.task.max_response_tokens = 0 if tiny else 1024
  c.sample_budget = 512 * 1024  # 512 steps of the base member.
  c.eval_every_samples = 32 * 1024
  c.checkpoint_every_samples = 32 * 1024
  if tiny:  # A CPU smoke run of a few steps.
    c.sample_budget = 64
    c.eval_every_samples = c.checkpoint_every_samples = 32
    c.log_every_steps = 1
    c.sft.update(steps=30, batch_size=8, warmup_steps=2, lr=3e-3)
  return c


def sweep() -> list[dict]:
  """The reference study's members: 64 ... 4096 prompts per step at group size 8 under the sqrt rule, for a Qwen
  model (`launch.study --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-0.5b`; tiny_random takes --batches=16,32)."""
  return [dict(batch=p * GROUP_SIZE, lr_rule="sqrt") for p in (64, 128, 256, 512, 1024, 2048, 4096)]
