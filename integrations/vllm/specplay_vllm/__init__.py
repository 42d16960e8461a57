"""specplay's speculative-decoding rules inside vLLM V1 (see integrations/vllm/README.md)."""
