r"""Recommends a batch size: T(B) = S(B) / R(B) from a throughput sweep and the S(B) fit of an analysed study.

  python -m launch.analyze --workdir=/tmp/arith_study --target=0.9
  python -m launch.plan_batch --config=configs/grpo_arith.py --workdir=/tmp/arith_study --rule=sqrt \
      --batches=32,64,128,256,512,1024 --learn_batches=64,256

The sweep trains each batch's member (built as launch.study builds it: batch=B,lr_rule=RULE,seed=0) in
WORKDIR/throughput/b<B>/ (resumable; a run shorter than these flags ask for is moved aside and rerun) for the
compiling step, --warmup steps, then max(--steps - 1, --min_samples / B) timed steps, whose R is measured as the
analysis measures it (--repeats rounds of all batches, pooled, in b<B>.r<k>/ after the first); S(B) = S_min (1 +
B / B_noise) is fitted to the rule's synchronous members in WORKDIR/analysis.json (only those at --learn_batches,
if given, so that the others test the prediction). Writes WORKDIR/plan.json and WORKDIR/plan.md (predicted vs
measured T and its error).

With --topology (a TPU slice one need not have, e.g. v5p:4x4x2), R is predicted instead of measured: each batch's
member has its step's programs compiled for that slice and timed at the chip's peak rates, its rollout through the
engine's schedule of responses drawn from --lengths (`predict.step_time`); nothing trains:

  python -m launch.plan_batch --config=configs/grpo_gsm8k_qwen.py:model=qwen3-30b-a3b --workdir=/tmp/study \
      --topology=v5p:4x4x2 --batches=512,1024,2048 --prompt_tokens=256 --response_tokens=8192 \
      --lengths=lognormal:2048:0.8

S(B) comes from one of three places, and plan.json's `samples_model` says which (`source`): the study's fit above
("study"), given as --samples_model=S_MIN:B_NOISE ("given"), or one run that logged `noise_scale` ("noise_run", e.g.
the reference member trained with --config.rl.noise_split=True): B_noise = its mean B_simple, and S_min from the
samples S_run it needed to reach --target of --metric at its own batch b, S_run = S_min (1 + b / B_noise), read as
launch.analyze reads S. The last two read no analysis.json, with or without --topology:

  python -m launch.plan_batch --config=configs/grpo_reasoning.py --workdir=/tmp/plan --noise_run=/tmp/noise_b32 \
      --target=0.66 --batches=16,32,64,128
"""
import dataclasses
import json
import os

from absl import app, flags

from jaxrl_batch.analysis import noise, planner
from jaxrl_batch.predict import lengths, step_time
from jaxrl_batch.study.runner import load_config_module, member_config, throughput_sweep
from launch import list_flags, logs

flags.DEFINE_string("config", None, "Config file of the study, optionally with base args.")
flags.DEFINE_string("workdir", None, "Study directory holding analysis.json (run launch.analyze first).")
flags.DEFINE_string("rule", "sqrt", "The family rule to plan for.")
flags.DEFINE_list("batches", ["32", "64", "128", "256", "512", "1024"], "Batches of the throughput sweep.")
flags.DEFINE_integer("steps", 4, "Training steps per swept batch besides the warm-up (the first, compiling, is not "
                     "timed).")
flags.DEFINE_integer("warmup", 5, "Untimed steps after the compiling one (XLA:CPU still compiles rarer shapes).")
flags.DEFINE_integer("min_samples", 1024, "Timed samples per swept batch at least: small batches run more steps. "
                     "With --topology: each member's step is the mean over this many rollouts' drawn lengths (32 "
                     "draws of B at least).")
flags.DEFINE_integer("repeats", 1, "Rounds of the sweep (each batch once per round, pooled): more rounds average "
                     "out the drift of a shared machine.")
flags.DEFINE_list("learn_batches", [], "Batches whose members the S(B) fit uses (default: every member that reached "
                  "the target).")
flags.DEFINE_multi_string("set", [], "key=value override applied to every swept run (as in launch.study).")
flags.DEFINE_string("topology", None, "Predict R on this TPU topology (v5p:4x4x2, v5e:2x2, ...) from the compiled "
                    "programs instead of measuring it here; 'cpu': predicted for this machine's CPU at its measured "
                    "rates (to check the prediction against the measured sweep).")
flags.DEFINE_integer("num_slices", 1, "With --topology: slices of it.")
flags.DEFINE_bool("compare_layouts", False, "With --topology: predict each member's step in every decode layout its "
                  "chips allow (the trainer's, and rollout_mesh.layout='own' on each data x tensor x expert mesh) and "
                  "plan with the fastest; plan.json's `step.layouts` lists them.")
flags.DEFINE_string("samples_model", None, "S_MIN:B_NOISE: S(B) = S_MIN (1 + B / B_NOISE) samples to target, given "
                    "instead of fitted to WORKDIR/analysis.json (which is then not read).")
flags.DEFINE_string("noise_run", None, "A run directory that logged noise_scale (e.g. the reference member with "
                    "--config.rl.noise_split=True): S(B) with B_noise = its mean B_simple and S_min from its samples "
                    "to --target at its batch, instead of fitted to WORKDIR/analysis.json (which is then not read).")
flags.DEFINE_float("target", None, "With --noise_run: the value (0..1) of --metric whose samples to target give S_min.")
flags.DEFINE_string("metric", "eval_accuracy", "With --noise_run: the evaluation field --target is of (as "
                    "launch.analyze's --metric).")
flags.DEFINE_integer("smooth", 1, "With --noise_run: odd number of evaluation points in the centred moving average "
                     "its curve is read on (as launch.analyze's --smooth).")
flags.DEFINE_string("lengths", "lognormal:512:1.0", f"With --topology: the response lengths' distribution "
                    f"({lengths.FORMS}), in tokens, clipped to --response_tokens.")
flags.DEFINE_integer("prompt_tokens", 256, "With --topology: prompt length in tokens (prompts padded to it).",
                     lower_bound=1)
flags.DEFINE_string("prompt_lengths", None, f"With --topology: the prompts' own lengths ({lengths.DRAWN_FORMS}), "
                    "clipped to --prompt_tokens, which packed micro-batches hold without padding (default: "
                    "--prompt_tokens).")
flags.DEFINE_integer("response_tokens", 1024, "With --topology: the response budget in tokens.", lower_bound=1)
list_flags.integers("batches", 1, "rollouts per step", "32,64,128")
list_flags.integers("learn_batches", 1, "rollouts per step of analysed members", "64,256")
list_flags.overrides("set")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def _check_samples_source(values: dict) -> bool:
  """S(B) comes from one place: WORKDIR/analysis.json, --samples_model, or --noise_run with its --target."""
  if values["samples_model"] and values["noise_run"]:
    raise flags.ValidationError("--samples_model and --noise_run both give S(B): pass one of them (or neither, to "
                                "fit S(B) to WORKDIR/analysis.json).")
  if values["noise_run"] and values["target"] is None:
    raise flags.ValidationError("--noise_run needs --target=X, the value of --metric whose samples to target give "
                                "S_min, e.g. --target=0.9.")
  if values["target"] is not None and not values["noise_run"]:
    raise flags.ValidationError("--target is read only with --noise_run (a study's target is its analysis.json's): "
                                "drop it, or add --noise_run=RUN.")
  return True


flags.register_multi_flags_validator(["samples_model", "noise_run", "target"], _check_samples_source)


def _lengths_validator(draw):
  """A flag validator that draws one length from the spec: a bad one is refused before anything is compiled."""
  def check(spec: str | None) -> bool:
    if spec is not None:
      try:
        draw(spec, 1, 1)
      except ValueError as e:
        raise flags.ValidationError(str(e)) from e
    return True
  return check


flags.register_validator("lengths", _lengths_validator(lengths.response_lengths))
flags.register_validator("prompt_lengths", _lengths_validator(lengths.prompt_lengths))


def main(argv):
  del argv
  logs.setup()
  source = _samples_source()
  analysis = _analysis(FLAGS.workdir) if source["source"] == "study" else dict(target=source.get("target"),
                                                                               members=[])
  measured = {m["batch"]: (m["samples_to_target"], m["time_to_target_s"])
              for m in analysis["members"] if m["rule"] == FLAGS.rule and not m.get("staleness")}
  batches = [int(b) for b in FLAGS.batches]
  learn = [int(b) for b in FLAGS.learn_batches] or None
  if FLAGS.topology:
    steps = _predicted_steps(batches)
    refused = [dict(batch=b, reason=str(s)) for b, s in steps.items() if isinstance(s, step_time.DoesNotFit)]
    steps = {b: s for b, s in steps.items() if not isinstance(s, step_time.DoesNotFit)}
    swept = {b: step.samples_per_s for b, step in steps.items()}
    sweep = dict(topology=FLAGS.topology, num_slices=FLAGS.num_slices, lengths=FLAGS.lengths,
                 prompt_tokens=FLAGS.prompt_tokens, response_tokens=FLAGS.response_tokens,
                 prompt_lengths=FLAGS.prompt_lengths, min_samples=FLAGS.min_samples,
                 rates=dataclasses.asdict(next(iter(steps.values())).programs["decode"].rates))
  else:
    steps, refused = {}, []
    swept = throughput_sweep(FLAGS.config, os.path.join(FLAGS.workdir, "throughput"), batches, FLAGS.rule,
                             FLAGS.steps, FLAGS.set, warmup=FLAGS.warmup, min_samples=FLAGS.min_samples,
                             repeats=FLAGS.repeats)
    sweep = dict(steps=FLAGS.steps, warmup=FLAGS.warmup, min_samples=FLAGS.min_samples, repeats=FLAGS.repeats)
  samples_model = None if source["source"] == "study" else (source["s_min"], source["b_noise"])
  result = dict(planner.plan(swept, measured, learn, predicted=bool(steps), samples_model=samples_model),
                rule=FLAGS.rule, target=analysis["target"], sweep=sweep)
  result["samples_model"] = dict(source, s_min=result["s_min"], b_noise=result["b_noise"])
  result["refused"] = refused
  for row in result["rows"]:
    if row["batch"] in steps:
      row["step"] = steps[row["batch"]].to_json()
  os.makedirs(FLAGS.workdir, exist_ok=True)  # a plan of predicted or given figures may be the directory's first file
  with open(os.path.join(FLAGS.workdir, "plan.json"), "w") as f:
    json.dump(result, f, indent=2)
  table = planner.render(result)
  with open(os.path.join(FLAGS.workdir, "plan.md"), "w") as f:
    f.write(table)
  print(table, end="")
  print(f"Wrote {os.path.join(FLAGS.workdir, 'plan.json')} and plan.md.")


def _analysis(workdir: str) -> dict:
  path = os.path.join(workdir, "analysis.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing: run `python -m launch.analyze --workdir={workdir} --target=...` "
                            "first, or give S(B) with --samples_model=S_MIN:B_NOISE.")
  with open(path) as f:
    return json.load(f)


def _samples_source() -> dict:
  """plan.json's `samples_model` before the plan: where S(B) comes from ("study": fitted by the plan to
  WORKDIR/analysis.json) and, for a given or noise-run S(B), its s_min and b_noise."""
  if FLAGS.noise_run:
    return noise.samples_model(FLAGS.noise_run, FLAGS.target, FLAGS.metric, FLAGS.smooth)
  if FLAGS.samples_model:
    s_min, b_noise = _samples_model(FLAGS.samples_model)
    return dict(source="given", s_min=s_min, b_noise=b_noise)
  return dict(source="study", analysis=os.path.join(FLAGS.workdir, "analysis.json"))


def _samples_model(spec: str) -> tuple[float, float]:
  """(S_min, B_noise) of --samples_model."""
  try:
    s_min, b_noise = (float(x) for x in spec.split(":"))
  except ValueError:
    s_min = b_noise = -1.0
  if s_min <= 0 or b_noise <= 0:
    raise ValueError(f"--samples_model={spec!r}: give S_MIN:B_NOISE, two positive numbers (samples to target at a "
                     "small batch, and the batch at which it doubles), e.g. 20000:512.")
  return s_min, b_noise


def _predicted_steps(batches: list[int]) -> dict[int, step_time.StepTime | step_time.DoesNotFit]:
  """Each batch's member (as the sweep builds it) predicted on --topology with lengths drawn from --lengths (or the
  reason it does not fit there)."""
  path, _, base_arg = FLAGS.config.partition(":")
  module = load_config_module(path)
  member = lambda batch: member_config(module, base_arg, dict(batch=batch, lr_rule=FLAGS.rule, seed=0), FLAGS.set)
  return step_time.sweep(member, batches, FLAGS.topology, FLAGS.lengths, prompt_len=FLAGS.prompt_tokens,
                         response_len=FLAGS.response_tokens, num_slices=FLAGS.num_slices,
                         prompt_lengths_spec=FLAGS.prompt_lengths, samples=FLAGS.min_samples,
                         layouts=FLAGS.compare_layouts)


if __name__ == "__main__":
  app.run(main)
