"""Modules of jaxrl_batch/ meet through public names: none imports another's `_private` name or reaches one through
an imported module or class (`aot._cost`), so that what a module keeps to itself can change without breaking
another (the compile-only check takes the trainer's programs by their public names)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxrl_batch"


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, filename: str) -> list[str]:
  """'file:line: name' for each private name of another module that `source` imports or reaches through an import."""
  tree, imported, found = ast.parse(source, filename), set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl_batch"):
      for alias in node.names:
        if _private(alias.name):
          found.append(f"{filename}:{node.lineno}: {node.module}.{alias.name}")
        imported.add(alias.asname or alias.name)
    elif isinstance(node, ast.Import):
      imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.startswith("jaxrl_batch"))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
        and node.value.id in imported:
      found.append(f"{filename}:{node.lineno}: {node.value.id}.{node.attr}")
  return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_no_module_uses_another_modules_private_names():
  found = [use for path in sorted(PACKAGE.rglob("*.py"))
           for use in private_uses(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
  assert not found, "make these names public (a name that says what it is) or keep their use inside their module:\n" \
      + "\n".join(found)


def test_the_check_finds_each_form():
  source = ("from jaxrl_batch import aot\nfrom jaxrl_batch.kernels.decode_attention import _ROWS\n"
            "import jaxrl_batch.train.collector as c\nfrom jaxrl_batch.model import ModelConfig\n"
            "aot._cost(x)\nc._sample\nModelConfig._check\nself._own\nlocal._x\naot.__name__\n")
  assert private_uses(source, "m.py") == ["m.py:2: jaxrl_batch.kernels.decode_attention._ROWS", "m.py:5: aot._cost",
                                          "m.py:6: c._sample", "m.py:7: ModelConfig._check"]
