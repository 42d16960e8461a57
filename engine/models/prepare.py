"""`python -m engine.models.prepare`: do the one-time work of a fresh install now, not at first use.

It converts the embedded GGUF to the safetensors cache and compiles the native CPU kernels, then
says what it found, so that the first `python app.py` starts in seconds and an install that cannot
run the fast path says so at install time.
"""

from __future__ import annotations

import time

from engine.models import cpu_kernels
from engine.models.embedded import embedded_target_dir


def main() -> None:
    start = time.perf_counter()
    target = embedded_target_dir()
    print(f"[prepare] default target: {target} ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    native = cpu_kernels.available()
    print(f"[prepare] native CPU kernels: {'built' if native else 'unavailable (torch fallbacks)'}"
          f" ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
