"""The one way tests compare computed floats: to a relative tolerance of the magnitude the computation works at.

Two float32 computations of one quantity in different orders (another CPU's vector width or thread count, another
device count, a kernel against its reference, chunks against the whole) agree to a few ulps of the magnitudes that
make the result up, not to a fixed number: an absolute tolerance at rounding level (`atol=1e-5` on gradients of
order 10) passes on one machine and fails on the next. So a comparison names

- `rtol`: the relative accuracy the computation allows (float32's eps is 1.2e-7; a sum of n terms in another order
  moves by up to about n eps of its terms' magnitude), and
- `scale`: the magnitude it is relative to. By default the largest |want| (every element of an array is computed
  at the array's scale: a logit near 0 carries the rounding of the logits near 10 that its softmax shares); for a
  sum whose terms cancel (a loss, an advantage), the sum of the terms' magnitudes.

Results of the same program run twice are compared exactly (`np.testing.assert_array_equal`).
`tests/test_tolerances.py` refuses any other float comparison in `tests/`.
"""
import jax
import numpy as np


def magnitude(want) -> float:
  """The largest finite |want|: the default scale of a comparison."""
  want = np.abs(np.asarray(want, np.float64))
  finite = want[np.isfinite(want)]
  return float(finite.max()) if finite.size else 0.0


def assert_close(actual, want, rtol, scale=None, err_msg=""):
  """Every element of `actual` is within `rtol * scale` of `want`'s (same shape, NaN and inf where `want`'s are).

  `scale` defaults to the largest |want|; pass it where `want` is a sum of cancelling terms (their magnitudes' sum)
  or zero by construction (the magnitude of what would be there if the code were wrong). A zero scale asks for
  exact equality: no rounding is relative to nothing."""
  scale = magnitude(want) if scale is None else float(scale)
  if scale == 0:
    err_msg = f"{err_msg} (want is zero, so the comparison is exact: pass scale=, the magnitude of the terms that " \
              "make it up, where rounding may leave a little)".strip()
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(want, np.float64), rtol=0,
                             atol=rtol * scale, err_msg=err_msg)


def assert_trees_close(actual, want, rtol, err_msg=""):
  """`assert_close` on each leaf of two pytrees of the same structure, at its own leaf's magnitude (at the whole
  tree's where a leaf is zero, as the gradient of an unused parameter is)."""
  leaves, treedef = jax.tree.flatten(want)
  whole = max(map(magnitude, leaves), default=0.0)
  for i, (a, w) in enumerate(zip(treedef.flatten_up_to(actual), leaves)):
    assert_close(a, w, rtol, scale=magnitude(w) or whole, err_msg=f"{err_msg} leaf {i}".strip())
