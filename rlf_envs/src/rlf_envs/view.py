"""`python -m rlf_envs.view RUN_DIR [--out FILE.html] [--port N]` (also `rlf-view`): look at a run in the browser.

Shows the reward/success curves (metrics.jsonl), the episodes stored in `trajectories/step_K.jsonl` per step
with filters (success, failed, tool errors, truncated, task), one episode as a chat (policy text vs
observation text, with the loss-mask token counts in token mode; tool calls and results folded; per-turn
rewards) and the same task at two steps side by side.

The page is one self-contained HTML file (CSS and JS from rlf_envs/assets/viewer, no CDN, no network):
`--out` writes it; otherwise it is served on 127.0.0.1 and rebuilt on every reload, so a running training
shows up as it goes. Everything in a trajectory is policy output or tool output, i.e. hostile: the data is
embedded as JSON with `<`, `>` and `&` escaped (it cannot close its script tag), the page only ever sets
text (never HTML) from it, and a Content-Security-Policy forbids any network access and any script but
the page's own.

State lives in the URL fragment, so a view can be shared or reloaded:
`#step=200&source=eval_greedy&filter=failed&task=q17&ep=200/eval_greedy/3&a=0&b=200`.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import sys
import threading
from pathlib import Path
from typing import Any

from rlf_envs.errors import RlfError
from rlf_envs.records import RecordError, TrajectoryRecord, list_steps, read_records

ASSETS = Path(__file__).parent / "assets" / "viewer"
MAX_TEXT = 20_000  # characters of one text field shown in the page (the record on disk keeps everything)


class ViewError(RlfError, ValueError):
    """A run directory the viewer cannot show."""


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n...[{len(text) - limit} more characters not shown]"


def _mask_runs(mask: list[int] | None) -> list[tuple[int, int, int]]:
    """[start, end, value] runs of the loss mask."""
    if not mask:
        return []
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, int(mask[start])))
            start = i
    return runs


def show_arguments(name: str, arguments: dict[str, Any]) -> str:
    """A call's arguments as a reader wants them: a shell command as `$ command`, other all-string arguments as
    `key:` blocks with their real line breaks (code edits stay readable), anything else as indented JSON."""
    if name == "bash" and set(arguments) == {"command"} and isinstance(arguments["command"], str):
        return "$ " + arguments["command"]
    if arguments and all(isinstance(v, str) for v in arguments.values()) and any("\n" in v for v in arguments.values()):
        return "\n".join(f"{k}:\n{v}" if "\n" in v else f"{k}: {v}" for k, v in arguments.items())
    return json.dumps(arguments, ensure_ascii=False, indent=1)


def episode_view(rec: TrajectoryRecord) -> dict[str, Any]:
    """What the page needs of one record: texts (cut to MAX_TEXT), tool calls/results, rewards, and the
    loss mask as runs and per-turn token counts instead of every token id."""
    mask = rec.loss_mask
    turns = []
    for t in rec.turns:
        def span_info(span: tuple[int, int] | None) -> dict[str, int] | None:
            if span is None or mask is None:
                return None
            s, e = span
            return {"tokens": e - s, "trained": int(sum(mask[s:e]))}

        turns.append({
            "action": _cut(t.action), "kind": t.kind, "error": t.error, "observation": _cut(t.observation),
            "reward": t.reward, "tool_seconds": t.tool_seconds,
            "calls": [{"name": c.name, "arguments": _cut(show_arguments(c.name, c.arguments))} for c in t.tool_calls],
            "results": [{"name": r.name, "content": _cut(r.content), "status": r.status, "latency_s": r.latency_s,
                         "truncated": r.truncated, "attempts": r.attempts} for r in t.results],
            "action_tokens": span_info(t.action_span), "observation_tokens": span_info(t.observation_span),
        })
    prompt_tokens = None
    if mask is not None:
        first = next((t.action_span[0] for t in rec.turns if t.action_span is not None), len(mask))
        prompt_tokens = {"tokens": first, "trained": int(sum(mask[:first]))}
    return {
        "key": f"{rec.step}/{rec.source}/{rec.index}", "source": rec.source, "step": rec.step, "index": rec.index,
        "task": {"id": rec.task.id, "question": _cut(rec.task.question, 2000),
                 # no ground truth (SWE/Harbor tasks: hidden tests decide): no "gold" shown
                 "gold": None if rec.task.ground_truth is None
                 else _cut(json.dumps(rec.task.ground_truth, ensure_ascii=False), 2000)},
        "prompt": _cut(rec.prompt), "prompt_tokens": prompt_tokens, "turns": turns,
        "answer": None if rec.answer is None else _cut(rec.answer, 2000), "end_reason": rec.end_reason,
        "error": rec.error, "reward": rec.reward, "success": rec.success,
        "tool_calls": rec.num_tool_calls, "tool_errors": rec.num_tool_errors,
        "mask_runs": _mask_runs(mask), "usage": rec.usage, "score_info": dict(list(rec.score_info.items())[:64]),
    }


def _metrics(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    path = run_dir / "metrics.jsonl"
    rl: list[dict[str, Any]] = []
    ev: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a running training
            if not isinstance(r, dict):
                continue
            num = {k: v for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            if r.get("stage") == "rl":
                rl.append(num)
            elif r.get("stage") == "eval":
                ev.append(num)
    summary = run_dir / "summary.json"  # rlf_envs.eval writes one summary instead of a metrics stream
    if not ev and summary.is_file():
        try:
            s = json.loads(summary.read_text(encoding="utf-8"))
            ev.append({"step": 0, "success_api": float(s["success_rate"]), "reward_api": float(s["reward_mean"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    return {"rl": rl, "eval": ev}


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """The page's data: run name, curves, and every stored episode (newest step first is the page's job)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ViewError(f"{run_dir} is not a directory: give a run dir (e.g. runs/quickstart-s0)")
    steps = list_steps(run_dir)
    metrics = _metrics(run_dir)
    if not steps and not metrics["rl"] and not metrics["eval"]:
        raise ViewError(f"{run_dir} has no trajectories/step_K.jsonl and no metrics.jsonl: is it a run dir? "
                        "(runs write trajectories at every eval; see logging.trajectories)")
    episodes: list[dict[str, Any]] = []
    problems: list[str] = []
    for _, path in steps:
        try:
            episodes.extend(episode_view(r) for r in read_records(path))
        except (RecordError, OSError) as e:
            problems.append(str(e))
    return {"run": run_dir.resolve().name, "metrics": metrics, "episodes": episodes, "problems": problems}


def _json_for_script(data: Any) -> str:
    """JSON that is safe inside <script type="application/json">: no '<', '>', '&' or line separators raw."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def render_html(data: dict[str, Any]) -> str:
    """The self-contained page: template + inlined CSS/JS + the data. The CSP allows only this page's
    own script (by hash) and inline styles; no network, no frames, no forms."""
    template = (ASSETS / "viewer.html").read_text(encoding="utf-8")
    css = (ASSETS / "viewer.css").read_text(encoding="utf-8")
    js = (ASSETS / "viewer.js").read_text(encoding="utf-8")
    import base64

    js_hash = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; script-src 'sha256-{js_hash}'; style-src 'unsafe-inline'; img-src data:; "
           "base-uri 'none'; form-action 'none'")
    title = "rlf viewer: " + "".join(c for c in str(data.get("run", "")) if c.isalnum() or c in "-_.")
    # str.replace, not str.format: the inlined CSS/JS are full of braces
    return (template.replace("@CSP@", csp).replace("@TITLE@", title).replace("@CSS@", css)
            .replace("@DATA@", _json_for_script(data)).replace("@JS@", js))


def write_html(run_dir: str | Path, out: str | Path) -> Path:
    from rlf_envs.records import atomic_write_text

    out = Path(out)
    atomic_write_text(out, render_html(load_run(run_dir)))
    return out


def make_server(run_dir: Path, host: str = "127.0.0.1", port: int = 8765) -> http.server.ThreadingHTTPServer:
    """A local server whose `/` is the page of `run_dir`, rebuilt on every request."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/", "/index.html"):
                self.send_error(404, "the viewer serves one page: /")
                return
            try:
                body = render_html(load_run(run_dir)).encode("utf-8")
                status = 200
            except ViewError as e:
                body, status = f"rlf viewer: {e}".encode(), 404
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return http.server.ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlf_envs.view", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory (e.g. runs/quickstart-s0)")
    p.add_argument("--out", type=Path, help="write one self-contained HTML file here and exit")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port to serve on (0: any free port)")
    args = p.parse_args(argv)
    try:
        if args.out is not None:
            out = write_html(args.run_dir, args.out)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB); open it in a browser")
            return 0
        load_run(args.run_dir)  # fail now with a clear message, not on the first request
        server = make_server(args.run_dir, args.host, args.port)
    except ViewError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot serve on {args.host}:{args.port}: {e} (try --port 0)", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    if isinstance(host, bytes):  # typeshed allows bytes for AF_UNIX-style addresses; ours is an IP
        host = host.decode()
    print(f"serving {args.run_dir} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
