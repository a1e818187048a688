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
