"""Every install line a user sees (README, docs, the servers' README, docstrings, error hints) works as written
from a checkout: rlf's distributions are named by their folder with declared extras, and a package's local
dependencies stand on the same line (tests/support/install_lines.py). The `train`-marked tests resolve the key lines
with pip itself (a dry run against the package index, nothing installed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from install_lines import ROOT, InstallLine, find_lines, problems

from rlf_envs import extras
from rlf_envs.adapters import ADAPTERS


def test_every_install_line_a_user_sees_works_from_a_checkout() -> None:
    lines = find_lines()
    assert len(lines) > 40, "the search for install lines found almost nothing: is its pattern broken?"
    bad = [f"{line}\n    " + "\n    ".join(problems(line)) for line in lines if problems(line)]
    assert not bad, "install lines that cannot work as written:\n" + "\n".join(bad)
    seen = {line.args for line in lines}
    # the smallest installs of the trainer and the server name their local sibling (README, getting started)
    assert "-e ./rlf_envs -e ./rlf_train" in seen and "-e ./rlf_envs ./servers" in seen


@pytest.mark.parametrize("args", [
    "'rlf-envs[bm25]'",  # the old missing-dependency hint
    "'rlf-envs[openai,search]'",  # the old api-eval page
    "-e ./rlf_train",  # "No matching distribution found for rlf-envs[bm25,tokenizers]"
    "./servers",
    "my-rlf-env",  # the env-package template's distribution
    "-e './rlf_envs[no-such-extra]'",
])
def test_the_check_refuses_what_a_new_user_tripped_on(args: str) -> None:
    assert problems(InstallLine("x", args))


def test_missing_dependency_hints_are_lines_that_work() -> None:
    hints = [extras.install_hint(m) for m in extras.EXTRA_FOR]
    hints += [a.install for a in ADAPTERS.values()]
    hints += [extras.pip_install("wandb", dist="rlf-train"), extras.pip_install("openrlhf", dist="rlf-train")]
    root = extras.checkout_root()
    assert root == ROOT  # this checkout: the hints name its absolute paths, so they work from any directory
    assert extras.install_hint("bm25s") == f"pip install -e '{ROOT}/rlf_envs[bm25]'"
    assert (extras.pip_install("wandb", dist="rlf-train")
            == f"pip install -e {ROOT}/rlf_envs -e '{ROOT}/rlf_train[wandb]'")
    for hint in hints:
        m = re.search(r"pip install ((?:[^`\"\n#(]|'[^'\n]*')+)", hint)
        assert m is not None, hint
        assert not problems(InstallLine("hint", m.group(1).strip()), cwd=Path("/")), hint


def test_hints_outside_a_checkout_list_the_extras_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "checkout_root", lambda: None)  # as if installed from a wheel
    assert extras.install_hint("bm25s") == "pip install 'bm25s<0.4,>=0.3'  (rlf-envs's extra bm25)"
    assert "rlf-envs[" not in extras.install_hint("pyarrow.parquet")


def test_the_cpu_torch_line_pins_what_constraints_pins() -> None:
    pin = (ROOT / "constraints.txt").read_text().split()
    lines = [line for line in find_lines() if re.search(r"\btorch==", line.args)]
    assert {line.where.split(":")[0] for line in lines} >= {"README.md", "docs/getting-started.md",
                                                            "docs/integrations/trl.md"}
    for line in lines:
        assert line.args.split()[0] in pin, line
        assert "--index-url https://download.pytorch.org/whl/cpu" in line.args, line
