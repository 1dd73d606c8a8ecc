"""Imports point one way: connector <- watchdog <- comm <- zero <- train; nn, optim, config, xp
are leaves.

meta_dist.errors (the UsageError) and meta_dist.env (the on/off switches) import nothing and
may be imported from anywhere.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "meta_dist"

ANYWHERE = ("meta_dist.errors", "meta_dist.env")  # a UsageError, a switch: from any module
# module (or package prefix) -> meta_dist modules it may import
ALLOWED = {
    "meta_dist.errors": set(),
    "meta_dist.env": set(),
    "meta_dist.xp": set(),
    "meta_dist.launcher": set(),
    "meta_dist.config": {"meta_dist.config", "meta_dist.launcher"},
    "meta_dist.failfast": {"meta_dist.launcher"},
    "meta_dist.lazy_mpi": {"meta_dist.launcher"},
    "meta_dist.blas_threads": set(),
    "meta_dist.trace": set(),
    "meta_dist.checkpoint": {"meta_dist.checkpoint"},
    "meta_dist.connector": {"meta_dist.blas_threads", "meta_dist.failfast", "meta_dist.launcher",
                            "meta_dist.lazy_mpi"},
    "meta_dist.stall_report": {"meta_dist.xp"},
    "meta_dist.watchdog": {"meta_dist.failfast", "meta_dist.lazy_mpi", "meta_dist.stall_report"},
    "meta_dist.gpus": {"meta_dist.connector", "meta_dist.xp"},
    "meta_dist.nn": {"meta_dist.xp", "meta_dist.nn"},
    "meta_dist.optim": {"meta_dist.xp", "meta_dist.optim"},
    "meta_dist.comm": {"meta_dist.comm", "meta_dist.connector", "meta_dist.failfast",
                       "meta_dist.gpus", "meta_dist.lazy_mpi", "meta_dist.watchdog",
                       "meta_dist.xp"},
    "meta_dist.distributed": {"meta_dist.comm", "meta_dist.connector", "meta_dist.config",
                              "meta_dist.gpus", "meta_dist.xp"},
    "meta_dist.zero": {"meta_dist.zero", "meta_dist.comm", "meta_dist.nn", "meta_dist.optim",
                       "meta_dist.xp"},
    "meta_dist.train": None,  # the glue: may import everything
    "meta_dist.bench": None,  # the benchmarks: whole programs
    "meta_dist": None,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rule_for(name: str):
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return prefix, ALLOWED[prefix]
    raise AssertionError(f"{name} has no layering rule; add it to ALLOWED")


def imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_imports_follow_the_layers():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        prefix, allowed = rule_for(name)
        if allowed is None:
            continue
        for imported in imports_of(path):
            if not imported.startswith("meta_dist") or imported in ANYWHERE:
                continue
            if not any(imported == a or imported.startswith(a + ".") for a in allowed):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "layering violated:\n" + "\n".join(wrong)


def test_leaves_do_not_import_mpi():
    for leaf in ("nn", "optim", "zero/partition.py", "config", "xp.py", "checkpoint"):
        root = PACKAGE / leaf
        for path in root.rglob("*.py") if root.is_dir() else [root]:
            assert "mpi4py" not in set(imports_of(path)), f"{path} imports mpi4py"


def test_importing_meta_dist_starts_no_mpi():
    """MPI starts with the context, not on import, whichever part is imported (every module of
    the package here): a rank that fails before dist.init() then exits like any process
    (tests/test_launch.py ends such jobs under both MPIs)."""
    import subprocess
    import sys

    code = ("import importlib, importlib.util, pkgutil, sys\n"
            "import meta_dist\n"
            "names = [m.name for m in pkgutil.walk_packages(meta_dist.__path__, 'meta_dist.')]\n"
            "extras = {'meta_dist.models.torch_gpt': 'torch',  # need the bench extra\n"
            "          'meta_dist.bench.torch_side': 'torch'}\n"
            "for name in names:\n"
            "    extra = extras.get(name)\n"
            "    if extra and importlib.util.find_spec(extra) is None:\n"
            "        continue\n"
            "    if name != 'meta_dist.__main__':\n"
            "        importlib.import_module(name)\n"
            "assert 'meta_dist.comm.mpi_backend' in sys.modules, names\n"
            "print(sorted(m for m in sys.modules if m.startswith('mpi4py.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
