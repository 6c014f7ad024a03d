"""The Colab demos run top to bottom in their reduced mode (code cells executed in order, shell lines skipped)."""
import json
import logging
import os

import pytest

from jaxrl_batch.predict import step_time
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # each test runs a notebook


def run_notebook(name: str, demo_dir, base_cache, monkeypatch) -> dict:
  """Executes demos/`name`'s code cells in order in its reduced mode; returns the namespace they leave."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("JAXRL_BATCH_DEMO_DIR", str(demo_dir))
  monkeypatch.setenv("JAXRL_BATCH_DEMO_BASE", base_cache)
  monkeypatch.setenv("JAXRL_BATCH_DEMO_FULL", "0")  # Reduced, even where a notebook defaults to full (an accelerator).
  with open(os.path.join(ROOT, "demos", name)) as f:
    notebook = json.load(f)
  absl_level = logging.getLogger("absl").level  # A notebook may quiet absl's INFO lines; the suite gets them back.
  namespace = {}
  try:
    for cell in notebook["cells"]:
      if cell["cell_type"] == "code":
        source = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
        exec(compile(source, name, "exec"), namespace)
  finally:
    logging.getLogger("absl").setLevel(absl_level)
  assert namespace["REDUCED"]
  return namespace


def test_demo_notebook_runs_reduced(tmp_path, monkeypatch, base_cache):
  namespace = run_notebook("batch_family_study.ipynb", tmp_path / "study", base_cache, monkeypatch)
  assert {m["member"] for m in namespace["analysis"]["members"]} == {"sqrt_b16", "sqrt_b32", "none_b16", "none_b32"}
  assert os.path.exists(tmp_path / "study" / "report.md")


def test_quickstart_notebook_runs_reduced(tmp_path, monkeypatch, base_cache):
  namespace = run_notebook("quickstart.ipynb", tmp_path, base_cache, monkeypatch)
  config, train_rows = namespace["config"], namespace["train_rows"]
  assert train_rows[-1]["samples"] == namespace["eval_rows"][-1]["samples"] == config.sample_budget
  before, after = namespace["before"], namespace["after"]  # samples.jsonl's rows of the first and the last step
  assert [r["step"] for r in before] == [1] * config.log_samples_count
  assert [r["step"] for r in after] == [train_rows[-1]["step"]] * config.log_samples_count
  assert all(r["reward"] == float(r["completion"] == str(r["answer"])) for r in before + after)  # strict answers
  assert {m["member"] for m in namespace["analysis"]["members"]} == {"sqrt_b16", "sqrt_b32"}
  assert os.path.exists(tmp_path / "reduced" / "study" / "report.md")


def test_reasoning_study_notebook_runs_reduced(tmp_path, monkeypatch, base_cache):
  namespace = run_notebook("reasoning_study.ipynb", tmp_path, base_cache, monkeypatch)
  assert {m["member"] for m in namespace["analysis"]["members"]} == {"sqrt_b16", "sqrt_b32"}
  assert namespace["analysis"]["noise"]["noise_inter"] is not None  # the split's parts, from the noise run
  assert {m["member"] for m in namespace["by_group"]["members"]} == {"sqrt_b32"}
  assert set(namespace["swept"]) == {16, 32} and namespace["plan"]["recommended_batch"] in (16, 32)


def test_qwen_colab_notebook_runs_reduced(tmp_path, monkeypatch, base_cache):
  namespace = run_notebook("grpo_qwen_colab.ipynb", tmp_path, base_cache, monkeypatch)
  config, train_rows = namespace["config"], namespace["train_rows"]
  assert config.lora.rank == 8 and not config.init_from  # LoRA on the tiny model; nothing downloaded
  assert train_rows[-1]["samples"] == namespace["eval_rows"][-1]["samples"] == config.sample_budget
  assert all(r["lr"] == config.optim.base_lr and r["grad_norm"] is not None for r in train_rows)  # B = B0: lr0
  before, after = namespace["before"], namespace["after"]
  assert [r["step"] for r in before] == [1] * config.log_samples_count
  assert [r["step"] for r in after] == [train_rows[-1]["step"]] * config.log_samples_count
  if namespace["report"] is not None:  # libtpu: the tiny model's LoRA update compiled for one v5e chip
    assert namespace["verdicts"]["update"].startswith("fits with"), namespace["verdicts"]
    assert namespace["report"].topology["num_chips"] == 1


def test_batch_on_paper_notebook_runs_reduced(tmp_path, monkeypatch, base_cache, compile_only_tpu):
  compile_only_tpu("v5e:2x2")  # the reduced mode's slice (skips where libtpu cannot load)
  namespace = run_notebook("batch_on_paper.ipynb", tmp_path, base_cache, monkeypatch)
  steps, plan = namespace["steps"]["v5e:2x2"], namespace["plans"]["v5e:2x2"]
  assert list(steps) == namespace["BATCHES"] == [16, 64]
  # 4 and 16 rollouts a chip: the first on 4 slots, the second on the cap, 8 slots refilled as rows end.
  assert len(steps[16].schedules) == len(steps[64].schedules) == step_time.MIN_DRAWS  # draws of lengths a member
  small, large = steps[16].schedules[0], steps[64].schedules[0]
  assert {s.rows for s in small.segments} == {16} and {s.rows for s in large.segments} == {32}
  assert sum(s.admitted for s in large.segments) > 32 and not namespace["refused"]["v5e:2x2"]
  generation = [steps[b].generation_per_s for b in steps]
  assert generation == sorted(generation)  # decode is bandwidth-bound at these concurrencies
  for row in plan["rows"]:
    assert row["predicted"] and row["throughput_samples_per_s"] == steps[row["batch"]].samples_per_s
  assert plan["recommended_batch"] in steps and os.path.exists(namespace["FIGURE"])
