"""Start-up shared by the launchers that train: the multi-process runtime (`--distributed`), then logging.

On a Cloud TPU pod or under SLURM, `--distributed` alone finds the coordinator and this process's rank; elsewhere
(or for several processes on one machine) give `--coordinator`, `--num_processes` and `--process_id`. See
launch/tpu_pod.sh and launch/slurm_gpu.sbatch.
"""
import sys
from collections.abc import Callable

from absl import app, flags, logging

from jaxrl_batch.config.args import unknown_key
from jaxrl_batch.runtime import distributed
from jaxrl_batch.runtime.disk_space import DiskFull
from jaxrl_batch.runtime.preemption import Stopped
from jaxrl_batch.train.workdir_lock import WorkdirBusy
from launch import logs

flags.DEFINE_bool("distributed", False, "Join a multi-process run (jax.distributed.initialize): one mesh over "
                  "every process's devices. Auto-detected on TPU pods and SLURM.")
flags.DEFINE_string("coordinator", None, "host:port of process 0's coordinator (with --distributed; default: "
                    "detected).")
flags.DEFINE_integer("num_processes", None, "Processes in the run (with --distributed; default: detected).")
flags.DEFINE_integer("process_id", None, "This process's rank, 0 .. num_processes-1 (with --distributed; default: "
                     "detected).")
FLAGS = flags.FLAGS


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), where a `--config.<key>` override that names no
  field of the config exits with one line naming it and the closest fields, not ml_collections' traceback."""
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError):
    path = next((a.partition("=")[2] for a in argv[1:] if a.startswith("--config=")), None)
    config = FLAGS["config"].parser.parse(path) if path else None
    for arg in argv[1:]:
      key = arg.removeprefix("--config.").partition("=")[0]
      problem = arg.startswith("--config.") and config is not None and unknown_key(config, key)
      if problem:
        sys.exit(f"FATAL Flags parsing error: --config.{key}: {problem} Nothing was run.")
    raise


def setup() -> None:
  """Call first in `main`: before anything touches a device. Processes other than 0 log warnings only."""
  explicit = (FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
  if not FLAGS.distributed and any(v is not None for v in explicit):
    raise app.UsageError("--coordinator, --num_processes and --process_id need --distributed.")
  if FLAGS.distributed:
    distributed.initialize(*explicit)
  logs.setup()
  if FLAGS.distributed and not distributed.is_main_process():
    logging.set_verbosity(logging.WARNING)


def run_to_exit(work: Callable[[], object]) -> None:
  """Runs `work()`. A stop on a signal (checkpoint saved) exits with 128 + the signal's number, and a workdir held by
  another process or a full disk with 1, each after its one-line message; other errors propagate."""
  try:
    work()
  except Stopped as e:
    logging.warning("%s", e)
    sys.exit(128 + e.signum)
  except (WorkdirBusy, DiskFull) as e:
    logging.error("%s", e)
    sys.exit(1)
