"""The layout's rules, read from the source (ast, nothing run):
- the root holds the card's scripts; every other module lives in a folder named for its role;
- imports run one way: no module in a folder imports an entry script (grpo, eval, flowtracer_trl), and
  neither the module graph nor the folder graph has a cycle (imports inside functions count too);
- nothing imports a module by its name from before the move into folders."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"flowtracer", "grpo", "data", "eval", "flowtracer_trl"}  # the root's .py files
ENTRY = {"grpo", "eval", "flowtracer_trl"}  # scripts no folder module may import
FOLDERS = ("tasks", "training", "evaluation", "gpu_kernels")
OLD_NAMES = (
    "answers",
    "arithmetic",
    "countdown",
    "prompts",
    "models",
    "rollout",
    "regions",
    "policy",
    "checkpoint",
    "runlog",
    "credit",
    "signals",
    "oar",
    "probes",
    "highflow",
    "figures",
    "learn",
    "memory",
    "memtrace",
    "significance",
    "passk",
)  # flat modules before the move


def modules(root=ROOT) -> dict:
    """{dotted module name: path} of the root scripts and the folder modules."""
    found = {p.stem: p for p in root.glob("*.py")}
    for folder in FOLDERS:
        found |= {f"{folder}.{p.stem}": p for p in (root / folder).glob("*.py") if p.stem != "__init__"}
    return found


def imported(path, names) -> set:
    """The modules of `names` that `path` imports, as dotted names: `from training import policy` and
    `import training.policy` give training.policy; `from training.policy import x` gives training.policy."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {d for d in deps if d in names}


def import_graph(root=ROOT) -> dict:
    """{module: the project modules it imports}, dotted."""
    mods = modules(root)
    return {name: imported(path, mods) - {name} for name, path in mods.items()}


def folder_of(module) -> str:
    """A module's place: its folder, or the module itself for a root script."""
    return module.split(".")[0]


def find_cycle(graph) -> list:
    """A cycle [a, b, ..., a] of the graph, or [] (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m) :] + [m]
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


def test_reads_dotted_imports_inside_functions(tmp_path):
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "low.py").write_text("import os\n\ndef f():\n    import grpo\n")
    (tmp_path / "grpo.py").write_text("from training import low\nimport torch.nn\n")
    graph = import_graph(tmp_path)
    assert graph == {"grpo": {"training.low"}, "training.low": {"grpo"}}
    assert find_cycle(graph) == ["grpo", "training.low", "grpo"]
    assert upward_imports(graph) == ["training.low imports grpo"]


def upward_imports(graph) -> list:
    return [f"{m} imports {d}" for m, deps in sorted(graph.items()) if "." in m for d in sorted(deps & ENTRY)]


def tracked(pattern):
    """The tracked files matching a git pathspec (`git ls-files`), or None outside a git checkout. The
    layout is the project's files: a script a user leaves in the root (the H100 run's decode_prof.py) is
    not one of them, and a file the project adds is tracked once committed."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", pattern], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return [ROOT / f for f in out]


def test_root_holds_the_card_scripts_and_folders_their_modules():
    files = tracked("*.py")
    if files is None:
        pytest.skip("not a git checkout: which root files are the project's is git's to say")
    assert {p.stem for p in files if p.parent == ROOT} == SCRIPTS
    for folder in FOLDERS:
        init = ROOT / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(init.read_text().strip().splitlines()) == 1, f"{init}: a one-line docstring"


def test_no_folder_module_imports_an_entry_script():
    graph = import_graph()
    assert {"grpo", "training.policy", "evaluation.memtrace", "tasks.answers"} <= set(graph)
    assert upward_imports(graph) == []


def test_no_cycle_among_modules_or_folders():
    graph = import_graph()
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
    folders = {}
    for m, deps in graph.items():
        here = folder_of(m)
        folders.setdefault(here, set()).update(folder_of(d) for d in deps if folder_of(d) != here)
    assert find_cycle(folders) == [], " -> ".join(find_cycle(folders))
    assert "evaluation" in folders["eval"] and "training" in folders["grpo"]
    assert "grpo" not in folders["training"]


def test_nothing_imports_an_old_flat_module_name():
    """git grep over the tracked .py, .ipynb and .md files: an import of a module by its name from before
    the move (`import policy`, `from regions import ...`, in code, notebook cells or README snippets)."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "*.py", "*.ipynb", "*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    names = "|".join(OLD_NAMES)
    pattern = (
        rf'(^|[";])[[:space:]]*(import ([A-Za-z_.]+( as [A-Za-z_]+)?, )*({names})\b'
        rf"|from ({names}) import)"
    )
    out = subprocess.run(
        ["git", "grep", "-n", "-E", pattern, "--", *files], cwd=ROOT, capture_output=True, text=True
    )
    hits = [h for h in out.stdout.splitlines() if "test_imports.py" not in h]
    assert hits == [], "\n".join(hits)


def pickled_globals(path) -> set:
    """(module, name) of every class or function that the pickle inside a torch.save file names."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add(tuple(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


def test_a_checkpoint_names_no_project_module(tmp_path, device):
    """Why a checkpoint written before the move resumes after it: trainer_state.pt's pickle names only torch's
    and Python's own classes (weights_only=True could load nothing else), the weights are safetensors, the
    tokenizer and config files JSON. So no module path of this project is stored, old or new. On each
    device: a CUDA run's optimizer state is pickled from CUDA tensors."""
    import torch

    import grpo
    from training.model import load
    from training.run import checkpoint

    model, tok = load.load_model("tiny-qwen3", device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]], device=model.device)).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--out-dir", str(tmp_path / "run")])
    checkpoint.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 3, cfg, 0)
    names = pickled_globals(tmp_path / "ckpt" / "trainer_state.pt")
    assert names and all(m.split(".")[0] in ("torch", "collections", "builtins", "_codecs") for m, _ in names)
    project = set(OLD_NAMES) | SCRIPTS | set(FOLDERS)
    for f in (tmp_path / "ckpt").rglob("*"):
        if f.suffix in (".json", ".txt", "") and f.is_file():
            assert not any(
                f"{m}." in f.read_text(errors="replace") for m in ("training", "evaluation", "tasks")
            )
    assert not {m.split(".")[0] for m, _ in names} & project
