"""One chat completion from any OpenAI-compatible server (`vllm serve`, llama.cpp's server, OpenAI, ...).

POST {url}/chat/completions with {"model", "messages", "temperature", "max_tokens"} through `requests`, the bearer
token from the environment variable `api_key_env` when it is set (local servers need none). `url` may be the
server root (http://127.0.0.1:8000), its /v1 base, or the full .../chat/completions address. Connection errors,
timeouts, 429 and 5xx answers are retried with exponential backoff (backoff, 2*backoff, ...); any other HTTP error,
or a body without choices[0].message.content, raises EndpointError at once with the status and the server's words.
"""

from __future__ import annotations

import os
import time

import requests

from opct.errors import MachineError
from opct.judges.base import JudgeError


class EndpointError(MachineError, RuntimeError):
    """The judge endpoint could not give a completion; the message says which URL and why."""


RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def completions_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def chat_completion(url: str, model: str, messages: list[dict], *, api_key_env: str = "OPCT_JUDGE_API_KEY",
                    temperature: float = 0.0, max_tokens: int = 512, timeout: float = 60.0, retries: int = 3,
                    backoff: float = 1.0, extra_body: dict | None = None) -> str:
    """The assistant text of one chat completion; `retries` extra attempts on transient failures. `extra_body`:
    server-specific request fields merged into the body (e.g. vLLM's {"structured_outputs": {"regex": ...}})."""
    target = completions_url(url)
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
            **(extra_body or {})}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            r = requests.post(target, json=body, headers=headers, timeout=timeout)
        except (requests.ConnectionError, requests.Timeout) as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if r.status_code in RETRY_STATUS:
            last = f"HTTP {r.status_code}: {r.text[:500]}"
            continue
        if r.status_code != 200:
            hint = f" (set ${api_key_env})" if r.status_code in (401, 403) and not key else ""
            raise EndpointError(f"{target}: HTTP {r.status_code}{hint}: {r.text[:500]}")
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"{target}: response is not a chat completion "
                                f"(no choices[0].message.content): {r.text[:500]}") from None
        if not isinstance(content, str):
            raise EndpointError(f"{target}: choices[0].message.content is {type(content).__name__}, not text")
        return content
    raise EndpointError(f"{target}: no completion after {retries + 1} attempts; last error: {last}")


def check(url: str, model: str, *, api_key_env: str = "OPCT_JUDGE_API_KEY") -> None:
    """One 1-token chat completion (one retry), so that a wrong URL, model name or key is found before any
    generation rather than after it; raises EndpointError saying why."""
    chat_completion(url, model, [{"role": "user", "content": "Reply with OK."}], api_key_env=api_key_env,
                    max_tokens=1, retries=1, timeout=120)


def check_endpoint(url: str, model: str) -> None:
    """--judge llm's endpoint answers one short request (endpoint.check), else a JudgeError naming the options."""
    try:
        check(url, model)
    except EndpointError as e:
        raise JudgeError(f"--judge-url {url} --judge-model {model}: the judge endpoint does not answer a test "
                         f"request: {e}") from None
