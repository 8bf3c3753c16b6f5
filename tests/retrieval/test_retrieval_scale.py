"""Wiki scale: resumable builds (SIGKILL mid-embedding, re-run), compressed faiss kinds with their measured
recall, embeddings reuse, memory-mapped faiss at load, and GPU faiss equal to CPU faiss."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from repo_paths import REPO

from rlf_envs.retrieval import DenseIndex, Encoder, IndexManifest, RetrievalError, build_index, load_index
from rlf_envs.retrieval.build import STATE_NAME, work_dir_for
from rlf_envs.retrieval.dense import build_faiss, exact_topk, read_faiss, recall_at_k

ROOT = REPO
CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"


def _corpus(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"corpus-{n}.jsonl"
    path.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:n]))
    return path


def _state(out: Path) -> dict[str, object]:
    try:
        return dict(json.loads((work_dir_for(out) / STATE_NAME).read_text()))
    except (OSError, ValueError):
        return {}


def _mapped(path: Path) -> bool:
    """Whether this process has `path` memory-mapped."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


_REAL_ENCODE = Encoder.encode_passages


class _CountingEncoder:
    """Counts the passages the real encoder embeds (a spy on Encoder.encode_passages)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_after: int | None = None) -> None:
        self.passages = 0
        real = _REAL_ENCODE

        def counting(encoder: Encoder, passages: list[str]) -> np.ndarray:
            if fail_after is not None and self.passages >= fail_after:
                raise KeyboardInterrupt  # stands for Ctrl-C between two chunks
            self.passages += len(passages)
            return real(encoder, passages)

        monkeypatch.setattr(Encoder, "encode_passages", counting)


def test_build_resumes_after_sigkill_mid_embedding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    n, chunk = 160, 8
    corpus = _corpus(tmp_path, n)
    queries = [json.loads(line)["contents"].split("\n")[0].strip('"') for line in corpus.read_text().splitlines()]
    ref_dir = tmp_path / "ref"
    build_index(corpus, ref_dir, kind="dense", embed_chunk=chunk, keep_embeddings=True, show_progress=False)

    out = tmp_path / "idx"
    cmd = [sys.executable, "-m", "servers.retrieval", "build", "--corpus", str(corpus), "--out", str(out),
           "--embed-chunk", str(chunk), "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "rlf_envs" / "src")])}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while int(_state(out).get("embedded", 0) or 0) < 2 * chunk:  # type: ignore[call-overload]
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "no embedding progress within 300 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    done = int(_state(out)["embedded"])  # type: ignore[call-overload]
    assert 2 * chunk <= done < n and done % chunk == 0

    # other parameters, or a changed corpus, refuse to resume and say how to start over
    with pytest.raises(RetrievalError, match="--restart") as e:
        build_index(corpus, out, kind="dense", embed_chunk=chunk, faiss_kind="hnsw", show_progress=False)
    assert "faiss_kind: 'flat' -> 'hnsw'" in str(e.value)
    assert int(_state(out)["embedded"]) == done  # type: ignore[call-overload]

    spy = _CountingEncoder(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="rlf.retrieval.build"):
        m = build_index(corpus, out, kind="dense", embed_chunk=chunk, show_progress=False)
    assert f"resuming dense embedding at passage {done} of {n}" in caplog.messages
    assert spy.passages == n - done  # only the rest was encoded
    assert not work_dir_for(out).exists()
    assert (m.count, m.faiss, m.recall, m.recall_k) == (n, "flat", 1.0, 10)

    # the resumed index answers exactly like the uninterrupted one
    ref, got = load_index(ref_dir), load_index(out)
    try:
        assert isinstance(got, DenseIndex) and _mapped(out / "index.faiss")  # served from the page cache
        want_hits, got_hits = ref.search_batch(queries, 5), got.search_batch(queries, 5)
        ref_dir_hits = want_hits
        for w, g in zip(want_hits, got_hits, strict=True):
            assert [h.document.id for h in g] == [h.document.id for h in w]
            assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=1e-6)
    finally:
        ref.close()
        got.close()

    # a second faiss kind from the kept embeddings: nothing is re-encoded, recall is measured on questions
    spy.passages = 0
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question": f"what is the capital of {q}?"}) + "\n" for q in queries[:40]))
    m = build_index(corpus, tmp_path / "pq", kind="dense", faiss_kind="ivfpq", nlist=4, pq_m=8, pq_nbits=4, nprobe=1,
                    embeddings=ref_dir / "embeddings.npy", recall_queries=qfile, show_progress=False)
    assert spy.passages == 0
    assert (m.faiss, m.nlist, m.pq_m, m.pq_nbits, m.recall_queries) == ("ivfpq", 4, 8, 4, 40)
    assert m.recall is not None and 0.0 < m.recall < 1.0  # 8 bytes per vector, 1 of 4 lists: lossy
    m = build_index(corpus, tmp_path / "sq", kind="dense", faiss_kind="ivfsq", nlist=4, nprobe=4,
                    embeddings=ref_dir / "embeddings.npy", show_progress=False)
    assert spy.passages == 0
    assert (m.faiss, m.nlist, m.nprobe, m.pq_m) == ("ivfsq", 4, 4, None)
    assert m.recall is not None and m.recall >= 0.9  # 8-bit vectors, every list probed
    sq = load_index(tmp_path / "sq")
    try:
        assert isinstance(sq, DenseIndex) and sq.index.nprobe == 4 and _mapped(tmp_path / "sq" / "index.faiss")
        assert [h.document.id for h in sq.search_batch(queries[:1], 3)[0]][:1] == [
            h.document.id for h in ref_dir_hits[0]][:1]
    finally:
        sq.close()
    with pytest.raises(RetrievalError, match="has shape"):
        build_index(_corpus(tmp_path, 20), tmp_path / "bad", kind="dense", embeddings=ref_dir / "embeddings.npy",
                    show_progress=False)


def test_interrupted_build_refuses_a_changed_corpus_until_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = _corpus(tmp_path, 24)
    out = tmp_path / "idx"
    _CountingEncoder(monkeypatch, fail_after=8)
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, out, kind="dense", embed_chunk=4, show_progress=False)
    assert _state(out)["embedded"] == 8 and _state(out)["done"] == ["docstore"]
    with corpus.open("a") as f:
        f.write(CORPUS.read_text().splitlines(keepends=True)[30])
    with pytest.raises(RetrievalError, match="the corpus changed") as e:
        build_index(corpus, out, kind="dense", embed_chunk=4, show_progress=False)
    assert "--restart" in str(e.value)
    spy = _CountingEncoder(monkeypatch)
    m = build_index(corpus, out, kind="dense", embed_chunk=4, restart=True, show_progress=False)
    assert m.count == 25 and spy.passages == 25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus-24.jsonl", "idx"]


def _unit_vectors(n: int, d: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_compressed_kinds_recall_against_exact_search(tmp_path: Path) -> None:
    import faiss

    emb_path = tmp_path / "emb.npy"
    arr = np.lib.format.open_memmap(emb_path, mode="w+", dtype=np.float32, shape=(3000, 64))
    arr[:] = _unit_vectors(3000, 64)
    arr.flush()
    emb = np.load(emb_path, mmap_mode="r")  # what a build hands faiss: a memmap, never a loaded array
    queries = _unit_vectors(40, 64, seed=1)
    flat = build_faiss(emb, "flat")
    assert np.array_equal(exact_topk(emb, queries, 10, chunk=700), flat.search(queries, 10)[1])
    assert recall_at_k(flat, emb, queries, 10) == 1.0
    ivfpq = build_faiss(emb, "ivfpq", nlist=16, pq_m=8)
    ivfpq.nprobe = 16
    assert ivfpq.code_size == 8
    assert 0.05 < recall_at_k(ivfpq, emb, queries, 10) < 0.95  # 8 bytes for 64 floats: lossy, not useless
    ivfsq = build_faiss(emb, "ivfsq", nlist=16)
    ivfsq.nprobe = 16
    assert ivfsq.code_size == 64  # one byte per dimension
    assert recall_at_k(ivfsq, emb, queries, 10) >= 0.9
    hnswsq = build_faiss(emb, "hnswsq", hnsw_m=16)
    hnswsq.hnsw.efSearch = 256
    assert recall_at_k(hnswsq, emb, queries, 10) >= 0.9
    with pytest.raises(RetrievalError, match="needs at least 256 passages"):
        build_faiss(emb[:200], "ivfpq", nlist=16, pq_m=8)
    with pytest.raises(RetrievalError, match="must divide"):
        build_faiss(emb, "ivfpq", nlist=16, pq_m=7)
    # every kind reads back memory-mapped and answers exactly as the in-memory index
    for name, index in (("flat", flat), ("ivfpq", ivfpq), ("ivfsq", ivfsq), ("hnswsq", hnswsq)):
        path = tmp_path / f"{name}.faiss"
        faiss.write_index(index, str(path))
        mapped = read_faiss(path)
        assert _mapped(path), name
        if name in ("ivfpq", "ivfsq"):
            mapped.nprobe = 16
        if name == "hnswsq":
            mapped.hnsw.efSearch = 256
        assert np.array_equal(mapped.search(queries, 10)[1], index.search(queries, 10)[1]), name
        assert not _mapped(tmp_path / "none.faiss")
    unmapped_path = tmp_path / "plain.faiss"
    faiss.write_index(flat, str(unmapped_path))
    read_faiss(unmapped_path, mmap=False)
    assert not _mapped(unmapped_path)


@pytest.mark.gpu
def test_gpu_faiss_equals_cpu_faiss() -> None:
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        pytest.skip("faiss sees no GPU: install rlf-envs[search-gpu] (faiss-gpu-cu12) on a CUDA machine")
    emb = _unit_vectors(5000, 64)
    queries = emb[:64] + 0.05 * _unit_vectors(64, 64, seed=2)
    for kind, nlist in (("flat", None), ("ivf", 32)):
        cpu = build_faiss(emb, kind, nlist=nlist)  # type: ignore[arg-type]
        if kind == "ivf":
            cpu.nprobe = 32  # every list: exact, so GPU and CPU must agree on the ids
        gpu = faiss.index_cpu_to_all_gpus(cpu)
        if kind == "ivf":
            faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", 32)
        cs, ci = cpu.search(queries, 10)
        gs, gi = gpu.search(queries, 10)
        assert np.array_equal(ci, gi), kind
        assert np.allclose(cs, gs, atol=1e-4), kind


def test_manifest_records_compressed_kind_fields(tmp_path: Path) -> None:
    m = IndexManifest(kind="dense", count=1, faiss="ivfpq", nlist=4, pq_m=8, pq_nbits=8, recall=0.5, recall_k=10)
    m.write(tmp_path)
    assert IndexManifest.read(tmp_path) == m
