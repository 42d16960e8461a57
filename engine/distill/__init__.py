"""Distilling the default pair's draft from its target: `python -m engine.distill --help`."""
