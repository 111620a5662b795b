"""An optional LLM judge for free-form answers: any OpenAI-compatible chat endpoint, verdicts cached.

The paper (Appendix B.2) judges the free-form answers that option/exact-answer parsing cannot settle
with GPT-5.5 at temperature 0. `Judge` sends one short prompt per answer to
``POST <url>/v1/chat/completions`` (standard library ``urllib`` only; no SDK), temperature 0, and
reads "correct" / "incorrect" from the reply. Every verdict is appended to a JSONL cache keyed by a
hash of (question, gold, reply, judge model), so a rerun, a resumed run or a rescoring makes no
request for an answer already judged. A reply that says neither word is cached as "unparsed" and
scores as wrong. HTTP failures are retried a few times, then raised with the URL and status.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from opd.cli import UserError
from opd.eval.evaluate import append_jsonl, read_jsonl

SYSTEM_PROMPT = "You grade answers to visual questions. Reply with one word: correct or incorrect."
USER_PROMPT = (
    "Question: {question}\n"
    "Reference answer: {gold}\n"
    "Model answer: {reply}\n\n"
    "Does the model answer mean the same as the reference answer? "
    "Reply with exactly one word: correct or incorrect."
)
VERDICTS = ("correct", "incorrect", "unparsed")


def endpoint(url: str) -> str:
    """The chat-completions URL of a base URL: ".../v1/chat/completions" is kept, ".../v1" and a bare
    host get the missing path appended."""
    url = url.strip().rstrip("/")
    if not re.match(r"https?://", url):
        raise ValueError(f"--judge-url {url!r}: expected an http:// or https:// URL")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def parse_verdict(text: str) -> str:
    """ "correct", "incorrect" or "unparsed" from a judge reply (its first matching word decides)."""
    m = re.search(r"\b(incorrect|not correct|wrong|correct)\b", str(text or ""), re.IGNORECASE)
    if not m:
        return "unparsed"
    return "correct" if m.group(1).lower() == "correct" else "incorrect"


def cache_key(question: str, gold: str, reply: str, model: str) -> str:
    """sha256 over the four strings (JSON-encoded, so no separator can collide)."""
    payload = json.dumps([str(question), str(gold), str(reply), str(model)], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class JudgeError(UserError, RuntimeError):
    """The judge endpoint failed or answered something that is not a chat completion (reported in one
    line with the URL and status: a wrong --judge-url/--judge-model, or a server to restart)."""


class Judge:
    """Verdicts from an OpenAI-compatible endpoint, cached in ``cache_path`` (JSONL).

    ``requests`` counts the HTTP requests made by this object (cache hits make none).
    """

    def __init__(self, url: str, model: str, cache_path, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0):
        if not model:
            raise ValueError("--judge-url needs --judge-model (the model name the endpoint serves)")
        self.url = endpoint(url)
        self.model = model
        self.cache_path = Path(cache_path)
        self.api_key = api_key
        self.timeout = timeout
        self.retries = max(1, retries)
        self.backoff = backoff
        self.requests = 0
        self.cache: dict[str, dict] = {row["key"]: row for row in read_jsonl(self.cache_path) if "key" in row}

    def verdict(self, question: str, gold: str, reply: str) -> str:
        """ "correct", "incorrect" or "unparsed" for one answer; from the cache when already judged."""
        key = cache_key(question, gold, reply, self.model)
        if key in self.cache:
            return self.cache[key]["verdict"]
        text = self._ask(USER_PROMPT.format(question=question, gold=gold, reply=reply))
        row = {"key": key, "verdict": parse_verdict(text), "model": self.model, "question": question,
               "gold": gold, "reply": reply, "judge_reply": text}
        append_jsonl(self.cache_path, [row])
        self.cache[key] = row
        return row["verdict"]

    def _ask(self, prompt: str) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
            "temperature": 0,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode("utf-8")
        last = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            self.requests += 1
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                detail = " ".join(exc.read().decode("utf-8", "replace").split())[:300]  # one line
                last = f"HTTP {exc.code}: {detail}"
                if exc.code < 500 and exc.code != 429:  # a client error does not get better on retry
                    break
                continue
            except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            try:
                return str(payload["choices"][0]["message"]["content"] or "")
            except (KeyError, IndexError, TypeError) as exc:
                raise JudgeError(f"judge {self.url}: not a chat completion (no choices[0].message.content): "
                                 f"{str(payload)[:300]}") from exc
        raise JudgeError(f"judge {self.url} (model {self.model!r}) failed after {attempt + 1} tries: {last}")


def judge_from_env(url: str, model: str, cache_path, key_env: str = "", timeout: float = 60.0) -> Judge:
    """A Judge whose API key (if any) is read from the environment variable ``key_env``."""
    return Judge(url, model, cache_path, api_key=os.environ.get(key_env) if key_env else None, timeout=timeout)
