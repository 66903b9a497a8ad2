"""The top-level scripts depend in one direction: the graph of their imports (inside functions too) has no
cycle, so a lower script never knows an upper one (memtrace.measure may run grpo's step; grpo builds its policy
from policy.py, not from memory.py)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root=ROOT) -> dict:
    """{script: the top-level scripts it imports}, from the source of every root/*.py (ast, nothing run)."""
    scripts = {p.stem: p for p in root.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = {d for d in deps if d in scripts and d != name}
    return graph


def find_cycle(graph) -> list:
    """A cycle [a, b, ..., a] of the graph, or [] (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        state[n] = "done"
        stack.pop()
        return []
    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return []


def test_find_cycle_hand_cases():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d"}}) == ["d", "d"]


def test_reads_imports_inside_functions(tmp_path):
    (tmp_path / "low.py").write_text("import os\n\ndef f():\n    import high\n")
    (tmp_path / "high.py").write_text("from low import f\nimport torch.nn\n")
    graph = import_graph(tmp_path)
    assert graph == {"low": {"high"}, "high": {"low"}} and find_cycle(graph) == ["high", "low", "high"]


def test_top_level_scripts_have_no_import_cycle():
    graph = import_graph()
    assert {"grpo", "memory", "policy", "flowtracer"} <= set(graph)
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
    assert "memory" not in graph["grpo"] and "policy" in graph["grpo"]
