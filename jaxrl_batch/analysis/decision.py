"""The decision: is member B faster to the target than the reference member B0, and why.

- gain = R(B) / R(B0): throughput ratio (> 1: more samples per second).
- penalty = S(B) / S(B0): samples-to-target ratio (> 1: more samples needed).
- predicted_time_ratio = penalty / gain; measured_time_ratio = T(B) / T(B0); all from member means.
- measured_time_ratio_ci: its 90% percentile-bootstrap interval: paired by seed (`ci_paired`) when both members
  reached the target with every seed and with the same >= 2 seeds (a seed fixes the warm start, which both share),
  else the two members' seeds resampled independently.
- verdict: "faster" if that interval lies below 1, "slower" if above, else "indistinguishable" (with one seed each
  the interval is the point ratio); "reference" for B0 itself; "censored" (and penalty / predicted / measured None)
  if either member has no seed reaching the target. gain is always given.
- Family range of a rule: starting at its batch nearest B0, the contiguous run of its batches whose invariance gap
  (mean |accuracy - reference accuracy| over shared samples) is <= the tolerance; None if that first batch is over.
The default reference is the smallest synchronous batch of the `sqrt` rule, else the smallest synchronous batch.
- Staleness (asynchronous members, `rl.max_staleness` = k > 0): each is also decided against the synchronous member
  of its rule and batch; a batch absorbs staleness up to the largest k whose penalty stays <= its gain, every smaller
  k included.
"""
import re

from jaxrl_batch.analysis import bootstrap


def _ratio(a: float | None, b: float | None) -> float | None:
  return None if a is None or b is None else a / b


def choose_reference(summaries: list[dict], reference: str | None) -> dict:
  """The reference member's summary: `reference` ('<rule>_b<batch>[_k<staleness>]') or the default."""
  names = [m["member"] for m in summaries]
  if reference is None:
    sqrt = [m for m in summaries if m["rule"] == "sqrt"]
    return min(sqrt or summaries, key=lambda m: (m.get("staleness", 0), m["batch"], m["rule"]))
  if not re.fullmatch(r"\w+_b\d+(_k\d+)?", reference):
    raise ValueError(f"reference {reference!r} is not '<rule>_b<batch>' or '<rule>_b<batch>_k<staleness>' (e.g. "
                     f"'sqrt_b64', 'sqrt_b64_k1'); members: {names}.")
  if reference not in names:
    raise ValueError(f"reference {reference!r} is not in the study; pick one of {names}.")
  return summaries[names.index(reference)]


def _times(summary: dict) -> dict[int, float]:
  """{seed: T} of the seeds of a member that reached the target."""
  return {s["seed"]: s["time_to_target_s"] for s in summary["seeds"] if s["time_to_target_s"] is not None}


def decide(member: dict, ref: dict) -> dict:
  """gain, penalty, predicted/measured time ratios, the measured ratio's 90% bootstrap interval over both members'
  seeds, and the verdict of `member` against `ref` (summaries with their `seeds`): faster or slower only when the
  interval excludes 1, else indistinguishable."""
  gain = _ratio(member["throughput_samples_per_s"], ref["throughput_samples_per_s"])
  if member["samples_to_target"] is None or ref["samples_to_target"] is None:
    return dict(gain=gain, penalty=None, predicted_time_ratio=None, measured_time_ratio=None,
                measured_time_ratio_ci=None, ci_paired=False, verdict="censored")
  penalty = _ratio(member["samples_to_target"], ref["samples_to_target"])
  measured = _ratio(member["time_to_target_s"], ref["time_to_target_s"])
  times, ref_times = _times(member), _times(ref)
  seeds = sorted(times)
  paired = len(seeds) >= 2 and seeds == sorted(ref_times) and all(s["time_to_target_s"] is not None
                                                                 for s in member["seeds"] + ref["seeds"])
  ci = (bootstrap.ratio_ci([times[k] for k in seeds], [ref_times[k] for k in seeds], paired=True) if paired
        else bootstrap.ratio_ci(list(times.values()), list(ref_times.values())))
  if member["member"] == ref["member"]:
    verdict = "reference"
  elif ci[1] < 1:
    verdict = "faster"
  elif ci[0] > 1:
    verdict = "slower"
  else:
    verdict = "indistinguishable"
  return dict(gain=gain, penalty=penalty, predicted_time_ratio=penalty / gain, measured_time_ratio=measured,
              measured_time_ratio_ci=ci, ci_paired=paired, verdict=verdict)


def staleness(summaries: list[dict]) -> list[dict]:
  """Per (rule, batch) that has asynchronous members and a synchronous one: each k > 0 decided against the
  synchronous member (`decide`), with its invariance gap to it (the summaries' `staleness_gap`), and `absorbs`:
  the largest k up to which every level's penalty <= gain (0: already the smallest exceeds it or is censored)."""
  out = []
  for sync in (m for m in summaries if m.get("staleness", 0) == 0):
    stale = sorted((m for m in summaries if m["rule"] == sync["rule"] and m["batch"] == sync["batch"]
                    and m.get("staleness", 0) > 0), key=lambda m: m["staleness"])
    if not stale:
      continue
    levels, absorbs, within = [], 0, True
    for m in stale:
      d = decide(m, dict(sync, member=None))  # member=None: never the "reference" verdict
      levels.append(dict(member=m["member"], staleness=m["staleness"], gap=m.get("staleness_gap"), **d))
      within = within and d["penalty"] is not None and d["penalty"] <= d["gain"]
      if within:
        absorbs = m["staleness"]
    out.append(dict(rule=sync["rule"], batch=sync["batch"], synchronous=sync["member"], levels=levels,
                    absorbs=absorbs))
  return out


def family_range(gaps: dict[int, float | None], reference_batch: int, tol: float) -> list[int] | None:
  """[min, max] batch of the contiguous batches around the one nearest `reference_batch` with gap <= `tol`."""
  batches = sorted(gaps)
  ok = [gaps[b] is not None and gaps[b] <= tol for b in batches]
  start = min(range(len(batches)), key=lambda i: (abs(batches[i] - reference_batch), batches[i]))
  if not ok[start]:
    return None
  lo = hi = start
  while lo > 0 and ok[lo - 1]:
    lo -= 1
  while hi < len(batches) - 1 and ok[hi + 1]:
    hi += 1
  return [batches[lo], batches[hi]]
