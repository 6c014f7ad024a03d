"""What every job shares: the config and its derived `family.Member`, mesh, tokenizer, task, model definition and
token layout.

Sequence layout used by sampling, SFT and RL alike: `[BOS prompt]` left-padded to `prompt_len` tokens, followed
by the response right-padded to `response_len` tokens (EOS included).
"""
import dataclasses
import json
import logging
import os

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxrl_batch import tasks
from jaxrl_batch.config import family, migrate
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.model import lora as lora_lib
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.runtime import sharding, transfer
from jaxrl_batch.sampling import EngineSettings, Strategy, engine_settings
from jaxrl_batch.text import chat_template as chat_template_lib
from jaxrl_batch.text import tokenizer as tokenizer_lib
from jaxrl_batch.text.loading import load_tokenizer


def check_pretrained_shape(hf_dir: str, model_cfg: ModelConfig) -> None:
  """Raises unless the Hugging Face checkpoint in `hf_dir` has the shape `config.model` describes."""
  from jaxrl_batch.hf.config import to_model_config  # The hf extra is needed only with init_from.
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"init_from={hf_dir!r} has no config.json; point it at a Hugging Face model directory.")
  with open(path) as f:
    pretrained = to_model_config(json.load(f), model_cfg.dtype, model_cfg.param_dtype)
  diffs = [f"model.{f.name}: config {getattr(model_cfg, f.name)!r}, checkpoint {getattr(pretrained, f.name)!r}"
           for f in dataclasses.fields(ModelConfig) if getattr(model_cfg, f.name) != getattr(pretrained, f.name)]
  if diffs:
    raise ValueError(f"init_from={hf_dir!r} does not match config.model ({'; '.join(diffs)}); pick the matching "
                     "model= preset or set those fields.")


def pretrained_context(hf_dir: str) -> int | None:
  """Positions the Hugging Face checkpoint in `hf_dir` was trained for (config.json's max_position_embeddings), or
  None when it does not say."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    return json.load(f).get("max_position_embeddings")


def packing_for(tokens: int, length: int, data_parallel: int) -> packing_lib.Packing | None:
  """Packed micro-batches of `tokens` (`micro_batch_tokens`): rows of `length` = prompt_len + response_len tokens, so
  any sequence fits one, tokens // length rows each; None for 0 (micro-batches of `micro_batch_size` padded rows)."""
  if not tokens:
    return None
  rows = tokens // length
  if tokens < 0 or rows < 1 or rows % data_parallel:
    raise ValueError(f"micro_batch_tokens={tokens} packs rows of {length} tokens (prompt_len + response_len): it "
                     f"must hold at least one row and a number of rows divisible by the data-parallel device count "
                     f"{data_parallel}, e.g. {length * data_parallel}; 0 = padded micro-batches of micro_batch_size "
                     "rows.")
  return packing_lib.Packing(rows, length)


@dataclasses.dataclass
class Experiment:
  """Resolved pieces of one run; build with `Experiment.create(config)`."""

  config: ml_collections.ConfigDict
  member: family.Member
  mesh: jax.sharding.Mesh
  tokenizer: tokenizer_lib.Tokenizer
  task: tasks.Task
  scorer: tasks.RewardScorer  # scores task.reward on host threads (config.task's SCORING_FIELDS)
  model_cfg: ModelConfig
  prompt_len: int
  response_len: int
  chat: chat_template_lib.ChatTemplate | None = None
  packing: packing_lib.Packing | None = None  # `micro_batch_tokens` > 0: packed micro-batches (`packing_for`)
  lora: lora_lib.LoRAConfig | None = None  # config.lora with rank > 0: RL trains low-rank adapters on the base

  @property
  def stop_id(self) -> int:
    """The token that ends a response: the chat template's end-of-turn marker when one is applied (and is a single
    token), else the tokenizer's EOS."""
    if self.chat is not None:
      ids = self.tokenizer.encode(self.chat.end_of_turn)
      if len(ids) == 1:
        return ids[0]
    return self.tokenizer.eos_id

  @classmethod
  def create(cls, config: ml_collections.ConfigDict, devices=None) -> "Experiment":
    migrate.check_current(config)
    mesh = sharding.make_mesh(**config.mesh, devices=devices)
    member = family.member(config, sharding.data_parallel_size(mesh))
    task_cfg = {k: v for k, v in config.task.items() if k != "name"}
    task = tasks.make_task(config.task.name, ml_collections.ConfigDict(task_cfg))
    init_from = config.init_from
    tokenizer = load_tokenizer(config.tokenizer_path or init_from or task.tokenizer_path())
    model_cfg = ModelConfig.from_config(config.model)
    if init_from:
      check_pretrained_shape(init_from, model_cfg)
    tokenizer_lib.check_vocab(tokenizer, model_cfg.vocab_size)
    skip_long_prompts = getattr(task, "skip_long_prompts", None)  # Tasks on user files (`tasks.jsonl_task`).
    if skip_long_prompts:
      skip_long_prompts(tokenizer, pretrained_context(init_from) if init_from else None)
    chat = chat_template_lib.resolve(config.chat_template, tokenizer.chat_template)
    # A template adds the same tokens around every prompt; 4 spare columns absorb merges at its boundaries.
    overhead = len(tokenizer.encode(chat_template_lib.render_prompt(chat, ""))) + 4 if chat else 0
    prompt_len = len(tokenizer.bos_ids) + task.max_prompt_len(tokenizer) + overhead
    response_len = task.max_answer_len(tokenizer) + config.extra_response_tokens
    return cls.of_lengths(config, member, mesh, prompt_len, response_len, tokenizer, task,
                          tasks.make_scorer(task, config.task), chat)

  @classmethod
  def of_lengths(cls, config: ml_collections.ConfigDict, member: family.Member, mesh, prompt_len: int,
                 response_len: int, tokenizer=None, task=None, scorer=None, chat=None) -> "Experiment":
    """The `Experiment` of a step of these token lengths: what derives from them (loss_agg='constant''s one
    default, the response budget; the packing) is derived here, for `create` and the compile-only check alike."""
    if member.algo.loss_agg == "constant" and not member.algo.loss_agg_constant:
      member = dataclasses.replace(member, algo=dataclasses.replace(member.algo, loss_agg_constant=float(response_len)))
    packing = packing_for(config.micro_batch_tokens, prompt_len + response_len, sharding.data_parallel_size(mesh))
    return cls(config, member, mesh, tokenizer, task, scorer, ModelConfig.from_config(config.model), prompt_len,
               response_len, chat, packing, lora_lib.LoRAConfig.from_config(config.lora))

  def _module_fn(self, seed: int, adapters: bool = False):
    return lambda: Transformer(self.model_cfg, nnx.Rngs(seed), lora=self.lora if adapters else None)

  def init_params(self, seed: int):
    """(graphdef, params) of a freshly initialised model (no adapters: the base), created sharded over the mesh."""
    return sharding.create_sharded(self._module_fn(seed), self.mesh, self.config.sharding_rules)

  def abstract_params(self, adapters: bool = False):
    """(graphdef, params as sharded ShapeDtypeStructs): a restore target; allocates nothing. `adapters`: the policy
    RL trains, with config.lora's adapters (the base without them when config.lora is off)."""
    return sharding.abstract_sharded(self._module_fn(0, adapters), self.mesh, self.config.sharding_rules)

  def policy_shardings(self):
    """The shardings of the policy's parameters (with config.lora's adapters) on this mesh: its sharding rules
    applied to it. Generation on a mesh of its own reads the policy so (`train.decode_layout`, `train.async_collector`):
    the learner's partition specs need not split over its axes (2 kv heads over tensor 4)."""
    return jax.tree.map(lambda x: x.sharding, self.abstract_params(adapters=True)[1])

  def trainable_params(self) -> int:
    """Parameters the update trains: the whole policy's, or with config.lora its adapters' (counted abstractly)."""
    return sum(x.size for x in jax.tree.leaves(lora_lib.trainable(self.abstract_params(adapters=True)[1])))

  def policy(self, graphdef, base_params, seed: int):
    """(graphdef, params) of the policy RL trains from the base policy `base_params`: with config.lora, the base
    with fresh adapters (created sharded; the base arrays are kept, not copied), else the base itself."""
    if self.lora is None:
      return graphdef, base_params
    graphdef, adapters = sharding.create_sharded(self._module_fn(seed, adapters=True), self.mesh,
                                                 self.config.sharding_rules, select=lambda p: lora_lib.split(p)[0])
    return graphdef, lora_lib.merge(base_params, adapters)

  @property
  def strategy(self) -> Strategy:
    """How the rollouts' tokens are chosen (`sampling.temperature`, `top_k`, `top_p`)."""
    return engine_settings.from_config(self.config.sampling)[0]

  @property
  def engine(self) -> EngineSettings:
    """How the rollout engine runs (the other `sampling.*` keys)."""
    return engine_settings.from_config(self.config.sampling)[1]

  def encode_prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_BxP, valid_BxP): BOS + prompt, left-padded to `prompt_len`."""
    ids = [self.tokenizer.bos_ids + self.tokenizer.encode(chat_template_lib.render_prompt(self.chat, p.prompt))
           for p in problems]
    return tokenizer_lib.left_pad(ids, self.prompt_len, self.tokenizer.pad_id)

  def decode_responses(self, tokens_BxN: np.ndarray, mask_BxN: np.ndarray) -> list[str]:
    """Response text of each row: the masked tokens before EOS.

    A response holding an id the tokenizer lacks (an embedding row past its vocabulary) decodes as '\ufffd',
    so it earns no reward instead of stopping the run.
    """
    tok = self.tokenizer
    def text(ids):
      return "\ufffd" if any(t >= tok.vocab_size for t in ids) else tok.decode(ids)
    return [text([t for t, m in zip(row, keep) if m and t not in (tok.eos_id, self.stop_id)])
            for row, keep in zip(tokens_BxN.tolist(), mask_BxN.tolist())]

  def shard_batch(self, tree):
    """Places host arrays with their leading (batch) dimension split over the data-parallel axes (`transfer.place`;
    inside a named crossing)."""
    return transfer.place(tree, lambda ndim: sharding.batch_sharding(self.mesh, ndim))

  def log_layout(self) -> None:
    logging.info("Devices: %d (%s), processes: %d; mesh %s.", jax.device_count(), jax.devices()[0].platform,
                 jax.process_count(), dict(self.mesh.shape))
    logging.info("Model: %.2fM parameters; tokenizer %s (%d ids); prompt %d + response %d tokens.",
                 self.model_cfg.num_params() / 1e6, self.tokenizer.path, self.tokenizer.vocab_size,
                 self.prompt_len, self.response_len)
    if self.lora is not None:
      adapters = self.trainable_params()
      logging.info("LoRA: rank %d, alpha %g on %s: %.2fM trainable parameters (%.2f%% of the model's); the base is "
                   "frozen.", self.lora.rank, self.lora.alpha, ",".join(self.lora.targets), adapters / 1e6,
                   100 * adapters / self.model_cfg.num_params())
