r"""Decode attention compiled for a TPU slice this machine does not have: the xla and pallas (Mosaic) backends side by
side, by the compiler's cost analysis (bytes accessed, estimated seconds) per concurrency.

  python -m launch.bench_decode_attention --concurrency=1,8,64,256 --out=/tmp/bench_decode_attention.json

For each cache layout (--caches: `slot`, the `KVCache` layout; `paged`, a pool of --page_size-slot pages, each row's
table naming its own --slots / --page_size pages) and concurrency B: one layer's decode attention of B rows over
--slots cache slots, bf16, --heads query heads over --kv_heads kv heads of --head_dim (default: qwen2.5-1.5b),
compiled by libtpu for the first --tensor chips of --topology (rows replicated, query heads over `tensor`; 1: one
chip) with `kernels.decode_attention(backend=...)` (`paged_decode_attention` for paged). Nothing runs. Reports per
chip the program's "bytes accessed" and "optimal_seconds" (`compiled.cost_analysis()`), and the roofline: the bytes
of keys and values a chip must read with every row at full length, over the chip's HBM bandwidth. The Mosaic kernel
declares its cost as one read of the blocks its grid names (`pl.CostEstimate`, every row at full length): its real
reads follow the live spans; the xla form reads every slot whatever the spans. Writes --out (JSON) and prints the
table.
"""
import datetime
import json

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_batch.kernels import BACKENDS, decode_attention, paged_decode_attention
from jaxrl_batch.runtime import sharding, topologies
from launch import list_flags

CACHES = ("slot", "paged")

flags.DEFINE_list("concurrency", ["1", "8", "64", "256"], "Rows B decoding at once.")
list_flags.integers("concurrency", 1, "rows decoding at once", "1,8,64,256")
flags.DEFINE_list("caches", list(CACHES), f"Cache layouts: {', '.join(CACHES)}.")
list_flags.choices("caches", CACHES)
flags.DEFINE_string("topology", "v5p:2x2x1", "TPU topology whose compile-only chips compile the programs.")
flags.DEFINE_integer("tensor", 1, "Chips of the topology in the mesh, query heads split over them (`tensor` axis).")
flags.DEFINE_integer("slots", 4096, "Cache slots S per row (the slot cache's length; the paged table's pages x size).")
flags.DEFINE_integer("page_size", 128, "Slots per page of the paged cache (a multiple of 128 fills TPU lanes).")
flags.DEFINE_integer("heads", 12, "Query heads N (qwen2.5-1.5b: 12).")
flags.DEFINE_integer("kv_heads", 2, "KV heads K (qwen2.5-1.5b: 2).")
flags.DEFINE_integer("head_dim", 128, "Head dimension H.")
flags.DEFINE_string("out", "bench_decode_attention.json", "Output JSON path.")
FLAGS = flags.FLAGS


def _arguments(mesh, cache: str, b: int):
  """Shape structs of one decode attention call: q, the cache (or pool and table), lengths, starts."""
  n, kv, h, s, c = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.slots, FLAGS.page_size
  heads = "tensor" if FLAGS.tensor > 1 else None
  kv_axis = heads if heads and kv % FLAGS.tensor == 0 else None

  def sds(shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
  q = sds((b, n, h), jnp.bfloat16, None, heads)
  rows = sds((b,), jnp.int32), sds((b,), jnp.int32)
  if cache == "slot":
    return q, sds((b, kv, h, s), jnp.bfloat16, None, kv_axis), sds((b, kv, s, h), jnp.bfloat16, None, kv_axis), *rows
  m = s // c
  return (q, sds((b * m, kv, h, c), jnp.bfloat16, None, kv_axis), sds((b * m, kv, c, h), jnp.bfloat16, None, kv_axis),
          sds((b, m), jnp.int32), *rows)


def compile_costs(mesh, cache: str, b: int, backend: str) -> dict:
  """Bytes accessed and estimated seconds per chip of one decode attention call by `backend`, compiled for `mesh`."""
  attention = decode_attention if cache == "slot" else paged_decode_attention
  with jax.set_mesh(mesh):
    compiled = jax.jit(lambda *a: attention(*a, backend=backend)).lower(*_arguments(mesh, cache, b)).compile()
  costs = compiled.cost_analysis()
  return {"bytes_accessed": float(costs["bytes accessed"]), "optimal_seconds": float(costs["optimal_seconds"])}


def roofline(chip, b: int) -> tuple[int, float]:
  """(bytes, seconds) a chip must read with every row at full length: the keys and values of the kv heads its query
  heads attend, over its HBM bandwidth."""
  tensor, n, kv = FLAGS.tensor, FLAGS.heads, FLAGS.kv_heads
  local_kv = kv // tensor if kv % tensor == 0 else max(1, kv * (n // tensor) // n)
  needed = 2 * b * local_kv * FLAGS.slots * FLAGS.head_dim * 2
  return needed, needed / chip.hbm_bytes_per_s


def table(rows: list[dict]) -> str:
  """The rows side by side: per cache and concurrency, each backend's bytes and estimated microseconds."""
  head = (f"{'cache':6} {'B':>4} {'roofline MB':>11} {'roofline us':>11} {'xla MB':>9} {'xla us':>9} "
          f"{'pallas MB':>9} {'pallas us':>9} {'xla/pallas':>10}")
  lines = [head]
  for r in rows:
    x, p = r["xla"], r["pallas"]
    lines.append(f"{r['cache']:6} {r['concurrency']:>4} {r['roofline_bytes'] / 1e6:>11.1f} "
                 f"{r['roofline_seconds'] * 1e6:>11.1f} {x['bytes_accessed'] / 1e6:>9.1f} "
                 f"{x['optimal_seconds'] * 1e6:>9.1f} {p['bytes_accessed'] / 1e6:>9.1f} "
                 f"{p['optimal_seconds'] * 1e6:>9.1f} {x['optimal_seconds'] / p['optimal_seconds']:>10.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.slots % FLAGS.page_size:
    raise app.UsageError(f"--slots={FLAGS.slots} is not a multiple of --page_size={FLAGS.page_size}.")
  topology = topologies.compile_only(FLAGS.topology)
  if not 1 <= FLAGS.tensor <= topology.num_chips:
    raise app.UsageError(f"--tensor={FLAGS.tensor}: {FLAGS.topology} has {topology.num_chips} chips.")
  mesh = sharding.make_mesh(data=1, fsdp=1, tensor=FLAGS.tensor, devices=topology.devices[:FLAGS.tensor])
  rows = []
  for cache in FLAGS.caches:
    for b in map(int, FLAGS.concurrency):
      needed, seconds = roofline(topology.chip, b)
      rows.append({"cache": cache, "concurrency": b, "roofline_bytes": needed, "roofline_seconds": seconds,
                   **{backend: compile_costs(mesh, cache, b, backend) for backend in BACKENDS}})
  print(table(rows))
  setup = {flag: getattr(FLAGS, flag) for flag in ("topology", "tensor", "slots", "page_size", "heads", "kv_heads",
                                                   "head_dim")}
  with open(FLAGS.out, "w") as f:
    json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "jax": jax.__version__, "device_kind": topology.chip.device_kind, "dtype": "bfloat16", **setup,
               "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
