"""What users call around training rather than inside it: gradient clipping, the
Megatron-style config entry, memory estimates, meta-device materialization, the
collective trace and the checkpoint memory reader. May import every layer below."""
