"""A sentence-transformers model directory run by gemel's own BERT: texts -> unit vectors.

Does what sentence-transformers does for all-MiniLM-L6-v2: tokenise with the directory's
tokenizer.json (truncating to ``max_seq_length``), encode, mean-pool over real tokens,
L2-normalise.
"""

from __future__ import annotations

import json
import os
import threading

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gemel.embeddings.bert import BertConfig, BertEncoder


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class SentenceEncoder:
    def __init__(self, path: str, num_threads: int | None = None, batch_size: int = 32):
        self.path = path
        cfg = BertConfig.from_dict(_read_json(os.path.join(path, "config.json")))
        st_cfg = _read_json(os.path.join(path, "sentence_bert_config.json"))
        pooling = _read_json(os.path.join(path, "1_Pooling", "config.json"))
        if pooling and not pooling.get("pooling_mode_mean_tokens", True):
            raise ValueError(f"{path}: only mean pooling is supported")
        modules = _read_json(os.path.join(path, "modules.json")) or []
        self.normalize = not modules or any(m.get("type", "").endswith("Normalize") for m in modules)
        self.max_seq_length = min(int(st_cfg.get("max_seq_length", cfg.max_position_embeddings)), cfg.max_position_embeddings)
        self.dimensions = cfg.hidden_size
        self.batch_size = batch_size
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_seq_length)
        pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        self.tokenizer.enable_padding(pad_id=pad_id, pad_token="[PAD]")  # to the longest in the batch
        self.model = BertEncoder(cfg).eval()
        self.model.load_hf_state_dict(load_file(os.path.join(path, "model.safetensors")))
        self.num_threads = num_threads
        self._lock = threading.Lock()  # one batch at a time; torch already uses every thread it has

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text is encoded with (special tokens included, after truncation)."""
        return [sum(e.attention_mask) for e in self.tokenizer.encode_batch(texts)]

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dimensions] float32 embeddings, unit length when the model normalises."""
        with self._lock:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            out = []
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer.encode_batch(texts[start : start + self.batch_size])
                ids = torch.tensor([e.ids for e in enc])
                mask = torch.tensor([e.attention_mask for e in enc])
                types = torch.tensor([e.type_ids for e in enc])
                hidden = self.model(ids, mask, types)
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                out.append(F.normalize(pooled, p=2, dim=1) if self.normalize else pooled)
            return torch.cat(out) if out else torch.empty(0, self.dimensions)
