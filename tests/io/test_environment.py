import re
from pathlib import Path

import yaml

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
