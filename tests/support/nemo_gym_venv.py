"""Build the NeMo-Gym interpreter the foreign-nemo tests run NeMo-Gym in (`tox -e foreign-nemo`'s commands_pre).

    python tests/support/nemo_gym_venv.py DIR

makes DIR a Python >= 3.12 venv with nemo-gym installed as the trainer's docs say (`--no-deps`: every nemo-gym
release pins mcp<2) beside the packages its servers import (`rlf_train.rollout.foreign.nemo_gym.REQUIREMENTS`), and
writes DIR/rlf-stamp.json; a DIR whose stamp matches is kept as it is (a rerun takes a second). The 3.12 is
$RLF_PYTHON312, else pyenv's 3.12.1 (as tox's adapters-rl-nemo env), else `python3.12` on PATH. Where none is found
it builds nothing and says so (exit status 0): the tests then skip, naming the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PYENV_312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"


def find_python312() -> str | None:
    for cand in (os.environ.get("RLF_PYTHON312"), PYENV_312, shutil.which("python3.12")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            r = subprocess.run([cand, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True,
                               text=True)
            if r.stdout.strip() == "True":
                return cand
    return None


def main() -> int:
    from rlf_train.rollout.foreign.nemo_gym import NEMO_GYM_VERSION, REQUIREMENTS

    target = Path(sys.argv[1]).resolve()
    python = find_python312()
    reason = target.with_name(target.name + ".skip")
    if python is None:
        reason.write_text("no Python >= 3.12 found (set RLF_PYTHON312, or install pyenv's 3.12.1)")
        print(f"nemo_gym_venv: {reason.read_text()}: the foreign-nemo tests will skip")
        return 0
    reason.unlink(missing_ok=True)
    want = {"python": python, "nemo_gym": NEMO_GYM_VERSION, "requirements": list(REQUIREMENTS)}
    stamp = target / "rlf-stamp.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (target / "bin" / "python").exists():
        print(f"nemo_gym_venv: {target} is up to date")
        return 0
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(target)], check=True)
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-qq", "--disable-pip-version-check"]
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([*pip, "--no-deps", f"nemo-gym=={NEMO_GYM_VERSION}"], check=True, env=env)
    subprocess.run([*pip, *REQUIREMENTS], check=True, env=env)
    stamp.write_text(json.dumps(want))
    print(f"nemo_gym_venv: built {target} ({python}, nemo-gym {NEMO_GYM_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
