"""modifiers policies (see kvtool/policies/__init__.py)."""
