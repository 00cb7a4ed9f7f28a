"""The engine: bounded cache, attention function, positions, block loop. Knows no policy by name,
no terminal, no file format."""
