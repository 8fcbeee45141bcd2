"""Copy a run that may still be folding itself at rest."""

from __future__ import annotations

import shutil
from pathlib import Path


def copy_run(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst``, passing over the files and directories that vanish meanwhile: after its last
    close a run's fold deletes what it merged away (``at_rest.settle_later``), which no query reads."""
    def copy(a: str, b: str) -> None:
        try:
            shutil.copy2(a, b)
        except FileNotFoundError:
            pass

    def listed(d: str, names: list[str]) -> list[str]:
        return [n for n in names if not (Path(d) / n).exists()]

    try:
        return Path(shutil.copytree(src, dst, copy_function=copy, ignore=listed))
    except shutil.Error as exc:  # a directory that vanished between its listing and its copy
        if all("No such file or directory" in str(e[-1]) for e in exc.args[0]):
            return Path(dst)
        raise
