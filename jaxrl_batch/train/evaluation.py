"""Held-out evaluation on the task's fixed eval split: greedy decoding, and with `config.eval.num_samples` = k > 0
also k sampled completions per problem, reported as pass@1, pass@k and maj@k; decoded by the run's engine on
`config.eval.slots` slots."""
import collections
import dataclasses
import functools
import logging
from collections.abc import Hashable, Sequence

import jax
import numpy as np

from jaxrl_batch.runtime.distributed import to_host
from jaxrl_batch.runtime.sharding import batch_sharding, data_parallel_size
from jaxrl_batch.sampling import EngineSettings, Strategy, rollout
from jaxrl_batch.train.setup import Experiment

# A sample is correct (pass@k, maj@k) when it earns the full reward: `Task.reward` is 1.0 if it solves the problem.
CORRECT_REWARD = 1.0
GREEDY_SEED, SAMPLING_SEED = 0, 1  # Keys of the two passes: fixed, so evaluation is a function of the params.


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """`config.eval`: `num_samples` (k) completions per held-out problem sampled at `temperature` (0 = greedy only);
  `slots`: sequences decoded at once per device by the run's engine (`sampling.engine`, chunk, backend), 0 = every
  held-out row at once. With the continuous engine a few hundred slots make the cost follow the tokens generated
  (a finished row's slot takes the next problem); the static engine decodes blocks of `slots` rows."""
  num_samples: int = 0
  temperature: float = 1.0
  slots: int = 0

  def __post_init__(self):
    k, t = self.num_samples, self.temperature
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"eval.num_samples={k!r}: sampled completions per held-out problem, an integer >= 0 "
                       "(0 = greedy evaluation only).")
    if k and not (isinstance(t, int | float) and t > 0):
      raise ValueError(f"eval.temperature={t!r}: the temperature of the eval.num_samples={k} samples must be > 0 "
                       "(the greedy pass is eval_accuracy).")
    if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 0:
      raise ValueError(f"eval.slots={self.slots!r}: sequences decoded at once per device, an integer >= 0 (0 = every "
                       "held-out row at once).")

  @classmethod
  def from_config(cls, config) -> "EvalConfig":
    """The run config's `eval` group."""
    return cls(**config["eval"])


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k (Chen et al. 2021) of a problem with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k), as
  1 - prod_{i=n-c+1..n} (1 - k / i) (no huge binomials). With n = k: 1 if any sample is correct, else 0."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}) needs 0 <= c <= n and 1 <= k <= n.")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_vote(answers: Sequence[Hashable | None]) -> int | None:
  """Index of the sample that stands for the vote's winner: the most frequent answer (None = no answer, no vote;
  ties go to the answer seen first), then its first sample. None when no sample has an answer."""
  votes = collections.Counter(a for a in answers if a is not None)  # Keeps first-seen order.
  if not votes:
    return None
  return list(answers).index(max(votes, key=votes.get))


def sampled_metrics(rewards_PxK: np.ndarray, answers_PxK: Sequence[Sequence[Hashable | None]] | None) -> dict:
  """Metrics (0..1) of k samples for each of P problems, their rewards `rewards_PxK` and, for tasks that extract a
  final answer, `answers_PxK`:
    eval_pass1: mean reward (pass@1 for rewards in {0, 1});
    eval_pass_at_k: mean over problems of `pass_at_k(k, correct, k)` (reward >= CORRECT_REWARD is correct);
    eval_maj_at_k: fraction of problems whose majority answer (`majority_vote`) is correct, graded by the reward of
      a sample that gave it; absent without answers.
  """
  k = rewards_PxK.shape[1]
  correct_PxK = rewards_PxK >= CORRECT_REWARD
  out = dict(eval_pass1=float(rewards_PxK.mean()),
             eval_pass_at_k=float(np.mean([pass_at_k(k, int(c), k) for c in correct_PxK.sum(axis=1)])))
  if answers_PxK is not None:
    votes = [majority_vote(answers) for answers in answers_PxK]
    out["eval_maj_at_k"] = float(np.mean([v is not None and bool(correct_PxK[i, v]) for i, v in enumerate(votes)]))
  return out


def engine_for(exp: Experiment, settings: EvalConfig) -> EngineSettings:
  """The run's engine as both passes decode with it: `settings.slots` per device on every data-parallel device
  (`aot` compiles the greedy pass). Each pass chooses tokens at its temperature, with no top-k / top-p."""
  slots = settings.slots * data_parallel_size(exp.mesh)
  return dataclasses.replace(exp.engine, slots=slots)


def evaluate(exp: Experiment, graphdef, params, settings: EvalConfig | None = None) -> dict:
  """Held-out metrics of `params`; deterministic given them (each pass decodes with a fixed key).

    eval_accuracy: mean reward (0..1) of greedy completions;
    eval_reward_errors: completions (greedy and sampled) whose reward raised or timed out: each scores 0, is
      counted, and the first error is logged;
    with `settings.num_samples` = k > 0 (default: `config.eval`), k completions per problem sampled at
      `settings.temperature` (no top-k/top-p): eval_pass1, eval_pass_at_k and, if the task defines
      `extract_answer` (`tasks.base.Task`), eval_maj_at_k (`sampled_metrics`).
  """
  settings = EvalConfig.from_config(exp.config) if settings is None else settings
  k = settings.num_samples
  problems = exp.task.eval_problems()
  dp = data_parallel_size(exp.mesh)
  padded = problems + problems[: (-len(problems)) % dp]
  tokens_BxP, valid_BxP = exp.encode_prompts(padded)
  engine = engine_for(exp, settings)
  slots = engine.slots
  if engine.engine == "static" and slots and (len(padded) % slots or slots % max(k, 1)):
    raise ValueError(f"eval.slots={settings.slots}: the static engine decodes the {len(padded)} held-out problems "
                     f"(x {k} samples) in blocks of eval.slots x {dp} devices rows, which must divide "
                     f"{len(padded)} and be a multiple of eval.num_samples; or use 0, or sampling.engine=continuous.")
  decode = functools.partial(rollout, graphdef, params, max_new_tokens=exp.response_len, eos_id=exp.stop_id,
                             pad_id=exp.tokenizer.pad_id, engine=engine, slots=slots,
                             row_sharding=functools.partial(batch_sharding, exp.mesh))
  greedy_in = exp.shard_batch((tokens_BxP, valid_BxP))
  sampled_in = exp.shard_batch((np.repeat(tokens_BxP, k, axis=0), np.repeat(valid_BxP, k, axis=0))) if k else None
  with jax.set_mesh(exp.mesh):
    outs = [decode(*greedy_in, jax.random.key(GREEDY_SEED), sampling=Strategy(temperature=0.0))[0]]
    if k:  # Each problem's k rows are adjacent: one prefill per problem.
      outs.append(decode(*sampled_in, jax.random.key(SAMPLING_SEED),
                         sampling=Strategy(temperature=settings.temperature), group_size=k)[0])
  fetched = to_host([(out.tokens_BxN, out.mask_BxN) for out in outs])
  texts = [exp.decode_responses(tokens_BxN, mask_BxN) for tokens_BxN, mask_BxN in fetched]
  p = len(problems)
  greedy, sampled = texts[0][:p], (texts[1][:p * k] if k else [])
  scores = exp.scorer.score(greedy + sampled, problems + [problem for problem in problems for _ in range(k)])
  failures = scores.failures()
  if failures:
    logging.warning("Evaluation: the reward function %s", failures)
  out = dict(eval_accuracy=float(scores.rewards_B[:p].mean()), eval_reward_errors=scores.errors + scores.timeouts)
  if k:
    extract = getattr(exp.task, "extract_answer", None)
    answers = None if extract is None else [[extract(text) for text in sampled[i * k:(i + 1) * k]] for i in range(p)]
    out.update(sampled_metrics(scores.rewards_B[p:].reshape(p, k), answers))
  return out


def eval_accuracy(exp: Experiment, graphdef, params) -> float:
  """Mean greedy reward (0..1) over the held-out problems (no sampled pass)."""
  return evaluate(exp, graphdef, params, EvalConfig())["eval_accuracy"]
