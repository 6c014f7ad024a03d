"""The suite's rule for float comparisons, checked on its own source: computed floats are compared with
`tests/close.py` (a tolerance relative to the magnitude compared), so no test can bring back an absolute tolerance
at rounding level that passes on one CPU and fails on another.

Refused anywhere in `tests/` but `close.py`: numpy's, jax.numpy's and math's closeness functions
(`assert_allclose`, `allclose`, `isclose`, `assert_almost_equal`, ...), and `pytest.approx` with `abs=`.
Allowed, and why:
- `pytest.approx(x)` / `pytest.approx(x, rel=r)`: relative to x by construction, for host-side Python floats inside
  `==` on lists, tuples and dicts, where a helper call would have to take the structure apart.
- `np.testing.assert_array_equal` and `==`: exact, for results of the same program.
"""
import ast
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
HELPER = "close.py"
REFUSED = {"assert_allclose", "allclose", "isclose", "assert_almost_equal", "assert_array_almost_equal",
           "assert_approx_equal", "assert_array_almost_equal_nulp", "assert_array_max_ulp"}


def _name(func) -> str:
  return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def bare_comparisons(source: str, filename: str) -> list[str]:
  """'file:line: call' for each float comparison in `source` that does not go through `close.py`."""
  found = []
  for node in ast.walk(ast.parse(source, filename)):
    if not isinstance(node, ast.Call):
      continue
    name = _name(node.func)
    absolute = name == "approx" and any(k.arg == "abs" for k in node.keywords)
    if name in REFUSED or absolute:
      found.append(f"{filename}:{node.lineno}: {ast.unparse(node.func)}")
  return found


def test_every_float_comparison_in_the_suite_is_relative_to_its_magnitude():
  found = []
  for filename in sorted(os.listdir(TESTS)):
    if filename.endswith(".py") and filename != HELPER:
      with open(os.path.join(TESTS, filename)) as f:
        found += bare_comparisons(f.read(), filename)
  assert not found, ("compare computed floats with tests/close.py's assert_close(actual, want, rtol, scale=) "
                     "(a tolerance relative to the magnitude compared; see its docstring), not:\n" + "\n".join(found))


@pytest.mark.parametrize("call", ["np.testing.assert_allclose(a, b, atol=1e-5)", "np.allclose(a, b)",
                                  "jnp.isclose(a, b, rtol=1e-6)", "math.isclose(a, b)", "pytest.approx(b, abs=1e-6)",
                                  "assert_allclose(a, b, rtol=1e-5)", "np.testing.assert_almost_equal(a, b)"])
def test_the_check_finds_a_bare_comparison(call):
  assert bare_comparisons(f"def test():\n  {call}\n", "t.py") == [f"t.py:2: {call.split('(')[0]}"]


def test_the_check_lets_the_helper_and_relative_forms_through():
  source = "assert_close(a, b, 1e-6)\nassert x == pytest.approx(y, rel=1e-6)\nnp.testing.assert_array_equal(a, b)\n"
  assert bare_comparisons(source, "t.py") == []
