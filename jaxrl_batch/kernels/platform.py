"""The platform a program is traced for, which is not always the machine's: a mesh of compile-only TPU devices on a
CPU host (`aot`) traces for "tpu" while `jax.default_backend()` says "cpu"."""
import jax


def current_platform() -> str:
  """The ambient mesh's devices' platform ("cpu", "gpu"/"cuda", "tpu"), else `jax.default_backend()`."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()
