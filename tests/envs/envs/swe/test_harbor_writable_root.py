"""`SessionSpec(writable_root=True)` on the local backend (what Harbor tasks need: /logs, /tests, COPY/RUN outside
the workdir): the session user adds entries anywhere in its own root, cannot rename, remove or rewrite the image's
own files, and nothing reaches the image on the host or another session."""

from __future__ import annotations

import os
from typing import Any

import pytest


def _image() -> str | None:
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image
    except ImportError:
        return None
    return debian_test_image()


def _need() -> str:
    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")
    img = _image()
    if img is None:
        pytest.skip("no Debian test image: run `python -m rlf_envs.sandbox.sessions.images build-debian`")
    return img


def _run(go: Any) -> Any:
    from rlf_envs import runtime
    from rlf_envs.sandbox.sessions.local import LocalBackend

    async def main() -> Any:
        b = LocalBackend(pool_size=0)
        try:
            return await go(b)
        finally:
            await b.aclose()

    return runtime.run(main())


def test_host_image_cannot_have_a_writable_root() -> None:
    from rlf_envs.sandbox.sessions import SessionSpec

    with pytest.raises(ValueError, match="writable_root needs an image"):
        SessionSpec(writable_root=True)


def test_writable_root_adds_entries_but_keeps_the_image_and_other_sessions() -> None:
    img = _need()
    from rlf_envs.sandbox.sessions import SessionSpec

    async def go(b: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with await b.create(SessionSpec(image=img, workdir="/app", writable_root=True)) as s:
            r = await s.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                             "printf '#!/bin/sh\\necho hi\\n' > /usr/local/bin/hello && chmod +x /usr/local/bin/hello"
                             " && hello && id -u")
            out["add"] = r
            await s.write_file("/tests/test.sh", "echo t\n", mode=0o755)
            out["read"] = await s.read_file("/logs/verifier/reward.txt")
            out["rm"] = await s.exec("rm -f /etc/os-release")
            out["mv"] = await s.exec("mv /usr/lib /usr/lib2")
            out["overwrite"] = await s.exec("echo x > /bin/ls")
            out["tests"] = await s.exec("bash /tests/test.sh")
            await s.write_file("new.txt", "n\n")
            out["diff"] = await s.diff()  # the agent's diff after the root is opened (imports nothing from it)
            async with await b.create(SessionSpec(image=img, workdir="/app")) as other:
                out["other"] = await other.exec("ls /logs /tests; mkdir /logs")
        return out

    out = _run(go)
    assert out["add"].ok and out["add"].stdout.splitlines()[0] == "hi", out["add"]
    assert out["add"].stdout.splitlines()[1] != "0"  # the session's own uid, not root
    assert out["read"] == b"1\n"
    assert out["tests"].stdout == "t\n"
    assert "+++ b/new.txt" in out["diff"]
    for k in ("rm", "mv", "overwrite"):
        assert not out[k].ok, (k, out[k])
    assert not out["other"].ok and "Permission denied" in out["other"].stderr  # not writable, nothing shared
    assert not os.path.exists(os.path.join(img, "logs")) and not os.path.exists(os.path.join(img, "tests"))
    assert not os.path.exists(os.path.join(img, "usr/local/bin/hello"))
