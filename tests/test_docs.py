"""The documentation stays true: the README is a landing page holding CI's commands, every relative link in it and
in docs/ resolves, the package layers that docs/architecture.md draws are the ones the imports follow, and its
list of each package's imports is the imports."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# What .ci/run executes, character for character.
CI_COMMANDS = (
    "pip install -e '.[test]' && pytest -q -n 2",
    "pip install -e '.[test,parity]' && pytest -q -m parity",
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def markdown_files() -> list[pathlib.Path]:
  return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
  """`text` without fenced code blocks and inline code, where brackets are not links."""
  return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """The anchors of `path`'s headings, repeated ones numbered as GitHub numbers them."""
  seen: dict[str, int] = {}
  out = set()
  for line in FENCE.sub("", path.read_text()).splitlines():
    if match := re.match(r"#{1,6} (.+)", line):
      base = slug(match.group(1))
      count = seen.get(base, 0)
      seen[base] = count + 1
      out.add(base if count == 0 else f"{base}-{count}")
  return out


def broken_links(path: pathlib.Path) -> list[str]:
  """Relative links in `path` whose file, or whose heading anchor, does not exist."""
  broken = []
  for target in LINK.findall(prose(path.read_text())):
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.exists():
      broken.append(f"{target} (no such file)")
    elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
      broken.append(f"{target} (no heading #{anchor})")
  return broken


def test_readme_is_a_landing_page_with_the_ci_commands():
  text = README.read_text()
  assert len(text.splitlines()) <= 200
  for command in CI_COMMANDS:
    assert command in text, command


def test_relative_links_resolve():
  broken = {str(path.relative_to(ROOT)): links for path in markdown_files() if (links := broken_links(path))}
  assert not broken


def test_slug_follows_github():
  assert slug("What protects a run directory") == "what-protects-a-run-directory"
  assert slug("`metrics.jsonl`: training rows") == "metricsjsonl-training-rows"
  assert slug("Memory: Qwen3-30B-A3B on 8 H200s") == "memory-qwen3-30b-a3b-on-8-h200s"


def documented_layers() -> list[list[str]]:
  """The packages of each line of docs/architecture.md's first code block, top layer first (launch/ left out)."""
  block = FENCE.search(ARCHITECTURE.read_text()).group(0).splitlines()[1:-1]
  layers = []
  for line in block:
    names = []
    for token in line.split():
      if not token.endswith("/"):
        break
      names.append(token.rstrip("/"))
    if names and not line.startswith(" ") and names != ["launch"]:
      layers.append(names)
  return layers


def package_imports() -> dict[str, set[str]]:
  """For each package of jaxrl_batch/, the other jaxrl_batch packages its modules import (lazy imports included)."""
  root = ROOT / "jaxrl_batch"
  packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
  graph = {name: set() for name in packages}
  for path in root.rglob("*.py"):
    parts = path.relative_to(root).parts
    if len(parts) < 2:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        modules = [f"{node.module}.{alias.name}" for alias in node.names]
      elif isinstance(node, ast.ImportFrom):  # relative: within the package unless it climbs out
        modules = [".".join(("jaxrl_batch", *parts[:-node.level], node.module or ""))]
      else:
        continue
      for module in modules:
        names = module.split(".")
        if names[0] == "jaxrl_batch" and len(names) > 1 and names[1] in packages and names[1] != parts[0]:
          graph[parts[0]].add(names[1])
  return graph


def test_layering():
  """Each package imports only packages on lower lines of docs/architecture.md's map, and the map names them all."""
  layers = documented_layers()
  level = {name: i for i, names in enumerate(layers) for name in names}
  graph = package_imports()
  assert set(level) == set(graph), "docs/architecture.md's map and jaxrl_batch/'s packages differ"
  upward = sorted(f"{p} -> {q}" for p, deps in graph.items() for q in deps if level[q] <= level[p])
  assert not upward, f"imports against the layers of docs/architecture.md: {upward}"


def documented_imports() -> dict[str, set[str]]:
  """docs/architecture.md's paragraph "The imports as they stand": package -> the packages it says it imports."""
  text = " ".join(ARCHITECTURE.read_text().split("The imports as they stand")[1].split("\n\n")[0].split())
  graph = {p: {q.strip(" `") for q in deps.split("(")[0].split(",")}
           for p, deps in re.findall(r"`(\w+)` -> ([^;]+)", text)}
  for p in re.findall(r"`(\w+)`(?= and| import no other)", text):
    graph[p] = set()
  return graph


def test_the_documented_imports_are_the_imports():
  assert documented_imports() == package_imports()


def test_no_module_is_over_600_lines():
  """Small modules, one concept each: a module past 600 lines is split (docs/architecture.md's map says where)."""
  long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "jaxrl_batch").rglob("*.py"))
          if (n := len(path.read_text().splitlines())) > 600}
  assert not long, f"modules over 600 lines: {long}"
