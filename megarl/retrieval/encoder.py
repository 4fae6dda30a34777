"""Text embeddings for dense retrieval with E5 conventions: `E5Encoder(path).encode_queries(texts)`.

E5 (intfloat/e5-base-v2, Search-R1's dense retriever) was trained with "query: " and
"passage: " prefixes, mean pooling over the attention mask and L2-normalised vectors, so the
inner product of two embeddings is their cosine similarity. Any Hugging Face encoder in a
local directory works; torch and transformers are imported only when an encoder is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "


class E5Encoder:
    """A Hugging Face encoder (model + tokenizer) loaded from a local directory.

    max_length: tokens kept per text (longer texts are truncated).
    batch_size: texts per forward pass.
    device: "cpu", "cuda", ...; None picks cuda when available.
    fp16: run the model in half precision (GPU only).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_length: int = 256,
        batch_size: int = 64,
        device: str | None = None,
        fp16: bool = False,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"encoder {path}: no config.json there; pass the local directory of a Hugging Face "
                "encoder (e.g. a download of intfloat/e5-base-v2)"
            )
        self.path = path
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval().to(self.device)
        if fp16:
            self.model = self.model.half()
        self.dim = int(self.model.config.hidden_size)

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode([QUERY_PREFIX + t for t in texts])

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode([PASSAGE_PREFIX + t for t in texts])

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 array [len(texts), dim] of unit vectors (texts already carry their prefix)."""
        import torch

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = list(texts[start : start + self.batch_size])
                inputs = self.tokenizer(
                    batch, max_length=self.max_length, padding=True, truncation=True, return_tensors="pt"
                ).to(self.device)
                hidden = self.model(**inputs).last_hidden_state
                out[start : start + len(batch)] = mean_pool_normalize(hidden, inputs["attention_mask"]).cpu().numpy()
        return out


def mean_pool_normalize(hidden, attention_mask):
    """Average of the token vectors where attention_mask is 1, scaled to unit L2 norm.

    hidden [batch, seq, dim], attention_mask [batch, seq] → float32 [batch, dim]. Padding
    positions must not count, or the same text would embed differently in different batches.
    """
    import torch

    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    mean = summed / mask.sum(dim=1).clamp(min=1.0)
    return torch.nn.functional.normalize(mean, p=2, dim=-1)
