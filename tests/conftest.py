"""Test setup: 8 fake CPU devices, so sharding tests run on one machine, and a compilation cache on disk.

Every compiled XLA:CPU executable holds memory mappings until its cache entry goes; the whole suite in one process
compiles enough of them to reach Linux's default vm.max_map_count (65,530), where the next compile segfaults. Each
test module therefore ends by dropping JAX's caches (the next module recompiles what it needs). Under pytest-xdist
(`-n 2`, the README's command) each worker has its own tmp paths; the workers share the compilation cache and the
cache of warm-start base policies, whose directories the controlling process sets before it starts them.
"""
import atexit
import gc
import os
import shutil
import tempfile

import pytest

# LLVM at -O0: the suite's programs are small and compiled far more than they run, and compiling them is most of its
# time (measured: 18-31% less CPU time on training, update and rollout-benchmark tests). Float results can differ
# from -O3's in their last bits (other machine code; measured on the debug member: losses to ~1e-7 relative): tests
# compare runs made under the same flags, which the processes they start keep (helpers.xla_flags), and programs of
# other shapes to a few ulps. And XLA:CPU's elemental emitters instead of its fusion emitters, which spend more time
# compiling these programs than running them (measured on one core: a two-run training test compiled in 7.3 s
# instead of 19.4 s, 17.4 s against 29.1 s in all).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
                      " --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and the `launch.*` processes its tests start: the modules clear
# JAX's in-memory caches (below) and the processes start cold, yet most compile the same debug-model programs
# (measured: `pytest tests/test_trainer.py tests/test_async.py tests/test_run_safety.py` took 2 min 15 s with it,
# 3 min 40 s without).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl_batch_tests_xla_")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  import jax  # here, not at the top: the environment above must be set before JAX loads

  jax.clear_caches()
  gc.collect()


# One cache of warm-start (SFT) base policies for the session, its workers and the processes they start: each
# config's base is trained once, by whichever worker needs it first (the others wait on its lock; train/sft.py).
if "JAXRL_BATCH_TEST_BASE_CACHE" not in os.environ:
  os.environ["JAXRL_BATCH_TEST_BASE_CACHE"] = tempfile.mkdtemp(prefix="jaxrl_batch_tests_base_")
  atexit.register(shutil.rmtree, os.environ["JAXRL_BATCH_TEST_BASE_CACHE"], True)


def pytest_collection_modifyitems(config, items):
  """Tests that train a run (they use the warm-start base policy, `base_cache`) are `slow`, like those that start
  processes or run notebooks: `pytest -m "not slow"` keeps the unit, kernel, model, engine and update tests.

  In a pytest-xdist worker under `--dist=loadgroup`, each test marked xdist_group("x") gets its id suffixed "@x", which
  is how the controller sends a group to one worker. pytest-xdist (3.8) writes the suffix to `item._nodeid`, which
  pytest 9.2 no longer reads (a node's id is `item._id`, a `NodeId`): there the groups were silently ignored, and each
  worker built the module fixtures its share of a group needed (measured: tests/test_trainer.py's shared run trained
  in both workers). The suffix is set here where xdist's did not take."""
  for item in items:
    if "base_cache" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.slow)
  if not getattr(config.option, "loadgroup", False):
    return
  for item in items:
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    if groups and "@" not in item.nodeid and hasattr(item, "_id"):
      from _pytest.nodeid import NodeId  # pylint: disable=import-outside-toplevel  # pytest >= 9.2 only
      item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")  # pylint: disable=protected-access


@pytest.fixture(scope="session")
def base_cache():
  """The directory of the suite's cached base policies (above)."""
  return os.environ["JAXRL_BATCH_TEST_BASE_CACHE"]


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory, base_cache):
  """The directory of one uninterrupted run of the debug member (`helpers.debug_config`: 6 steps of 32 rollouts,
  checkpoints at steps 4 and 6), shared by tests/test_trainer.py and tests/test_run_safety.py, whose tests only read
  it (copy it before changing anything). They are marked xdist_group("debug_run"): under `-n 2` one worker trains it
  once for both modules."""
  from jaxrl_batch.train.trainer import Trainer  # pylint: disable=import-outside-toplevel  # after the environment
  from tests.helpers import ONE_DEVICE, debug_config  # pylint: disable=import-outside-toplevel

  workdir = str(tmp_path_factory.mktemp("debug_run") / "run")
  Trainer(debug_config(base_cache), workdir, devices=ONE_DEVICE).run()
  return workdir


@pytest.fixture(scope="session")
def compile_only_tpu():
  """`compile_only_tpu(name)`: libtpu's compile-only devices of TPU topology `name` ('v5p:2x2x1'), a
  `topologies.Topology`; skips the test (with the reason) where libtpu is not installed or cannot load them."""
  pytest.importorskip("libtpu", reason="libtpu is not installed (pip install 'jax[tpu]')")
  from jaxrl_batch.runtime import topologies  # pylint: disable=import-outside-toplevel  # after the environment above

  def load(name):
    try:
      return topologies.compile_only(name)
    except Exception as e:  # pylint: disable=broad-except  # any failure to load libtpu is a reason to skip
      pytest.skip(f"libtpu cannot load a compile-only {name} here: {e}")

  return load


@pytest.fixture
def poison_update(monkeypatch):
  """`poison_update(n, change)`: the n-th optimizer update (`rl.learner.update`) returns change(state, metrics)."""
  from jaxrl_batch.rl import learner

  def install(n, change):
    original, calls = learner.update, []

    def poisoned(*args, **kwargs):
      out = original(*args, **kwargs)
      calls.append(1)
      return change(*out) if len(calls) == n else out

    monkeypatch.setattr(learner, "update", poisoned)

  return install
