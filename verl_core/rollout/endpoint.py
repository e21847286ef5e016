"""Rollouts from an OpenAI-compatible server (``verl-flow serve``, any vLLM server): :class:`EndpointEngine`.

The engine is a :class:`~verl_core.rollout.base.RolloutEngine` that cannot take weights: it samples
from whatever the server serves (``verl-flow eval --endpoint URL``). Each (prompt, sample) is one
``POST {url}/v1/completions`` with the prompt as token ids, so the server sees exactly the ids the
in-process engines would (the prompts rendered by the run's chat template, tokenized by the run's
tokenizer: the server must serve a model with that tokenizer, e.g. an export of the run;
:func:`check_tokenizer` compares one prompt through the server's ``/tokenize``).

Request fields, as :class:`~verl_core.rollout.vllm.VLLMEngine` sets vLLM's sampling parameters:
``temperature`` (0: greedy), ``top_p``, ``top_k``, ``max_tokens``, ``stop`` with
``include_stop_str_in_output`` (the text keeps the stop string, like the HF engine's cut),
``stop_token_ids`` (``<|im_end|>`` when the tokenizer has it, besides the server's eos),
``seed=derive_seed("sample", seed, prompt_key, j)``, ``logprobs=0`` (the sampled token's log-prob)
and vLLM's ``return_token_ids`` (the response ids; a server without it is refused). Requests run
``max_concurrency`` at a time; a failed request raises :class:`EndpointError` with the server's answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from torch import Tensor, nn

from verl_core.data.tokenizer import IM_END
from verl_core.errors import VerlFlowError
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.requests import encode_prompts
from verl_core.rollout.sampler import check_prompt_keys
from verl_core.seeding import derive_seed


class EndpointError(VerlFlowError):
    """The server refused a request or answered in a shape we cannot read."""


class EndpointEngine:
    """Completions from ``base_url`` (``http://host:port``, without ``/v1``) for ``model`` (the served
    model name; None: the first of ``/v1/models``). ``tokenizer`` encodes string prompts and names
    ``<|im_end|>``."""

    shares_weights = False

    def __init__(
        self,
        base_url: str,
        tokenizer: Any,
        model: str | None = None,
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model = model or served_models(self._client, self.base_url)[0]

    @property
    def policy_version(self) -> int:
        return -1  # unknown: the server's weights are not ours to version

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        params = params or SamplingParams()
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pkeys = check_prompt_keys(prompt_keys, len(prompt_ids))
        seed = params.seed if params.seed is not None else 0
        rows = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]  # one request per sample

        def one(row: tuple[int, int]) -> Completion:
            i, j = row
            body = self._post(
                "/v1/completions",
                self._payload(prompt_ids[i], params, derive_seed("sample", seed, pkeys[i], j)),
            )
            return _completion(i, j, prompt_ids[i], body)

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(rows)))) as pool:
            return list(pool.map(one, rows))

    def _payload(self, ids: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        stop_ids = list(params.stop_token_ids)
        im_end = self.tokenizer.get_vocab().get(IM_END)
        if im_end is not None:
            stop_ids.append(int(im_end))  # eos is the server's own stop token already
        return {
            "model": self.model,
            "prompt": ids,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,  # 0: off
            "n": 1,
            "seed": seed,
            "stop": list(params.stop),
            "stop_token_ids": list(dict.fromkeys(stop_ids)),
            "include_stop_str_in_output": True,
            "skip_special_tokens": True,
            "logprobs": 0,
            "return_token_ids": True,
        }

    def _post(self, path: str, payload: Mapping[str, Any]) -> Any:
        return post(self._client, self.base_url + path, payload)

    def close(self) -> None:
        self._client.close()

    # -- weights are the server's --------------------------------------------------------------

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        raise EndpointError("EndpointEngine: the server's weights cannot be updated from here")

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        raise EndpointError("EndpointEngine: the server's weights cannot be updated from here")

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        raise EndpointError("EndpointEngine: the server's weights cannot be updated from here")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


def post(client: httpx.Client, url: str, payload: Mapping[str, Any]) -> Any:
    """POST JSON, return the JSON answer; :class:`EndpointError` on a transport error or non-2xx."""
    try:
        response = client.post(url, json=payload)
    except httpx.HTTPError as e:
        raise EndpointError(f"{url}: {type(e).__name__}: {e}") from None
    if not 200 <= response.status_code < 300:
        raise EndpointError(f"{url} answered HTTP {response.status_code}: {response.text[:500]!r}")
    return response.json()


def served_models(client: httpx.Client, base_url: str) -> list[str]:
    """The model names ``GET {base_url}/v1/models`` lists."""
    try:
        response = client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        names = [m["id"] for m in response.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        raise EndpointError(f"{base_url}/v1/models: cannot list the served models ({e})") from None
    if not names:
        raise EndpointError(f"{base_url}/v1/models lists no model")
    return names


def check_tokenizer(engine: EndpointEngine, text: str, ids: Sequence[int]) -> None:
    """Raise :class:`EndpointError` unless the server tokenizes ``text`` (without special tokens) to
    ``ids`` (vLLM's ``/tokenize``): a server with another tokenizer would read our ids as other text."""
    body = engine._post("/tokenize", {"model": engine.model, "prompt": text, "add_special_tokens": False})
    theirs = body.get("tokens") if isinstance(body, dict) else None
    if theirs != list(ids):
        raise EndpointError(
            f"{engine.base_url} serves {engine.model!r} with another tokenizer than the run's: {text[:60]!r} "
            f"is {list(ids)[:12]}... here and {str(theirs)[:80]} there; serve an export of this run"
        )


def _completion(prompt_index: int, sample_index: int, prompt_ids: list[int], body: Any) -> Completion:
    """One ``/v1/completions`` answer (one choice) → :class:`Completion`."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        text = str(choice["text"])
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise EndpointError(
            f"/v1/completions answer without choices[0].text / token_ids ({e!r}; a vLLM server returns "
            f"token ids with return_token_ids): {str(body)[:300]}"
        ) from None
    if len(logprobs) != len(ids):
        raise EndpointError(f"/v1/completions returned {len(logprobs)} log-probs for {len(ids)} tokens")
    finish: FinishReason = "length" if choice.get("finish_reason") == "length" else "stop"
    return Completion(prompt_index, sample_index, list(prompt_ids), ids, text, logprobs, finish)
