"""Reading checkpoints straight into their final place (reader, page cache, tensor sources)."""
