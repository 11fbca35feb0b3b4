"""Parallelisms composed with FSDP: tensor parallel parameters and the layer-wise
distributed optimizer. Each reaches the core through the parameters and process groups
a unit is given (and `core.extension_points`); imports only the core."""
