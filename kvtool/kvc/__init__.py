"""The ``.kvc`` saved-cache format: header, schema and checksums (``format``, no torch), the atomic writer
(``write``), loading tensors into a cache (``load``) and the recall archive beside a cache (``archive``).

Layered between ``runtime`` (above: sessions, settings) and ``policies``/``core`` (below): it knows caches
and archives, never a session. The format itself is documented in docs/kvc-format.md.
"""
