"""Checkpoints and state: full state dicts, the sharded DCP-compatible format (writer,
reader, the verified file layer), safetensors and Hugging Face loading. Built on the
core's state-dict protocol; imports only the core."""
