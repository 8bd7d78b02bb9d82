"""docs/architecture.md: every module is in its table and imports as the page says (read from the
code with ast), and the one-file method it shows is the file docs/examples/knorm.py, and it works."""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import keepkv
from keepkv.methods import METHODS, SELECTIONS

from conftest import random_batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "knorm.py"
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "keepkv"


def layers() -> dict[str, int]:
    """The page's table: module ("keepkv/cache.py", or a folder "keepkv/methods/") -> its layer."""
    rows = re.findall(r"^\| (\d+) \| `(keepkv/[^`]+)` \|", PAGE.read_text(), flags=re.M)
    assert rows, "docs/architecture.md has no module table"
    table = {path: int(layer) for layer, path in rows}
    assert len(table) == len(rows), "a module is listed twice"
    return table


def modules() -> dict[str, Path]:
    """Every module of keepkv/ by its dotted name ("keepkv.eval" for keepkv/eval/__init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def row_of(path: Path, table: dict[str, int]) -> str:
    """The table row a file belongs to: its folder's row, else its own."""
    relative = path.relative_to(ROOT).as_posix()
    folder = next((row for row in table if row.endswith("/") and relative.startswith(row)), None)
    return folder or relative


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported keepkv module, whether it is imported when ``name`` is) for every import of the
    file, those inside functions included."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    at_import, outside = set(), [tree]  # what runs when the module is imported: all but function bodies
    while outside:
        node = outside.pop()
        at_import.add(id(node))
        outside += [child for child in ast.iter_child_nodes(node)
                    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from package import module` imports the module; `from module import name`, the module
            targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found += [(target, id(node) in at_import) for target in targets if target.split(".")[0] == "keepkv"]
    return found


def test_every_module_is_in_the_architecture_table():
    table = layers()
    rows = {row_of(path, table) for path in modules().values()}
    assert sorted(rows) == sorted(table), "docs/architecture.md's table and keepkv/'s modules differ"


def test_imports_follow_the_layers_of_the_architecture_page():
    """Every import, inside functions too, goes to a lower layer or within a folder; within a
    folder, the imports that run at import time form no circle."""
    table, known = layers(), modules()
    upward, graph = [], {}
    for name, path in known.items():
        source = row_of(path, table)
        graph[name] = set()
        for target, at_import in imports(name, path, known):
            assert target in known, f"{path.relative_to(ROOT)} imports {target}, which is not a keepkv module"
            row = row_of(known[target], table)
            if row != source and table[row] >= table[source]:
                upward.append(f"{path.relative_to(ROOT)} (layer {table[source]}) imports {target} (layer {table[row]})")
            if at_import and target != name:
                graph[name].add(target)
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(upward)
    done, active = set(), []

    def visit(name):
        assert name not in active, "an import circle: " + " -> ".join(active[active.index(name):] + [name])
        if name not in done:
            active.append(name)
            for target in graph[name]:
                visit(target)
            active.pop()
            done.add(name)

    for name in graph:
        visit(name)


def test_the_import_check_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above can fail: a store that imports the cache, and two modules of one folder
    that import each other when imported."""
    fake = tmp_path / "keepkv"
    (fake / "kit").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cache.py").write_text("from .store import LayerStore\n")
    (fake / "store.py").write_text("def later():\n    from .cache import CompressedCache\n")
    (fake / "kit" / "__init__.py").write_text("from .a import x\n")
    (fake / "kit" / "a.py").write_text("from .b import y\n")
    (fake / "kit" / "b.py").write_text("from .a import x\n")
    page = tmp_path / "architecture.md"
    page.write_text("| 1 | `keepkv/__init__.py` | x |\n| 1 | `keepkv/kit/` | x |\n| 2 | `keepkv/store.py` | x |\n"
                    "| 3 | `keepkv/cache.py` | x |\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", tmp_path)
    monkeypatch.setattr(here, "PACKAGE", fake)
    monkeypatch.setattr(here, "PAGE", page)
    test_every_module_is_in_the_architecture_table()
    with pytest.raises(AssertionError, match="keepkv/store.py \\(layer 2\\) imports keepkv.cache \\(layer 3\\)"):
        test_imports_follow_the_layers_of_the_architecture_page()
    (fake / "store.py").write_text("")
    with pytest.raises(AssertionError, match=r"an import circle: keepkv\.kit\.(a|b) -> keepkv\.kit\.(b|a) -> keepkv\.kit\.\1"):
        test_imports_follow_the_layers_of_the_architecture_page()


@pytest.fixture
def registry():
    """The registry as it was: the example's registration must not leak into other tests."""
    saved = dict(METHODS), dict(SELECTIONS)
    yield
    for registry, before in zip((METHODS, SELECTIONS), saved):
        registry.clear()
        registry.update(before)


def load_example():
    spec = importlib.util.spec_from_file_location("knorm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_show_the_example_file_verbatim():
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert EXAMPLE.read_text() in blocks


@torch.no_grad()
def test_the_one_file_method_keeps_the_sinks_and_the_smallest_keys(registry):
    load_example()
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 6))
    budget = 12
    compressed = keepkv.CompressedCache(model.config, "knorm", budget)
    full = keepkv.CompressedCache(model.config, "full")
    with keepkv.enabled(model):
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=compressed)
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=full)
    for small, big in zip(compressed.layers, full.layers):
        assert (small.live_counts() == budget).all()
        norms = big.keys.float().norm(dim=-1).masked_fill(~big.live(), float("inf"))
        norms = norms.masked_fill((big.positions >= 0) & (big.positions < 4), float("-inf"))  # the sinks
        expected = big.positions.gather(-1, norms.topk(budget, largest=False).indices).sort(-1).values
        got = small.positions.masked_fill(~small.live(), -1).sort(-1).values[..., -budget:]
        assert torch.equal(got, expected)
    tokens = keepkv.get_method("knorm+sinks=0")
    assert tokens.selection.sinks == 0 and tokens.name == "knorm"
    paired = keepkv.get_method("keepkv+selection=knorm")  # the new selection pairs with another merge
    assert paired.selection.name == "knorm" and paired.merging.name == "keepkv"
