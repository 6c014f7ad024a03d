"""The study's PNG plots (matplotlib's object API with the Agg canvas: no display, no global pyplot state)."""
import os

import numpy as np
from matplotlib.figure import Figure

from jaxrl_batch.analysis.members import MemberResults

FILES = ("accuracy_vs_samples.png", "accuracy_vs_time.png", "throughput_vs_batch.png",
         "time_to_target_vs_batch.png")


def _rules(members: list[MemberResults]) -> list[str]:
  return sorted({m.rule for m in members})


def _series(rule: str, staleness: int) -> str:
  return rule + (f", k={staleness}" if staleness else "")


def _accuracy(members: list[MemberResults], target: float, metric: str, in_time: bool) -> Figure:
  """One panel per rule, one seed-mean line per batch of the evaluation `metric`, the target as a dashed line."""
  rules = _rules(members)
  fig = Figure(figsize=(5 * len(rules), 4))
  fig.subplots_adjust(bottom=0.14, left=0.08, right=0.98, wspace=0.1)
  axes = fig.subplots(1, len(rules), squeeze=False, sharey=True)[0]
  for ax, rule in zip(axes, rules):
    for m in (m for m in members if m.rule == rule):
      x, y = m.clock_curve if in_time else m.curve
      ax.plot(x, y, marker=".", label=f"B={m.batch}" + (f", k={m.staleness}" if m.staleness else ""))
    ax.axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set(title=f"rule: {rule}", xlabel="training seconds" if in_time else "samples")
    ax.legend(fontsize="small")
  axes[0].set_ylabel(f"held-out {metric} (seed mean)")
  return fig


def _throughput(members: list[MemberResults], summaries: dict[str, dict]) -> Figure:
  """Per rule, stacked bars of rollout / reward / update seconds per sample at each batch."""
  rules = _rules(members)
  fig = Figure(figsize=(5 * len(rules), 4))
  fig.subplots_adjust(bottom=0.14, left=0.08, right=0.98, wspace=0.1)
  axes = fig.subplots(1, len(rules), squeeze=False, sharey=True)[0]
  for ax, rule in zip(axes, rules):
    ruled = [m for m in members if m.rule == rule]
    x, bottom = np.arange(len(ruled)), np.zeros(len(ruled))
    for phase in ("rollout", "reward", "update"):
      cost = np.array([summaries[m.name][f"{phase}_s_per_sample"] for m in ruled]) * 1e3
      ax.bar(x, cost, bottom=bottom, label=phase)
      bottom += cost
    ax.set_xticks(x, [str(m.batch) + (f"\nk={m.staleness}" if m.staleness else "") for m in ruled])
    ax.set(title=f"rule: {rule}", xlabel="batch (rollouts per update)")
    ax.legend(fontsize="small")
  axes[0].set_ylabel("ms per sample (1000 / throughput)")
  return fig


def _time_to_target(members: list[MemberResults], summaries: dict[str, dict], target: float) -> Figure:
  """Mean time-to-target with its 90% interval per batch, one series per rule (and staleness); censored members as x
  at the top."""
  fig = Figure(figsize=(6, 4))
  fig.subplots_adjust(bottom=0.14, left=0.12)
  ax = fig.subplots()
  finite = [s["time_to_target_s"] for s in summaries.values() if s["time_to_target_s"] is not None]
  top = 1.1 * max(finite, default=1.0)
  for i, (rule, k) in enumerate(sorted({(m.rule, m.staleness) for m in members})):
    rows = [summaries[m.name] for m in members if (m.rule, m.staleness) == (rule, k)]
    done = [r for r in rows if r["time_to_target_s"] is not None]
    if done:
      t = np.array([r["time_to_target_s"] for r in done])
      ci = np.array([r["time_to_target_ci"] for r in done])
      ax.errorbar([r["batch"] for r in done], t, yerr=[t - ci[:, 0], ci[:, 1] - t], marker="o", capsize=3,
                  color=f"C{i}", label=_series(rule, k))
    censored = [r["batch"] for r in rows if r["time_to_target_s"] is None]
    if censored:
      ax.scatter(censored, [top] * len(censored), marker="x", color=f"C{i}", label=f"{_series(rule, k)}: censored")
  batches = sorted({m.batch for m in members})
  ax.set_xscale("log", base=2)
  ax.set_xticks(batches, [str(b) for b in batches])
  ax.minorticks_off()
  ax.set(xlabel="batch (rollouts per update)", ylabel=f"training seconds to accuracy {target}",
         title="time to target (mean, 90% CI)")
  ax.legend(fontsize="small")
  return fig


def write(members: list[MemberResults], summaries: list[dict], target: float, out_dir: str,
          metric: str = "eval_accuracy") -> list[str]:
  """Writes the four PNGs into `out_dir` (curves of the evaluation field `metric`); returns their file names."""
  by_name = {s["member"]: s for s in summaries}
  figures = (_accuracy(members, target, metric, in_time=False), _accuracy(members, target, metric, in_time=True),
             _throughput(members, by_name), _time_to_target(members, by_name, target))
  for name, fig in zip(FILES, figures):
    fig.savefig(os.path.join(out_dir, name), dpi=100)
  return list(FILES)
