"""What the README, docs/, `--help` and the core modules' docstrings cite, read from the files.

The drift tests check each citation against the code: a path (from the repo root; a markdown
link from its document), a `module.name` (imported, then `getattr`), a `file.py: Class.method`,
each line range of the README's hunk table (the method's lines as `ast` sees them, holding its
`Seed hunk` mark), and that every ```python block is a recipe a test runs or says why not.
Pure file reading: no process is started. `python -m relgrad_checks.drift` fixes the ranges.
"""
import ast
import functools
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = ("comm_buffer.py", "sharding.py", "pipeline.py", "relgrad.py")
# First components of a dotted name that are this repo's modules or packages.
OURS = ("comm_buffer", "sharding", "pipeline", "relgrad", "relgrad_extras", "relgrad_demo",
        "relgrad_checks", "test_all")
# Files of Paddle, PaddleNLP, torch or a user's run that the text names, none in this repo.
NOT_OURS = {"tensor_fusion_helper.py", "dygraph_sharding_optimizer.py", "pipeline_parallel.py",
            "distributed_strategy.proto", "mix_precision_utils.py", "topology.py",
            "your_script.py", "recipe.py", "full.pt", "sharding_io.py"}
NOT_OURS_PREFIXES = ("python/paddle/", "paddle/", "torch/")
_EXTENSIONS = (".py", ".md", ".png", ".svg", ".txt", ".proto", ".json", ".toml", ".cfg")

_TICKED = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FILE_NAME = re.compile(r"\b([\w/.-]*\w\.py): ([A-Za-z_][\w.]*\w)")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_PATH = re.compile(r"^[\w./-]+$")
_CONFIG = re.compile(r"^(pp_configs|sharding_configs)\.(\w+)(?:=\S+)?$")
_CONFIGS = {"pp_configs": "PpConfig", "sharding_configs": "DygraphShardingConfig"}


def docs() -> list:
    """README.md and docs/*.md, relative to the repo root."""
    return [Path("README.md")] + sorted(p.relative_to(REPO) for p in (REPO / "docs").glob("*.md"))


_TAG = re.compile(r"<!-- recipe (\w+): ([^>]*?) -->\n```python\n(.*?)```", re.S)
_FENCE = re.compile(r"^```python\n", re.M)
_MARK = re.compile(r"<!-- (recipe \w+: [^>]*?|not run: [^>]+?) -->\n$")


def readme_recipes() -> dict:
    """{name: (files to copy, source)} of every tagged recipe; ValueError on a name twice."""
    found = {}
    for doc in docs():
        for m in _TAG.finditer((REPO / doc).read_text()):
            if m.group(1) in found:
                raise ValueError(f"recipe {m.group(1)!r} is tagged twice (again in {doc})")
            found[m.group(1)] = (m.group(2).split(), m.group(3))
    return found


def fenced_python_blocks() -> list:
    """[(doc, line, the marker above it or None)] of every ```python block: a test runs it when
    the marker is `<!-- recipe NAME: files -->`; `<!-- not run: reason -->` says why not."""
    blocks = []
    for doc in docs():
        text = (REPO / doc).read_text()
        for m in _FENCE.finditer(text):
            before = text[:m.start()]
            mark = _MARK.search(before[before.rstrip("\n").rfind("\n") + 1:])
            blocks.append((str(doc), before.count("\n") + 1, mark and mark.group(1)))
    return blocks


def core_docstrings() -> dict:
    """{"file.py:line": docstring} of every module, class and function of the core."""
    found = {}
    for name in CORE:
        tree = ast.parse((REPO / name).read_text())
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]:
            text = ast.get_docstring(node, clean=False)
            if text:
                found[f"{name}:{getattr(node, 'lineno', 1)}"] = text
    return found


def citations(text: str, bare: bool = False) -> tuple:
    """(paths, dotted names, (file, name) pairs) `text` cites in backticks, links and
    `file.py: name` tags; with `bare` (as `--help`) every word ending in an extension or /."""
    paths, dotted = set(), set()
    pairs = set(_FILE_NAME.findall(text))
    if bare:
        for word in re.findall(r"[\w./-]+", text):
            word = word.rstrip(".")
            if word.endswith(_EXTENSIONS) or (
                    word.endswith("/") and re.match(r"^\w", word)):
                paths.add(word)
    for token in _TICKED.findall(text):
        token = token.strip()
        if _FILE_NAME.fullmatch(token):
            continue
        if _PATH.match(token) and (token.endswith("/") or token.endswith(_EXTENSIONS)):
            paths.add(token)
        elif _DOTTED.match(token) and token.split(".")[0] in OURS:
            dotted.add(token)
        elif _CONFIG.match(token):  # a config field, as `pp_configs.release_gradients=True`
            section, field = _CONFIG.match(token).groups()
            dotted.add(f"relgrad.{_CONFIGS[section]}.{field}")
    return paths, dotted, pairs


def links(text: str) -> list:
    """Markdown link targets of `text` that are not web addresses."""
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def is_ours(path: str) -> bool:
    """Whether a cited path must exist in this repo (Paddle's and torch's files are not)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name not in NOT_OURS and not path.startswith(NOT_OURS_PREFIXES)


def path_exists(path: str) -> bool:
    """A path with a folder from the repo root; a bare name at the root or in docs/, .ci/,
    relgrad_*/."""
    if "/" in path.rstrip("/"):
        return (REPO / path).exists()
    folders = [REPO, REPO / "docs", REPO / ".ci"] + sorted(REPO.glob("relgrad_*"))
    return any((folder / path).exists() for folder in folders)


def resolve_dotted(name: str) -> str | None:
    """None if `name` resolves (its longest module prefix imported, getattr the rest), else
    why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]}"


def resolve_in_file(file: str, name: str) -> str | None:
    """None if `file.py: name` resolves (dotted: getattr, inherited counts; bare: a module
    attribute or one a class of the module defines), else why not."""
    if not (REPO / file).is_file():
        return f"no file {file}"
    module = importlib.import_module(file[:-3].replace("/", "."))
    if "." in name:
        return resolve_dotted(f"{module.__name__}.{name}")
    if hasattr(module, name):
        return None
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and v.__module__ == module.__name__]
    if any(name in vars(cls) for cls in classes):
        return None
    return f"{file} defines no {name}"


def link_problem(doc: str, target: str) -> str | None:
    """Why the markdown link `target` of `doc` is broken, or None."""
    file, _, anchor = target.partition("#")
    path = ((REPO / doc).parent / file).resolve() if file else REPO / doc
    if not path.exists():
        return "no such file"
    if anchor and anchor not in heading_anchors(path.read_text()):
        return "no such heading"
    return None


def heading_anchors(text: str) -> set:
    """GitHub's anchors for the headings of a markdown text."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


# ---------------------------------------------------------------- the hunk table

_RANGES = r"`((?:\d+-\d+)(?:, \d+-\d+)*)`"  # the hunk's lines, in the row's file
_ROW = re.compile(r"^\| (\d+) \| (.*?) \| (.*?) \| `([\w/]+\.py): ([\w.]+)` \| " + _RANGES
                  + r" \| ?(.*?) ?\|$", re.M)
_READ = re.compile(r"`([\w.]+)` (\d+-\d+)")  # "read with": a name and its range, the row's file


def _parse_ranges(text):
    return [tuple(int(n) for n in part.split("-")) for part in text.split(", ")]


def _format_ranges(ranges):
    return ", ".join(f"{a}-{b}" for a, b in ranges)


def hunk_rows(readme: str) -> list:
    """[(row, hunk text, file, qualified name, [(first, last)], read with)]
    of the README's hunk table."""
    return [(int(m.group(1)), m.group(2), m.group(4), m.group(5), _parse_ranges(m.group(6)),
             m.group(7)) for m in _ROW.finditer(readme)]


def read_with_range(file: str, name: str) -> tuple | None:
    """(first, last) of `name` in `file`: a qualified name, a method of one of its classes, or
    the one `self.name = ...` line (with the comment block above it) that sets an attribute."""
    found = actual_range(file, name)
    if found is not None:
        return found
    for node in ast.parse((REPO / file).read_text()).body:
        if isinstance(node, ast.ClassDef) and actual_range(file, f"{node.name}.{name}"):
            return actual_range(file, f"{node.name}.{name}")
    return _attribute_range(file, name)


def _attribute_range(file, name):
    source = (REPO / file).read_text()
    sets = []
    for node in _statements(source):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(getattr(t, "attr", None) == name for t in targets):
            sets.append(node)
    if len(sets) != 1:
        return None
    lines = source.splitlines()
    first = sets[0].lineno
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    return first, sets[0].end_lineno


@functools.lru_cache(maxsize=None)
def _tree(source):
    """`ast.parse(source)` once per text (the table's rows read 4 files some 60 times)."""
    return ast.parse(source)


@functools.lru_cache(maxsize=None)
def _statements(source):
    return [n for n in ast.walk(_tree(source)) if isinstance(n, ast.stmt)]


def actual_range(file: str, qualname: str) -> tuple | None:
    """(first, last) line of `qualname` in `file` as `ast` sees it: a def or class from its
    first decorator; a class attribute from the comment block above it."""
    source = (REPO / file).read_text()
    node = _tree(source)
    for part in qualname.split("."):
        children = [n for n in ast.iter_child_nodes(node) if (
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part) or (isinstance(n, ast.AnnAssign)
                                    and getattr(n.target, "id", None) == part)]
        if not children:
            return None
        node = children[0]
    if isinstance(node, ast.AnnAssign):
        lines = source.splitlines()
        first = node.lineno
        while first > 1 and lines[first - 2].strip().startswith("#"):
            first -= 1
        return first, node.end_lineno
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first, node.end_lineno


def hunk_range(file: str, qualname: str, mark: str) -> list | None:
    """[(first, last)] of the hunks marked `mark` in `qualname`: each from the mark through
    the next blank line (at least the statement after it); the whole method or field when
    marked so. None without a mark."""
    whole = actual_range(file, qualname)
    if whole is None:
        return None
    source = (REPO / file).read_text()
    lines = source.splitlines()
    marks = [n for n in range(whole[0], whole[1] + 1)
             if lines[n - 1].lstrip().startswith("#") and mark in lines[n - 1]]
    if not marks:
        return None
    if any("the whole method" in lines[n - 1] for n in marks) or mark not in lines[
            whole[0] - 1] and _is_field(source, qualname):
        return [whole]
    statements = _statements(source)
    ranges = []
    for n in marks:
        if ranges and n <= ranges[-1][1]:
            continue  # a mark inside a hunk already cited
        after = [s for s in statements if s.lineno > n]
        end = min(after, key=lambda s: (s.lineno, -s.end_lineno)).end_lineno
        while end < whole[1] and lines[end].strip():
            end += 1
        ranges.append((n, end))
    return ranges


def _is_field(source, qualname):
    node = _tree(source)
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part
                     or getattr(getattr(n, "target", None), "id", None) == part), None)
        if node is None:
            return False
    return isinstance(node, ast.AnnAssign)


def _marks(hunk):
    points = re.findall(r"point (\d)", hunk)  # a row may hold two points of one method
    if not points:
        return ["Seed hunk"]
    return [f"# Seed hunk (reconstructed, point {point}):" for point in points]


def _hunk_ranges(file, qualname, hunk):
    """`hunk_range` of each mark the row's text names, in line order; None if one is absent."""
    ranges = []
    for mark in _marks(hunk):
        found = hunk_range(file, qualname, mark)
        if found is None:
            return None
        ranges += found
    return sorted(ranges)


def check_hunk_row(row: tuple) -> str | None:
    """Why a row of the hunk table does not match the code (its names, its ranges of the
    `Seed hunk` marks, `hunk_range`), or None."""
    number, hunk, file, qualname, ranges, read_with = row
    for name, cited in _READ.findall(read_with):
        actual = read_with_range(file, name)
        if actual is None:
            return f"row {number}: read with `{name}`: {file} has none"
        if _parse_ranges(cited) != [actual]:
            at = _format_ranges([actual])
            return f"row {number}: read with `{name}` cites {cited}, it is at {at}"
    if actual_range(file, qualname) is None:
        return f"row {number}: {file} has no {qualname}"
    actual = _hunk_ranges(file, qualname, hunk)
    if actual is None:
        return f"row {number} ({qualname}): no `{' / '.join(_marks(hunk))}` comment in it"
    if ranges != actual:
        return (f"row {number} ({qualname}): cites {file}:{_format_ranges(ranges)}, the hunk "
                f"is at {file}:{_format_ranges(actual)}")
    return None


def fix_ranges(readme: str) -> str:
    """The README with each row's ranges (and read-with ranges) set to what the code holds."""
    def fixed(m):
        actual = _hunk_ranges(m.group(4), m.group(5), m.group(2))
        if actual is None:
            return m.group(0)
        start, end = m.span(6)[0] - m.start(), m.span(6)[1] - m.start()
        row = m.group(0)
        read_with = _READ.sub(lambda r: _read_fixed(m.group(4), r), m.group(7))
        read_start, read_end = m.span(7)[0] - m.start(), m.span(7)[1] - m.start()
        row = row[:read_start] + read_with + row[read_end:]
        return row[:start] + _format_ranges(actual) + row[end:]

    def _read_fixed(file, r):
        actual = read_with_range(file, r.group(1))
        return r.group(0) if actual is None else f"`{r.group(1)}` {_format_ranges([actual])}"
    return _ROW.sub(fixed, readme)


if __name__ == "__main__":
    # python -m relgrad_checks.drift: rewrite the hunk table's ranges in README.md in place.
    path = REPO / "README.md"
    path.write_text(fix_ranges(path.read_text()))
