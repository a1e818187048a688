import re
import tomllib
from importlib import metadata
from pathlib import Path

import yaml

import attnum

ROOT = Path(__file__).resolve().parents[2]


def _pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"unpinned requirement {line!r}"
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_environment_yml_agrees_with_requirements_txt():
    pip_pins = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _pins(pip_section) == pip_pins
    assert "torch" in pip_pins and pip_pins["torch"] == "2.13.0"
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert python == "python=3.11"
    assert "import-linter" in pip_pins  # `make test` runs lint-imports
    assert metadata.version("import-linter") == pip_pins["import-linter"], "the installed import-linter is not the pin"


# -- the import layers (pyproject.toml [tool.importlinter]), as `make test` checks them with lint-imports --

def _importlinter_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_the_import_contracts_hold():
    from importlinter.cli import lint_imports

    assert Path(attnum.__file__).resolve().parent == ROOT / "lib" / "attnum", "another attnum is on sys.path"
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_every_module_of_attnum_is_in_one_layer():
    """A module left out of the layers would be free to import anything (and so to close a cycle)."""
    layers = next(c for c in _importlinter_config()["contracts"] if c["type"] == "layers")["layers"]
    named = [name.strip() for layer in layers for name in layer.split("|")]
    assert len(named) == len(set(named))
    package = ROOT / "lib" / "attnum"
    modules = {f"attnum.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"attnum.{p.parent.name}" for p in package.glob("*/__init__.py")}
    assert set(named) == modules


def test_every_study_is_in_the_independence_contract():
    independent = next(c for c in _importlinter_config()["contracts"] if c["type"] == "independence")["modules"]
    assert independent == ["attnum.studies.*"]
    studies = {p.parent.name for p in (ROOT / "lib" / "attnum" / "studies").glob("*/__init__.py")}
    assert studies == {path.stem[3:] for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}


# -- the lock (requirements-lock.txt: every package, transitive ones included) and pyproject's bounds --

def _lock() -> dict[str, str]:
    lines = [line.strip() for line in (ROOT / "requirements-lock.txt").read_text().splitlines()]
    entries = [line for line in lines if line and not line.startswith("#")]
    pins = _pins(entries)
    assert len(pins) == len(entries), "a package is locked twice"
    return pins


def test_the_lock_agrees_with_the_direct_pins_of_requirements_txt():
    from packaging.version import Version

    lock, direct = _lock(), _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert not set(direct) - set(lock), f"pinned in requirements.txt but not locked: {sorted(set(direct) - set(lock))}"
    # a local build label (torch's ``+cpu``) is the same release
    differ = {name: (version, lock[name]) for name, version in direct.items()
              if Version(Version(lock[name]).public) != Version(version)}
    assert differ == {}, f"requirements.txt pin vs lock: {differ}"
    assert len(lock) > len(direct)  # the transitive packages are locked too
    assert "attnum" not in lock and "pip" not in lock


def test_every_requirement_of_a_locked_package_is_locked():
    """Walks the requirements (with their extras) from requirements.txt's pins through the metadata of the
    packages installed here at their locked versions: every package reached must be locked."""
    from packaging.requirements import Requirement

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    lock = _lock()
    direct = _pins((ROOT / "requirements.txt").read_text().splitlines())
    todo, seen, unlocked, walked = [(name, "") for name in direct], set(), set(), 0
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        if name not in lock:
            unlocked.add(name)
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if norm(dist.version) != norm(lock[name]):
            continue  # installed here at another version: its metadata says nothing about the locked one
        walked += 1
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(norm(req.name), e) for e in sorted(req.extras) or [""]]
    assert unlocked == set(), f"required by a locked package but not locked: {sorted(unlocked)}"
    assert walked >= len(direct), "the installed environment is not the locked one: too few packages walked"


def test_make_installs_the_lock():
    """`make setup` (and every target through the stamp) installs requirements-lock.txt, re-installs when it
    changes, and installs nothing else but the editable attnum without dependencies."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$(STAMP):"))
    assert "requirements-lock.txt" in lines[start].split(":", 1)[1].split()
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t") and not (recipe and recipe[-1].endswith("\\")):
            break
        recipe.append(line)
    installs = [line for line in recipe if "pip install" in line]
    assert installs and all("-r requirements-lock.txt" in line or "--no-deps -e ." in line for line in installs)
    assert not any("requirements.txt" in line for line in recipe)


def test_pyproject_bounds_admit_the_pins_and_name_every_pinned_package():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"]) == {"lab", "docs", "test", "gpu"}
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    direct = _pins((ROOT / "requirements.txt").read_text().splitlines())
    names = {re.sub(r"[-_.]+", "-", r.name).lower() for r in declared}
    assert names == set(direct), f"pyproject vs requirements.txt: {sorted(names ^ set(direct))}"
    for req in declared:
        pin = direct[re.sub(r"[-_.]+", "-", req.name).lower()]
        assert req.specifier and not any(s.operator == "==" for s in req.specifier), f"{req}: a lower bound, not a pin"
        assert req.specifier.contains(pin), f"{req} excludes the pinned {pin}"
    for needed in ("dask", "distributed", "ipykernel", "myst-nb"):  # sweep/run-all, papermill's kernel, attnum.glue
        assert needed in {re.sub(r"[-_.]+", "-", r).lower().split(">")[0] for r in project["dependencies"]}


# -- the README's tables: the kernel families (generated from the registry) and the layout --

def _readme() -> list[str]:
    return (ROOT / "README.md").read_text().splitlines()


def test_the_readme_kernel_family_table_is_the_registrys():
    from attnum.kernels.registry import family_table, families

    lines = _readme()
    start = lines.index("| family | example names | what it is |")
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert "\n".join(table) == family_table()
    assert len(table) == 2 + len(families())  # header, rule, one row per family


LAYOUT_ENTRY = re.compile(r"^( *)([\w<>]+(?:/[\w<>]+)*(?:\.py|/)(?:, [\w<>]+(?:\.py|/))*)(?: {2,}|$)")


def _layout_paths() -> list[Path]:
    """The paths the README's layout block names, each under the folder its indentation places it in."""
    lines = _readme()
    start = lines.index("## Layout")
    fence = lines.index("```", start)
    block = lines[fence + 1:lines.index("```", fence + 1)]
    paths, stack = [], []  # stack: (indent, folder) of the folders open above the current line
    for line in block:
        match = LAYOUT_ENTRY.match(line)
        if not match:
            continue  # a description's continuation line
        indent, tokens = len(match.group(1)), match.group(2).split(", ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ROOT
        named = [parent / token for token in tokens]
        paths += named
        if len(tokens) == 1 and tokens[0].endswith("/"):
            stack.append((indent, named[0]))
    return paths


def test_every_path_the_readme_layout_names_exists():
    paths = _layout_paths()
    assert len(paths) > 30
    missing = []
    for path in paths:
        relative = path.relative_to(ROOT).as_posix()
        if "<" in relative:  # a placeholder such as <study>: at least one folder fits it
            found = list(ROOT.glob(re.sub(r"<[^>]+>", "*", relative)))
        else:
            found = [path] if path.exists() else []
        if not found:
            missing.append(relative)
    assert missing == []


def test_the_readme_layout_names_every_module_of_attnum():
    named = set()
    for path in _layout_paths():  # a folder is named also through what it holds (studies/<study>/)
        relative = path.relative_to(ROOT)
        named |= {relative.as_posix()} | {parent.as_posix() for parent in relative.parents}
    package = ROOT / "lib" / "attnum"
    modules = [p for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    modules += [p.parent for p in package.glob("*/__init__.py")]
    modules += [p for p in (package / "kernels").glob("*.py") if p.stem != "__init__"]
    left_out = sorted(p.relative_to(ROOT).as_posix() for p in modules if p.relative_to(ROOT).as_posix() not in named)
    assert left_out == []
