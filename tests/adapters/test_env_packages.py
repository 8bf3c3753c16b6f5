"""Env packages: a distribution with an `rlf_envs.envs` entry point registers its ids on `import rlf_envs`.
The template package (templates/rlf-env-package) is installed into a fresh venv (pip, offline) and used with no
import line of its own: gymnasium.make and `python -m rlf_envs.eval`."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

from rlf_envs.registration import PACKAGE_ENVS, load_env_packages
from tests.conftest import ROOT

TEMPLATE = ROOT / "templates" / "rlf-env-package"
GOOD = {"goodpkg/Arith-v0": "rlf_envs.envs.calculator:CalculatorEnv"}
WRONG_NAMESPACE = {"other/Arith-v0": "rlf_envs.envs.calculator:CalculatorEnv"}
STEALS_RLF = {"rlfx/Search-v0": "rlf_envs.envs.search:SearchEnv"}
NOT_A_MAPPING = 42


def _registers_by_hand() -> None:
    from rlf_envs.registration import register_env

    register_env("byhand/Arith-v0", "rlf_envs.envs.calculator:CalculatorEnv")


def _ep(name: str, attr: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"tests.adapters.test_env_packages:{attr}", group="rlf_envs.envs")


def test_entry_points_register_ids_and_bad_packages_are_skipped_with_a_warning() -> None:
    eps = [_ep("goodpkg", "GOOD"), _ep("byhand", "_registers_by_hand"), _ep("wrongns", "WRONG_NAMESPACE"),
           _ep("notmap", "NOT_A_MAPPING"), _ep("missing", "NO_SUCH_ATTR"),
           EntryPoint(name="gone", value="no_such_module_xyz:ENVS", group="rlf_envs.envs"),
           _ep("rlf", "GOOD")]
    with pytest.warns(UserWarning) as caught:
        out = load_env_packages(lambda: eps)
    assert out == {"goodpkg": ["goodpkg/Arith-v0"], "byhand": ["byhand/Arith-v0"]}
    text = "\n".join(str(w.message) for w in caught)
    assert "must be in the package's namespace: 'wrongns/<Name>-v<N>'" in text
    assert "it must be a mapping of env id" in text
    assert "no_such_module_xyz" in text and "NO_SUCH_ATTR" in text
    assert "the namespace 'rlf' is rlf's own" in text
    env = gym.make("goodpkg/Arith-v0").unwrapped
    assert type(env).__name__ == "CalculatorEnv"
    venv = gym.make_vec("goodpkg/Arith-v0", num_envs=2, vectorization_mode="vector_entry_point")
    assert type(venv).__name__ == "ToolVectorEnv" and venv.num_envs == 2
    venv.close()
    # a second package cannot take ids already registered
    with pytest.warns(UserWarning, match="already registered"):
        assert load_env_packages(lambda: [_ep("goodpkg", "GOOD")]) == {}
    assert PACKAGE_ENVS["goodpkg/Arith-v0"]


def _venv_with_template(tmp_path: Path) -> Path:
    """A fresh venv that sees this environment's packages (a .pth file), with the template pip-installed into
    it (offline: no index, no build isolation)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    venv_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    parent = [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()
    # addsitedir (not a bare path) so the parent's own .pth files (editable installs) are processed too
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(parent)]
    Path(venv_site, "_parent_env.pth").write_text("\n".join(lines) + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", str(TEMPLATE)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PIP_CONSTRAINT": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    return py


def test_the_template_package_installs_and_needs_no_import_line(tmp_path: Path, chat_server: Any) -> None:
    py = _venv_with_template(tmp_path)
    make = ("import gymnasium, rlf_envs; env = gymnasium.make('myenv/Arithmetic-v0'); obs, info = env.reset(seed=1); "
            "print(type(env.unwrapped).__name__, 'calculator' in obs, info['task_id'])")
    r = subprocess.run([str(py), "-c", make], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[:2] == ["ArithmeticEnv", "True"]
    # the package is not importable from this process: the venv's own install is what registered the id
    assert "myenv/Arithmetic-v0" not in gym.registry
    fake = chat_server(mode="native")
    out = tmp_path / "eval"
    r = subprocess.run([str(py), "-m", "rlf_envs.eval", "--env", "myenv/Arithmetic-v0", "--base-url", fake.url,
                        "--model", "fake", "-n", "6", "--concurrency", "3", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env"] == "myenv/Arithmetic-v0" and summary["episodes"] == 6
    assert summary["success_rate"] == 1.0 and summary["tool_calls_mean"] == 1.0  # the package's tool ran
    # an id no installed package provides: a clear error, exit 2
    r = subprocess.run([str(py), "-m", "rlf_envs.eval", "--env", "myenv/Nope-v0", "--base-url", fake.url,
                        "--model", "fake", "-n", "1", "--no-progress"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 2 and "myenv/Nope-v0" in r.stderr
