"""Speculative-decoding engine: acceptance rules, model pairs, decoding loops, events, benchmark.

Pure PyTorch + transformers; never imports the UI.
"""

from engine.acceptance import METHODS, VerifyResult, induced_distribution, verify
from engine.config import DECODE_METHODS, SpecConfig
from engine.decoding import generate
from engine.sampling import SamplingParams, logits_to_probs

__all__ = [
    "DECODE_METHODS", "METHODS", "SamplingParams", "SpecConfig", "VerifyResult",
    "generate", "induced_distribution", "logits_to_probs", "verify",
]
