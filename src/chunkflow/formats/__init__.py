"""Transformer files in the formats people download (one file beside a diffusers folder): each format a module here
that detects, checks and loads its file (fp8_scaled.py)."""
