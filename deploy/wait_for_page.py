"""Wait until a just-started `python app.py` serves its page; exit non-zero if the process dies first.

Used by .ci/run to prove the README's first command serves the playground. The limit is a hang
guard for a broken start, not a speed requirement: a healthy start takes seconds.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request

HANG_GUARD_SECONDS = 600


def main(url: str, pid: int, log_path: str) -> int:
    started = time.monotonic()
    while time.monotonic() - started < HANG_GUARD_SECONDS:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"app.py exited before serving {url}; its output:\n{open(log_path).read()}", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                page = response.read().decode("utf-8", "replace")
            if response.status == 200 and "specplay" in page:
                print(f"served {url} after {time.monotonic() - started:.1f} s; app.py said:")
                print(open(log_path).read().strip())
                return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"app.py did not serve {url} within {HANG_GUARD_SECONDS} s:\n{open(log_path).read()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
