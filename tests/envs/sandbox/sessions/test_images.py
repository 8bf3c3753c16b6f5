"""Session images for the local backend: OCI archives (layers, whiteouts) unpacked once into the cache, and a real
Debian root (the test image: `python -m rlf_envs.sandbox.sessions.images build-debian`, which .ci/run runs) under an
overlay whose writes never reach the image. Tests needing the built image are skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec, images

FAST = SessionLimits(exec_timeout_s=60, session_timeout_s=300, disk_mb=64)
DEBIAN = images.debian_test_image()
needs_debian = pytest.mark.skipif(DEBIAN is None, reason="the Debian test image is not built: python -m "
                                  "rlf_envs.sandbox.sessions.images build-debian (needs mmdebstrap, ~2 min)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend needs root")


def _tar(entries: list[tuple[str, bytes | str | None]]) -> bytes:
    """Members: bytes = a file, None = a directory, a str = a symlink to it (or, named "hard", a hard link)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type = tarfile.LNKTYPE if name == "hard" else tarfile.SYMTYPE
                info.linkname = data
                tf.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _oci(path: Path, layers: list[bytes]) -> None:
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    ldescs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": add(layer), "size": len(layer)}
              for layer in layers]
    cfg = add(b"{}")
    manifest = json.dumps({"schemaVersion": 2, "config": {"digest": cfg, "size": 2}, "layers": ldescs}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{"digest": add(manifest), "size": len(manifest)}]})
    entries: list[tuple[str, bytes | str | None]] = [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
                                               ("index.json", index.encode())]
    entries += [(f"blobs/sha256/{d.split(':')[1]}", data) for d, data in blobs.items()]
    path.write_bytes(_tar(entries))


def test_oci_archive_layers_and_whiteouts_unpack_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_CACHE_DIR", str(tmp_path / "cache"))
    base = _tar([("bin", None), ("bin/sh", b"#!"), ("etc", None), ("etc/gone", b"x"), ("opq", None),
                 ("opq/old", b"o"), ("../evil", b"e"), ("/abs", b"a"), ("out", str(tmp_path)),
                 ("out/through_link", b"t"), ("hard", "out/victim")])
    (tmp_path / "victim").write_text("v")
    top = _tar([("etc/.wh.gone", b""), ("opq/.wh..wh..opq", b""), ("opq/new", b"n"), ("etc/added", b"a")])
    arch = tmp_path / "img.tar"
    _oci(arch, [base, top])
    root = Path(images.resolve_local(f"oci-archive:{arch}"))
    assert (root / "bin" / "sh").read_bytes() == b"#!" and (root / "etc" / "added").read_bytes() == b"a"
    assert not (root / "etc" / "gone").exists() and sorted(os.listdir(root / "opq")) == ["new"]
    assert not (tmp_path / "evil").exists() and (root / "abs").read_bytes() == b"a"  # names stay inside
    assert not (tmp_path / "through_link").exists() and not (root / "hard").exists()  # never through a link
    assert (tmp_path / "victim").stat().st_nlink == 1
    mtime = root.stat().st_mtime_ns
    assert images.resolve_local(f"oci-archive:{arch}") == str(root) and root.stat().st_mtime_ns == mtime  # cached
    with pytest.raises(images.ImageError, match="index.json"):
        bad = tmp_path / "bad.tar"
        bad.write_bytes(_tar([("x", b"")]))
        images.resolve_local(f"oci-archive:{bad}")
    with pytest.raises(images.ImageError, match="no such file"):
        images.resolve_local(f"oci-archive:{tmp_path / 'missing.tar'}")


def test_a_whiteout_of_a_deep_or_locked_tree_unpacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lower layer's tree 1500 levels deep (deeper than Python's recursion limit) and a directory of mode 000,
    removed by whiteouts of the next layer: removed by `sandbox.cleanup` (shutil.rmtree raised RecursionError)."""
    monkeypatch.setenv("RLF_CACHE_DIR", str(tmp_path / "cache"))
    deep = "/".join(["deep"] + ["d"] * 1500)
    entries: list[tuple[str, bytes | str | None]] = [(deep[:i], None) for i in range(4, len(deep) + 1, 2)
                                                     if deep[i - 1] != "/" and (i == len(deep) or deep[i] == "/")]
    entries += [(deep + "/f", b"x"), ("locked", None), ("locked/f", b"y"), ("keep", b"k")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0 if name == "locked" else 0o755
                tf.addfile(info)
            else:
                assert isinstance(data, bytes)
                info.size, info.mode = len(data), 0o644
                tf.addfile(info, io.BytesIO(data))
    top = _tar([(".wh.deep", b""), (".wh.locked", b""), ("added", b"a")])
    arch = tmp_path / "img.tar"
    _oci(arch, [buf.getvalue(), top])
    root = Path(images.resolve_local(f"oci-archive:{arch}"))
    assert sorted(os.listdir(root)) == ["added", "keep"]
    assert not [n for n in os.listdir(tmp_path / "cache" / "images") if n.startswith(".")]  # no half-made copy


@needs_root
@needs_debian
def test_a_session_in_the_debian_image_runs_git_and_pytest_and_leaves_the_image_untouched(tmp_path: Path) -> None:
    from rlf_envs.sandbox.sessions.local import LocalBackend

    assert DEBIAN is not None
    seed = tmp_path / "repo"
    seed.mkdir()
    (seed / "test_x.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")

    async def go() -> None:
        b = LocalBackend(pool_size=0)
        try:
            async with await b.create(SessionSpec(image=DEBIAN, seed_dir=str(seed), limits=FAST)) as s:
                r = await s.exec("cat /etc/debian_version; python3 -m pytest -q 2>&1 | tail -1; git --version")
                assert r.exit_code == 0 and r.stdout.startswith("12.") and "1 passed" in r.stdout, r
                r = await s.exec("touch /usr/bin/evil /evil 2>&1; echo x > /tmp/t && cat /tmp/t")
                assert r.stdout.endswith("x\n") and "denied" in r.stdout
                await s.write_file("new.py", "x = 1\n")
                assert "new.py" in await s.diff()
        finally:
            await b.aclose()

    asyncio.run(go())
    assert not os.path.exists(os.path.join(DEBIAN, "evil")) and not os.path.exists(os.path.join(DEBIAN, "workspace"))


@pytest.mark.slow
@needs_root
@needs_debian
def test_the_debian_root_as_a_rootfs_tarball_runs_a_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_envs.sandbox.sessions.local import LocalBackend

    tar = images.debian_test_tarball()
    assert tar is not None
    monkeypatch.setenv("RLF_CACHE_DIR", str(tmp_path / "cache"))

    async def go() -> str:
        b = LocalBackend(pool_size=0)
        try:
            async with await b.create(SessionSpec(image=f"rootfs-tar:{tar}", limits=FAST)) as s:
                return (await s.exec("python3 -c 'print(42)'")).stdout
        finally:
            await b.aclose()

    assert asyncio.run(go()) == "42\n"


def test_the_image_cli_runs_on_a_bare_interpreter(tmp_path: Path) -> None:
    """.ci/run builds and finds the test image with the machine's own python, which has no rlf_envs and none of its
    dependencies: the CLI must work there (stdlib only), not die importing the package."""
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RLF_CACHE_DIR": str(tmp_path / "cache")}
    # -S: no site-packages (so no rlf_envs, no pydantic), -I: no PYTHONPATH, run from a directory that is not the repo
    proc = subprocess.run([sys.executable, "-I", "-S", images.__file__, "path"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1 and "not built" in proc.stderr, (proc.returncode, proc.stderr)
