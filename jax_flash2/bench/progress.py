"""A dependency-free progress bar on stderr (tqdm is used when installed)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
  """`update(label)` after each step; `close()` at the end."""

  def __init__(self, total: int, desc: str = "bench", stream: TextIO | None = None, enabled: bool = True):
    self.total = max(total, 1)
    self.done = 0
    self.desc = desc
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self.start = time.perf_counter()
    self._tqdm = None
    if enabled:
      try:
        from tqdm import tqdm  # optional

        self._tqdm = tqdm(total=total, desc=desc, file=self.stream, leave=True, dynamic_ncols=True)
      except ImportError:
        pass
    self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

  def update(self, label: str = "") -> None:
    self.done += 1
    if not self.enabled:
      return
    if self._tqdm is not None:
      self._tqdm.set_postfix_str(label, refresh=False)
      self._tqdm.update(1)
      return
    width = 30
    filled = int(width * self.done / self.total)
    bar = "#" * filled + "." * (width - filled)
    elapsed = time.perf_counter() - self.start
    line = f"{self.desc} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label}"
    if self._tty:
      self.stream.write("\r" + line[:150].ljust(150))
      if self.done >= self.total:
        self.stream.write("\n")
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self._tqdm is not None:
      self._tqdm.close()
    elif self.enabled and self._tty and self.done < self.total:
      self.stream.write("\n")
      self.stream.flush()
