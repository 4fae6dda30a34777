"""Prompt datasets: verl / Search-R1 rows -> prompt token ids, and their resumable order.

A row has `data_source`, the prompt (chat messages [{"role", "content"}] or a string) under
`prompt_key`, `reward_model: {"ground_truth": ...}` and optional `extra_info`; parquet or
jsonl. Prompts are rendered with the tokenizer's chat template when asked and available
(else the message contents are joined), and prompts longer than max_prompt_length tokens
are dropped and counted; a line that is not UTF-8 or not a JSON object, and an empty prompt,
stop the load with the file and line (row). `PromptOrder` (which prompts each step trains
on) yields the same order after a restart from its `state_dict()`. Main entry points:
`load_prompts`, `PromptOrder`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and row."""


# parquet key-value metadata of a data file: the retrieval corpus its questions are answered
# from, as the index manifest records it (megarl.retrieval.corpus.corpus_info; written by
# megarl.data.prepare.write_rows, compared with the index at the start of a run)
CORPUS_METADATA = b"megarl.corpus"


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    index: int = 0  # row position in the loaded set (stable across restarts)


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid: not a parquet file, or a damaged one
            raise DataError(f"{path}: cannot be read as parquet ({e})") from None
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, "rb") as fh:  # decoded line by line, so that an error can name its line
            for number, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark is harmless
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                                    f"{e.start + 1} of the line); re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))  # so that a column past the end names this line
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: a {type(row).__name__}, not a JSON object (one row per line)")
                rows.append(row)
        return rows
    raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .parquet or .jsonl")


def data_corpus(path: str | Path) -> dict | None:
    """The corpus a parquet data file was prepared against (CORPUS_METADATA), or None: not
    recorded, or a jsonl file, which has no place to record it."""
    path = Path(path)
    if path.suffix != ".parquet" or not path.is_file():
        return None
    metadata = pq.read_schema(path).metadata or {}
    try:
        record = json.loads(metadata[CORPUS_METADATA])
    except (KeyError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def render_prompt(tokenizer, prompt: Any, apply_chat_template: bool) -> list[int]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer.encode(text, add_special_tokens=False)


def _checked_row(row: dict, where: str, prompt_key: str) -> dict:
    """The row's reward_model, once the columns the run reads are there and well formed."""
    for key in (prompt_key, "data_source", "reward_model"):
        if key not in row:
            raise DataError(f"{where}: missing column {key!r} (have {sorted(row)})")
    reward = row["reward_model"]
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        raise DataError(f"{where}: reward_model must be a mapping with 'ground_truth'")
    _check_prompt(row[prompt_key], f"{where}: {prompt_key}")
    return reward


def data_source_counts(files: list[str], prompt_key: str = "prompt") -> Counter:
    """The rows of each data_source in `files`, every row checked as load_prompts checks it but
    for its length in tokens (no tokenizer): what `megarl train --dry-run` reads of the data."""
    counts: Counter = Counter()
    for path in files:
        for number, row in enumerate(read_rows(path), 1):
            _checked_row(row, f"{path} row {number}", prompt_key)
            counts[str(row["data_source"])] += 1
    return counts


def load_prompts(files: list[str], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int,
                 apply_chat_template: bool = True) -> tuple[list[PromptRecord], int]:
    """(records, number of prompts dropped for being longer than max_prompt_length)."""
    records, dropped = [], 0
    for path in files:
        for number, row in enumerate(read_rows(path), 1):
            where = f"{path} row {number}"
            reward = _checked_row(row, where, prompt_key)
            prompt = row[prompt_key]
            ids = render_prompt(tokenizer, prompt, apply_chat_template)
            if not ids:
                raise DataError(f"{where}: {prompt_key} {prompt!r} is zero tokens once rendered; give the prompt text")
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            records.append(PromptRecord(ids, str(row["data_source"]), reward["ground_truth"],
                                        dict(row.get("extra_info") or {}), len(records)))
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_length=%d tokens", dropped, max_prompt_length)
    if not records:
        raise DataError(f"no usable prompts in {files} (dropped {dropped} as too long)")
    return records, dropped


def _check_prompt(prompt: Any, where: str) -> None:
    """A prompt is a string or chat messages [{role, content: str}] with some text: an empty
    one would train the policy on answering nothing."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where} is empty ({prompt!r}); give the prompt text or drop the row")
        return
    if not isinstance(prompt, list | tuple) or not prompt:
        raise DataError(f"{where} must be a non-empty string or a list of chat messages [{{role, content}}], "
                        f"got {prompt!r}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {i} must be {{role, content}} with a string content, got {message!r}")
    if not any(m["content"].strip() for m in prompt):
        raise DataError(f"{where}: every message's content is empty; give the prompt text or drop the row")


class PromptOrder:
    """Epochs of (optionally shuffled) indices, seeded per epoch; resumable from its state."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, count: int) -> list[int]:
        """The next `count` indices, crossing into the next epoch when one runs out."""
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            need = count - len(out)
            out += order[self.position:self.position + need].tolist()
            self.position += need
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise DataError(f"the checkpoint's data order was for {state['size']} prompts with seed {state['seed']}, "
                            f"this run has {self.size} prompts with seed {self.seed}; resume with the same data and seed")
        self.epoch, self.position = state["epoch"], state["position"]
