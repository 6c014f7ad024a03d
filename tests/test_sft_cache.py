"""The cache of warm-start base policies is shared safely: processes (or threads) that need the same base policy
wait for the one creating it instead of training it again into the same directory; its key leaves out how rewards
are scored."""
import copy
import hashlib
import json
import threading
import time
import types

from configs import grpo_arith
from jaxrl_batch.train import sft


def test_a_second_user_of_a_base_policy_waits_for_the_one_creating_it(tmp_path):
  directory, events = str(tmp_path / "cache" / "key"), []
  entered = threading.Event()

  def first():
    with sft._one_trainer(directory):
      entered.set()
      time.sleep(0.5)
      events.append("first done")

  thread = threading.Thread(target=first)
  thread.start()
  entered.wait()
  with sft._one_trainer(directory):
    events.append("second in")
  thread.join()
  assert events == ["first done", "second in"]


def test_how_rewards_are_scored_leaves_the_base_policy_key_as_it_was(tmp_path):
  """`tasks.SCORING_FIELDS` do not change the warm start: changing them reuses the cached base, and a config at
  their defaults keeps the key it had when the whole task group was hashed, and the model group only the fields the
  recipe listed then; any other task field changes it."""
  tokenizer = tmp_path / "tokenizer.model"
  tokenizer.write_bytes(b"a tokenizer")
  exp = lambda config: types.SimpleNamespace(config=config, tokenizer=types.SimpleNamespace(path=str(tokenizer)),
                                             response_len=8, chat=None)
  config = grpo_arith.get_config("debug")
  key = sft.cache_key(exp(config))
  with open(tokenizer, "rb") as f:
    listed = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff", "rope_theta",
              "norm_eps", "tie_embeddings", "dtype", "param_dtype")  # The recipe's model fields before 2026-12-07.
    whole_task = dict(model={k: config.model[k] for k in listed},
                      task=config.task.to_dict(), sft={k: v for k, v in config.sft.items() if k != "cache_dir"},
                      seed=config.seed, tokenizer=hashlib.sha256(f.read()).hexdigest(), response_len=8)
  assert key == hashlib.sha256(json.dumps(whole_task, sort_keys=True).encode()).hexdigest()[:16]
  for field, value in (("reward_timeout_s", 0.05), ("reward_workers", 4), ("stream_rewards", False),
                       ("max_failed_reward_steps", 2)):
    changed = copy.deepcopy(config)
    changed.task[field] = value
    assert sft.cache_key(exp(changed)) == key, field
  changed = copy.deepcopy(config)
  changed.task.max_digits = 2
  assert sft.cache_key(exp(changed)) != key
