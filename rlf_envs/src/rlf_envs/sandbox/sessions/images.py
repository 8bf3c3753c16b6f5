"""Session images: where a session's root filesystem comes from, and the offline test image.

`SessionSpec.image` for the local backend:

- `"host"`: the host's /usr, /bin, /sbin, /lib* (read-only binds) and a few files of /etc: no image to build.
- a directory holding a root filesystem (it stays untouched: the session sees it through an overlay whose upper
  layer is a bounded tmpfs, or read-only where the kernel has no overlayfs).
- `"oci-archive:/path/img.tar"`: an OCI image layout tarball (`docker save` of recent engines, `skopeo copy ...
  oci-archive:`, `podman save --format oci-archive`); its layers are unpacked once into
  `$RLF_CACHE_DIR/images/oci-<digest>/` (whiteouts applied), shared read-only by every session.
- `"rootfs-tar:/path/root.tar"`: a plain tarball of a root filesystem (what `mmdebstrap` writes), unpacked once into
  `$RLF_CACHE_DIR/images/rootfs-<digest>/`.

CLI: `python -m rlf_envs.sandbox.sessions.images build-debian` builds the test image (Debian 12 minbase with
python3, git, bash, python3-pytest) with mmdebstrap from Debian's archive into `$RLF_CACHE_DIR/images/` and prints
its root directory; `debian_test_image()` returns that directory or None.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__ and sys.path:
    # run as a script (`python .../sessions/images.py path`): Python put this file's folder first on sys.path, and
    # that folder holds `types.py`, which would shadow the standard library's `types` (a circular import as soon as
    # argparse loads); nothing is imported from this folder by name
    import os.path as _osp

    if _osp.realpath(sys.path[0] or ".") == _osp.dirname(_osp.realpath(__file__)):
        del sys.path[0]

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

try:
    from rlf_envs.sandbox import cleanup
except ImportError:  # run as a script by a bare interpreter (.ci/run builds the test image so): the stdlib-only module
    import importlib.util

    _here = Path(__file__).resolve().parents[1]
    _spec = importlib.util.spec_from_file_location("rlf_sandbox_cleanup", _here / "cleanup.py")
    assert _spec is not None and _spec.loader is not None
    cleanup = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(cleanup)

DEBIAN_PACKAGES = ("python3", "git", "bash", "python3-pytest", "ca-certificates")
DEBIAN_SUITE = "bookworm"
DEBIAN_TEST_NAME = "debian-12-test"


class ImageError(ValueError):
    """An image spec that cannot be used (says why and how to fix it)."""


def cache_dir() -> Path:
    """`$RLF_CACHE_DIR/images` (else ~/.cache/rlf/images), made -- or tightened -- 0700: only its owner (root, for
    the local backend) may traverse it. The image roots in it keep their own modes (a session sees its image through
    an overlay, whose lower layer the root agent mounts before the session's root is entered, so the session's uid
    never needs this directory), and no session uid can reach the rest of the cache through it."""
    d = Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf") / "images"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    private_dir(d)
    return d


def private_dir(d: Path) -> None:
    """Make the directory `d` 0700 (if it is ours and not already so): what rlf caches for tasks there (image unpacks,
    seed copies) is neither readable nor traversable by any other uid, session uids included."""
    st = d.lstat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)


def resolve_local(image: str) -> str:
    """The root directory (or "host") a local session of `image` starts from; unpacks archives into the cache."""
    if image == "host":
        return "host"
    if image.startswith("docker:"):
        raise ImageError(f"{image!r} is an image of a container engine: use the docker backend "
                         "(open_backend('docker')), or `docker save` it and pass 'oci-archive:PATH'")
    if image.startswith("oci-archive:"):
        return unpack_oci(image.split(":", 1)[1])
    if image.startswith("rootfs-tar:"):
        return unpack_rootfs_tar(image.split(":", 1)[1])
    p = os.path.realpath(image)
    if not os.path.isdir(p):
        raise ImageError(f"image {image!r}: no such directory (use 'host', a root directory, 'oci-archive:PATH' or "
                         "'rootfs-tar:PATH')")
    if not (os.path.exists(p + "/bin/sh") or os.path.islink(p + "/bin")):
        raise ImageError(f"image {image!r} holds no /bin/sh: not a root filesystem")
    return p


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    st = os.stat(path)
    h.update(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def inside(root: str, path: str) -> bool:
    """Whether `path`, links resolved, is `root` or below it (`root` already resolved)."""
    p = os.path.realpath(path)
    return p == root or p.startswith(root.rstrip("/") + "/")


def _safe_extract(tf: tarfile.TarFile, dest: str, whiteouts: bool) -> None:
    """Extract a (root filesystem) layer into dest: names stay inside dest and never through a link; device nodes
    are skipped (sessions get their own /dev); OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`) delete from earlier
    layers."""
    real = os.path.realpath(dest)
    for m in tf:
        name = os.path.normpath(m.name.lstrip("/"))
        if name in (".", "") or name.startswith("..") or "/../" in f"/{name}/":
            continue
        parent, base = os.path.split(name)
        pdir = os.path.join(real, parent)
        if not inside(real, pdir):  # never through a link an earlier member made
            continue
        if whiteouts and base == ".wh..wh..opq":
            if os.path.isdir(pdir):
                for e in os.listdir(pdir):
                    _rm(os.path.join(pdir, e))
            continue
        if whiteouts and base.startswith(".wh."):
            _rm(os.path.join(pdir, base[4:]))
            continue
        if m.ischr() or m.isblk() or m.isfifo():
            continue
        target = os.path.join(real, name)
        if os.path.lexists(target) and not (m.isdir() and os.path.isdir(target) and not os.path.islink(target)):
            _rm(target)
        m.name = name
        if m.islnk():
            m.linkname = os.path.normpath(m.linkname.lstrip("/"))
            if m.linkname.startswith("..") or not inside(real, os.path.join(real, m.linkname)):
                continue  # a hard link to a file outside the tree (through a symlink member)
        tf.extract(m, real, set_attrs=True, numeric_owner=True, filter="fully_trusted")


def _rm(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        cleanup.remove_tree(path)  # (a layer's tree: any depth or mode; never raises)


def _publish(tmp: str, final: Path) -> str:
    """Make an unpacked tree visible under its final name atomically (a concurrent unpacker's copy wins or loses)."""
    try:
        os.rename(tmp, final)
    except OSError:
        cleanup.remove_tree(tmp)
        if not final.is_dir():
            raise
    return str(final)


def unpack_rootfs_tar(path: str) -> str:
    if not os.path.isfile(path):
        raise ImageError(f"rootfs-tar:{path}: no such file")
    final = cache_dir() / f"rootfs-{_file_digest(path)}"
    if final.is_dir():
        return str(final)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir())
    try:
        with tarfile.open(path) as tf:
            _safe_extract(tf, tmp, whiteouts=False)
        os.chmod(tmp, 0o755)
    except BaseException:
        cleanup.remove_tree(tmp)
        raise
    return _publish(tmp, final)


def unpack_oci(path: str) -> str:
    """Unpack an OCI image-layout tarball's layers (first manifest of index.json) into the cache; returns the root."""
    if not os.path.isfile(path):
        raise ImageError(f"oci-archive:{path}: no such file")
    with tarfile.open(path) as outer:
        def blob(digest: str) -> bytes:
            algo, hexd = digest.split(":", 1)
            f = outer.extractfile(f"blobs/{algo}/{hexd}")
            if f is None:
                raise ImageError(f"oci-archive:{path}: blob {digest} missing")
            return f.read()

        try:
            index = json.loads(outer.extractfile("index.json").read())  # type: ignore[union-attr]
        except KeyError:
            raise ImageError(f"oci-archive:{path}: no index.json (not an OCI image layout; for a plain root "
                             "filesystem tarball use 'rootfs-tar:PATH')") from None
        mdesc = index["manifests"][0]
        manifest = json.loads(blob(mdesc["digest"]))
        if "manifests" in manifest:  # an image index: take its first manifest
            manifest = json.loads(blob(manifest["manifests"][0]["digest"]))
        key = mdesc["digest"].split(":", 1)[1][:20]
        final = cache_dir() / f"oci-{key}"
        if final.is_dir():
            return str(final)
        tmp = tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir())
        try:
            for layer in manifest["layers"]:
                algo, hexd = layer["digest"].split(":", 1)
                f = outer.extractfile(f"blobs/{algo}/{hexd}")
                if f is None:
                    raise ImageError(f"oci-archive:{path}: layer {layer['digest']} missing")
                with tarfile.open(fileobj=f, mode="r|*") as tf:
                    _safe_extract(tf, tmp, whiteouts=True)
            os.chmod(tmp, 0o755)
        except BaseException:
            cleanup.remove_tree(tmp)
            raise
    return _publish(tmp, final)


def debian_test_image() -> str | None:
    """The test image's root directory if `build-debian` made it, else None."""
    root = cache_dir() / DEBIAN_TEST_NAME / "root"
    return str(root) if (root / "usr" / "bin" / "python3").exists() else None


def debian_test_tarball() -> str | None:
    tar = cache_dir() / DEBIAN_TEST_NAME / "root.tar"
    return str(tar) if tar.is_file() else None


def build_debian(mirror: str | None = None, timeout_s: float = 1200) -> str:
    """Build the test image with mmdebstrap (needs root, `apt-get install mmdebstrap`, Debian's archive reachable).
    Writes `<cache>/images/debian-12-test/root.tar` and unpacks it to `.../root`; returns the root directory."""
    done = debian_test_image()
    if done:
        return done
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed: `apt-get install -y mmdebstrap` (Debian/Ubuntu)")
    out = cache_dir() / DEBIAN_TEST_NAME
    out.mkdir(exist_ok=True)
    tar = out / "root.tar"
    tmp_tar = out / f".root.{os.getpid()}.tar"
    cmd = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(DEBIAN_PACKAGES), "--mode=root",
           "--format=tar", DEBIAN_SUITE, str(tmp_tar)] + ([mirror] if mirror else [])
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s, stdout=sys.stderr)
        os.replace(tmp_tar, tar)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_tar)
    root = out / "root"
    tmp = tempfile.mkdtemp(prefix=".root-", dir=out)
    try:
        with tarfile.open(tar) as tf:
            _safe_extract(tf, tmp, whiteouts=False)
        os.chmod(tmp, 0o755)
    except BaseException:
        cleanup.remove_tree(tmp)
        raise
    _publish(tmp, root)
    print(f"built {root} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return str(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlf_envs.sandbox.sessions.images")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-debian", help="build the Debian 12 test image (mmdebstrap) into the cache")
    b.add_argument("--mirror", default=None, help="a Debian mirror URL (default: mmdebstrap's, deb.debian.org)")
    sub.add_parser("path", help="print the test image's root directory (exit 1 if not built)")
    u = sub.add_parser("unpack", help="unpack an oci-archive:PATH or rootfs-tar:PATH into the cache")
    u.add_argument("image")
    a = ap.parse_args(argv)
    if a.cmd == "build-debian":
        print(build_debian(a.mirror))
    elif a.cmd == "path":
        p = debian_test_image()
        if p is None:
            print("not built: python -m rlf_envs.sandbox.sessions.images build-debian", file=sys.stderr)
            return 1
        print(p)
    else:
        print(resolve_local(a.image))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
