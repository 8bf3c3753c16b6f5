"""Nothing the local trainer imports takes the accelerator behind the policy's back (issue 37): jax (bm25s imports
it when installed and it pre-allocates 75% of a GPU; tests/retrieval/test_retrieval_no_jax.py) and TensorFlow
(tensorboard's file I/O imports it when installed). Fake `jax`, `flax` and `tensorflow` packages first on a child's
sys.path record any import, so the check holds whether or not the real ones are installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAKE = """
from pathlib import Path
Path({marker!r}).write_text("imported")
raise ImportError("fake {name} (tests/train/test_no_device_grabbers.py)")
"""

CHILD = r"""
import sys
from pathlib import Path
from rlf_train.logging_utils import MetricsLogger

log = MetricsLogger(Path(sys.argv[1]), tensorboard=True)
for step in range(3):
    log.log({"stage": "rl", "step": step, "loss": 0.5 / (step + 1)})
log.close()
assert any((Path(sys.argv[1]) / "tb" / "rl").iterdir()), "no TensorBoard event file written"
"""


def test_tensorboard_logging_imports_no_tensorflow_or_jax(tmp_path: Path) -> None:
    site = tmp_path / "fake"
    markers = {}
    for name in ("tensorflow", "jax", "flax"):
        (site / name).mkdir(parents=True)
        markers[name] = tmp_path / f"{name}-imported"
        (site / name / "__init__.py").write_text(FAKE.format(marker=str(markers[name]), name=name))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *[p for p in sys.path if p]])}
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [n for n, m in markers.items() if m.exists()], "the trainer's logging imported a device-grabbing package"
