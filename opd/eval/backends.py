"""Answering benchmark items through a server instead of Hugging Face `generate` in this process.

eval.py --backend picks one: `hf` (`opd.eval.inference`, the default), `openai` (`OpenAIBackend`: any
OpenAI-compatible chat completions endpoint: vLLM, SGLang, `transformers serve`, llama.cpp, ...) or `vllm`
(`VLLMBackend`: a vLLM server started for --model by `opd.engine.vllm_server.VLLMServer`, or one already running). Each
has `answer_items(items, ...)` yielding (item, reply) in order, as `inference.answer_items` does; the prompts,
parsers and aggregates are eval.py's own either way. A request is tried 3 times (`RETRY_WAIT` apart, doubling); one
that still fails stops the run with one line and is never stored, so never scored.

`OpenAIBackend` sends eval.py's own user turn (the image as a lossless PNG data URL), greedy and with the server's
generation defaults turned off (its docstring says how, per server kind). `VLLMBackend` sends the trainer's own token
ids (`opd.engine.vllm_rollouts.generate_text`, checked against the server's) and decodes with the trainer's
processor: the engine computes in bf16, so a reply can part from HF float32 greedy at a near-tie
(tests/test_eval_backends.py measures how often).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoConfig, GenerationConfig

from opd.cli import UserError
from opd.engine import vllm_server
from opd.engine.vllm_rollouts import SUPPRESS_BIAS, generate_text, image_url
from opd.eval.bench_items import BenchItem, item_origin, prompt_text
from opd.eval.inference import VIEWS, item_error, item_image
from opd.models.chat import encode_prompt, user_message
from opd.models.loading import load_processor, resolve_model_source, special_ids
from opd.models.lora import is_adapter_folder

CONNECT_TIMEOUT = 5.0  # seconds /v1/models (or a --vllm-url's /health) may take before the server counts as unreachable
TEMPLATE_KWARGS = ("vllm", "sglang", "transformers")  # the server kinds that take chat_template_kwargs
RETRY_WAIT = 1.0  # seconds before a failed request's second try, doubled before each later one (both backends)


def api_base(url: str, flag: str = "--base-url") -> str:
    """The OpenAI base URL (ending in /v1) of what a user gave: a bare host, .../v1 or .../v1/chat/completions."""
    url = url.strip().rstrip("/")
    if not re.match(r"https?://[^/]", url):
        raise UserError(f"{flag} {url!r}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    for tail in ("/chat/completions", "/completions"):
        url = url.removesuffix(tail)
    return url if url.endswith("/v1") else url + "/v1"


def chat_messages(item: BenchItem, view: str = "full") -> list[dict]:
    """The item's user turn in OpenAI form: `opd.models.chat.user_message`'s parts, each image as an image_url."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; known: {', '.join(VIEWS)}")
    try:
        url = image_url(item_image(item, view))  # the pixels eval.py's processor sees, losslessly
    except ValueError as exc:  # an image that does not decode: name the item
        raise item_error(item, exc) from None
    [message] = user_message(prompt_text(item), 1)
    content = [{"type": "image_url", "image_url": {"url": url}} if part["type"] == "image" else part
               for part in message["content"]]
    return [{"role": "user", "content": content}]


def config_source(source: str) -> str:
    """Where a checkpoint's config is: the checkpoint, or for a LoRA adapter folder (a LoRA run's policy/:
    adapter_config.json, no config.json) its base model's (`base_model_name_or_path`), whose token ids the
    adapter keeps."""
    if not is_adapter_folder(source):
        return source

    path = Path(source) / "adapter_config.json"
    try:
        base = json.loads(path.read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: no base model (base_model_name_or_path) to read the config from: {exc}") from None
    try:
        return resolve_model_source(str(base))
    except UserError as exc:
        raise UserError(f"{path}: its base model (base_model_name_or_path): {exc}") from None


def config_special_ids(source: str) -> dict:
    """`opd.models.loading.special_ids` of a checkpoint from its config and generation config alone (no weights); a LoRA
    adapter folder's are its base's (`config_source`)."""
    source = config_source(source)
    config = AutoConfig.from_pretrained(source)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return special_ids(SimpleNamespace(config=config, generation_config=generation))


def _chunks(items: Iterable, n: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class OpenAIBackend:
    """Greedy replies from an OpenAI-compatible chat completions endpoint (`connect` first).

    One chat completion per item (`--batch-size` of them in flight): the user turn `opd.models.chat.user_message`
    builds (the image, as a lossless PNG base64 data URL, in front of `opd.eval.bench_items.prompt_text(item)`), so the
    server's chat template renders the prompt the trainer's processor renders; greedy (temperature 0, top_p 1, no
    penalties, seed), `max_tokens` = --max-new-tokens, and, when --model names the checkpoint, its vision special
    tokens biased by -100 (`logit_bias`, the OpenAI bound), as `generate`'s suppression. Servers add their own
    generation defaults (the checkpoint's generation_config.json): a server `/v1/models` identifies gets the
    parameters that turn them off and `chat_template_kwargs.enable_thinking` as --enable-thinking: `transformers
    serve` a whole `generation_config` (`opd.models.loading.neutral_generation_config`: the checkpoint's EOS and pad
    ids, greedy, the vision tokens suppressed), vLLM and SGLang `repetition_penalty` 1. Any other server (kind
    'openai') gets the standard parameters only: its chat template's default thinking mode applies there. A reply's
    `reasoning_content` (a server's reasoning parser split a think block off) is put back in front as
    ``<think>...</think>``, which the answer parser drops again."""

    def __init__(self, base: str, served_model: str, kind: str = "openai", ids: dict | None = None,
                 api_key: str | None = None, timeout: float = 600.0, seed: int = 42, retries: int = 3):
        self.base, self.served_model, self.kind, self.ids = base, served_model, kind, ids
        self.api_key, self.timeout, self.seed, self.retries = api_key, timeout, seed, max(1, retries)
        self.requests = 0  # HTTP requests sent (retries included), counted under a lock: pool threads send them
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # picklable (eval.py hands rank 0's connected backend to every rank)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, url: str, served_model: str | None = None, ids: dict | None = None, api_key: str | None = None,
                timeout: float = 600.0, seed: int = 42, connect_timeout: float = CONNECT_TIMEOUT) -> OpenAIBackend:
        """Checks that a server answers GET <base>/models within `connect_timeout` seconds and takes the model
        name from it (the first listed, or `served_model`, which must be listed); a one-line UserError else."""
        base = api_base(url)
        try:
            listing = _get_json(base + "/models", api_key, connect_timeout)
        except urllib.error.HTTPError as exc:
            raise UserError(f"--base-url {url}: GET {base}/models answered HTTP {exc.code} {exc.reason}: not the base "
                            "URL of an OpenAI-compatible server (it usually ends in /v1)") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise UserError(f"--base-url {url}: no OpenAI-compatible server answers GET {base}/models within "
                            f"{connect_timeout:g} s ({getattr(exc, 'reason', exc)})") from None
        models = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(models, list):
            raise UserError(f"--base-url {url}: GET {base}/models is not a model list: {str(listing)[:200]}")
        names = [str(m.get("id")) for m in models if isinstance(m, dict) and m.get("id")]
        if served_model is None:
            if not names:
                raise UserError(f"--base-url {url}: the server lists no model; name it with --served-model")
            served_model = names[0]
        elif names and served_model not in names:
            raise UserError(f"--served-model {served_model!r}: {base} serves {', '.join(map(repr, names))}")
        entry = next((m for m in models if isinstance(m, dict) and m.get("id") == served_model), {})
        return cls(base, served_model, server_kind(entry), ids, api_key, timeout, seed)

    def body(self, item: BenchItem, view: str, max_new_tokens: int, enable_thinking: bool) -> dict:
        """The chat completion request of one item (greedy, neutral: see the module docstring)."""
        body = {
            "model": self.served_model, "messages": chat_messages(item, view), "max_tokens": max_new_tokens,
            "temperature": 0.0, "top_p": 1.0, "seed": self.seed, "frequency_penalty": 0.0, "stream": False,
        }  # fmt: skip
        if self.kind in TEMPLATE_KWARGS:  # not standard: an unknown server may refuse it
            body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        vision = (self.ids or {}).get("vision") or []
        if vision:
            body["logit_bias"] = {str(t): SUPPRESS_BIAS for t in vision}  # -100.0: a float (transformers serve
            # refuses an int), the OpenAI bound
        if self.kind == "transformers" and self.ids:  # its default: the checkpoint's generation_config.json
            body["generation_config"] = json.dumps({
                "eos_token_id": self.ids["eos"], "pad_token_id": self.ids["pad"], "do_sample": False,
                "max_new_tokens": max_new_tokens, "suppress_tokens": vision or None,
            })  # fmt: skip
        elif self.kind in ("vllm", "sglang"):  # their default: the checkpoint's generation_config.json
            body["repetition_penalty"] = 1.0
            body["presence_penalty"] = 0.0
        return body

    def reply(self, item: BenchItem, view: str, max_new_tokens: int, enable_thinking: bool,
              max_prompt_len: int | None = None) -> str:
        """One item's reply: the message content, a split-off reasoning put back as a think block."""
        out = self._post(self.body(item, view, max_new_tokens, enable_thinking), item)
        try:
            message = out["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{self.base}/chat/completions: not a chat completion for {item.benchmark} item "
                            f"{item.index}: {str(out)[:300]}", local=True) from None
        prompt_tokens = (out.get("usage") or {}).get("prompt_tokens")
        if max_prompt_len and prompt_tokens and prompt_tokens > max_prompt_len:
            raise UserError(f"benchmark '{item.benchmark}': {item_origin(item)}: prompt has {prompt_tokens} tokens (the "
                            f"server's count), over the maximum prompt length {max_prompt_len}: raise --max-prompt-len",
                            local=True)
        content = str(message.get("content") or "")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return (f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content).strip()

    def answer_items(self, items: Iterable[BenchItem], batch_size: int = 8, max_new_tokens: int = 64,
                     enable_thinking: bool = False, view: str = "full",
                     max_prompt_len: int | None = None) -> Iterator[tuple[BenchItem, str]]:
        """(item, reply) for every item, in order; `batch_size` requests in flight."""
        with ThreadPoolExecutor(max_workers=max(1, batch_size)) as pool:
            for chunk in _chunks(items, max(1, batch_size)):
                futures = [pool.submit(self.reply, item, view, max_new_tokens, enable_thinking, max_prompt_len)
                           for item in chunk]
                yield from zip(chunk, (f.result() for f in futures))

    def _post(self, body: dict, item: BenchItem) -> dict:
        data = json.dumps(body).encode("utf-8")
        last = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(RETRY_WAIT * 2 ** (attempt - 1))
            with self._lock:
                self.requests += 1
            request = urllib.request.Request(self.base + "/chat/completions", data=data,
                                             headers=_headers(self.api_key), method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                detail = " ".join(exc.read().decode("utf-8", "replace").split())[:300]
                last = f"HTTP {exc.code}: {detail}"
                if exc.code < 500 and exc.code != 429:  # a bad request does not get better on retry
                    break
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        raise UserError(f"{self.base}/chat/completions (model {self.served_model!r}) failed for {item.benchmark} "
                        f"item {item.index} after {attempt + 1} tries: {last}", local=True)


def server_kind(entry: dict) -> str:
    """'vllm', 'sglang', 'transformers' (transformers serve: its /v1/models entries carry a load `status`) or
    'openai' (anything else: only standard parameters are sent)."""
    owner = str(entry.get("owned_by", "")).lower()
    if owner in ("vllm", "sglang"):
        return owner
    if isinstance(entry.get("status"), dict) and "value" in entry["status"]:
        return "transformers"
    return "openai"


def _headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _get_json(url: str, api_key: str | None, timeout: float):
    request = urllib.request.Request(url, headers=_headers(api_key), method="GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode("utf-8"))


def refuse_adapter(model_dir: str, backend: str) -> None:
    """A one-line UserError for a LoRA adapter folder (a LoRA run's policy/: adapter_config.json, no config.json)
    given to a backend that serves whole checkpoints."""
    if model_dir and is_adapter_folder(model_dir):
        raise UserError(f"--backend {backend} --model {model_dir}: a LoRA adapter (adapter_config.json, no "
                        "config.json), which a vLLM server does not load as a model; evaluate it with --backend hf "
                        "(it merges the adapter into its base), or merge it first (python -m opd.export RUN writes "
                        "checkpoint-N/merged/) and give that folder as --model")


def _transient(exc: UserError) -> bool:
    """Whether a `VLLMServer.post` failure may pass on a retry: a 5xx or 429 answer, a dropped or timed-out
    connection; not a 4xx, a server that died (`_raise_if_dead`: no cause) or a prompt expanded otherwise."""
    cause = exc.__cause__
    if isinstance(cause, urllib.error.HTTPError):
        return cause.code >= 500 or cause.code == 429
    return isinstance(cause, (urllib.error.URLError, OSError))


class RetryingServer:
    """A `opd.engine.vllm_server.VLLMServer` whose POSTs are tried `tries` times in all (`_transient` failures only,
    RETRY_WAIT apart, doubling), as `OpenAIBackend`'s requests are; everything else is the server's own."""

    def __init__(self, server, tries: int = 3):
        self.server, self.tries = server, max(1, tries)

    def __getattr__(self, name):  # only for what this class lacks
        if name == "server":
            raise AttributeError(name)
        return getattr(self.server, name)

    def post(self, path: str, body: dict | None = None, timeout: float = 600.0):
        for attempt in range(self.tries):
            if attempt:
                time.sleep(RETRY_WAIT * 2 ** (attempt - 1))
            try:
                return self.server.post(path, body, timeout=timeout)
            except UserError as exc:
                if not _transient(exc):
                    raise
                if attempt == self.tries - 1:
                    raise UserError(f"{exc} (after {self.tries} tries)") from exc.__cause__


class VLLMBackend:
    """Greedy replies from a vLLM server through `opd.engine.vllm_rollouts.generate_text` (the trainer's token ids).

    A request that still fails after its tries (`RetryingServer`) stops the run with one line: its chunk's replies
    are not stored (never scored as answers), the rows stored before stay, and the same command continues."""

    def __init__(self, server, processor, ids: dict, image_token_id: int | None, timeout: float = 3600.0):
        self.server, self.processor, self.ids = server, processor, ids
        self.image_token_id, self.timeout = image_token_id, timeout
        self.retrying = RetryingServer(server)

    @classmethod
    def open(cls, model_dir: str, vllm_url: str | None = None, dtype: str = "bfloat16", seed: int = 42,
             max_model_len: int | None = None, log_path=None, env: dict | None = None,
             timeout: float = 3600.0, say=None) -> VLLMBackend:
        """A server for `model_dir`: connected to at `vllm_url`, else started from the vLLM venv
        (`opd.engine.vllm_server.check_venv`: a missing venv is a one-line UserError naming scripts/install_vllm.sh).
        A LoRA adapter folder is refused in one line (`refuse_adapter`). `say` (a callable taking a line) is told
        when a started server starts, with its log, and when it answers (`VLLMServer.start`)."""
        refuse_adapter(model_dir, "vllm")
        config = AutoConfig.from_pretrained(model_dir)
        if vllm_url:
            server = vllm_server.VLLMServer.connect(vllm_url, dtype=dtype)
        else:
            vllm_server.check_venv()
            if max_model_len is None:
                max_model_len = min(int(getattr(config.get_text_config(), "max_position_embeddings", 4096)), 32768)
            server = vllm_server.VLLMServer.start(model_dir, seed=seed, dtype=dtype, max_model_len=max_model_len,
                                                  log_path=log_path, env=env, say=say)
        return cls(server, load_processor(model_dir), config_special_ids(model_dir),
                   getattr(config, "image_token_id", None), timeout)

    def answer_items(self, items: Iterable[BenchItem], batch_size: int = 8, max_new_tokens: int = 64,
                     enable_thinking: bool = False, view: str = "full",
                     max_prompt_len: int | None = None) -> Iterator[tuple[BenchItem, str]]:
        """(item, reply) for every item, in order; `batch_size` requests in flight (the engine batches them)."""
        for chunk in _chunks(items, max(1, batch_size)):
            prompts, images = [], []
            for item in chunk:
                try:
                    image = item_image(item, view)
                    prompts.append(encode_prompt(self.processor, [image], prompt_text(item), enable_thinking,
                                                 max_prompt_len))
                except ValueError as exc:  # over max_prompt_len, an undecodable image: name the item (as inference)
                    raise item_error(item, exc) from None
                images.append([image])
            try:
                texts = generate_text(self.retrying, prompts, images, max_new_tokens, self.processor,
                                      eos=self.ids["eos"], vision=self.ids["vision"],
                                      image_token_id=self.image_token_id, max_concurrency=max(1, batch_size),
                                      timeout=self.timeout)
            except UserError as exc:  # this process's server failed (died, refused a request): only it knows
                indices = ", ".join(item.index for item in chunk)
                raise UserError(f"{exc}; answering {chunk[0].benchmark} item(s) {indices}: none of them stored, the "
                                "replies before are kept; the same command continues from there", local=True) from None
            yield from zip(chunk, texts)

    def close(self) -> None:
        self.server.stop()  # a connected server (--vllm-url) is left running
