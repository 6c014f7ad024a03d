r"""GRPO on synthetic integer arithmetic: a batch family that runs end to end on a laptop CPU.

A member of the family is chosen by its batch size B (rollouts per update = prompts x group size) and the rule
that retunes the learning rate from the base member (B0 = `optim.base_batch`, lr0 = `optim.base_lr`):
  none: lr = lr0,  linear: lr = lr0 * B / B0,  sqrt: lr = lr0 * sqrt(B / B0).
The rule is applied when the trainer builds the optimizer, so `--config.batch_size=...` stays consistent;
an explicit `--config.optim.lr=...` wins and is logged as an override.

Commands (from the repository root):
  python -m launch.train --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith
  python -m launch.train --config=configs/grpo_arith.py:batch=256,lr_rule=sqrt --workdir=/tmp/arith_b256
  python -m launch.train --config=configs/grpo_arith.py:debug --workdir=/tmp/arith_debug   # < 1 minute
  python -m launch.train --config=configs/grpo_arith.py:moe --workdir=/tmp/arith_moe       # mixture of experts
  python -m launch.sft --config=configs/grpo_arith.py --workdir=/tmp/arith_base             # warm start only
"""
import ml_collections

from jaxrl_batch.config.args import parse_arg
from jaxrl_batch.runtime import sharding
from jaxrl_batch.tasks import arithmetic

BASE_BATCH = 128  # B0: the family's reference member (16 prompts x 8 samples).
BASE_LR = 5e-5  # lr0 at B0 (Adam).
GROUP_SIZE = 8  # Samples per prompt when the family scales prompts per step.
BASE_PROMPTS = BASE_BATCH // GROUP_SIZE  # Prompts per step when the family scales the group size.


def parse(arg: str | None) -> ml_collections.ConfigDict:
  """The config argument's fields, with defaults."""
  return parse_arg(arg, batch=0, lr_rule="sqrt", seed=0, family_axis="prompts", debug=False, moe=False)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: 'batch=<rollouts per update>,lr_rule=<none|linear|sqrt|adam_sde>,seed=<int>,
  family_axis=<prompts|group_size>,debug,moe'.

  Without `batch`, the member is the family's base (B0 = 128; under `debug`, B = 32 with lr0 = 2e-3). `moe` swaps
  each block's SwiGLU for a mixture of experts (`moe_config`) with as many active parameters as the dense model has
  in all; the rest of the recipe is unchanged.
  """
  arg = parse(arg)
  if arg.family_axis not in ("prompts", "group_size"):
    raise ValueError(f"family_axis={arg.family_axis!r}: use prompts (group size fixed) or group_size.")
  c = ml_collections.ConfigDict()
  c.seed = arg.seed  # Seeds init, prompts and sampling; every step's randomness is derived from (seed, step).

  c.task = arithmetic.default_config()
  c.task.name = "arithmetic"  # Registered task name (jaxrl_batch.tasks.TASKS).
  c.task.max_digits = 2  # Operands 0..99: learnable by a 1M-parameter model in ~2 minutes of CPU SFT.
  # The warm-start corpus writes most differences as decimals ("-7.0", "-7."), which the strict reward rejects,
  # and most sums plainly: the base policy is right on sums only, and RL must carry the strict format over.
  c.task.sft_strict_frac_add = 0.9
  c.task.sft_strict_frac_sub = 0.2
  # Scoring, for any task (may change on resume): a reward past the timeout scores 0 and is counted
  # (`reward_timeouts`); threads running the reward function; with the continuous engine, score responses as they
  # end, while decoding goes on.
  c.task.reward_timeout_s = 30.0
  c.task.reward_workers = 1
  c.task.stream_rewards = True
  c.tokenizer_path = ""  # SentencePiece .model file; "" uses the task's bundled tokenizer.

  c.model = ml_collections.ConfigDict(dict(
      vocab_size=32,  # Embedding rows; must be >= the tokenizer's vocabulary.
      d_model=128,  # Residual width.
      num_layers=4,  # Decoder blocks.
      num_heads=4,  # Query heads.
      num_kv_heads=2,  # Key/value heads (GQA).
      head_dim=32,  # Width of one head.
      d_ff=512,  # SwiGLU hidden width.
      rope_theta=10_000.0,  # RoPE base.
      norm_eps=1e-6,  # RMSNorm epsilon.
      tie_embeddings=True,  # Share the embedding table with the output head.
      dtype="float32",  # Activations ("float32" | "bfloat16").
      param_dtype="float32",  # Parameters.
      logits_chunk=1024,  # Positions whose float32 logits exist at once in training and scoring (0 = all).
      remat="none",  # What a block keeps for the backward pass: "none" | "block" | "dots" (recompute the rest).
      attention="auto",  # Uncached forward: auto (CPU dense, TPU splash, GPU flash_gpu) | dense | splash | flash_gpu.
  ))

  # Device mesh (runtime.sharding.make_mesh); -1 takes the rest. `expert` splits MoE experts (and the batch).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))
  c.sharding_rules = sharding.DEFAULT_RULES  # Logical axis -> mesh axes.
  # Generation on devices of its own (needs rl.max_staleness >= 1): the last `devices` devices, with this mesh
  # shape, sample while the others train; 0 = colocated (generation and update share the mesh). On a CPU host,
  # `process_cores` (e.g. "0") instead generates in a child process pinned to those cores, the learner on the others
  # (`train.generator_process`: weights shipped after every update); "" = in this process.
  c.rollout_mesh = ml_collections.ConfigDict(dict(devices=0, data=-1, fsdp=1, tensor=1, expert=1, process_cores=""))

  c.algo = "grpo"  # RL algorithm: grpo (critic-free) | ppo (critic + GAE; see configs/ppo_arith.py).
  c.batch_size = arg.batch or BASE_BATCH  # B: rollouts per step (= prompts per step x group_size).
  # Batch axis the family scales: prompts (group_size fixed, num_prompts = B / G) | group_size (num_prompts fixed,
  # group_size = B / P). `--config.batch_size=` then changes the other factor (config.json's "derived" says how).
  c.family_axis = arg.family_axis
  by_prompts = arg.family_axis == "prompts"
  c.group_size = GROUP_SIZE if by_prompts else 0  # Samples per prompt G (group estimators compare them); 0 = derived.
  c.num_prompts = 0 if by_prompts else BASE_PROMPTS  # Prompts per step P; 0 = derived.
  # Rollouts per forward/backward (gradient accumulation; 0 = the whole mini-batch). With >= 2 micro-batches per
  # update the trainer also logs the gradient noise scale B_simple (`noise_scale`).
  c.micro_batch_size = 32
  # Rollouts per forward when scoring a step's batch (the trainer's old log-probs, the reference's, the critic's old
  # values): forward only, no activations kept for a backward pass, so it may exceed micro_batch_size. 0 = the whole
  # batch in one forward.
  c.score_micro_batch_size = 0
  # > 0: pack sequences (padding stripped) into micro-batches of about this many tokens instead: rows of
  # prompt_len + response_len tokens, micro_batch_tokens // that rows each, as many micro-batches as the tokens
  # fill (a forward's cost follows the tokens). Every forward packs: the update, trainer log-probs, the reference,
  # the critic, the warm start. 0 = micro_batch_size padded rows.
  c.micro_batch_tokens = 0
  c.rl = rl_config()
  c.critic = critic_config()
  c.sampling = ml_collections.ConfigDict(dict(
      temperature=1.0,  # Rollout temperature (the trainer scores log-probs at the same temperature).
      top_k=0,  # 0 = off.
      top_p=1.0,  # 1.0 = off.
      attention_backend="auto",  # Decode attention: auto (pallas on GPU, else xla; TPU: xla) | xla | pallas.
      engine="static",  # static (one block, run to its longest response) | continuous (slots refilled as rows end).
      slots=0,  # Sequences decoding at once per device (0 = the whole batch); static decodes blocks of this many.
      chunk=16,  # Continuous engine: decode steps between two host syncs (one small transfer each way).
      page_size=0,  # Continuous engine: > 0 pages the KV cache (sequences hold pages as they grow; one device).
      pages=0,  # Paged cache: growable pages (0 = every slot at the longest length; fewer preempt and re-prefill).
  ))
  c.rollout = ml_collections.ConfigDict(dict(
      partial=False,  # Partial rollouts: slots never drain; unfinished sequences continue next step (continuous).
      partial_budget=0,  # Decode steps a step runs at least before it stops (it stops once B rollouts are complete).
      max_lookahead=1,  # Prompts of up to this many steps ahead may start decoding while a step's batch completes.
  ))
  c.extra_response_tokens = 2  # Response budget beyond the longest correct answer (+EOS); longer = truncated.

  c.optim = ml_collections.ConfigDict(dict(
      base_lr=BASE_LR,  # lr0 of the family's base member.
      base_batch=BASE_BATCH,  # B0 (rollouts per update) at which base_lr was tuned.
      lr_rule=arg.lr_rule,  # How lr follows B: none | linear | sqrt.
      lr=-1.0,  # Explicit peak lr; > 0 overrides the rule (logged).
      b1=0.9,  # Adam beta1.
      b2=0.999,  # Adam beta2.
      eps=1e-8,  # Adam epsilon.
      weight_decay=0.0,  # Decoupled weight decay (AdamW).
      grad_clip=1.0,  # Global-norm gradient clip; 0 disables.
      warmup_samples=1024,  # Linear warmup length in samples (rollouts), the same for every member.
      schedule="constant",  # constant | cosine (decays to final_lr_frac * peak at sample_budget).
      final_lr_frac=0.1,  # End of the cosine, as a fraction of the peak lr.
  ))

  c.sample_budget = 49_152  # Total rollouts of the run: every member trains on the same number of samples.
  c.eval_every_samples = 4096  # Greedy held-out evaluation cadence, in samples.
  # > 0: the run ends (saving a checkpoint) at the first evaluation whose held-out accuracy reaches this; a study's
  # members then stop once past the target they are analysed at. 0 = every run trains to sample_budget.
  c.stop_at_accuracy = 0.0
  # Sampled evaluation (train.evaluation), may change on resume: k completions per held-out problem (0 = greedy
  # only), logged as eval_pass1, eval_pass_at_k, eval_maj_at_k beside the greedy eval_accuracy.
  c.eval = ml_collections.ConfigDict(dict(
      num_samples=0,  # k samples per held-out problem; 0 = off.
      temperature=1.0,  # Temperature of those samples (> 0; no top-k / top-p).
      # Sequences decoded at once per device by the run's sampling.engine (0 = every held-out row at once); with the
      # continuous engine, fewer slots than rows make the cost follow the tokens.
      slots=0,
  ))
  c.checkpoint_every_samples = 4096  # Checkpoint cadence, in samples.
  c.log_every_steps = 5  # Progress line cadence, in steps (the line shows one of the step's completions).
  c.log_samples_every_steps = 10  # samples.jsonl cadence, in steps (0 = never): a few rollouts as text.
  c.log_samples_count = 4  # Rollouts logged each time: the first of the batch (one prompt's group by default).
  c.log_samples_max_chars = 2000  # Longer prompts and completions keep their head and tail (0 = no limit).
  c.writers = ("jsonl",)  # Where metrics rows go (jaxrl_batch.train.writers): jsonl (always) | tensorboard | wandb.
  c.wandb = ml_collections.ConfigDict(dict(
      project="jaxrl_batch",  # W&B project.
      name="",  # Run name; "" = the workdir's basename.
      group="",  # Run group; "" = the study's directory for a study member, else '<task>_<algo>_<lr rule>'.
      mode="",  # online | offline | disabled; "" = W&B's default (WANDB_MODE).
  ))

  c.sft = ml_collections.ConfigDict(dict(
      steps=2000,  # Supervised warm-start steps (cross-entropy on the completion tokens).
      batch_size=64,  # Examples per SFT step.
      lr=1e-3,  # SFT peak lr (warmup then cosine to 0).
      warmup_steps=30,  # SFT warmup steps.
      cache_dir="",  # Where base checkpoints are cached; "" = ~/.cache/jaxrl_batch/base.
  ))

  if arg.debug:
    # Learns in seconds, so that tests of training and resume see every piece of run state matter: one-digit
    # operands, mostly loose sums in the warm start (greedy, the base policy solves none of the 16 held-out problems;
    # sampled, ~0.4 of its rollouts earn reward), and RL that makes them strict (~0.3 held-out within 192 samples),
    # with rewards and gradients from the first step.
    c.task.update(max_digits=1, num_eval=16, sft_strict_frac_add=0.3)
    c.model.update(d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, d_ff=128)
    c.batch_size = arg.batch or 32
    c.micro_batch_size = 8
    c.group_size, c.num_prompts = (4, 0) if by_prompts else (0, 8)
    c.optim.update(base_lr=2e-3, warmup_samples=32)  # lr = 1e-3 at the debug base batch 32 (sqrt rule).
    c.sample_budget = 192
    c.eval_every_samples = 64
    c.checkpoint_every_samples = 64
    c.log_every_steps = 1
    c.sft.update(steps=1000, batch_size=64, lr=3e-3, warmup_steps=30)
  if arg.moe:
    c.model.update(moe_config(c.model))
  return c


def moe_config(model: ml_collections.ConfigDict, num_experts: int = 8, k: int = 2) -> dict:
  """Mixture-of-experts fields for the dense `model`: every layer routes each token to k of `num_experts` experts of
  width d_ff / k, so a token's active parameters are the dense model's (plus the D x E routers)."""
  return dict(
      num_experts=num_experts,  # Experts E per MoE layer.
      num_experts_per_tok=k,  # Experts each token is routed to.
      moe_d_ff=model.d_ff // k,  # SwiGLU hidden width of one expert.
      norm_topk_prob=True,  # Renormalise the k chosen router probabilities (Qwen3-MoE).
      decoder_sparse_step=1,  # Every layer is an MoE layer.
  )


def rl_config() -> ml_collections.ConfigDict:
  """The algorithm's knobs (jaxrl_batch.rl.algorithm.AlgoConfig checks their combinations)."""
  return ml_collections.ConfigDict(dict(
      # Advantages: grpo (group mean/std) | drgrpo (group mean, no std) | rloo (leave-one-out mean) |
      # reinforce_pp (batch-whitened return) | reinforce_pp_baseline (group mean, then batch whitening) | gae (PPO).
      estimator="grpo",
      gamma=1.0,  # Discount over response tokens (reinforce_pp*, gae and the returns).
      lam=1.0,  # GAE lambda.
      whiten_advantages=False,  # Whiten advantages over the batch's response tokens (usual for PPO).
      clip_low=0.2,  # Ratio clip below: 1 - clip_low.
      clip_high=0.2,  # Ratio clip above: 1 + clip_high (clip-higher, DAPO: 0.28).
      dual_clip=0.0,  # Dual-clip constant c > 1 capping the loss of A < 0 tokens at -c * A; 0 = off.
      ratio_level="token",  # token | sequence (GSPO: the sequence's mean log-ratio on every token).
      # Loss aggregation, always over global counts of the mini-batch: token_mean | seq_mean_token_mean |
      # seq_mean_token_sum | constant (sum over tokens / loss_agg_constant, mean over sequences: Dr.GRPO).
      loss_agg="token_mean",
      loss_agg_constant=0.0,  # The constant normaliser in tokens; 0 = the response budget (max new tokens).
      kl_coef=0.0,  # KL weight (initial value when adaptive); 0 = no KL term and no reference model in memory.
      kl_estimator="k3",  # k1 | k2 | k3 (Schulman's estimators of KL(pi || pi_ref) per token).
      kl_in="loss",  # loss | reward (-kl_coef * k1 added to each token's reward; needs kl_estimator='k1').
      kl_target=0.0,  # > 0: adapt kl_coef towards this per-token KL (Ziegler et al.); 0 = fixed coefficient.
      kl_horizon=10_000,  # Adaptive controller horizon, in samples.
      epochs=1,  # Passes over each rollout batch.
      mini_batches=1,  # Optimizer updates per pass (the batch is shuffled and split into this many).
      old_logp="sampler",  # The ratio's denominator: sampler (behaviour log-probs) | trainer (recomputed).
      tis_cap=0.0,  # Importance weight pi_trainer / pi_sampler on the loss, bounded by this cap; 0 = off.
      # truncate: min(w, cap) (truncated IS) | mask: w, or 0 past the cap (the decoupled PPO objective of AReaL:
      # with old_logp='trainer' the clip is against the proximal policy, the weight corrects for the sampler's lag).
      tis_mode="truncate",
      # Asynchronous RL: generation runs up to this many steps ahead of the learner (a step's rollouts come from the
      # policy of that many steps before; 0 = synchronous). Pair it with old_logp='trainer' and a tis_cap.
      max_staleness=0,
      dynamic_sampling=False,  # Drop groups whose rewards are all equal and refill the batch (DAPO).
      max_sampling_rounds=3,  # Bound on sampling rounds per step under dynamic sampling.
      overlong="none",  # Truncated responses: none | mask (out of the loss) | penalty (reward offset).
      overlong_buffer=0,  # Penalty ramps from 0 at (response budget - buffer) tokens to -penalty at the budget.
      overlong_penalty=1.0,  # Reward offset of a truncated response (the end of the ramp).
      entropy_coef=0.0,  # Entropy bonus weight (0 = off; entropy is logged either way).
      # Log the gradient noise scale's inter-prompt (noise_inter) and intra-prompt (noise_intra) parts: the backward
      # pass runs for the loss and two signed variants of it (~2x the update's cost). False: noise_scale alone.
      noise_split=False,
  ))


def critic_config() -> ml_collections.ConfigDict:
  """The value model (used by algo='ppo' only) and its own optimizer and batch-family rule."""
  return ml_collections.ConfigDict(dict(
      share_backbone=False,  # True: value head on the policy; False: a separate critic network.
      num_layers=0,  # Separate critic: the policy's first num_layers blocks (0 = all), initialised from the base.
      vf_clip=0.2,  # Value clipping around the old values; 0 = off.
      vf_coef=1.0,  # Weight of the value loss (with a shared backbone it trades against the policy loss).
      warmup_steps=0,  # Steps at the start in which only the critic learns (the actor is frozen).
      optim=ml_collections.ConfigDict(dict(
          base_lr=1e-4,  # Critic lr0 at base_batch; retuned by its own lr_rule.
          base_batch=BASE_BATCH,  # B0 of the critic's family.
          lr_rule="sqrt",  # none | linear | sqrt | adam_sde, independent of the actor's.
          lr=-1.0,  # Explicit critic lr; > 0 overrides the rule.
          b1=0.9, b2=0.999, eps=1e-8,  # Adam.
          weight_decay=0.0,  # Decoupled weight decay.
          grad_clip=1.0,  # Global-norm clip; 0 disables.
          warmup_samples=0,  # Linear warmup in samples.
          schedule="constant",  # constant | cosine.
          final_lr_frac=0.1,  # End of the cosine.
      )),
  ))


def sweep() -> list[dict]:
  """The study's members (config args): the sqrt family over 64..512 rollouts per update, and `none` as the control."""
  return [dict(batch=b, lr_rule=rule) for rule in ("sqrt", "none") for b in (64, 128, 256, 512)]
