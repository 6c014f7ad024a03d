"""The Colab demo runs top to bottom in its reduced mode (code cells executed in order, shell lines skipped)."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_notebook_runs_reduced(tmp_path, monkeypatch, base_cache):
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("JAXRL_BATCH_DEMO_DIR", str(tmp_path / "study"))
  monkeypatch.setenv("JAXRL_BATCH_DEMO_BASE", base_cache)
  monkeypatch.delenv("JAXRL_BATCH_DEMO_FULL", raising=False)
  with open(os.path.join(ROOT, "demos", "batch_family_study.ipynb")) as f:
    notebook = json.load(f)
  namespace = {}
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      source = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
      exec(compile(source, "batch_family_study.ipynb", "exec"), namespace)
  assert namespace["REDUCED"]
  assert {m["member"] for m in namespace["analysis"]["members"]} == {"sqrt_b16", "sqrt_b32", "none_b16", "none_b32"}
  assert os.path.exists(tmp_path / "study" / "report.md")
