"""llama.cpp on the embedded GGUF (llama-cpp-python, optional): the bar for CPU decoding.

One loader for every caller (the benchmark's `llama.cpp` row, `fast_llama_measure --llama-cpp`), so
both run the same llama.cpp: the native build `deploy/install_llama_cpp.sh` makes for this CPU. On
a CPU with AMX that build's batched GEMM on AMX tiles dies with "Illegal instruction" on the Xeon
of session 40 (a `tilezero` in a prompt pass), while its one-token path is its fastest decode, so
there every evaluation goes one token per micro-batch (`n_ubatch=1`): decoding is untouched, and a
prompt, or a multi-token `eval`, becomes a run of one-token steps. Compare decode speeds there.
"""

from __future__ import annotations

from engine.models.cpu_kernels import cpu_flags
from engine.models.embedded import gguf_path

INSTALL_HINT = ("llama-cpp-python: `bash deploy/install_llama_cpp.sh <python>` builds it once for this CPU "
                "(about 8 minutes on 2 cores) and caches the wheel")


def one_token_batches() -> bool:
    """Whether llama.cpp must evaluate one token per micro-batch here: its AMX GEMM cannot run."""
    return "amx_tile" in cpu_flags()


def load_llama(threads: int):
    """The embedded GGUF in llama.cpp at `threads` threads (SystemExit with the install hint without it)."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise SystemExit(f"the llama.cpp peer needs {INSTALL_HINT}") from err
    batches = {"n_ubatch": 1} if one_token_batches() else {}
    return Llama(model_path=str(gguf_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False,
                 **batches)
