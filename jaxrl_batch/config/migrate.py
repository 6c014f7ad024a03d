"""Old config.json files brought up to date, in one place: the fields added to the recipe after runs were written.

Each entry of `ADDED` is a dotted field and the value that does what a run written before the field existed did (or
a function of the saved config giving it, where that depends on the run's other fields).
It is history, not a default (configs/base.py holds the defaults of new runs): an entry never changes once written,
and a field added to the recipe gets one. `complete` fills the missing fields into a saved config when config.json
is read (`train.rundir.read_config`: resume, branch, analysis), so that the library reads every field directly. Keys
that no recipe has are kept: a resume then refuses the run as a different config, as before. `ADDED_TASK` does the
same for fields added to the `task` group of some tasks only.
"""
import copy
import logging

def _carry_kv(config: dict) -> bool:
  """rollout.carry_kv of a run written before it: partial rollouts re-prefilled their carried sequences (False); a run
  without them carried nothing, so the field did nothing there and takes the recipe's default (True), so that the
  run resumes under the config it is given."""
  return not config["rollout"].get("partial", False)


ADDED = {
    "family_axis": "prompts",  # Families scaled prompts per step at a fixed group size.
    "num_prompts": 0,  # Derived: batch_size / group_size.
    "score_micro_batch_size": 0,  # The step's batch scored in one forward.
    "micro_batch_tokens": 0,  # No packing.
    "stop_at_accuracy": 0.0,  # Every run trained to its sample_budget.
    "init_from": "",  # The supervised warm start.
    "chat_template": "none",  # Prompts as the task writes them.
    "writers": ["jsonl"],  # metrics.jsonl only.
    "eval": dict(num_samples=0, temperature=1.0, slots=0),  # Greedy evaluation only.
    "log_samples_every_steps": 0,  # No samples.jsonl.
    "log_samples_count": 0,
    "log_samples_max_chars": 0,
    "rollout": dict(partial=False, partial_budget=0, max_lookahead=1),  # Every step's rollouts run to their end.
    "rollout.carry_kv": _carry_kv,  # Carried partial rollouts were re-prefilled under the new weights every step.
    "rollout_mesh": dict(devices=0, data=-1, fsdp=1, tensor=1, expert=1, process_cores=""),  # Colocated generation.
    "rollout_mesh.process_cores": "",  # Generation in the learner's process.
    "rollout_mesh.layout": "trainer",  # Colocated generation decoded with the trainer's layout.
    "rl.max_staleness": 0,  # Synchronous.
    "rl.noise_split": False,  # noise_scale alone.
    "rl.router_aux_loss_coef": 0.0,  # No load-balancing term in the loss.
    "task.max_failed_reward_steps": 0,  # Runs went on whatever their reward function did.
    "lora": dict(rank=0, alpha=16.0, targets=["q", "k", "v", "o", "gate", "up", "down"], dropout=0.0),  # Full RL.
    # The model fields a recipe did not list (every one is listed since): its run took ModelConfig's defaults.
    "model.dtype": "float32",
    "model.param_dtype": "float32",
    "model.qkv_bias": False,
    "model.qk_norm": False,
    "model.rope_scaling": None,
    "model.num_experts": 0,
    "model.num_experts_per_tok": 0,
    "model.moe_d_ff": 0,
    "model.norm_topk_prob": True,
    "model.decoder_sparse_step": 1,
    "model.mlp_only_layers": [],
    "model.routing_replay": False,
    "model.attention": "auto",
    "model.moe_chunk": 16_384,
}

# Task field -> (the tasks whose group has it, the value of a run written before it); filled where task.name is one.
ADDED_TASK = {
    # The cap derived from the model's context: a longer prompt left no room in it for a response.
    "max_prompt_tokens": (("gsm8k", "math", "countdown"), 0),
}


def complete(config: dict, source: str = "config.json") -> dict:
  """A copy of the saved `config` (config.json's "config") with every field of `ADDED` it lacks filled in; a log
  line from `source` names what was filled."""
  out, filled = copy.deepcopy(config), []
  for name, value in ADDED.items():
    *groups, key = name.split(".")
    node = out
    for group in groups:  # A group missing too is created (analysis reads configs that hold a few fields).
      node = node.setdefault(group, {}) if isinstance(node, dict) else None
    if isinstance(node, dict) and key not in node:
      node[key] = value(out) if callable(value) else copy.deepcopy(value)
      filled.append(f"{name}={node[key]!r}")
  task = out.get("task")
  for key, (names, value) in ADDED_TASK.items():
    if isinstance(task, dict) and task.get("name") in names and key not in task:
      task[key] = value
      filled.append(f"task.{key}={value!r}")
  if filled:
    logging.info("%s predates fields of the recipe; filled with what its run did: %s.", source, ", ".join(filled))
  return out


def check_current(config) -> None:
  """Refuses a config (a config file's ConfigDict) that lacks fields of `ADDED`, naming them and the fix: the library
  reads every field directly, so a config written before those fields existed would fail on the first one it reads."""
  tree = config.to_dict() if hasattr(config, "to_dict") else config
  missing = []
  for name in ADDED:
    *groups, key = name.split(".")
    node = tree
    for group in groups:
      node = node.get(group) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key not in node:  # Present, even as None (model.rope_scaling), is enough.
      missing.append(name)
  if missing:
    raise ValueError(f"The config lacks {', '.join(missing)}, fields every recipe has had since they were added. "
                     "Build the config on configs/base.get_config (docs/configs.md), or add the fields with the values "
                     "in jaxrl_batch/config/migrate.py's ADDED (what runs did before they existed).")
