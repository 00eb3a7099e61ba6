"""What ``pip install -e .`` gives: numpy with the package (torch warns at every import without
it), and the ``fsdp-compile`` command beside ``python -m fsdp_compile``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib needs Python 3.11


def test_numpy_is_installed_with_the_package_and_torch_does_not_warn() -> None:
    dependencies = re.search(r"^dependencies = \[(.*)\]$", PYPROJECT, re.MULTILINE)[1]
    assert '"numpy"' in dependencies
    assert any(r.split(";")[0].strip() == "numpy" for r in importlib.metadata.requires("fsdp_compile") or [])
    done = subprocess.run([sys.executable, "-c", "import torch, fsdp_compile"], capture_output=True, text=True,
                          check=True)
    assert "Failed to initialize NumPy" not in done.stderr, done.stderr


def test_the_console_script_is_the_module_command() -> None:
    assert '\n[project.scripts]\nfsdp-compile = "fsdp_compile.__main__:main"\n' in PYPROJECT
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="fsdp-compile")
    from fsdp_compile.__main__ import main

    assert script.load() is main
    # run as the installed command would be: the usage names it, and every subcommand is there
    done = subprocess.run([sys.executable, "-c", "import sys; from fsdp_compile.__main__ import main; "
                           "sys.argv[0] = '/usr/bin/fsdp-compile'; sys.exit(main())", "plan", "--help"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith("usage: fsdp-compile plan")
    done = subprocess.run([sys.executable, "-m", "fsdp_compile", "--help"], capture_output=True, text=True,
                          check=True)
    assert done.stdout.startswith("usage: python -m fsdp_compile") and "{inspect,plan,compare}" in done.stdout


def test_the_lab_is_not_installed_with_the_package() -> None:
    """``lab/fsdp_compile_lab`` (the model of the CPU machine the figures are measured on) is the
    repository's, not the package's: setuptools' discovery, as pyproject.toml configures it, finds
    the package and its subpackages only, and a process without ``lab/`` on its path cannot
    import the lab."""
    from setuptools import find_namespace_packages

    include = re.search(r"^\[tool\.setuptools\.packages\.find\]\n(?:#.*\n)*include = \[(.*)\]$", PYPROJECT,
                        re.MULTILINE)
    patterns = re.findall(r'"([^"]+)"', include[1])
    found = find_namespace_packages(str(ROOT), include=patterns)
    assert "fsdp_compile.planning.calibration" in found and "fsdp_compile.network" in found
    assert [p for p in found if p != "fsdp_compile" and not p.startswith("fsdp_compile.")] == []
    assert (ROOT / "lab" / "fsdp_compile_lab" / "__init__.py").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import importlib.util, fsdp_compile; "
                           "print(importlib.util.find_spec('fsdp_compile_lab'))"],
                          capture_output=True, text=True, check=True, env=env, cwd=ROOT.parent)
    assert done.stdout.strip() == "None", done.stdout
