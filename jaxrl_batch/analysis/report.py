"""report.md: the decision table, the answer in one paragraph, the definitions and the skipped runs."""


def _num(x: float | None, digits: int = 3) -> str:
  if x is None:
    return "-"
  return f"{x:,.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"


def _with_ci(x: float | None, ci: list[float] | None) -> str:
  return "-" if x is None else f"{_num(x)} [{_num(ci[0])}, {_num(ci[1])}]"


def _ratio(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}x"


def _ratio_ci(x: float | None, ci: list[float] | None) -> str:
  return "-" if x is None else f"{_ratio(x)} [{ci[0]:.2f}, {ci[1]:.2f}]"


def decision_table(analysis: dict) -> str:
  """Markdown table: one row per member."""
  lines = ["| member | seeds | S samples [90% CI] | T s [90% CI] | R samples/s | gain | penalty | predicted | "
           "measured [90% CI] | verdict | gap |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for m in analysis["members"]:
    seeds = f"{m['n_seeds']}" + (f" ({m['n_censored']} censored)" if m["n_censored"] else "")
    lines.append(" | ".join([
        f"| {m['member']}", seeds, _with_ci(m["samples_to_target"], m["samples_to_target_ci"]),
        _with_ci(m["time_to_target_s"], m["time_to_target_ci"]),
        _with_ci(m["throughput_samples_per_s"], m["throughput_ci"]), _ratio(m["gain"]), _ratio(m["penalty"]),
        _ratio(m["predicted_time_ratio"]),
        _ratio_ci(m["measured_time_ratio"], m["measured_time_ratio_ci"]) + (" p" if m.get("ci_paired") else ""),
        m["verdict"],
        _num(m["invariance_gap"], 2)]) + " |")
  return "\n".join(lines)


def _families(analysis: dict) -> list[str]:
  tol = analysis["invariance_tol"]
  out = []
  for rule, family in analysis["families"].items():
    if family["range"] is None:
      out.append(f"`{rule}` keeps no batch within {tol} of the reference curve.")
    else:
      lo, hi = family["range"]
      batches = f"only at batch {lo}" if lo == hi else f"over batches {lo}..{hi}"
      out.append(f"`{rule}` keeps the accuracy-vs-samples curve within {tol} of the reference {batches}.")
  return out


def _best(analysis: dict, ref: dict) -> str:
  reached = [m for m in analysis["members"] if m["measured_time_ratio"] is not None]
  if not reached:
    return f"No member's time to accuracy {analysis['target']} can be compared with the reference (censored)."
  best = min(reached, key=lambda m: m["time_to_target_s"])
  if best["member"] == ref["member"]:
    return (f"No member reaches accuracy {analysis['target']} sooner than the reference "
            f"({_num(best['time_to_target_s'])} s).")
  return (f"The fastest to accuracy {analysis['target']} is {best['member']}: {_num(best['time_to_target_s'])} s of "
          f"training, {_ratio_ci(best['measured_time_ratio'], best['measured_time_ratio_ci'])} the reference's "
          f"{_num(ref['time_to_target_s'])} s (predicted {_ratio(best['predicted_time_ratio'])} = penalty "
          f"{_ratio(best['penalty'])} / gain {_ratio(best['gain'])}): {best['verdict']}.")


def _untuned(analysis: dict, ref: dict) -> str:
  larger = [m for m in analysis["members"] if m["rule"] == "none" and m["batch"] > ref["batch"]]
  if not larger:
    return "The study has no un-retuned (`none`) member larger than the reference batch."
  each = ", ".join(f"{m['member']} {m['verdict']}" + (f" ({_ratio(m['measured_time_ratio'])})"
                                                       if m["measured_time_ratio"] is not None else "")
                   for m in larger)
  answer = "yes" if all(m["verdict"] in ("slower", "censored") for m in larger) else "not all"
  return f"Are the un-retuned (`none`) larger batches slower? {answer}: {each}."


def conclusion(analysis: dict) -> str:
  """One paragraph: curve alignment per rule, the best member against the reference, the `none` control."""
  ref = next(m for m in analysis["members"] if m["member"] == analysis["reference"])
  return " ".join(_families(analysis) + [_best(analysis, ref), _untuned(analysis, ref)])


def staleness_section(analysis: dict) -> str:
  """Markdown: per (rule, batch) with asynchronous members, each staleness against the synchronous member, and how
  much staleness the batch absorbs."""
  lines = ["## Staleness (asynchronous RL)",
           "Each `rl.max_staleness` = k > 0 member against the synchronous member of its rule and batch; gap: mean "
           f"|accuracy difference| to that member's curve (invariance tolerance {analysis['invariance_tol']}).",
           "| member | k | gain | penalty | predicted | measured [90% CI] | verdict | gap |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for batch in analysis["staleness"]:
    for level in batch["levels"]:
      lines.append(" | ".join([f"| {level['member']}", str(level["staleness"]), _ratio(level["gain"]),
                               _ratio(level["penalty"]), _ratio(level["predicted_time_ratio"]),
                               _ratio_ci(level["measured_time_ratio"], level["measured_time_ratio_ci"]),
                               level["verdict"], _num(level["gap"], 2)]) + " |")
  summary = [f"`{b['synchronous']}` absorbs staleness up to k = {b['absorbs']} (samples penalty <= throughput gain)."
             for b in analysis["staleness"]]
  return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n\n" + " ".join(summary)


def noise_section(analysis: dict) -> str:
  """Markdown: the noise scale of one run against the samples penalties of each rule (`analysis.noise`)."""
  n = analysis["noise"]
  split = "" if n["noise_inter"] is None else (
      f" = G x {_num(n['noise_inter'])} prompts (inter-prompt) + {_num(n['noise_intra'])} rollouts (intra-prompt), "
      f"G = {n['group_size']}")
  lines = ["## Gradient noise scale",
           f"`{n['run']}` (batch {n['batch']}, {n['rows']} steps) measured B_simple = {_num(n['noise_scale'])} "
           f"rollouts{split}. Predicted samples penalty (1 + B/B_simple)/(1 + B0/B_simple) against the measured "
           f"S/S0 (B0 = {n['reference_batch']}); predicted to reach {n['penalty_start']}x at batch "
           f"{_num(n['predicted_start'])}.",
           "Each cell: measured penalty (predicted)."]
  batches = sorted({b["batch"] for r in n["rules"].values() for b in r["batches"]})
  lines += ["| rule | B_noise of the S(B) fit | " + " | ".join(f"B={b}" for b in batches)
            + f" | penalty >= {n['penalty_start']}x from |",
            "| --- | --- | " + " | ".join("---" for _ in batches) + " | --- |"]
  for rule, r in n["rules"].items():
    by_batch = {b["batch"]: b for b in r["batches"]}
    cells = [f"{_ratio(by_batch[b]['measured_penalty'])} ({_ratio(by_batch[b]['predicted_penalty'])})"
             if b in by_batch else "-" for b in batches]
    fit = "-" if r["fit"] is None else ("inf" if r["fit"]["b_noise"] is None else _num(r["fit"]["b_noise"]))
    lines.append(f"| {rule} | {fit} | " + " | ".join(cells) + f" | {r['measured_start'] or '-'} |")
  return "\n\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:])


def render(analysis: dict) -> str:
  """The whole report.md."""
  parts = [
      f"# Batch study: time to accuracy {analysis['target']}",
      f"Metric: `{analysis['metric']}`. Reference member: {analysis['reference']}; smoothing: {analysis['smooth']} "
      f"evaluation point(s); invariance tolerance: {analysis['invariance_tol']}. Ratios are against the reference "
      "(measured < 1: faster). Verdicts are statistical: faster or slower only when the 90% bootstrap interval "
      "of the measured time ratio (over both members' seeds; marked p where paired by seed) excludes 1, else "
      "indistinguishable. Censored: no seed reached the target.",
      decision_table(analysis),
      conclusion(analysis),
      *([staleness_section(analysis)] if analysis.get("staleness") else []),
      *([noise_section(analysis)] if analysis.get("noise") else []),
      "## Definitions\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in analysis["definitions"].items()),
  ]
  if analysis["skipped"]:
    parts.append("## Skipped\n\n" + "\n".join(f"- `{s['dir']}`: {s['reason']}" for s in analysis["skipped"]))
  return "\n\n".join(parts) + "\n"
