"""Running this folder's build scripts (build.sh, build_node.sh, build_lws.sh), which cache what they
build by their pins."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run_build_script(script: Path) -> Path:
    """Run one of this folder's build scripts; its progress goes to stderr, and its last line on
    stdout is the folder it built."""
    result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {result.returncode}); its progress log is above")
    return Path(result.stdout.strip().splitlines()[-1])
