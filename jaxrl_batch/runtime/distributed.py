"""Many hosts on JAX's multi-controller runtime: every process runs the same program over one global mesh.

Every process computes the same host values (prompts, sampling keys, rewards, mini-batch order) from (seed, step);
`Experiment.shard_batch` places only the shards of a batch on the process's own devices, and `to_host` reads global
arrays back. Process 0 alone writes logs, `metrics.jsonl` and `config.json`; every process takes part in orbax
checkpoint saves and restores (the run directory and the SFT cache must be on a filesystem every host sees).
"""
import jax
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Joins this process to the run; call before anything touches a device.

  Without arguments JAX detects the cluster (Cloud TPU pod, SLURM, Open MPI, Kubernetes, or JAX_COORDINATOR_ADDRESS
  in the environment). On CPU, processes exchange collectives through gloo (JAX's default).
  """
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def is_main_process() -> bool:
  """True on the process that writes logs and files (process 0; the only one of a single-process run)."""
  return jax.process_index() == 0


def _gather(x):
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return multihost_utils.process_allgather(x, tiled=True)
  return jax.device_get(x)


def to_host(tree):
  """`jax.device_get` that also reads arrays spread over other processes' devices (a collective: every process must
  call it with the same tree)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return jax.tree.map(_gather, tree)
