"""Build rlf's repository-level repair tasks (SWE-smith style) from real pure-Python projects.

    python -m rlf_envs.data.swe.generate             # fetch the sdists, mutate, run, validate, write here
    python -m rlf_envs.data.swe.generate --projects toolz --cache /tmp/swe   # one project (in parallel: several)
    python -m rlf_envs.data.swe.generate --merge-only --cache /tmp/swe       # the splits from the built projects

For each project of `PROJECTS` (small, pure Python, MIT/BSD licensed, no runtime dependencies, tests in the
sdist): `pip download --no-binary :all: --no-deps name==version` fetches the sdist, its licence is checked,
its sources, tests and licence are packed as `repos/<id>.tar.gz` (deterministic bytes). Then every mutation
site of its functions (`mutate.py`: flipped comparisons, off-by-one, swapped operands, dropped negations,
wrong constants, removed early returns...) is a candidate bug, tried in a seeded order: the project's suite
runs on the mutated tree, the tests that passed before and fail now are FAIL_TO_PASS, a sample of the tests
that still pass (same files first) is PASS_TO_PASS, and mutants that no test sees, that break collection or
fail more than a quarter of the suite are dropped. The issue text is written from the failing tests' names
and their assertion messages (memory addresses blanked; a message quoting the mutated line is left out), never
from the change. Each kept task is validated by running its F2P + P2P tests on the broken tree (every F2P
fails, every P2P passes) and on the gold (original) tree (all pass).

Split: by mutated function (a stable hash of project and function), so no function of the test split is
mutated in train. Output: `repos/<id>.tar.gz`, `projects.json` (per project: dist, version, licence, import
root, test paths), `train.jsonl` / `test.jsonl` with SWE-bench's field names (`instance_id`, `repo`,
`version`, `problem_statement`, `patch` = gold fix, `test_patch` = "", `FAIL_TO_PASS`, `PASS_TO_PASS`) plus
`bug_patch` (pristine -> broken, what the env applies) and `mutation` (where and which operator; never shown).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import difflib
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlf_envs.data.swe.mutate import Mutant, mutants
from rlf_envs.envs.swe.pytest_report import PLUGIN_MODULE, PLUGIN_SOURCE, REPORT_ENV, PytestOutcome, parse_report

HERE = Path(__file__).resolve().parent
SEED = 3939
TEST_SHARE = 0.2
MAX_P2P = 15
MAX_F2P = 40
RUN_TIMEOUT_S = 60.0
PYTEST_ARGS = ("-p", "no:cacheprovider", "-o", "addopts=", "-q", "-p", PLUGIN_MODULE)


COVERAGE_MODULE = "rlf_swe_coverage"
COVERAGE_SOURCE = '''
import json, os, sys, threading

import pytest

_ROOT = os.path.realpath(os.environ["RLF_SWE_COVER_ROOT"])
_LINES = {}
_cur = None
_keep = {}


def _wanted(filename):
    r = _keep.get(filename)
    if r is None:
        real = os.path.realpath(filename)
        r = _keep[filename] = real.startswith(_ROOT + os.sep) and "/tests/" not in real and not os.path.basename(
            real).startswith(("test_", "conftest"))
    return r


def _profile(frame, event, arg):
    if event == "call" and _cur is not None:
        code = frame.f_code
        if _wanted(code.co_filename):
            _cur.add((os.path.relpath(os.path.realpath(code.co_filename), _ROOT), code.co_firstlineno))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _cur
    _cur = set()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        _LINES[item.nodeid] = sorted(_cur)
        _cur = None


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["RLF_SWE_COVER_OUT"], "w") as f:
        json.dump(_LINES, f)
'''


@dataclass(frozen=True)
class Project:
    """One source project: its sdist, what is shipped of it and how its tests run."""

    id: str
    dist: str
    version: str
    license: str  # the licence family checked in its LICENSE file
    license_file: str
    pythonpath: str  # import root relative to the repository ("." or "src")
    ship: tuple[str, ...]  # top-level entries of the sdist that are shipped
    sources: tuple[str, ...]  # globs of the modules whose functions are mutated
    tests: tuple[str, ...]  # test paths given to pytest


PROJECTS = (
    Project("inflection", "inflection", "0.5.1", "MIT", "LICENSE", ".",
            ("inflection", "test_inflection.py", "LICENSE", "README.rst"), ("inflection/__init__.py",),
            ("test_inflection.py",)),
    Project("cachetools", "cachetools", "8.0.2", "MIT", "LICENSE", "src",
            ("src", "tests", "LICENSE", "README.rst"), ("src/cachetools/*.py",), ("tests",)),
    Project("parse", "parse", "1.22.4", "MIT", "LICENSE", ".",
            ("parse", "tests", "LICENSE", "README.rst"), ("parse/__init__.py",), ("tests",)),
    Project("toolz", "toolz", "1.2.0", "BSD-3-Clause", "LICENSE.txt", ".",
            ("toolz", "tlz", "LICENSE.txt", "README.rst"),
            ("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/recipes.py"),
            ("toolz/tests",)),
)
_LICENSE_MARKERS = {"MIT": "Permission is hereby granted, free of charge",
                    "BSD-3-Clause": "Redistribution and use in source and binary forms"}


def is_test_path(path: str) -> bool:
    """Paths the hidden run owns: test modules, conftest.py, anything under a tests/ directory."""
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return (name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")
            or any(p in ("tests", "test", "testing") for p in parts[:-1]))


# -- fetching and packing ------------------------------------------------------------------------------


def fetch_sdist(p: Project, cache: Path) -> Path:
    """The unpacked sdist of `p` (pip download into `cache` once)."""
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"{p.dist}-{p.version}"
    if not root.is_dir():
        archives = list(cache.glob(f"{p.dist.replace('-', '_')}-{p.version}.tar.gz")) + list(
            cache.glob(f"{p.dist}-{p.version}.tar.gz"))
        if not archives:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                            f"{p.dist}=={p.version}", "-d", str(cache)], check=True, timeout=300)
            archives = list(cache.glob(f"*{p.version}.tar.gz"))
            archives = [a for a in archives if a.name.lower().startswith(p.dist.replace("-", "_").lower())
                        or a.name.lower().startswith(p.dist.lower())]
        if not archives:
            raise FileNotFoundError(f"pip download of {p.dist}=={p.version} left no sdist in {cache}")
        with tarfile.open(archives[0]) as tf:
            tf.extractall(cache, filter="data")
        unpacked = [d for d in cache.iterdir() if d.is_dir() and d.name.lower().replace("_", "-")
                    == f"{p.dist}-{p.version}".lower()]
        if not unpacked:
            raise FileNotFoundError(f"{archives[0]} did not unpack to {root}")
        unpacked[0].rename(root)
    lic = (root / p.license_file).read_text(encoding="utf-8", errors="replace")
    if _LICENSE_MARKERS[p.license] not in lic:
        raise ValueError(f"{p.dist} {p.version}: {p.license_file} is not the {p.license} licence; not shipped")
    return root


def _shipped_files(root: Path, p: Project) -> list[str]:
    out = []
    for top in p.ship:
        path = root / top
        if path.is_file():
            out.append(top)
        else:
            out += [str(f.relative_to(root)) for f in sorted(path.rglob("*")) if f.is_file()
                    and "__pycache__" not in f.parts and not f.name.endswith((".pyc", ".pyo"))]
    return sorted(out)


def pack(root: Path, files: Iterable[str]) -> bytes:
    """A deterministic .tar.gz of `files` (relative to `root`): sorted, mtime 0, root-owned, mode 644."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name in sorted(files):
            data = (root / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tf.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


# -- running tests ------------------------------------------------------------------------------------------


def run_tests(repo: Path, p: Project, tests: Iterable[str], plugin_dir: Path,
              timeout_s: float = RUN_TIMEOUT_S, coverage: dict[str, list[tuple[str, int]]] | None = None
              ) -> dict[str, PytestOutcome]:
    """pytest on `repo` with the report plugin; the outcomes by node id ({} when the run died). With `coverage`
    (a dict to fill), the source functions each test calls are recorded too, as (path, first line of the code
    object) (sys.setprofile: call events only)."""
    fd, report = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cover = report + ".cover"
    try:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(plugin_dir), "LANG": "C.UTF-8",
               "PYTHONPATH": os.pathsep.join([str(repo / p.pythonpath), str(plugin_dir)]),
               "PYTHONDONTWRITEBYTECODE": "1", REPORT_ENV: report, "PYTHONHASHSEED": "0",
               "RLF_SWE_COVER_ROOT": str(repo), "RLF_SWE_COVER_OUT": cover}
        extra = ["-p", COVERAGE_MODULE] if coverage is not None else []
        try:
            subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *extra, *tests], cwd=repo, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {}
        if coverage is not None and os.path.exists(cover):
            coverage.update({k: [(f, n) for f, n in v] for k, v in json.loads(Path(cover).read_text()).items()})
        return parse_report(Path(report).read_text(encoding="utf-8"))
    finally:
        for f in (report, cover):
            if os.path.exists(f):
                os.unlink(f)


def unified_diff(path: str, before: str, after: str) -> str:
    """A git-style unified diff of one file (what `git apply` and `patch -p1` take)."""
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}", n=3)
    text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in body)
    return f"diff --git a/{path} b/{path}\n{text}"


_ADDR = re.compile(r"0x[0-9a-fA-F]{6,}")


def problem_statement(p: Project, failing: list[tuple[str, PytestOutcome]], m: Mutant, source: str) -> str:
    """The issue: which tests fail and how, never where or what the change is."""
    mutated_lines = {ln.strip() for ln in m.apply(source).splitlines()[m.lineno - 1:m.end_lineno] if ln.strip()}
    original_lines = {ln.strip() for ln in source.splitlines()[m.lineno - 1:m.end_lineno] if ln.strip()}
    quoted = mutated_lines | original_lines
    lines = [f"Something in `{p.dist}` ({p.version}) is broken: tests of its own suite fail.", "",
             "Failing tests:"]
    for nodeid, o in failing[:5]:
        msg = _ADDR.sub("0x...", o.message.strip().splitlines()[0] if o.message.strip() else "")
        if any(q and q in msg for q in quoted):
            msg = ""
        lines.append(f"- `{nodeid}`" + (f"\n  {msg[:300]}" if msg else ""))
    if len(failing) > 5:
        lines.append(f"- ... and {len(failing) - 5} more")
    lines += ["", f"Reproduce with `python3 -m pytest -p no:cacheprovider -o addopts= {failing[0][0]}` (import root: "
              f"`{p.pythonpath}`). Fix the library so that these tests pass and the rest of the suite keeps "
              "passing; do not change the tests."]
    return "\n".join(lines)


# -- building -------------------------------------------------------------------------------------------------


def _split_of(p: Project, function: str) -> str:
    h = int(hashlib.sha256(f"{SEED}:{p.id}:{function}".encode()).hexdigest()[:8], 16)
    return "test" if (h % 1000) < TEST_SHARE * 1000 else "train"


def _instance_id(p: Project, m: Mutant) -> str:
    fn_slug = re.sub(r"[^a-z0-9]+", "-", m.function.lower()).strip("-")
    return f"{p.id}__{fn_slug}-{m.op.replace('_', '-')}-{m.index}"


def _try_mutant(p: Project, pristine: Path, m: Mutant, baseline: dict[str, PytestOutcome],
                covering: list[str], plugin_dir: Path, rng_seed: int) -> dict[str, object] | None:
    """Run the tests that call the mutated function (and a P2P sample) on the mutant; validate; the row or None."""
    passing = [k for k, o in baseline.items() if o.passed and " " not in k and k.isascii() and "::" in k]
    cands = [k for k in covering if k in set(passing)]
    if not cands:
        return None  # no test calls the mutated function: no test can see the bug
    rng = random.Random(rng_seed)
    files = {k.split("::")[0] for k in cands}
    rest = [k for k in passing if k not in set(cands)]
    near = [k for k in rest if k.split("::")[0] in files]
    far = [k for k in rest if k.split("::")[0] not in files]
    rng.shuffle(near)
    rng.shuffle(far)
    extra = (near + far)[:MAX_P2P]
    with tempfile.TemporaryDirectory(prefix=f"swe-{p.id}-") as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(pristine, work)
        src = (pristine / m.path).read_text(encoding="utf-8")
        broken = m.apply(src)
        (work / m.path).write_text(broken, encoding="utf-8")
        after = run_tests(work, p, cands + extra, plugin_dir)
        if not after or any(o.outcome == "error" and "::" not in k for k, o in after.items()):
            return None
        if any(k not in after for k in cands + extra):
            return None
        f2p = [k for k in cands if not after[k].passed]
        if not f2p or len(f2p) > min(MAX_F2P, len(passing) // 4):
            return None
        still = [k for k in cands if after[k].passed]
        rng.shuffle(still)
        p2p = sorted(([k for k in extra if after[k].passed] + still)[:MAX_P2P])
        sel = f2p + p2p
        (work / m.path).write_text(src, encoding="utf-8")
        check_gold = run_tests(work, p, sel, plugin_dir)
        if not all(k in check_gold and check_gold[k].passed for k in sel):
            return None
        failing = [(k, after[k]) for k in f2p]
    return {
        "instance_id": _instance_id(p, m),
        "repo": p.id,
        "version": p.version,
        "problem_statement": problem_statement(p, failing, m, src),
        "patch": unified_diff(m.path, broken, src),
        "test_patch": "",
        "bug_patch": unified_diff(m.path, src, broken),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "mutation": {"path": m.path, "function": m.function, "op": m.op, "line": m.lineno},
        "split": _split_of(p, m.function),
    }


def build_project(p: Project, cache: Path, out: Path, per_project: int, max_tries: int, workers: int,
                  plugin_dir: Path, previous: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    root = fetch_sdist(p, cache)
    files = _shipped_files(root, p)
    pristine = cache / f"ship-{p.id}"
    if pristine.exists():
        shutil.rmtree(pristine)
    for f in files:
        (pristine / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f, pristine / f)
    (out / "repos").mkdir(parents=True, exist_ok=True)
    (out / "repos" / f"{p.id}.tar.gz").write_bytes(pack(pristine, files))
    coverage: dict[str, list[tuple[str, int]]] = {}
    baseline = run_tests(pristine, p, p.tests, plugin_dir, timeout_s=900, coverage=coverage)
    by_line: dict[tuple[str, int], list[str]] = {}
    for nodeid, lines in coverage.items():
        for fl in lines:
            by_line.setdefault((fl[0], fl[1]), []).append(nodeid)
    n_pass = sum(o.passed for o in baseline.values())
    if n_pass < 20:
        raise RuntimeError(f"{p.id}: only {n_pass} tests pass on the pristine tree; is pytest installed?")
    cands: list[Mutant] = []
    for pattern in p.sources:
        for path in sorted(pristine.glob(pattern)):
            rel = str(path.relative_to(pristine))
            if not is_test_path(rel):
                cands += mutants(path.read_text(encoding="utf-8"), rel)
    rng = random.Random(f"{SEED}:{p.id}")
    rng.shuffle(cands)
    per_fn: dict[str, int] = {}
    kept: list[dict[str, object]] = list(previous or [])
    done_ids = {str(r["instance_id"]) for r in kept}
    for r in kept:
        fn = str(r["mutation"]["function"])  # type: ignore[index]
        per_fn[fn] = per_fn.get(fn, 0) + 1
    tried = 0
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        queue = iter(cands)
        while len(kept) < per_project and tried < max_tries:
            batch = []
            for m in queue:
                if per_fn.get(m.function, 0) >= 2 or _instance_id(p, m) in done_ids:
                    continue
                batch.append(m)
                if len(batch) >= workers * 2:
                    break
            if not batch:
                break
            tried += len(batch)
            def covering(m: Mutant) -> list[str]:  # the tests that call the mutated function
                return sorted(by_line.get((m.path, m.def_line), ()))

            for m, row in zip(batch, pool.map(lambda m: _try_mutant(p, pristine, m, baseline, covering(m),
                                                                      plugin_dir, SEED + m.index), batch), strict=True):
                if row is not None and per_fn.get(m.function, 0) < 2 and len(kept) < per_project:
                    per_fn[m.function] = per_fn.get(m.function, 0) + 1
                    kept.append(row)
    print(f"{p.id}: {len(cands)} mutation sites, {tried} tried, {len(kept)} kept "
          f"({sum(r['split'] == 'test' for r in kept)} test)", flush=True)
    return kept


def write_outputs(out: Path, rows_dir: Path, projects: list[Project]) -> tuple[int, int]:
    """projects.json and train/test JSONL from the per-project rows (`rows-<id>.jsonl`)."""
    rows: list[dict[str, object]] = []
    for p in projects:
        path = rows_dir / f"rows-{p.id}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: build project {p.id} first")
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    manifest = {p.id: {k: v for k, v in asdict(p).items() if k not in ("sources", "ship")} for p in projects}
    (out / "projects.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    by_id = {p.id: p for p in projects}
    for r in rows:  # the split is decided here (TEST_SHARE can change without rebuilding)
        r["split"] = _split_of(by_id[str(r["repo"])], str(r["mutation"]["function"]))  # type: ignore[index]
    counts = []
    for split in ("train", "test"):
        chosen = [r for r in rows if r["split"] == split]
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for r in chosen:
                f.write(json.dumps({k: v for k, v in r.items() if k != "split"}) + "\n")
        counts.append(len(chosen))
    return counts[0], counts[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "rlf-swe-sdists")
    ap.add_argument("--per-project", type=int, default=45)
    ap.add_argument("--max-tries", type=int, default=700)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--projects", nargs="*", default=[p.id for p in PROJECTS],
                    help="build only these (several processes can build different projects at once)")
    ap.add_argument("--merge-only", action="store_true", help="only write the splits from the built projects")
    ap.add_argument("--extend", action="store_true",
                    help="keep a project's built rows and add more (up to --per-project), skipping what it has")
    args = ap.parse_args(argv)
    rows_dir = args.cache / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    if not args.merge_only:
        with tempfile.TemporaryDirectory(prefix="swe-plugin-") as plugin:
            plugin_dir = Path(plugin)
            (plugin_dir / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
            (plugin_dir / f"{COVERAGE_MODULE}.py").write_text(COVERAGE_SOURCE, encoding="utf-8")
            for p in [p for p in PROJECTS if p.id in args.projects]:
                built = rows_dir / f"rows-{p.id}.jsonl"
                previous = ([json.loads(x) for x in built.read_text(encoding="utf-8").splitlines() if x.strip()]
                            if args.extend and built.is_file() else None)
                rows = build_project(p, args.cache, args.out, args.per_project, args.max_tries, args.workers,
                                     plugin_dir, previous)
                tmp = rows_dir / f".rows-{p.id}.jsonl"
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
                os.replace(tmp, rows_dir / f"rows-{p.id}.jsonl")
    done = [p for p in PROJECTS if (rows_dir / f"rows-{p.id}.jsonl").is_file()]
    if len(done) == len(PROJECTS):
        train, test = write_outputs(args.out, rows_dir, list(PROJECTS))
        print(f"train {train}, test {test}")
    else:
        print(f"built {[p.id for p in done]}; run the others (or --merge-only once all are built)")


if __name__ == "__main__":
    main()
