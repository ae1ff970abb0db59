"""The files a user copies beside distributed.py: each opt-in concern in a file of its own that reads only
distributed.py's public names and torch, and that distributed.py never imports; the names that moved out of
distributed.py say where they went."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import distributed

HERE = Path(__file__).resolve().parent.parent
BESIDE = ["checkpointer.py", "ddp_check.py", "shared_memory_allreduce.py", "seeded_dataset.py", "sync_batchnorm.py",
          "sharded_stream.py", "slow_rank.py"]


def imported_modules(tree: ast.AST) -> set[str]:
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return found | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize("name", BESIDE)
def test_a_file_beside_reads_only_public_names_and_is_never_imported(name):
    """The file meets distributed.py through ``__all__`` alone (so each can be read, copied and changed on its own),
    imports nothing but the standard library, torch and distributed (no numpy, no other file beside it), and
    distributed.py, copied alone, never imports it."""
    tree = ast.parse((HERE / name).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "distributed"}
    used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "distributed"
             for alias in node.names}
    assert used <= set(distributed.__all__), f"{name} reads private names: {sorted(used - set(distributed.__all__))}"
    foreign = {module for module in imported_modules(tree) if module.split(".")[0] not in sys.stdlib_module_names
               and module.split(".")[0] not in ("torch", "distributed")}
    assert not foreign, f"{name} imports {sorted(foreign)}"
    ours = imported_modules(ast.parse((HERE / "distributed.py").read_text()))
    assert Path(name).stem not in ours


@pytest.mark.parametrize("moved", ["seeded_dataset", "sync_batchnorm"])
def test_a_moved_name_raises_attribute_error_naming_its_new_import(moved):
    """distributed.seeded_dataset and distributed.sync_batchnorm moved to files of their own: an old script's call
    fails at once, naming the file and the import that replaces it; other unknown names fail as usual."""
    with pytest.raises(AttributeError, match=rf"distributed\.{moved} moved to {moved}\.py.*`from {moved} import "
                                             rf"{moved}`"):
        getattr(distributed, moved)
    assert not hasattr(distributed, moved)
    with pytest.raises(AttributeError, match=r"module 'distributed' has no attribute 'no_such_name'"):
        distributed.no_such_name  # noqa: B018
