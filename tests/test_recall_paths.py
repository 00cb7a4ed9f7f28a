"""Recall on every path it is the default for: what each path must keep, read or bound, by exact oracles.

Archive scoring reads key bytes only; recall's temporaries are chunked and its query log holds only the
layers and rows it scores with; a question near the model's range is scored in the frame it is fed in;
int4's 16-bit window is read by position; a restore keeps the compact keys' original copy; ``--cite``
keeps the passage recall brought back; H2O builds its protection only when it evicts.
"""

from __future__ import annotations

import torch

from kvtool.core.archive import GroupArchive
from kvtool.core.archive_stores import MemoryStore


class CountingStore:
    """A store that counts the bytes read from it."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.row_bytes, self.where = inner.row_bytes, inner.where
        self.bytes_read = 0

    @property
    def rows(self) -> int:
        return self.inner.rows

    def read(self, index: torch.Tensor) -> torch.Tensor:
        out = self.inner.read(index)
        self.bytes_read += out.numel()
        return out

    def append(self, rows: torch.Tensor) -> None:
        self.inner.append(rows)

    def close(self) -> None:
        self.inner.close()


def _counting_archive(dtype: torch.dtype, h: int = 3, d: int = 16, page: int = 4) -> tuple[GroupArchive, list]:
    made: list[CountingStore] = []

    def factory(row_bytes: int) -> CountingStore:
        made.append(CountingStore(MemoryStore(row_bytes)))
        return made[-1]

    return GroupArchive(h, d, dtype, page, factory), made


def test_scoring_reads_the_key_half_of_the_rows_only():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.int8):
        arch, made = _counting_archive(dtype)
        h, d, n = arch.h, arch.d, 40
        keys, values = torch.randn(h, n, d), torch.randn(h, n, d)
        arch.append(keys, values, torch.arange(n).expand(h, n))
        q = torch.randn(h, 5, d)
        scored = torch.cat([s for _, s in arch.scores(q, torch.arange(arch.pages).expand(h, -1))], dim=2)
        # the oracle: q·k of the keys as archived (exact for a float archive, the dequantized keys for int8)
        archived = arch.read(torch.arange(n).expand(h, n))[0]
        torch.testing.assert_close(scored, q @ archived.float().transpose(1, 2), rtol=0, atol=1e-5)
        kv_read = sum(s.bytes_read for s in made if s not in (arch.index, arch.summaries)) - n * arch.store.row_bytes
        # the ``read`` above took whole rows; scoring took the key half of each archived token's row
        assert kv_read == n * arch.store.row_bytes // 2, dtype
