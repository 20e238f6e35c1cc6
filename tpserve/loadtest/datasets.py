"""The prompts of a load test: random words, a shared prefix plus random words, a ShareGPT
JSON file, or a JSONL file of prompts.

Random prompts are made of common English words (one token each in the usual BPE
vocabularies) and fitted to the requested length with a TokenCounter: the word count is
corrected until the server's /tokenize says the prompt has exactly the target number of
tokens (BOS included), or as close as whole words allow.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpserve.loadtest.token_count import TokenCounter

WORDS = tuple(dict.fromkeys(
    "the of and to in is was for on are with as at be by this from or have an they which "
    "one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also "
    "did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "house water small place number part sound again home read hand large spell add land "
    "big high such follow act why ask change went light kind need try picture animal point "
    "mother near build self earth father head stand page country found answer school grow "
    "study learn plant cover food sun four thought let keep eye never city tree cross farm "
    "hard start story saw far sea draw left late run while press close night real few north"
    .split()
))

MAX_FIT_STEPS = 8
FIT_CONCURRENCY = 16
# vLLM's ShareGPT filter: pairs outside these token bounds are dropped.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class PromptSpec:
    """One request to send: the prompt text, its max_tokens and the prompt length aimed at."""

    prompt: str
    output_len: int
    target_input_len: int | None = None


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """n integers drawn uniformly from [mean*(1-r), mean*(1+r)], each at least 1."""
    low = max(1, int(np.floor(mean * (1.0 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1.0 + range_ratio))))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_words(rng: np.random.Generator, n: int) -> list[str]:
    """n words drawn uniformly (with replacement) from WORDS."""
    return [WORDS[i] for i in rng.integers(0, len(WORDS), size=n)]


async def fit_text(
    counter: TokenCounter,
    make: Callable[[int], str],
    target: int,
    first_guess: int,
) -> tuple[str, int]:
    """Find k so that counter.count(make(k)) == target; returns (text, its token count).

    ``make(k)`` must grow by about one token per unit of k. Each step moves k by the
    remaining difference; when whole words cannot hit the target exactly, the closest
    text seen is returned.
    """
    k = max(1, first_guess)
    tried: set[int] = set()
    best: tuple[int, str, int] | None = None
    for _ in range(MAX_FIT_STEPS):
        tried.add(k)
        text = make(k)
        n = await counter.count(text)
        if best is None or abs(n - target) < best[0]:
            best = (abs(n - target), text, n)
        if n == target:
            break
        k_next = max(1, k + target - n)
        if k_next in tried:
            break
        k = k_next
    assert best is not None
    return best[1], best[2]


class _WordSource:
    """Words of one prompt, drawn lazily so that fitting may ask for more than guessed."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._words: list[str] = []

    def text(self, k: int, prefix: str = "") -> str:
        if k > len(self._words):
            self._words += random_words(self._rng, k - len(self._words) + 16)
        body = " ".join(self._words[:k])
        return f"{prefix} {body}" if prefix else body


async def _overhead(counter: TokenCounter) -> int:
    """Tokens the server adds to any prompt (a BOS, usually): count('the') - 1."""
    return max(0, await counter.count("the") - 1)


async def _fit_many(
    counter: TokenCounter,
    rng: np.random.Generator,
    targets: list[int],
    output_lens: list[int],
    prefix: str,
    guess_offset: int,
) -> list[PromptSpec]:
    sources = [_WordSource(np.random.default_rng(rng.integers(2**63))) for _ in targets]
    limit = asyncio.Semaphore(FIT_CONCURRENCY)

    async def one(source: _WordSource, target: int, output_len: int) -> PromptSpec:
        async with limit:
            text, _ = await fit_text(
                counter, lambda k: source.text(k, prefix), target, target - guess_offset
            )
        return PromptSpec(prompt=text, output_len=output_len, target_input_len=target)

    return list(await asyncio.gather(
        *(one(s, t, o) for s, t, o in zip(sources, targets, output_lens, strict=True))
    ))


async def random_dataset(
    counter: TokenCounter,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[PromptSpec]:
    """num_prompts distinct prompts of random words, each fitted to its drawn length."""
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    overhead = await _overhead(counter)
    return await _fit_many(counter, rng, inputs, outputs, "", overhead)


async def prefix_dataset(
    counter: TokenCounter,
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    num_prefixes: int = 1,
) -> list[PromptSpec]:
    """Prompts that start with one of ``num_prefixes`` prefixes of prefix_len tokens each,
    then differ.

    Each prompt has prefix_len + (its drawn input length) tokens, as with vLLM's
    ``--random-prefix-len``. With several prefixes (vLLM's
    ``--prefix-repetition-num-prefixes``) each takes an equal share of the prompts (the
    first ones one more when they do not divide), in a shuffled order.
    """
    rng = np.random.default_rng(seed)
    overhead = await _overhead(counter)
    prefixes = []
    for _ in range(num_prefixes):
        source = _WordSource(np.random.default_rng(rng.integers(2**63)))
        prefixes.append(await fit_text(counter, source.text, prefix_len, prefix_len - overhead))
    inputs = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    targets = [prefix_len + n for n in inputs]
    # one prefix draws no order, so its prompts are the ones it always gave
    owner = (rng.permutation([i % num_prefixes for i in range(num_prompts)])
             if num_prefixes > 1 else [0] * num_prompts)
    specs: list[PromptSpec | None] = [None] * num_prompts
    for k, (prefix, prefix_tokens) in enumerate(prefixes):
        mine = [i for i in range(num_prompts) if owner[i] == k]
        fitted = await _fit_many(counter, rng, [targets[i] for i in mine],
                                 [outputs[i] for i in mine], prefix, prefix_tokens)
        for i, spec in zip(mine, fitted, strict=True):
            specs[i] = spec
    return specs


def file_dataset(path: Path, num_prompts: int, default_output_len: int) -> list[PromptSpec]:
    """Prompts from a JSONL file, in file order, repeated if it has fewer than num_prompts.

    Each line: {"prompt": "...", "output_len": 128}; output_len is optional.
    Blank lines are skipped.
    """
    specs: list[PromptSpec] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                specs.append(_parse_line(path, number, line, default_output_len))
    if not specs:
        raise DatasetError(f"{path}: no prompts in the file")
    return [specs[i % len(specs)] for i in range(num_prompts)]


def _parse_line(path: Path, number: int, line: str, default_output_len: int) -> PromptSpec:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f'{where}: "prompt" must be a non-empty string')
    output_len = item.get("output_len", default_output_len)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise DatasetError(f'{where}: "output_len" must be a positive integer')
    return PromptSpec(prompt=prompt, output_len=output_len)


async def sharegpt_dataset(
    counter: TokenCounter,
    path: Path,
    num_prompts: int,
    output_len: int | None,
    seed: int,
) -> list[PromptSpec]:
    """num_prompts requests from a ShareGPT file, filtered as vLLM's ``bench serve`` does.

    The conversations are shuffled with ``seed``; each gives the first human turn as the
    prompt and the token count of the first gpt turn after it as max_tokens (or
    ``output_len`` when given). A pair is dropped when the prompt or the answer has
    fewer than SHAREGPT_MIN_LEN tokens (the answer is not checked with ``output_len``),
    the prompt has more than SHAREGPT_MAX_PROMPT_LEN, or both together more than
    SHAREGPT_MAX_TOTAL_LEN. Prompt tokens are counted as the server sees them (BOS
    included, as vLLM's tokenizer call does); answer tokens without the tokens the
    server adds to every prompt. Kept pairs repeat when fewer than num_prompts remain.
    """
    pairs = read_sharegpt(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    overhead = await _overhead(counter)
    specs: list[PromptSpec] = []
    for start in range(0, len(order), FIT_CONCURRENCY):
        if len(specs) >= num_prompts:
            break
        batch = [pairs[i] for i in order[start:start + FIT_CONCURRENCY]]
        specs += [s for s in await asyncio.gather(
            *(_sharegpt_spec(counter, p, c, output_len, overhead) for p, c in batch))
            if s is not None]
    if not specs:
        raise DatasetError(f"{path}: no conversation passes the ShareGPT length filter")
    specs = specs[:num_prompts]
    return [specs[i % len(specs)] for i in range(num_prompts)]


def read_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first human turn, first gpt turn after it) of each conversation that has both."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(f'{path}: expected a JSON list of {{"conversations": [...]}}')
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        turns = [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]
        human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if human is None:
            continue
        gpt = next((t for t in turns[human + 1:] if t.get("from") == "gpt"), None)
        if gpt is not None:
            pairs.append((turns[human]["value"], gpt["value"]))
    if not pairs:
        raise DatasetError(f"{path}: no conversation with a human turn and a gpt answer")
    return pairs


async def _sharegpt_spec(
    counter: TokenCounter, prompt: str, answer: str, output_len: int | None, overhead: int
) -> PromptSpec | None:
    prompt_len = await counter.count(prompt)
    if output_len is None:
        new_output_len = await counter.count(answer) - overhead
        if new_output_len < SHAREGPT_MIN_LEN:
            return None
    else:
        new_output_len = output_len
    if (prompt_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT_LEN
            or prompt_len + new_output_len > SHAREGPT_MAX_TOTAL_LEN):
        return None
    return PromptSpec(prompt=prompt, output_len=new_output_len, target_input_len=prompt_len)
