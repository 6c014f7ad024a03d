r"""The recipe every family shares: a family file (grpo_arith.py, ppo_arith.py, grpo_reasoning.py, grpo_gsm8k_qwen.py)
starts from `get_config` and states only what differs (its task, its base member, its budgets).

Defaults live here, each commented where it is set (or in the family file that changes it), except those of the
groups read into a dataclass (`model`, `lora`, `sampling`, `eval`): `group` lists every field of the dataclass at
its default, written and documented there only (and used as well by the library's own calls without a config), and
the recipe sets what it shapes. The library supplies no others: it reads the config's fields (no
`config.get(key, default)`), and the dataclasses that mirror a group (`rl.algorithm.AlgoConfig` for `rl` and
`critic`) are built from the config without defaults. A field added after runs were written also gets an entry in
`jaxrl_batch.config.migrate.ADDED`: the value those runs ran with, filled into an old config.json when it is read
(resume, branch, analysis) and named in a log line.

The arguments of the arithmetic-style families (`ARGS`): 'batch=<rollouts per step>,lr_rule=<none|linear|sqrt|
adam_sde>,seed=<int>,family_axis=<prompts|group_size>,lora=<rank>,debug,moe' (lora: a LoRA family of that rank, whose
base lr the family file sets).
"""
import dataclasses

import ml_collections

from jaxrl_batch import tasks
from jaxrl_batch.config.args import parse_arg
from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.model.lora import LoRAConfig
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling.engine_settings import EngineSettings
from jaxrl_batch.sampling.strategies import Strategy
from jaxrl_batch.train.evaluation import EvalConfig

ARGS = dict(batch=0, lr_rule="sqrt", seed=0, family_axis="prompts", lora=0, debug=False, moe=False)
CRITIC_BASE_BATCH = 128  # B0 of the critic's lr family (configs/ppo_arith.py's base member).


def parse(arg: str | None) -> ml_collections.ConfigDict:
  """The config argument's fields (`ARGS`), with defaults."""
  return parse_arg(arg, **ARGS)


def get_config(arg: ml_collections.ConfigDict, *, batch: int, group_size: int, base_lr: float,
               base_batch: int) -> ml_collections.ConfigDict:
  """The shared recipe for the member `arg` (parsed by `parse`) of a family whose default member trains on `batch`
  rollouts per step, `group_size` samples per prompt, and whose lr is `base_lr` at `base_batch` (B0).

  `debug` shrinks the model to 2 layers and logs every step; `moe` swaps each block's SwiGLU for a mixture of
  experts (`moe_config`) with as many active parameters as the dense model has in all. The family sets the task.
  """
  if arg.family_axis not in ("prompts", "group_size"):
    raise ValueError(f"family_axis={arg.family_axis!r}: use prompts (group size fixed) or group_size.")
  c = ml_collections.ConfigDict()
  c.seed = arg.seed  # Seeds init, prompts and sampling; every step's randomness is derived from (seed, step).

  # Scoring, for any task (may change on resume), with its defaults and their meaning in one place,
  # jaxrl_batch.tasks.SCORING_FIELDS: the reward's timeout, its threads, streamed rewards, and how many consecutive
  # steps whose every reward failed stop the run. The family adds its task's fields (`name`: jaxrl_batch.tasks.TASKS).
  c.task = ml_collections.ConfigDict(dict(tasks.SCORING_FIELDS))
  c.tokenizer_path = ""  # SentencePiece .model file; "" uses the task's bundled tokenizer (with init_from, its own).
  c.init_from = ""  # Hugging Face directory to start from instead of the supervised warm start.
  c.chat_template = "none"  # Prompt wrapping: auto (from the tokenizer) | none | chatml | ...

  # The policy (jaxrl_batch.model.ModelConfig: every field, documented there); the recipe sets the shape.
  c.model = group(ModelConfig,
      vocab_size=32,  # Embedding rows; must be >= the tokenizer's vocabulary.
      d_model=128,  # Residual width.
      num_layers=4,  # Decoder blocks.
      num_heads=4,  # Query heads.
      num_kv_heads=2,  # Key/value heads (GQA).
      head_dim=32,  # Width of one head.
      d_ff=512,  # SwiGLU hidden width.
  )
  # LoRA (jaxrl_batch.model.lora.LoRAConfig: rank, alpha, targets, dropout): rank > 0 trains low-rank adapters on
  # the base policy (frozen; the KL reference is the base without them) instead of every weight; the lr rules apply
  # to the adapters' lr.
  c.lora = group(LoRAConfig, rank=arg.lora)

  # Device mesh (runtime.sharding.make_mesh); -1 takes the rest. `expert` splits MoE experts (and the batch).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))
  c.sharding_rules = sharding.DEFAULT_RULES  # Logical axis -> mesh axes.
  # Generation on devices of its own (needs rl.max_staleness >= 1): the last `devices` devices, with this mesh
  # shape, sample while the others train; 0 = colocated (generation and update share the mesh). On a CPU host,
  # `process_cores` (e.g. "0") instead generates in a child process pinned to those cores, the learner on the others
  # (`train.generator_process`: weights shipped after every update); "" = in this process. `layout`: colocated
  # generation decodes with the trainer's mesh and layout ("trainer"), or ("own") on this mesh shape over the
  # learner's own devices, the policy resharded into its layout once per step (`train.decode_layout`), or ("auto")
  # the fastest of those predicted on the run's devices, chosen by launch.train and saved in config.json.
  c.rollout_mesh = ml_collections.ConfigDict(dict(devices=0, data=-1, fsdp=1, tensor=1, expert=1, process_cores="",
                                                  layout="trainer"))

  c.algo = "grpo"  # RL algorithm: grpo (critic-free) | ppo (critic + GAE; see configs/ppo_arith.py).
  c.batch_size = arg.batch or batch  # B: rollouts per step (= prompts per step x group_size).
  # Batch axis the family scales: prompts (group_size fixed, num_prompts = B / G) | group_size (num_prompts fixed,
  # group_size = B / P). `--config.batch_size=` then changes the other factor (config.json's "derived" says how).
  c.family_axis = arg.family_axis
  by_prompts = arg.family_axis == "prompts"
  c.group_size = group_size if by_prompts else 0  # Samples per prompt G (group estimators compare them); 0 = derived.
  c.num_prompts = 0 if by_prompts else batch // group_size  # Prompts per step P; 0 = derived.
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
  # Rollouts: how the next token is chosen (sampling.strategies.Strategy: temperature, top_k, top_p; the trainer
  # scores log-probs at the same temperature) and how the engine runs (sampling.engine_settings.EngineSettings:
  # engine static | continuous, slots, chunk, page_size, pages, attention_backend).
  c.sampling = group(Strategy, EngineSettings)
  c.rollout = ml_collections.ConfigDict(dict(
      partial=False,  # Partial rollouts: slots never drain; unfinished sequences continue next step (continuous).
      partial_budget=0,  # Decode steps a step runs at least before it stops (it stops once B rollouts are complete).
      max_lookahead=1,  # Prompts of up to this many steps ahead may start decoding while a step's batch completes.
      carry_kv=True,  # Partial rollouts: carried sequences keep their slot's KV cache (False: re-prefilled each step).
  ))
  c.extra_response_tokens = 2  # Response budget beyond the longest correct answer (+EOS); longer = truncated.

  c.optim = ml_collections.ConfigDict(dict(
      base_lr=base_lr,  # lr0 of the family's base member.
      base_batch=base_batch,  # B0 (rollouts per update) at which base_lr was tuned.
      lr_rule=arg.lr_rule,  # How lr follows B: none | linear | sqrt | adam_sde.
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
  # Sampled evaluation (train.evaluation.EvalConfig: num_samples, temperature, slots), may change on resume: k
  # completions per held-out problem (0 = greedy only), logged as eval_pass1, eval_pass_at_k, eval_maj_at_k beside
  # the greedy eval_accuracy.
  c.eval = group(EvalConfig)
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

  if arg.debug:  # A 2-layer model that learns in seconds on a CPU, and a progress line every step.
    c.model.update(d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, d_ff=128)
    c.log_every_steps = 1
  if arg.moe:
    c.model.update(moe_config(c.model))
  return c


def group(*classes, **recipe) -> ml_collections.ConfigDict:
  """The config group that `classes` (frozen dataclasses) are built from: every field of theirs, at its default
  (written and documented in the dataclass only) or at the recipe's value in `recipe`."""
  fields = [f for cls in classes for f in dataclasses.fields(cls)]
  unknown = sorted(set(recipe) - {f.name for f in fields})
  if unknown:
    raise ValueError(f"{unknown} are no fields of {[cls.__name__ for cls in classes]}.")
  defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
  return ml_collections.ConfigDict(dict(defaults, **recipe))


def algo_config(**changes) -> AlgoConfig:
  """The recipe's algorithm settings (GRPO) with `changes`, unchecked: for tests and benchmarks that run an update
  without a run."""
  recipe = get_config(parse(None), batch=8, group_size=8, base_lr=1.0, base_batch=8)  # The family does not matter.
  return dataclasses.replace(AlgoConfig.from_config(recipe), **changes)


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
      # Mixture of experts: weight of the load-balancing loss (`router_aux_loss`, logged either way) in the loss.
      router_aux_loss_coef=0.0,
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
          base_batch=CRITIC_BASE_BATCH,  # B0 of the critic's family.
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
