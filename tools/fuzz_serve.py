"""Request fuzzing for ``expertfs serve``, in process against the aiohttp application.

Bodies come from hypothesis strategies (``fuzz_bodies``), per endpoint, from valid-but-odd to
garbage: wrong types, huge numbers, NaN/Infinity, deep nesting, invalid UTF-8 and lone
surrogates, huge strings, duplicate keys, wrong content types and methods, truncated bodies.
Every answer must be a 2xx (a stream ends with ``[DONE]``, or ``message_stop`` for the Anthropic
Messages API, and carries no error) or a 4xx whose body is an OpenAI error (``{"error":
{"message", "type", "param", "code"}}``; Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` under ``/v1/messages``; a 503 with ``Retry-After``); a 5xx, a malformed 4xx or an
answer slower than the per-request timeout (a hang) is a failure, and the server must still
answer ``/health`` at the end. A chat the server accepted with a JSON ``response_format`` or a
forced ``tool_choice`` must keep it once finished (``unkept``).

The model is ``FastEngine``: seeded random logits over a real tokenizer's vocabulary (the tiny
synthesised qwen3moe store's, with llama.cpp's Qwen3 chat template, which takes tools), so the
server's whole path (templates, tokenizer, sampling, stop strings, logprobs, tool parsing,
streaming) runs at the speed of the HTTP layer. The suite
(``tests/runtime/server/test_fuzz.py``) runs a few seeded examples per endpoint; this script
runs many::

    .venv/bin/python tools/fuzz_serve.py --count 10000 --seed 0 --time-limit 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fuzz_bodies import ENDPOINTS, cases  # noqa: F401  (the suite imports them here)


class FastEngine:
    """The engine interface ``Session`` drives, answering seeded random logits at once (or
    after ``delay`` seconds a token); ``decodes`` counts the tokens asked for."""

    def __init__(self, n_vocab: int, n_ctx: int = 128, seed: int = 0, delay: float = 0.0) -> None:
        self.n_vocab, self.delay, self.pos, self.decodes = n_vocab, delay, 0, 0
        self.options = SimpleNamespace(n_ctx=n_ctx)
        self.provider = SimpleNamespace(stats=SimpleNamespace(bytes_read=0, requests=0, hits={}))
        self._gen = torch.Generator().manual_seed(seed)

    def can_reset(self, pos: int) -> bool:
        return True

    def reset(self, pos: int = 0) -> None:
        self.pos = pos

    def _logits(self) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.randn(self.n_vocab, generator=self._gen) * 3

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.pos += len(ids)
        return self._logits()

    def decode(self, token: int) -> torch.Tensor:
        self.pos += 1
        self.decodes += 1
        return self._logits()


def tiny_tokenizer(folder: str | Path, template: str | None = None) -> Any:
    """The tiny synthesised qwen3moe store's tokenizer, with its own chat template (which takes
    no tools) or ``template``."""
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.formats.gguf_read import read_gguf
    from expertfs.synth import SynthConfig, synthesize
    path = synthesize(SynthConfig.tiny("qwen3moe"), str(Path(folder) / "m.gguf"))
    tok = GGUFTokenizer(read_gguf(path[0] if isinstance(path, list) else path).kv)
    if template is not None:
        tok.chat_template = template
    return tok


def llama_template(name: str) -> str | None:
    """A chat template: a file, or one of llama.cpp's ``models/templates`` (None if absent)."""
    if Path(name).is_file():
        return Path(name).read_text(encoding="utf-8")
    from llamacpp_convert import ConverterUnavailable, source_dir
    try:
        path = source_dir() / "models" / "templates" / name
    except ConverterUnavailable:
        return None
    return path.read_text(encoding="utf-8") if path.is_file() else None


# ---- checking answers -------------------------------------------------------------------

def _reply(headers: Any, raw: bytes) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls, finish reason) of a chat answer, whole or streamed."""
    if not headers.get("Content-Type", "").startswith("text/event-stream"):
        choice = json.loads(raw)["choices"][0]
        msg = choice["message"]
        return msg.get("content") or "", msg.get("tool_calls") or [], choice["finish_reason"]
    content, calls, finish = "", {}, None
    for line in raw.decode().split("\n"):
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if not ev.get("choices"):               # an in-band error (verdict has judged it)
            continue
        choice = ev["choices"][0]
        d, finish = choice.get("delta") or {}, choice.get("finish_reason") or finish
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            call = calls.setdefault(c["index"], {"function": {"name": "", "arguments": ""}})
            f = c.get("function") or {}
            call["function"]["name"] += f.get("name") or ""
            call["function"]["arguments"] += f.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)], finish


def unkept(case: tuple[str, str, bytes, dict[str, str]], headers: Any, raw: bytes
           ) -> tuple[str | None, str | None]:
    """(what was checked, why it failed) for a chat answer the server accepted with a JSON
    ``response_format`` or a forced tool call, once it says it finished: the content must be
    JSON (matching the schema, when jsonschema is installed), the call one of the tools, the
    named one if named, its arguments a JSON object."""
    if case[1] != "/v1/chat/completions":
        return None, None
    try:
        body = json.loads(case[2])
        rf, choice, tools = body.get("response_format"), body.get("tool_choice"), body.get("tools")
    except (ValueError, AttributeError):
        return None, None
    content, calls, finish = _reply(headers, raw)
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tools and (choice == "required" or isinstance(choice, dict)):
        names = {t["function"]["name"] for t in tools}
        if isinstance(choice, dict):
            names = {choice["function"]["name"]}
        if not calls:
            return "call", f"no tool call for tool_choice {choice!r}: {content[:200]!r}"
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"])
            except ValueError:
                args = None
            if c["function"]["name"] not in names or not isinstance(args, dict):
                return "call", f"call {c['function']} for tool_choice {choice!r}"
        return "call", None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in ("json_object", "json_schema") or calls:
        return None, None
    try:
        value = json.loads(content)
    except ValueError:
        return "json", f"{kind} reply is not JSON: {content[:200]!r}"
    if kind == "json_object" and not isinstance(value, dict):
        return "json", f"json_object reply is not an object: {content[:200]!r}"
    try:
        import jsonschema
    except ImportError:
        return "json", None
    if kind != "json_schema":
        return "json", None
    try:
        jsonschema.validate(value, rf["json_schema"].get("schema", {}))
    except jsonschema.ValidationError as e:
        return "json", f"reply {content[:200]!r} does not match the schema: {e.message}"
    return "json", None

def _error_ok(raw: bytes, anthropic: bool) -> bool:
    try:
        body = json.loads(raw)
        err = body["error"]
        if anthropic:
            return (body["type"] == "error" and isinstance(err["message"], str)
                    and bool(err["message"]) and isinstance(err["type"], str))
        return (isinstance(err["message"], str) and bool(err["message"])
                and isinstance(err["type"], str) and "param" in err and "code" in err)
    except (ValueError, KeyError, TypeError):
        return False


def _anthropic_stream_ok(text: str) -> bool:
    """Events in the Messages API's order: message_start first, message_stop last, no error."""
    names = [line[7:] for line in text.split("\n") if line.startswith("event: ")]
    return (bool(names) and names[0] == "message_start" and names[-1] == "message_stop"
            and "error" not in names and names.count("content_block_start")
            == names.count("content_block_stop"))


def verdict(status: int, headers: Any, raw: bytes, path: str = "") -> tuple[str, str | None]:
    """("2xx" | "4xx" | "5xx" | "bad", why) for one answer (to a request for ``path``: errors
    under /v1/messages are Anthropic's shape, the others OpenAI's)."""
    anthropic = path.startswith("/v1/messages")
    if status >= 500:
        return "5xx", raw[:300].decode("utf-8", "replace")
    if status >= 400:
        if not _error_ok(raw, anthropic):
            return "bad", f"{status} not an {'Anthropic' if anthropic else 'OpenAI'} error: " \
                f"{raw[:200]!r}"
        if status == 503 and "Retry-After" not in headers:
            return "bad", "503 without Retry-After"
        return "4xx", None
    if 200 <= status < 300:
        if headers.get("Content-Type", "").startswith("text/event-stream"):
            text = raw.decode()
            if anthropic:
                if not _anthropic_stream_ok(text):
                    return "bad", f"stream: {text[-300:]}"
            elif not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                return "bad", f"stream: {text[-300:]}"
        elif raw and not headers.get("Content-Type", "").startswith("text/plain"):
            json.loads(raw)
        return "2xx", None
    return "bad", f"status {status}"


class Harness:
    """The application on a test server in this thread's event loop, with ``send`` per case."""

    def __init__(self, session: Any, timeout: float = 20.0, **config: Any) -> None:
        from aiohttp.test_utils import TestClient, TestServer

        from expertfs.runtime.server import ServerConfig, build_app
        self.loop = asyncio.new_event_loop()
        self.timeout = timeout
        self.counts: Counter[str] = Counter()
        self.checked: Counter[str] = Counter()  # JSON replies and forced calls checked
        self.failures: list[tuple[tuple[str, str, bytes, dict[str, str]], str]] = []
        app = build_app(session, ServerConfig("tiny", **{"max_body": 1 << 20, **config}))

        async def start() -> Any:
            client = TestClient(TestServer(app))
            await client.start_server()
            return client
        self.client = self.loop.run_until_complete(start())

    async def _send(self, method: str, path: str, data: bytes, headers: dict[str, str]
                    ) -> tuple[int, Any, bytes]:
        async with self.client.request(method, path, data=data, headers=headers) as r:
            return r.status, r.headers, await r.read()

    def send(self, case: tuple[str, str, bytes, dict[str, str]]) -> str:
        try:
            status, headers, raw = self.loop.run_until_complete(
                asyncio.wait_for(self._send(*case), self.timeout))
            kind, why = verdict(status, headers, raw, case[1])
            if kind == "2xx":
                what, broke = unkept(case, headers, raw)
                self.checked.update([what] if what else [])
                kind, why = ("unkept", broke) if broke else (kind, why)
        except asyncio.TimeoutError:
            kind, why = "hang", f"no answer in {self.timeout:g} s"
        except Exception as e:                 # the connection died: the server dropped it
            kind, why = "dropped", f"{type(e).__name__}: {e}"
        self.counts[kind] += 1
        if why is not None:
            self.failures.append((case, f"{kind}: {why}"))
        return kind

    def alive(self) -> bool:
        return self.send(("GET", "/health", b"", {})) == "2xx"

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from expertfs.runtime.server.session import Session
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=10000, help="requests in all (10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds in all (600)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per request (20)")
    ap.add_argument("--show", type=int, default=120, help="bytes of each failing body shown")
    ap.add_argument("--template", default="Qwen-Qwen3-0.6B.jinja",
                    help="chat template, one that takes tools: a file or a name in llama.cpp's "
                    "models/templates (Qwen-Qwen3-0.6B.jinja); '' for the tiny store's own")
    args = ap.parse_args(argv)
    template = llama_template(args.template) if args.template else None
    if args.template and template is None:
        print(f"fuzz_serve: template {args.template} not found; the tiny store's own (no tools)")
    with tempfile.TemporaryDirectory() as d:
        tok = tiny_tokenizer(d, template)
    h = Harness(Session(FastEngine(tok.n_vocab, n_ctx=4096, seed=args.seed), tok),
                timeout=args.timeout)            # a context the tool prompts fit in
    t0, per = time.monotonic(), -(-args.count // len(ENDPOINTS))

    class Stop(Exception):
        pass
    for endpoint in ENDPOINTS:
        @seed(args.seed)
        @settings(max_examples=per, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases(endpoint))
        def one(case: tuple[str, str, bytes, dict[str, str]]) -> None:
            if time.monotonic() - t0 > args.time_limit:
                raise Stop
            h.send(case)
        try:
            one()
        except Stop:
            break
    alive = h.alive()
    h.close()
    c = h.counts
    print(f"requests {sum(c.values()) - 1}  2xx {c['2xx'] - 1}  4xx {c['4xx']}  5xx {c['5xx']}  "
          f"hangs {c['hang']}  malformed {c['bad']}  dropped {c['dropped']}  "
          f"unkept {c['unkept']} (of {h.checked['json']} JSON replies, {h.checked['call']} "
          f"forced calls)  server alive {alive}  {time.monotonic() - t0:.0f} s")
    for case, why in h.failures[:10]:
        print(f"  {case[0]} {case[1]} {case[2][:args.show]!r}: {why}")
    return 0 if alive and not h.failures else 1


if __name__ == "__main__":
    sys.exit(main())
