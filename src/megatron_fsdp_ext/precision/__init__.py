"""Gathering in other formats than the parameter dtype: torchao's FP8 and MXFP8 weights
(fp8.py), registered with the core as its gather transform. Imports only the core."""
