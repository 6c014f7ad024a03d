r"""GRPO on GSM8K-format math with a Qwen-shaped policy: the reference study's family shape on real hardware.

Members scale prompts per step (64 ... 4096) at group size 8; lr0 = 1e-6 at 128 prompts (B0 = 1,024 rollouts),
retuned by the sqrt rule. A member is chosen by `batch=` (rollouts per step) or `prompts=` (batch = prompts x group
size), `lr_rule=` and `seed=`, the arguments every family config shares. `model=` picks the policy:
  tiny_random     a 2-layer Qwen2-style model with the bundled sample tokenizer: runs end to end on a CPU on the
                  bundled sample data (a smoke run, not a learning result). Group size 4, B0 = 16 rollouts with
                  lr0 = 1e-4, 64 samples per member: batch=16 and batch=32 make a two-member study.
  tiny_moe        the same smoke run with a 2-layer Qwen3-MoE-style model (QK-norm, untied, 8 experts, 2 per token,
                  as many active parameters as tiny_random's MLPs).
  qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen3-30b-a3b
                  shapes of the released checkpoints; set `init_from` to the Hugging Face directory (config.json,
                  *.safetensors, tokenizer.json) and `task.path` to your GSM8K JSONL file. qwen3-30b-a3b is the
                  reference study's mixture of experts (30.5B parameters, 3.3B active: 128 experts, 8 per token).
`lora=<rank>` trains LoRA adapters of that rank (alpha LORA_ALPHA) on the frozen base instead of every weight, with
the LoRA family's base lr: LORA_BASE_LR at B0 (TINY_LORA_BASE_LR for the tiny models). `colab` sets one small
accelerator's run (a Colab TPU v5e-1 or a 16 GB GPU: COLAB below and demos/grpo_qwen_colab.ipynb): one chip, prompts
of at most 256 tokens and responses of 512, 8 prompts x 8 samples per step, micro-batches of 8, a short budget.
With `lora=16` it fits qwen2.5-0.5b and qwen2.5-1.5b on one v5e chip; full fine-tuning of qwen2.5-1.5b does not
(docs/results/2026-12-06-lora-v5e.md).
`mesh=DxFxT` or `mesh=DxFxTxE` sets the (data, fsdp, tensor) mesh and optionally its expert axis E (default 1;
MoE experts and the batch are split over it); -1 takes the remaining devices. Without `mesh`, the model's default
(MESHES): 1x-1x1x8 for qwen3-30b-a3b (8 expert groups, fsdp over the rest), -1x1x1 otherwise.

Commands (from the repository root):
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --workdir=/tmp/gsm8k_tiny
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=tiny_moe --workdir=/tmp/gsm8k_tiny_moe
  python -m launch.study --config=configs/grpo_gsm8k_qwen.py:model=tiny_random --batches=16,32 --rules=sqrt \
      --workdir=/tmp/gsm8k_tiny_study
  python -m launch.analyze --workdir=/tmp/gsm8k_tiny_study --target=0.5
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-0.5b,prompts=128 --workdir=/tmp/q05 \
      --config.init_from=/data/Qwen2.5-0.5B-Instruct --config.task.path=/data/gsm8k/train.jsonl \
      --config.task.eval_path=/data/gsm8k/test.jsonl
  python -m launch.train --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-0.5b,lora=16,colab --workdir=/tmp/q05_lora \
      --config.init_from=/data/Qwen2.5-0.5B-Instruct --config.task.path=/data/gsm8k/train.jsonl \
      --config.task.eval_path=/data/gsm8k/test.jsonl
  python -m launch.aot_check --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-1.5b,lora=16,colab --topology=v5e:1x1 \
      --prompt_tokens=256 --response_tokens=512 --out=/tmp/aot_q15_lora
  python -m launch.train --distributed --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-7b,mesh=1x-1x4 ...
  python -m launch.train --distributed --config=configs/grpo_gsm8k_qwen.py:model=qwen3-30b-a3b,mesh=1x-1x1x8 \
      --config.init_from=/data/Qwen3-30B-A3B ...
"""
import ml_collections

from configs import base
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
# LoRA (`lora=<rank>`): the adapters' lr is ~10x full fine-tuning's. TRL's "LoRA Without Regret" guide (Schulman et
# al. 2025, reproduced with GRPO on SmolLM3-3B: https://huggingface.co/docs/trl/main/en/lora_without_regret) trains
# LoRA at 1e-5 where full fine-tuning takes 1e-6, with alpha 32 at every rank (ranks 1-32 for RL): under LoRA's
# alpha / rank scaling the best lr then hardly depends on the rank. We keep that alpha and put that lr at our B0 (TRL
# ran 8 rollouts per optimizer step, so the sqrt rule from 1,024 rollouts makes ours the more cautious); untested on
# the hardware here.
LORA_ALPHA = 32.0  # alpha at every rank (2 x rank at the notebook's rank 16).
LORA_BASE_LR = 1e-5  # lr0 of the LoRA family at B0 (10 x BASE_LR).
# The tiny smoke family's LoRA lr0 at TINY_BASE_BATCH, by the same ratio (10 x TINY_BASE_LR). Its smoke run checks
# the mechanics (the adapters get gradients and move), not learning: the 2-layer model learns no GSM8K at either lr.
TINY_LORA_BASE_LR = 1e-3
# `colab`: one chip of 16 GB (a Colab TPU v5e-1, a T4 GPU): the model's weights in bfloat16 (QWEN2), blocks
# recomputed in the backward pass, 8 prompts x GROUP_SIZE samples per step (B = 64) in micro-batches of 8, prompts
# cut at COLAB_PROMPT_TOKENS (+ the chat template: prompt_len <= 256) and responses at 512 tokens, and a budget of
# 64 steps with a held-out evaluation of 128 GSM8K problems every 8 and a group of completions as text every step
# (samples.jsonl). The prompt asks for the answer after '####', which the strict reward reads.
COLAB_PROMPTS = 8
COLAB_PROMPT_TOKENS = 216  # The question's tokens; Qwen2.5's chat template adds ~30 and the trainer 4 spare.
COLAB_RESPONSE_TOKENS = 510  # + the trainer's 2 extra tokens (extra_response_tokens) = 512.
COLAB_TEMPLATE = ("{question}\nThink step by step, then write the final answer as a number on its own line after "
                  "'####'.")

QWEN2 = dict(qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6, dtype="bfloat16", param_dtype="bfloat16")
# Qwen3-MoE: QK-norm, no q/k/v bias, untied head, every layer a mixture of experts with renormalised top-k weights.
QWEN3_MOE = dict(qk_norm=True, tie_embeddings=False, rope_theta=1_000_000.0, norm_eps=1e-6, norm_topk_prob=True,
                 decoder_sparse_step=1)
MODELS = {
    "tiny_random": dict(vocab_size=400, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                        tie_embeddings=True, qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6),
    "tiny_moe": dict(vocab_size=400, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                     num_experts=8, num_experts_per_tok=2, moe_d_ff=64, **QWEN3_MOE),
    "qwen2.5-0.5b": dict(vocab_size=151_936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                         d_ff=4864, tie_embeddings=True, **QWEN2),
    "qwen2.5-1.5b": dict(vocab_size=151_936, d_model=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         d_ff=8960, tie_embeddings=True, **QWEN2),
    "qwen2.5-7b": dict(vocab_size=152_064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       d_ff=18_944, tie_embeddings=False, **QWEN2),
    # d_ff is config.json's intermediate_size (unused: no layer is dense), kept so init_from's shape check passes.
    # Float32 master weights (and so Adam moments) under bfloat16 compute: an Adam step of the recipe's lr 1e-6
    # rounds away in bfloat16 weights (docs/scaling.md).
    "qwen3-30b-a3b": dict(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                          d_ff=6144, num_experts=128, num_experts_per_tok=8, moe_d_ff=768, dtype="bfloat16",
                          param_dtype="float32", **QWEN3_MOE),
}
# Response budget in tokens per model (task.max_response_tokens; the others 1,024): the reference study's 8,192.
RESPONSE_TOKENS = {"qwen3-30b-a3b": 8192}
TINY = ("tiny_random", "tiny_moe")  # CPU smoke models: the bundled sample data and tokenizer.
# Default `mesh=` per model (data x fsdp x tensor[x expert]): 128 experts in 8 expert groups, fsdp over the rest.
MESHES = {"qwen3-30b-a3b": "1x-1x1x8"}
DEFAULT_MESH = "-1x1x1"


def parse(arg: str | None) -> ml_collections.ConfigDict:
  return parse_arg(arg, model="tiny_random", batch=0, prompts=0, lr_rule="sqrt", seed=0, mesh="", lora=0, colab=False,
                   debug=False)


def batch_size(batch: int, prompts: int, group_size: int, base_batch: int) -> int:
  """Rollouts per step from `batch=` and/or `prompts=` (batch = prompts x group size); `base_batch` without either."""
  if batch and prompts and batch != prompts * group_size:
    raise ValueError(f"batch={batch} and prompts={prompts} disagree: batch = prompts x group size {group_size} = "
                     f"{prompts * group_size}; give one of them.")
  return batch or prompts * group_size or base_batch


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: 'model=<one of MODELS>,batch=<rollouts per step>,prompts=<per step>,lr_rule=<rule>,seed=<int>,
  mesh=<DxFxT[xE]>,lora=<rank>,colab,debug' (debug = the tiny_random smoke run; colab = one small accelerator, a
  real model). Without `batch` or `prompts`, the member is the family's base (with colab: COLAB_PROMPTS prompts)."""
  arg = parse(arg)
  if arg.debug:
    arg.model = "tiny_random"
  if arg.model not in MODELS:
    raise ValueError(f"model={arg.model!r}: use one of {sorted(MODELS)}.")
  tiny = arg.model in TINY
  if arg.colab and tiny:
    raise ValueError(f"colab sets a real model's run on one chip; model={arg.model} is a CPU smoke model already.")
  group_size = TINY_GROUP_SIZE if tiny else GROUP_SIZE  # The family scales prompts per step (P = B / G).
  base_batch = TINY_BASE_BATCH if tiny else BASE_PROMPTS * GROUP_SIZE
  if arg.lora:
    base_lr = TINY_LORA_BASE_LR if tiny else LORA_BASE_LR
  else:
    base_lr = TINY_BASE_LR if tiny else BASE_LR
  prompts = arg.prompts or (COLAB_PROMPTS if arg.colab and not arg.batch else 0)
  c = base.get_config(base.parse(f"lr_rule={arg.lr_rule},seed={arg.seed},lora={arg.lora}"),
                      batch=batch_size(arg.batch, prompts, group_size, base_batch), group_size=group_size,
                      base_lr=base_lr, base_batch=base_batch)
  if arg.lora:
    c.lora.alpha = LORA_ALPHA
  c.task.update(gsm8k.default_config())
  c.task.name = "gsm8k"  # JSONL rows {"question", "answer": "... #### N"}; task.path "" = the bundled sample.
  c.task.extraction = "flexible" if tiny else "strict"  # Reward: the number after '####' (strict) or the last one.
  c.task.max_response_tokens = 0 if tiny else RESPONSE_TOKENS.get(arg.model, 1024)
  c.tokenizer_path = SAMPLE_TOKENIZER if tiny else ""  # "" with init_from: the checkpoint's tokenizer.json.
  c.chat_template = "none" if tiny else "auto"
  c.model.update(MODELS[arg.model])  # The recipe's model group (every ModelConfig field) shaped as the model.
  c.mesh = ml_collections.ConfigDict(sharding.mesh_sizes(arg.mesh or MESHES.get(arg.model, DEFAULT_MESH)))

  c.micro_batch_size = 8 if tiny else 64
  # Real shapes: blocks recomputed in the backward pass, and the step's batch scored 64 rollouts per forward (the
  # whole batch in one forward needs ~746 GiB per chip for qwen2.5-1.5b at 4k tokens: docs/scaling.md).
  c.model.remat = "none" if tiny else "block"
  c.score_micro_batch_size = 0 if tiny else 64
  c.rl.clip_high = 0.28  # Clip-higher (DAPO).
  c.optim.warmup_samples = 0
  c.sample_budget = 512 * 1024  # 512 steps of the base member.
  c.eval_every_samples = 32 * 1024
  c.checkpoint_every_samples = 32 * 1024
  if tiny:  # A CPU smoke run of a few steps.
    c.sample_budget = 64
    c.eval_every_samples = c.checkpoint_every_samples = 32
    c.log_every_steps = 1
    c.sft.update(steps=30, batch_size=8, warmup_steps=2, lr=3e-3)
  if arg.colab:
    colab(c, arg.mesh)
  return c


def colab(c: ml_collections.ConfigDict, mesh: str) -> None:
  """One 16 GB accelerator's run (the `colab` argument; COLAB_* above say what and why)."""
  c.mesh = ml_collections.ConfigDict(sharding.mesh_sizes(mesh or "1x1x1"))
  c.task.update(max_prompt_tokens=COLAB_PROMPT_TOKENS, max_response_tokens=COLAB_RESPONSE_TOKENS,
                prompt_template=COLAB_TEMPLATE, num_eval=128)
  c.micro_batch_size = 8
  c.score_micro_batch_size = 16
  c.sample_budget = 64 * COLAB_PROMPTS * GROUP_SIZE
  c.eval_every_samples = 8 * COLAB_PROMPTS * GROUP_SIZE
  c.checkpoint_every_samples = 16 * COLAB_PROMPTS * GROUP_SIZE
  c.log_every_steps = 1
  c.log_samples_every_steps = 1


def sweep() -> list[dict]:
  """The reference study's members: 64 ... 4096 prompts per step at group size 8 under the sqrt rule, for a Qwen
  model (`launch.study --config=configs/grpo_gsm8k_qwen.py:model=qwen2.5-0.5b`; the tiny models take
  --batches=16,32)."""
  return [dict(batch=p * GROUP_SIZE, lr_rule="sqrt") for p in (64, 128, 256, 512, 1024, 2048, 4096)]
