"""Prompt datasets: verl / Search-R1 rows -> prompt token ids, and their resumable order.

A row has `data_source`, the prompt (chat messages [{"role", "content"}] or a string) under
`prompt_key`, `reward_model: {"ground_truth": ...}` and optional `extra_info`; parquet or
jsonl. Prompts are rendered with the tokenizer's chat template when asked and available
(else the message contents are joined), and prompts longer than max_prompt_length tokens
are dropped and counted. `PromptOrder` (which prompts each step trains on) yields the same
order after a restart from its `state_dict()`. Main entry points: `load_prompts`, `PromptOrder`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and row."""


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
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        return rows
    raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .parquet or .jsonl")


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


def load_prompts(files: list[str], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int,
                 apply_chat_template: bool = True) -> tuple[list[PromptRecord], int]:
    """(records, number of prompts dropped for being longer than max_prompt_length)."""
    records, dropped = [], 0
    for path in files:
        for number, row in enumerate(read_rows(path), 1):
            where = f"{path} row {number}"
            for key in (prompt_key, "data_source", "reward_model"):
                if key not in row:
                    raise DataError(f"{where}: missing column {key!r} (have {sorted(row)})")
            reward = row["reward_model"]
            if not isinstance(reward, dict) or "ground_truth" not in reward:
                raise DataError(f"{where}: reward_model must be a mapping with 'ground_truth'")
            prompt = row[prompt_key]
            if not prompt or not (isinstance(prompt, str) or all(isinstance(m, dict) and "content" in m for m in prompt)):
                raise DataError(f"{where}: {prompt_key} must be a non-empty string or a list of chat messages")
            ids = render_prompt(tokenizer, prompt, apply_chat_template)
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
