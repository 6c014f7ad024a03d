"""Post-hoc analysis of a batch study: does a larger batch reach the target accuracy sooner?

  from jaxrl_batch.analysis import analyze
  analyze("/tmp/study", target=0.9)   # writes analysis.json, report.md and PNG plots into /tmp/study
"""
from jaxrl_batch.analysis.runs import Run, load_study
from jaxrl_batch.analysis.study import DEFINITIONS, analyze

__all__ = ["DEFINITIONS", "Run", "analyze", "load_study"]
