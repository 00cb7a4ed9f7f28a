"""The layout keeps its promises: one dependency direction, no cycles, a model usable after the engine."""

from __future__ import annotations

import grimp
import pytest
import torch

from kvtool.errors import UsageError
from kvtool.policies import PolicyEnv, build_policy
from tests.helpers import VOCAB, dense_logits, make_engine, stream_logits, tiny_llama

LAYERS = [
    "kvtool.documents",
    "kvtool.core",
    "kvtool.policies",
    "kvtool.kvc",
    "kvtool.runtime",
    "kvtool.eval",
    "kvtool.cli",
]


def test_no_import_cycles_and_no_back_imports() -> None:
    graph = grimp.build_graph("kvtool")
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith("kvtool"):
                assert not graph.chain_exists(importer=imported, imported=module), f"cycle {module} <-> {imported}"
    for low, high in ((a, b) for i, a in enumerate(LAYERS) for b in LAYERS[i + 1 :]):
        assert not graph.find_shortest_chain(importer=low, imported=high), f"{low} imports {high}"


def test_plain_forward_still_works_after_an_engine() -> None:
    """Building an Engine registers kvtool's attention, but a plain forward gives transformers' own result."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(1))
    before = dense_logits(model, ids)
    engine = make_engine(model, "sink", budget=24)
    stream_logits(engine, ids)  # evicts: the engine path really ran
    after = dense_logits(model, ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.config._attn_implementation == "kvtool"


def test_modifier_refuses_a_base_with_its_own_head_layout() -> None:
    env = PolicyEnv(num_layers=1, num_kv_heads=2, num_attention_heads=4, head_dim=8, budget=64)
    with pytest.raises(UsageError, match="lays out its own head groups"):
        build_policy("razor+caote", {"fallback": "h2o"}, env)
    build_policy("razor", {"fallback": "h2o+caote"}, env)  # the modifier on the fallback is the way


def test_modules_and_functions_stay_small():
    """One job per room: no module over 600 lines, no function over 80 (docs/architecture.md)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "kvtool"
    too_long = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 600:
            too_long.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                too_long.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert not too_long, too_long


def test_bench_keeps_the_same_rules():
    """bench/ grows by the same rules: no script over 600 lines, no import circle between its modules
    (each imports its siblings as ``import x`` or ``from bench.x import``)."""
    import ast
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    names = {p.stem for p in bench.glob("*.py")}
    graph: dict[str, set[str]] = {}
    too_long = []
    for path in sorted(bench.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 600:
            too_long.append(f"bench/{path.name}: {text.count(chr(10))} lines")
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                mods = [node.module]
            else:
                continue
            deps |= {m.removeprefix("bench.") for m in mods if m.removeprefix("bench.") in names}
    assert not too_long, too_long

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph.get(start, ()))

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, f"bench modules in an import circle: {circles}"
