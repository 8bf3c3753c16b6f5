"""The sandboxed Python interpreter tool: per-episode files, and hostile code called through a Toolbox."""

from __future__ import annotations

import secrets
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlf_envs.sandbox import SandboxLimits
from rlf_envs.tools import PythonInterpreter, Toolbox
from rlf_envs.types import ToolStatus

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, max_output_bytes=4096)


@pytest.mark.asyncio
async def test_files_persist_within_an_episode_only() -> None:
    tool = PythonInterpreter(LIMITS)
    box = Toolbox([tool])
    try:
        r = await box.call("python", {"code": "open('notes.txt', 'w').write('kept')\nprint('saved')"})
        assert r.ok and r.content == "[stdout]\nsaved"
        first = tool.workdir
        assert first is not None
        r = await box.call("python", {"code": "print(open('notes.txt').read())"})
        assert r.content == "[stdout]\nkept"
        tool.start_episode()
        assert not first.root.exists()  # the old episode's dir is gone
        r = await box.call("python", {"code": "import os\nprint(os.path.exists('notes.txt'))"})
        assert r.content == "[stdout]\nFalse"
        r = await box.call("python", {"code": "print(input()[::-1])", "stdin": "abc"})
        assert r.content == "[stdout]\ncba"
        r = await box.call("python", {"code": "raise SystemExit(4)"})
        assert r.ok and r.content == "[exit status 4]"
        r = await box.call("python", {"cmd": "ls"})
        assert r.status is ToolStatus.INVALID_ARGS
    finally:
        last = tool.workdir
        await tool.aclose()
    assert last is not None and not last.root.exists()


@pytest.mark.asyncio
async def test_hostile_code_through_the_tool(leftovers: Callable[[str], list[int]], isolated: None) -> None:
    tool = PythonInterpreter(LIMITS)
    box = Toolbox([tool])
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    outside = Path(f"/tmp/rlf_escape_{secrets.token_hex(6)}")
    try:
        t0 = time.monotonic()
        r = await box.call("python", {"code": "while True:\n    pass"})
        assert r.ok and "[killed: time limit of 5 s]" in r.content
        assert time.monotonic() - t0 < 30.0
        r = await box.call("python", {"code": "while True:\n    print('y' * 1000)"})
        assert "[killed: output over 4096 bytes]" in r.content and len(r.content) < 4000
        kill = textwrap.dedent(f"""
            import os, signal
            try:
                open({str(outside)!r}, "w").write("x")
            except OSError:
                pass
            if os.fork() == 0:
                os.setsid()
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            parent = os.getppid()
            if parent > 1:  # 0 in a pid namespace
                for send in (os.kill, os.killpg):
                    try:
                        send(parent, signal.SIGKILL)
                    except OSError:
                        pass
            print("still here")
        """)
        r = await box.call("python", {"code": kill})
        assert r.ok and r.content == "[stdout]\nstill here", r  # the supervisor survived to report
        assert leftovers(marker) == []
        assert not outside.exists()
        r = await box.call("python", {"code": "print('next call works')"})
        assert r.content == "[stdout]\nnext call works"
    finally:
        outside.unlink(missing_ok=True)
        await tool.aclose()


@pytest.mark.asyncio
async def test_a_planted_symlink_does_not_redirect_our_writes(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("original")
    tool = PythonInterpreter(LIMITS)
    try:
        # the next call's script is written where this symlink (and then a directory) stands
        plant = f"import os\nos.remove('.rlf_main.py')\nos.symlink({str(target)!r}, '.rlf_main.py')\nprint('planted')"
        assert (await tool.call({"code": plant})) == "[stdout]\nplanted"
        assert (await tool.call({"code": "print('second')"})) == "[stdout]\nsecond"
        assert target.read_text() == "original"
        plant_dir = "import os\nos.remove('.rlf_main.py')\nos.mkdir('.rlf_main.py')\nprint('dir')"
        assert (await tool.call({"code": plant_dir})) == "[stdout]\ndir"
        assert (await tool.call({"code": "print('third')"})) == "[stdout]\nthird"
    finally:
        await tool.aclose()
