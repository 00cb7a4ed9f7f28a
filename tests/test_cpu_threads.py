"""A CPU's explicit attention splits its per-head matmuls over the threads; the products stay those of one bmm.

3 KV heads on 2 threads: each head's rows are cut in two against copies of its K/V (``attention._head_bmm``).
The oracles are ``torch.bmm`` itself and the model's own dense forward, on a model whose KV heads do not divide
among the threads (CI's 2 cores would otherwise never take the split).
"""

from __future__ import annotations

import pytest
import torch

from kvtool.config import MIN_PART_ROWS, batch_split
from kvtool.core.attention import _head_bmm
from tests.helpers import VOCAB, dense_logits, make_engine, stream_logits, tiny_llama


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_split_only_where_heads_and_rows_allow():
    assert batch_split(3, 2, 2 * MIN_PART_ROWS) == 2
    assert batch_split(4, 2, 4096) == 1  # the heads divide among the threads
    assert batch_split(3, 2, 3) == 1  # a decoded token: the copy would cost more than it saves
    assert batch_split(3, 2, 2 * MIN_PART_ROWS + 1) == 1  # rows that do not cut evenly
    assert batch_split(3, 16, 4096) == 1  # more than 4 parts


def test_split_products_equal_one_bmm(two_threads):
    model = tiny_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    cache = make_engine(model, "h2o", 512, block_size=256).new_cache()
    assert cache.batch_split(3, 3 * 256) == 2
    g = torch.Generator().manual_seed(0)
    a, k, v = (
        torch.randn(3, 768, 16, generator=g),
        torch.randn(3, 300, 16, generator=g),
        torch.randn(3, 300, 16, generator=g),
    )
    scores = _head_bmm(cache, a, k, torch.empty(3, 768, 300), "keys", transposed=True)
    torch.testing.assert_close(scores, torch.bmm(a, k.transpose(1, 2)), rtol=1e-6, atol=1e-5)
    probs = torch.softmax(scores, -1)
    torch.testing.assert_close(_head_bmm(cache, probs, v, None, "values"), torch.bmm(probs, v), rtol=1e-6, atol=1e-6)


def test_a_split_read_equals_the_dense_forward(two_threads):
    """Nothing evicted (budget over the document), h2o's explicit probabilities at block 256: dense logits."""
    model = tiny_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    ids = torch.randint(0, VOCAB, (600,), generator=torch.Generator().manual_seed(1))
    got, cache = stream_logits(make_engine(model, "h2o", 1024, block_size=256), ids)
    assert cache.batch_split(3, 2 * 256) == 2 and cache.counters.evicted_tokens == 0
    torch.testing.assert_close(got, dense_logits(model, ids), rtol=1e-4, atol=1e-4)
