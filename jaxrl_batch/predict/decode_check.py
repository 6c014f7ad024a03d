"""The decode step on this CPU, predicted and measured: the check of the kernel-level time at the sizes of a model.

Why: `launch.plan_batch --topology=cpu` holds whole steps of a 1M-parameter family against a measured sweep; the
decode step of a larger model (the ~100M reference shape of `launch.bench_rollout`) is where a prediction of the
rollout must hold at concurrency 1 ... 64. For each concurrency the continuous engine's decode step
(`aot.decode_roofline.step`, every slot live, the cache at the bucket of the prompt and the budget) is compiled for
this CPU once, timed by `program_time` kernel by kernel at the rates measured here, and run on zeros (the weights,
the cache and the slots: a decode step's cost does not depend on their values) for the measured time, the best of
`repeats` runs (the first is not timed).
"""
import dataclasses

import jax
import ml_collections

from jaxrl_batch.predict import spread, step_time
from jaxrl_batch.predict.program_time import ProgramTime, Rates, program_time
from jaxrl_batch.aot import decode_roofline


@dataclasses.dataclass(frozen=True)
class Point:
  """One concurrency: the step's predicted seconds (`predicted`, its parts in `program`) and measured seconds."""
  concurrency: int
  cache_length: int
  predicted_s: float
  measured_s: float
  program: ProgramTime

  @property
  def ratio(self) -> float:
    """Predicted over measured (1 = exact; < 1: predicted too fast)."""
    return self.predicted_s / self.measured_s


def measure(config: ml_collections.ConfigDict, concurrencies, prompt_len: int, response_len: int,
            repeats: int = 10) -> tuple[Rates, list[Point]]:
  """(the rates measured here, one `Point` per concurrency) for the decode step of `config`'s model on this CPU."""
  devices = tuple(jax.devices("cpu"))
  rates = step_time.target(step_time.CPU, config)[1]
  points = []
  for concurrency in concurrencies:
    step_, inputs = decode_roofline.engine_step(config, devices, prompt_len, response_len, concurrency)
    if isinstance(inputs, str):
      raise ValueError(f"The decode step of {concurrency} slots cannot be laid out: {inputs}")
    predicted = program_time(decode_roofline.compile_step(step_, inputs), rates)
    seconds = spread.executions(spread.on_zeros(step_, inputs), repeats, step_.exp.mesh)
    points.append(Point(concurrency, inputs["state"].cache.length, predicted.running(1, 1), float(seconds.min()),
                        predicted))
  return rates, points


def table(points: list[Point]) -> str:
  """The points side by side: predicted ms (and its parts: temporaries faulted in, products, other kernels' bytes,
  launches), measured ms."""
  lines = [f"{'rows':>5} {'cache':>6} {'predicted ms':>13} {'temps':>8} {'products':>9} {'bytes':>8} {'launches':>9} "
           f"{'measured ms':>12} {'pred/meas':>10}"]
  for p in points:
    ms = lambda s: f"{s * 1e3:.3f}"
    lines.append(f"{p.concurrency:>5} {p.cache_length:>6} {ms(p.predicted_s):>13} {ms(p.program.setup_s):>8} "
                 f"{ms(p.program.compute_s):>9} {ms(p.program.memory_s):>8} {ms(p.program.launch_s):>9} "
                 f"{ms(p.measured_s):>12} {p.ratio:>10.2f}")
  return "\n".join(lines)
