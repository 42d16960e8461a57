"""Model pairs and the one model interface the decoding loops talk to."""

from engine.models.causal_lm import CausalLM, HFCausalLM
from engine.models.registry import PAIRS, ModelPair, load_pair

__all__ = ["CausalLM", "HFCausalLM", "ModelPair", "PAIRS", "load_pair"]
