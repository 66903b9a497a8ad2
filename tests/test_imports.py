"""The layout's rules, read from the source (ast, nothing run):
- the root holds the card's scripts; every other module lives in a folder named for its role, and training/
  in a few rooms (packages), each opened by a docstring that names its modules and holds no code;
- imports run one way: no folder module imports an entry script (grpo, eval, flowtracer_trl); training's rooms
  import only rooms below them (ROOMS' order); neither modules nor rooms import each other in a circle
  (imports inside functions count too);
- no module is longer than MAX_LINES; a top-level name defined in two modules has one meaning (SAME_ROLE);
- nothing imports a module by a name it had before a move, or names its old path."""

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"flowtracer", "grpo", "data", "eval", "flowtracer_trl"}  # the root's .py files
ENTRY = {"grpo", "eval", "flowtracer_trl"}  # scripts no folder module may import
FOLDERS = ("tasks", "training", "evaluation", "gpu_kernels")
# training's rooms from the ground up: a room imports only those before it (policy.py is a room of one file)
ROOMS = ("decode", "policy", "credit", "usercode", "model", "memory", "run", "config")
MAX_ENTRIES = 8  # training/ holds at most this many rooms besides its __init__.py
MAX_LINES = 500  # a module holds one idea; past about 500 lines it holds two
# Names defined at the top of more than one module, each with one meaning wherever it is defined.
SAME_ROLE = {
    "main": "a script's entry point",
    "parse": "a command line read into its config",
    "parse_args": "a command line read into its config",
    "add_flags": "a command's flags added to its parser",
    "check": "the first bad flag of a config, as one sentence",
    "update": "grpo.py's update (the back-off and the benchmarks wrap or time it)",
    "generate": "rollout.generate (the back-off and the benchmarks wrap or time it)",
    "evaluate": "an evaluation of a model on a task's held-out questions",
    "intervene": "eval.py intervene (its command calls the probe's)",
    "recall": "eval.py recall (its command calls the probe's)",
    "answer_forms": "eval.py answer-forms (its command calls the probe's)",
    "plot": "eval.py's figures (its command, learn's report)",
    "records": "a task's rows as records",
    "reward": "a task's verified reward of one completion",
    "style_fits": "whether a prompt style suits a task",
    "table": "rows as a text table",
    "report": "a command's text report",
    "summarize": "a probe's per-response rows summed up",
    "changed": "whether something changed since it was recorded",
    "compare": "two answers or runs compared",
    "counts": "how many of each",
    "free": "memory given back to the allocator",
    "rewrite": "a text rewritten",
    "run": "a benchmark's part run",
    "run_once": "a benchmark's configuration run once",
    "show": "a benchmark's result printed",
    "stop": "a child process stopped",
    "synced": "a CUDA-synchronised timer",
    "timed": "a CUDA-synchronised timer",
    "load": "what a command needs, loaded",
    "train": "GRPO training runs",
    "rows": "a generated task's rows (data.Dataset.generator)",
}
# Module names from before each move: the flat modules before the folders, and training's flat modules
# before the rooms (tests/test_imports.py keeps both lists: an old import would fail at run time anyway,
# but not in a docstring, a notebook cell or a README snippet).
FLAT_NAMES = (
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
)
TRAINING_FLAT = (
    "attention backoff budget checkpoint config_file credit cudagraph decode_step dynamic_filter engine "
    "flags footprint gguf heldout helptext load models oar preflight presets pretrained resume reward_code "
    "reward_files reward_forms rollout rollout_log run rundir runlog shaping signals step_bytes step_shapes "
    "tracking trl_setup usercode"
).split()


def modules(root=ROOT) -> dict:
    """{dotted module name: path} of the root scripts and the folder modules (packages by their __init__)."""
    found = {p.stem: p for p in root.glob("*.py")}
    for folder in FOLDERS:
        for p in (root / folder).rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


def imported(path, names) -> set:
    """The modules of `names` that `path` imports, as dotted names: `from training.run import log` and
    `import training.run.log` give training.run.log; `from training.run.log import x` gives training.run.log.
    A package is counted only where nothing of it is named (`from training import policy`:
    training.policy)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(names)
            deps |= subs or {node.module}
    return {d for d in deps if d in names}


def import_graph(root=ROOT) -> dict:
    """{module: the project modules it imports}, dotted."""
    mods = modules(root)
    return {name: imported(path, mods) - {name} for name, path in mods.items()}


def folder_of(module) -> str:
    """A module's place: its folder, or the module itself for a root script."""
    return module.split(".")[0]


def room_of(module):
    """A training module's room (training.run.log: run; training.policy: policy), None elsewhere."""
    parts = module.split(".")
    return parts[1] if parts[0] == "training" and len(parts) > 1 else None


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


def upward_imports(graph) -> list:
    """Imports against the layering: a folder module importing an entry script, or a training room importing
    a room above it in ROOMS (or one not in ROOMS)."""
    bad = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if "." in m for d in sorted(deps & ENTRY)]
    for m, deps in sorted(graph.items()):
        here = room_of(m)
        for d in sorted(deps):
            there = room_of(d)
            if here and there and there != here:
                if here not in ROOMS or there not in ROOMS or ROOMS.index(there) > ROOMS.index(here):
                    bad.append(f"{m} imports {d}: room {here} under room {there}")
    return bad


def test_find_cycle_hand_cases():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d"}}) == ["d", "d"]


def test_reads_dotted_imports_inside_functions(tmp_path):
    (tmp_path / "training" / "decode").mkdir(parents=True)
    (tmp_path / "training" / "run").mkdir()
    (tmp_path / "training" / "decode" / "low.py").write_text("import os\n\ndef f():\n    import grpo\n")
    (tmp_path / "training" / "decode" / "up.py").write_text("def f():\n    from training.run import log\n")
    (tmp_path / "training" / "run" / "log.py").write_text("from training.decode import low\n")
    (tmp_path / "grpo.py").write_text("from training.decode import low\nimport torch.nn\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "grpo": {"training.decode.low"},
        "training.decode.low": {"grpo"},
        "training.decode.up": {"training.run.log"},
        "training.run.log": {"training.decode.low"},
    }
    assert find_cycle(graph) == ["grpo", "training.decode.low", "grpo"]
    assert upward_imports(graph) == [
        "training.decode.low imports grpo",
        "training.decode.up imports training.run.log: room decode under room run",
    ]


def tracked(pattern):
    """The tracked files matching a git pathspec (`git ls-files`), or None outside a git checkout. The
    layout is the project's files: a script a user leaves in the root is not one of them, and a file the
    project adds is tracked once committed."""
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
        tree = ast.parse((ROOT / folder / "__init__.py").read_text())
        assert ast.get_docstring(tree) and len(tree.body) == 1, f"{folder}/__init__.py: a docstring alone"


def test_training_is_a_few_rooms_each_opened_by_a_docstring_naming_its_modules():
    """At most MAX_ENTRIES entries in training/ besides __init__.py (the rooms of ROOMS, the same set); each
    room's __init__.py is a docstring alone that names every module of the room, so it cannot drift."""
    files = tracked("training/*")
    if files is None:
        pytest.skip("not a git checkout")
    entries = {p.relative_to(ROOT / "training").parts[0] for p in files} - {"__init__.py"}
    assert len(entries) <= MAX_ENTRIES, sorted(entries)
    assert {e.removesuffix(".py") for e in entries} == set(ROOMS)
    for room in ROOMS:
        init = ROOT / "training" / room / "__init__.py"
        if not init.exists():  # a room of one file
            continue
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(tree.body) == 1, f"{init}: a docstring alone"
        held = sorted(p.name for p in init.parent.glob("*.py") if p.name != "__init__.py")
        assert held and all(name in doc for name in held), (init, held)


def test_imports_run_down_the_rooms_and_no_folder_module_imports_an_entry_script():
    graph = import_graph()
    assert {"grpo", "training.policy", "training.run.log", "evaluation.memtrace", "tasks.answers"} <= set(
        graph
    )
    assert upward_imports(graph) == []


def test_no_cycle_among_modules_folders_or_rooms():
    graph = import_graph()
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
    folders, rooms = defaultdict(set), defaultdict(set)
    for m, deps in graph.items():
        folders[folder_of(m)] |= {folder_of(d) for d in deps} - {folder_of(m)}
        if room_of(m):
            rooms[room_of(m)] |= {room_of(d) for d in deps if room_of(d)} - {room_of(m)}
    assert find_cycle(folders) == [], " -> ".join(find_cycle(folders))
    assert find_cycle(rooms) == [], " -> ".join(find_cycle(rooms))
    assert "evaluation" in folders["eval"] and "training" in folders["grpo"]
    assert "grpo" not in folders["training"]


def test_no_module_is_past_its_bound():
    """MAX_LINES is an upper bound on a module's lines (an idea per module), not a size to trim to."""
    files = tracked("*.py")
    if files is None:
        pytest.skip("not a git checkout")
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, long


def test_a_name_defined_in_two_modules_has_one_meaning():
    """Every top-level function or class defined in more than one project module (tests apart) is a role of
    SAME_ROLE: one name, one meaning across the files."""
    files = tracked("*.py")
    if files is None:
        pytest.skip("not a git checkout")
    where = defaultdict(list)
    for p in files:
        if p.parts[len(ROOT.parts)] == "tests":
            continue
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                where[node.name].append(str(p.relative_to(ROOT)))
    twice = {name: places for name, places in where.items() if len(places) > 1 and name not in SAME_ROLE}
    assert twice == {}, twice


def test_nothing_imports_a_module_by_a_name_from_before_a_move():
    """Over the tracked .py, .ipynb and .md files: an import of a module by its flat name from before the
    folders (`import policy`, `from regions import ...`), or a training module named by its name or path from
    before the rooms (`from training import rollout`, `training.rollout.generate`, `training/rollout.py`), in
    code, notebook cells or README snippets. The rooms named as a flat module was (credit, run, usercode) and
    the room of one file (policy) are today's names where a module of the room follows."""
    files = tracked("*.py") or []
    files += (tracked("*.ipynb") or []) + (tracked("*.md") or [])
    if not files:
        pytest.skip("not a git checkout")
    flat, old = "|".join(FLAT_NAMES), "|".join(TRAINING_FLAT)
    rooms = "|".join(r for r in ROOMS if r in TRAINING_FLAT)
    patterns = [
        rf"(^|[\";])\s*(import ([A-Za-z_.]+( as [A-Za-z_]+)?, )*({flat})\b|from ({flat}) import)",
        rf"from training import [^\n]*\b({old})\b",
        rf"training[./](?!(?:{rooms})(?:/|\.\w| import ))(?!policy\b)({old})\b",
    ]
    hits = []
    for path in files:
        if path.name == "test_imports.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line, re.M) for p in patterns):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
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
    """Why a checkpoint written before a move resumes after it: trainer_state.pt's pickle names only torch's
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
    project = set(FLAT_NAMES) | set(TRAINING_FLAT) | SCRIPTS | set(FOLDERS)
    for f in (tmp_path / "ckpt").rglob("*"):
        if f.suffix in (".json", ".txt", "") and f.is_file():
            assert not any(
                f"{m}." in f.read_text(errors="replace") for m in ("training", "evaluation", "tasks")
            )
    assert not {m.split(".")[0] for m, _ in names} & project
