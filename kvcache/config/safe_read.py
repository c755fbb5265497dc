"""Read a config file without letting a hostile path turn against the host.

Only regular files are read: a FIFO would block forever and ``/dev/zero`` never ends, so the
path is checked with ``stat`` before it is opened, opened non-blocking, checked again on the
open descriptor (the path may have been swapped in between), and read up to
:data:`MAX_FILE_BYTES` + 1 bytes. Failures raise :class:`InputRefused` with a message that
says why and what to do.
"""

from __future__ import annotations

import os
import stat

__all__ = ["MAX_FILE_BYTES", "InputRefused", "one_line", "printable", "read_config_text", "too_big"]

#: Largest config accepted, in bytes (the shipped ones are under 1 KiB).
MAX_FILE_BYTES = 64 * 1024
#: Longest excerpt of a library's message quoted in ours.
_MAX_DETAIL = 160


class InputRefused(Exception):
    """The file or its YAML is refused before validation. ``line`` is 1-based (None: unknown)."""

    def __init__(self, message: str, line: int | None = None):
        self.message = message
        self.line = line
        super().__init__(message)


def printable(text: str) -> str:
    """``text`` as it can be printed: with odd characters (a newline, an undecodable byte of a
    file name) it is shown escaped, as ``ascii`` writes it."""
    try:
        text.encode("utf-8")
    except UnicodeError:
        return ascii(text)
    return text if text.isprintable() else ascii(text)


def one_line(text: object) -> str:
    """A library's message (or an exception) on one line, cut to a readable length."""
    try:
        flat = " ".join(str(text).split())
    except Exception:  # a message that cannot be made must not hide the error
        flat = f"<{type(text).__name__}>"
    return flat if len(flat) <= _MAX_DETAIL else flat[: _MAX_DETAIL - 3] + "..."


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of the config file at ``path``. Raises InputRefused naming why it cannot be used."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise InputRefused("no such file; check the path") from None
    except ValueError as err:  # e.g. an embedded NUL byte
        raise InputRefused(f"is not a usable path ({one_line(err)}); check the path") from None
    except OSError as err:
        raise InputRefused(_unreadable(err)) from None
    _require_regular(info)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise InputRefused(_unreadable(err)) from None
    try:
        _require_regular(os.fstat(fd))  # the path may have been swapped since stat
        raw = _read_at_most(fd, MAX_FILE_BYTES + 1)
    except OSError as err:
        raise InputRefused(f"cannot be read: {one_line(err.strerror or err)}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise InputRefused(f"grew past {MAX_FILE_BYTES // 1024} KiB while it was read; a config is at most that")
    return _decode(raw)


def _unreadable(err: OSError) -> str:
    return f"cannot be read: {one_line(err.strerror or err)}; check the path and its permissions"


def _require_regular(info: os.stat_result) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise InputRefused("is a directory; give a .yaml file")
    if not stat.S_ISREG(mode):
        kinds = [
            (stat.S_ISFIFO, "a FIFO"),
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"),
        ]
        kind = next((f"{name}, not" for test, name in kinds if test(mode)), "not")
        raise InputRefused(f"is {kind} a regular file; give a .yaml file")
    if info.st_size > MAX_FILE_BYTES:
        raise InputRefused(too_big(info.st_size))


def too_big(size: int) -> str:
    return (
        f"is {size:,} bytes; a config is at most {MAX_FILE_BYTES // 1024} KiB "
        f"(the shipped ones are under 1 KiB); check the path"
    )


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise InputRefused(
            f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at line {line}); save it as UTF-8", line
        ) from None
