"""Held-out evaluation: pass@k against enumeration, majority voting, the sampled pass end to end on the debug model,
and the analysis of a sampled metric."""
import itertools
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo_arith
from jaxrl_batch.analysis import analyze
from jaxrl_batch.config import migrate
from jaxrl_batch.tasks import make_task
from jaxrl_batch.tasks.countdown import CountdownTask
from jaxrl_batch.train import rundir
from jaxrl_batch.train.evaluation import EvalConfig, evaluate, majority_vote, pass_at_k, sampled_metrics
from jaxrl_batch.train.setup import Experiment

SAMPLED_FIELDS = {"eval_pass1", "eval_pass_at_k", "eval_maj_at_k"}


def test_pass_at_k_hand_values_and_brute_force():
  assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
  assert pass_at_k(10, 3, 4) == pytest.approx(5 / 6)  # 1 - C(7, 4) / C(10, 4) = 1 - 35/210
  assert (pass_at_k(5, 0, 5), pass_at_k(5, 1, 5), pass_at_k(5, 3, 3)) == (0.0, 1.0, 1.0)
  for n in range(1, 8):  # The fraction of the k-subsets of n samples (the first c correct) holding a correct one.
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
      subsets = list(itertools.combinations(range(n), k))
      assert pass_at_k(n, c, k) == pytest.approx(sum(min(s) < c for s in subsets) / len(subsets), rel=1e-12)
  # Large n: the product form where the binomials overflow a float.
  assert pass_at_k(2000, 10, 100) == pytest.approx(1 - math.comb(1990, 100) / math.comb(2000, 100), rel=1e-12)
  with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
    pass_at_k(3, 4, 1)


def test_majority_vote_over_extracted_answers():
  gsm8k = make_task("gsm8k", {})
  math_task = make_task("math", {})
  answers = [gsm8k.extract_answer(t) for t in ["So #### 1,000 in all", "#### 7", "#### $1000.0", "no answer", "#### 7"]]
  assert answers == ["1000", "7", "1000", None, "7"]
  assert majority_vote(answers) == 0  # A 2-2 tie goes to the answer seen first; its first sample stands for it.
  assert majority_vote(["8", "7", "7", "8", None, None, None]) == 0  # No answer is no vote.
  assert majority_vote([None, None]) is None
  boxed = [r"\boxed{x + 1}", r"\boxed{\dfrac12}", r"so \boxed{0.5}.", r"\boxed{1/2}", r"\boxed{x+1}", r"\boxed{"]
  answers = [math_task.extract_answer(t) for t in boxed]
  assert answers == ["x+1", "1/2", "1/2", "1/2", "x+1", None]
  assert majority_vote(answers) == 1
  assert make_task("arithmetic", {}).extract_answer(" 12") == " 12"  # The strict reward compares the whole text.
  assert not hasattr(CountdownTask, "extract_answer")  # Many answers are correct: no majority vote.
  rewards_PxK = np.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], np.float32)
  votes_PxK = [["a", "b", "b", "a"], [None] * 4, ["c", "d", "e", "c"]]  # Winners: a (tie, wrong), none, c (right).
  assert sampled_metrics(rewards_PxK, votes_PxK) == pytest.approx(
      dict(eval_pass1=3 / 12, eval_pass_at_k=2 / 3, eval_maj_at_k=1 / 3))
  assert set(sampled_metrics(rewards_PxK, None)) == {"eval_pass1", "eval_pass_at_k"}


def test_eval_config_is_checked_and_older_configs_resume():
  with pytest.raises(ValueError, match=r"eval.num_samples=-1"):
    EvalConfig(num_samples=-1)
  with pytest.raises(ValueError, match=r"eval.temperature=0.0: .* must be > 0"):
    EvalConfig(num_samples=4, temperature=0.0)
  assert EvalConfig(num_samples=0, temperature=0.0).num_samples == 0  # Greedy only: the temperature is unused.
  new = grpo_arith.get_config("debug")
  old = json.loads(new.to_json())
  del old["eval"]
  assert EvalConfig.from_config(migrate.complete(old)) == EvalConfig()  # Read back: greedy only.
  new.eval.num_samples = 8
  assert rundir.config_diff(old, json.loads(new.to_json())) == []  # A run written before `eval` existed resumes.


@pytest.mark.slow
def test_sampled_evaluation_end_to_end(monkeypatch):
  """The debug model, freshly initialised, on 2 data-parallel devices (15 problems: one padding row), with a reward
  of the completion's first character, so that samples differ in reward and some rewards raise."""
  config = grpo_arith.get_config("debug")
  config.task.num_eval = 15
  config.eval.num_samples = 4
  config.model.vocab_size = 18  # The tokenizer's: no id decodes as the unknown '\ufffd', so completions vary.
  exp = Experiment.create(config, devices=jax.devices()[:2])
  graphdef, params = exp.init_params(0)
  scored = []  # (completion, prompt) of every reward call.

  def reward(completion, problem):
    scored.append((completion, problem.prompt))
    code = ord(completion[0]) if completion else 0
    if code % 5 == 0:
      raise ValueError("a broken verifier")
    return float(code % 2)

  monkeypatch.setattr(exp.task, "reward", reward)
  out = evaluate(exp, graphdef, params)
  assert set(out) == {"eval_accuracy", "eval_reward_errors"} | SAMPLED_FIELDS
  assert len(scored) == 15 + 15 * 4  # Greedy, then k samples per problem; the padding problem is not scored.
  assert out["eval_reward_errors"] == sum((ord(c[0]) if c else 0) % 5 == 0 for c, _ in scored) > 0
  assert all(0.0 <= out[key] <= 1.0 for key in SAMPLED_FIELDS | {"eval_accuracy"})
  assert out["eval_pass1"] < out["eval_pass_at_k"]  # Strictly: the samples of some problem differ.
  assert evaluate(exp, graphdef, params) == out  # The same key every evaluation.
  scored.clear()
  greedy = evaluate(exp, graphdef, params, EvalConfig())
  assert greedy == dict(eval_accuracy=out["eval_accuracy"], eval_reward_errors=greedy["eval_reward_errors"])
  greedy_text = dict((prompt, c) for c, prompt in scored)
  scored.clear()
  # Near-greedy samples repeat each problem's greedy completion: the k rows of a problem decode its own prompt.
  cold = evaluate(exp, graphdef, params, EvalConfig(num_samples=2, temperature=1e-4))
  assert [c for c, _ in scored[15:]] == [greedy_text[prompt] for _, prompt in scored[15:]]
  assert [prompt for _, prompt in scored[15:]] == [p.prompt for p in exp.task.eval_problems() for _ in range(2)]
  assert cold["eval_pass1"] == pytest.approx(cold["eval_accuracy"]) == cold["eval_pass_at_k"]


# Under `-n 2` both engines' cases are in one worker (`--dist=loadgroup`), which compiles the one-block greedy pass
# they both start from once.
@pytest.mark.xdist_group("eval_engines")
@pytest.mark.parametrize("engine,slots", [("continuous", 4), ("static", 5)])
@pytest.mark.slow
def test_evaluation_on_the_runs_engine_and_slots_gives_the_one_block_completions(monkeypatch, engine, slots):
  """The continuous engine on 4 slots (a finished row's slot takes the next problem) and the static one in blocks
  of 5 rows decode the greedy completions of one block of all 15 problems, on the debug model."""
  config = grpo_arith.get_config("debug")
  config.task.num_eval = 15
  config.model.vocab_size = 18
  exp = Experiment.create(config, devices=jax.devices()[:1])
  graphdef, params = exp.init_params(0)
  scored = []
  monkeypatch.setattr(exp.task, "reward", lambda completion, problem: scored.append(completion) or 0.0)
  evaluate(exp, graphdef, params, EvalConfig())
  one_block, scored[:] = list(scored), []
  exp.config.sampling.engine = engine
  evaluate(exp, graphdef, params, EvalConfig(slots=slots))
  assert scored == one_block and len(set(one_block)) > 1
  with pytest.raises(ValueError, match=r"eval.slots=-1"):
    EvalConfig(slots=-1)
  if engine == "static":
    with pytest.raises(ValueError, match=r"eval.slots=4: the static engine .* must divide 15"):
      evaluate(exp, graphdef, params, EvalConfig(slots=4))


def _write_run(root, batch, evals):
  """A run of 8 training steps of 0.5 s and evaluation rows `evals` [(samples, {field: value})]."""
  run_dir = root / f"sqrt_b{batch}_s0"
  run_dir.mkdir()
  config = dict(batch_size=batch, seed=0, sample_budget=8 * batch, optim=dict(lr_rule="sqrt"))
  (run_dir / "config.json").write_text(json.dumps(dict(config=config)))
  rows = [dict(step=s, samples=s * batch, rollout_s=0.25, reward_s=0.125, update_s=0.125) for s in range(1, 9)]
  rows += [dict(step=s // batch, samples=s, eval_reward_errors=0, **fields) for s, fields in evals]
  rows.sort(key=lambda r: (r["samples"], "eval_reward_errors" in r))
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_analysis_of_a_sampled_metric(tmp_path):
  # pass@k crosses 0.6 at 128 samples, greedy accuracy at 384.
  evals = [(s, dict(eval_accuracy=0.2 + 0.4 * s / 384, eval_pass_at_k=0.4 + 0.2 * s / 128)) for s in (0, 256, 512)]
  _write_run(tmp_path, 64, evals)
  by_metric = {m: analyze(str(tmp_path), target=0.6, metric=m) for m in ("eval_accuracy", "eval_pass_at_k")}
  assert [a["members"][0]["samples_to_target"] for a in by_metric.values()] == pytest.approx([384, 128])
  assert by_metric["eval_pass_at_k"]["metric"] == "eval_pass_at_k"
  assert json.loads((tmp_path / "analysis.json").read_text())["metric"] == "eval_pass_at_k"
  assert "Metric: `eval_pass_at_k`" in (tmp_path / "report.md").read_text()
  with pytest.raises(ValueError, match=r"metrics.jsonl:\d+: runs have no eval_maj_at_k: this evaluation row holds "
                     r"eval_accuracy, eval_pass_at_k, eval_reward_errors\. .*eval.num_samples > 0"):
    analyze(str(tmp_path), target=0.6, metric="eval_maj_at_k")
  with pytest.raises(ValueError, match="metric='samples' must be a field of the evaluation rows"):
    analyze(str(tmp_path), target=0.6, metric="samples")
  proc = subprocess.run([sys.executable, "-m", "launch.analyze", f"--workdir={tmp_path}", "--target=0.6",
                         "--metric=eval_pass_at_k"], capture_output=True, text=True, check=False,
                        cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr
  assert "| sqrt_b64 | 1 | 128 [128, 128]" in proc.stdout
