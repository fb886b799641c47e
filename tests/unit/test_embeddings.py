"""gemel's BERT encoder against transformers' BertModel on the same all-MiniLM-L6-v2 weights,
with sentence-transformers' pooling (mean over real tokens, L2 normalise)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir() -> str:
    from gemel.loader.sources import ModelNotFound, resolve

    try:
        return resolve("all-minilm-l6-v2")
    except ModelNotFound as e:
        pytest.skip(str(e))


def test_matches_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    from gemel.embeddings import SentenceEncoder

    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 40, "café ünïcode 日本語", "a"]
    enc = SentenceEncoder(model_dir)
    ours = enc.embed(texts)

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref_model = transformers.BertModel.from_pretrained(model_dir).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=enc.max_seq_length, return_tensors="pt")
    with torch.no_grad():
        hidden = ref_model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)

    assert ours.shape == (4, 384)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert enc.count_tokens(texts) == batch["attention_mask"].sum(1).tolist()
    assert enc.count_tokens(texts)[1] == enc.max_seq_length == 256  # truncated like sentence-transformers


def test_batches_agree_with_singles(model_dir):
    from gemel.embeddings import SentenceEncoder

    enc = SentenceEncoder(model_dir, batch_size=2)
    texts = ["short", "a somewhat longer sentence to force padding", "third one"]
    together = enc.embed(texts)
    alone = torch.cat([enc.embed([t]) for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)
