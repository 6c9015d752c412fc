"""The import layers of DESIGN.md hold: imports point down only, siblings never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_lightning"

# Layer of each top-level part of the package (DESIGN.md "Layers").
LAYERS = {
    "types": 0, "algo": 0, "utils": 0, "errors": 0,
    "losses": 1, "rewards": 1, "tools": 1,
    "samplers": 2,
    "agents": 3,
    "module": 4, "data": 4,
    "callbacks": 5,
    "cli": 6,
    "trl_compat": 7,  # the TRL facade runs the CLI
}  # fmt: skip
PURE_LAYERS = {"types", "algo", "utils", "errors", "losses", "rewards", "tools"}  # no lightning


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if rel.parts else ""


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) in LAYERS)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path):
    part = part_of(path)
    for name in imports_of(path):
        if name.startswith("grpo_lightning."):
            target = name.split(".")[1]
            if target == part or target not in LAYERS:
                continue
            assert LAYERS[target] < LAYERS[part], (
                f"{path.relative_to(PACKAGE)} ({part}, L{LAYERS[part]}) imports {name} "
                f"({target}, L{LAYERS[target]}): imports must point to a lower layer"
            )
        root = name.split(".")[0]
        if part in PURE_LAYERS:
            assert root not in {"lightning", "pytorch_lightning"}, f"{path} imports {name} in a pure layer"
        if root == "vllm":
            assert path.parent.name == "samplers" and path.name.startswith("vllm"), f"{path} imports vllm"


def test_every_part_has_a_layer():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert parts <= set(LAYERS), f"parts without a layer: {parts - set(LAYERS)}"
