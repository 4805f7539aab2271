"""What users install: a wheel built from this checkout, installed into a fresh virtual
environment outside it, holds every module of ``hypercli/`` and runs a recipe.

Offline: the wheel is built without build isolation, and the new environment finds the
third-party packages of the test environment through a ``.pth`` line (a path line only: the
test environment's editable hook for hypercli is not run there), so ``import hypercli`` can only
come from the installed wheel.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)], check=True,
                   capture_output=True, timeout=300)
    (whl,) = out.glob("hypercli-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True,
                   timeout=120)
    py = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "test-deps.pth").write_text("".join(p + "\n" for p in deps))
    return env


def test_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hypercli").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "hypercli").rglob("*.py")}
    for pkg in packages:
        assert f"{pkg}/__init__.py" in names, pkg


def test_installed_wheel_runs_a_recipe(venv, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    (work / "data").mkdir()
    (work / "data" / "a.txt").write_text("alpha\n")
    (work / "r.yaml").write_text(textwrap.dedent("""
        name: fromwheel
        cluster: {workers: 2}
        experiments:
          work:
            parameters: {i: [1, 2]}
            command: |
              python3 -c 'import hypercli, sys; print(hypercli.__file__)'
              echo '{"i": {{i}}}' >> "$HYPER_METRICS"
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HYPER_HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
               COLUMNS="200")
    hyper = str(venv / "bin" / "hyper")
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import hypercli.mount.pack as m; print(m.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout
    r = subprocess.run([hyper, "run", "r.yaml"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([hyper, "results", "fromwheel"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "work-0001" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([hyper, "data", "push", "data", f"file://{tmp_path}/store/ds"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_installed_wheel_has_the_catalog_snapshot(wheel, venv, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("aws.csv.gz", "gcp.csv.gz", "azure.csv.gz", "snapshot.json", "NOTICE.md",
              "public_prices.csv"):
        assert f"hypercli/offers/data/{f}" in names, f
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HYPER_HOME=str(tmp_path / "home"), COLUMNS="200")
    r = subprocess.run([str(venv / "bin" / "hyper"), "offers", "L4:8", "--json"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"instance_type": "g2-standard-96"' in r.stdout
