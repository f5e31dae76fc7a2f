"""Small helpers shared across the library: sizes, devices, seeds and atomic file writes."""

from __future__ import annotations

import contextlib
import errno as _errno
import hashlib
import io
import json
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import h5py
import numpy as np
import torch

from poodle.errors import ConfigError, WriteError, mark

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``1048576`` into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot read memory size {text!r}: use a number with MiB or GiB, e.g. 4GiB", param="text", value=text
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"memory size must be positive, got {text!r}", param="text", value=text)
    return n


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The one place a device name is read: ``auto`` -> CUDA when available, else CPU; ``cpu``,
    ``cuda`` and ``cuda:N`` (N an existing device) as given.

    Anything else (``meta``, ``mps``, ``cuda:-1``, ``cuda:7`` on a one-GPU machine, a typo) is a
    :class:`ConfigError` naming the value: the solvers and the backbones run on CPU or CUDA only.
    """
    if isinstance(name, torch.device):
        dev, text = name, str(name)
    else:
        text = str(name).strip()
        if text == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        m = re.fullmatch(r"(cpu|cuda)(?::(-?\d+))?", text)
        if m is None:
            raise ConfigError(
                f"{mark('device')} {text!r}: use auto, cpu, cuda or cuda:N (N >= 0)",
                param="device",
                value=name,
            )
        if m.group(2) is not None and int(m.group(2)) < 0:
            raise ConfigError(
                f"{mark('device')} {text!r}: the CUDA device index must be >= 0",
                param="device",
                value=name,
            )
        if m.group(1) == "cpu" and m.group(2) is not None:
            raise ConfigError(
                f"{mark('device')} {text!r}: the CPU takes no index; use cpu",
                param="device",
                value=name,
            )
        dev = torch.device(text)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{mark('device')} {text!r}: use auto, cpu, cuda or cuda:N (N >= 0)",
            param="device",
            value=name,
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{mark('device')} {text}: CUDA is not available on this machine (use cpu or auto)",
                param="device",
                value=name,
            )
        n = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < n:
            raise ConfigError(
                f"{mark('device')} {text}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}",
                param="device",
                value=name,
            )
    return dev


SEED_MAX = 2**63 - 1


def check_seed(seed: object, what: str = "seed") -> int:
    """``seed`` as an int in ``0 .. 2**63 - 1`` (what torch, numpy and HDF5 attributes all hold);
    ConfigError naming the value otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(
            f"{mark(what) if what.isidentifier() else what} must be an integer, got {seed!r}",
            params=(what,) if what.isidentifier() else (),
            param=what,
            value=seed,
        )
    if not 0 <= int(seed) <= SEED_MAX:
        raise ConfigError(
            f"{mark(what) if what.isidentifier() else what} {seed} does not fit 63 bits: use 0 .. {SEED_MAX}",
            params=(what,) if what.isidentifier() else (),
            param=what,
            value=seed,
        )
    return int(seed)


def check_writable_dir(path: str | os.PathLike, what: str = "output", param: str | None = None) -> None:
    """ConfigError unless a file can be created next to ``path`` (in its directory or, when that is
    missing, the nearest existing ancestor, where it would be made):
    checked before the work starts, so an unwritable place fails in a second, not after the run. A
    real probe file is created and removed, since permission bits do not tell (root, read-only mounts).
    ``param``: the library parameter that named ``path`` (the error says it, for the front end to map)."""
    params = () if param is None else (param,)
    p = resolve_path(path, param, what)
    what = mark(param) if param else what
    parent = p.parent
    probe = parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{what} {path}: {probe} is a file, not a directory", params=params, param=param, value=path)
    # probe the nearest existing folder (the missing ones are made by whoever writes): no side effect
    try:
        fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(
            f"{what} {path}: cannot write in directory {probe} ({e.strerror or e})",
            params=params,
            param=param,
            value=path,
        ) from None


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of integer ``parts`` (e.g. ``(seed, episode)``).

    Hashing rather than ``seed * K + i`` keeps neighbouring (seed, i) pairs statistically unrelated.
    """
    h = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def derive_seeds(first: int, indices: Iterable[int], *rest: int) -> list[int]:
    """``[derive_seed(first, i, *rest) for i in indices]``, faster (the common bytes are made once)."""
    head, tail = f"{int(first)},".encode(), "".join(f",{int(r)}" for r in rest).encode()
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    return [from_bytes(blake2b(b"%b%d%b" % (head, i, tail), digest_size=8).digest(), "little") >> 1 for i in indices]


def generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded with :func:`derive_seed` of ``parts``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def content_hash(obj: Any, *, separators: tuple[str, str] = (",", ":")) -> str:
    """Hex sha256 of ``obj`` as canonical JSON (sorted keys; values JSON cannot hold written with
    ``str``): the one hash of settings, identities and names. ``separators`` are json's; the
    compact default is what results keys are made of."""
    text = json.dumps(obj, sort_keys=True, separators=separators, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Paths and writes


def _unresolvable(path: Path, e: OSError) -> str:
    """Why ``path`` cannot be resolved (``e`` from ``os.stat``), naming the component at fault."""
    parts = path.parts
    for i in range(1, len(parts) + 1):  # the first prefix that fails in the same way is the culprit
        prefix = Path(*parts[:i])
        try:
            os.stat(prefix)
        except OSError as inner:
            if inner.errno == e.errno:
                if e.errno == _errno.ELOOP:
                    return "a symbolic link loop" if i == len(parts) else f"{prefix} is a symbolic link loop"
                if e.errno == _errno.ENOTDIR:
                    return f"{Path(*parts[: i - 1])} is a file, not a directory"
                if e.errno == _errno.EACCES:
                    return f"permission denied to look into {Path(*parts[: i - 1]) if i > 1 else prefix}"
                break
    return e.strerror or str(e)


def resolve_path(path: str | os.PathLike, param: str | None = None, what: str = "path") -> Path:
    """``path`` as given, once it is known to resolve: every name on the way exists or is simply
    missing (then nothing is there yet, and the caller decides what that means). A symbolic link
    loop, a file used as a folder, a folder that cannot be searched or a name that is too long is a
    ConfigError naming ``param`` (or ``what``), the path and why: the one check of path arguments,
    so that none of them reaches ``Path.exists`` (which says False for a loop) or ``Path.resolve``
    (which raises RuntimeError for one)."""
    p = Path(path)
    try:
        os.stat(p)
    except FileNotFoundError:
        return p
    except OSError as e:
        raise ConfigError(
            f"{mark(param) if param else what} {path}: cannot be resolved: {_unresolvable(p, e)}",
            params=() if param is None else (param,),
            param=param,
            value=path,
        ) from None
    return p


# errnos of a write that could not be completed (disk full, quota, size limit, read-only, I/O)
_WRITE_ERRNOS = {
    _errno.EFBIG: "beyond the file-size limit of this process, ulimit -f, or of the file system",
    _errno.ENOSPC: "the disk is full",
    _errno.EDQUOT: "the disk quota is used up",
    _errno.EROFS: "the file system is read-only",
    _errno.EIO: "an input/output error of the device",
    _errno.EACCES: "permission denied",
    _errno.EPERM: "operation not permitted",
}


def check_size_limit(size: int) -> None:
    """OSError(EFBIG) when this process may not make a file of ``size`` bytes (``RLIMIT_FSIZE``,
    ``ulimit -f``): said before writing, since writing past it sends SIGXFSZ, which kills a process
    that does not ignore it (Python does) halfway through the write."""
    try:
        import resource  # POSIX only: imported here so that the module loads elsewhere
    except ImportError:  # pragma: no cover
        return
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size > limit:
        raise OSError(_errno.EFBIG, os.strerror(_errno.EFBIG))


def write_errno(e: BaseException) -> int | None:
    """The errno of a failed write in ``e``: an ``OSError``'s own, or the one HDF5 and torch write
    into their messages (``errno = 28``); None when ``e`` is no failed write."""
    code = getattr(e, "errno", None)
    if code is None and isinstance(e, (OSError, RuntimeError)):
        m = re.search(r"errno = (\d+)", str(e))
        code = int(m.group(1)) if m else None
    return code if code in _WRITE_ERRNOS else None


def write_error(path: str | os.PathLike, e: BaseException, outcome: str) -> WriteError:
    """The :class:`WriteError` of a failed write of ``path`` (``e`` holds the cause; see
    :func:`write_errno`): ``cannot write PATH: CAUSE (WHY); OUTCOME``."""
    code = write_errno(e)
    cause = os.strerror(code) if code is not None else (str(e).splitlines() or [type(e).__name__])[0]
    why = f" ({_WRITE_ERRNOS[code]})" if code is not None else ""
    return WriteError(f"cannot write {path}: {cause}{why}; {outcome}", path=str(path), errno=code)


class FailSafeFile(io.FileIO):
    """A file for h5py's file-object driver (``h5py.File(FailSafeFile(path, "w+"), "w")``) that never
    reports a failed write to HDF5: the first failure is kept in :attr:`failed` and every later
    write is dropped. HDF5 does not survive a failed write (its library may crash then, or when the
    process exits), so the file on disk simply stops where the failure struck, as if the process had
    been killed there, while HDF5 carries on; whoever writes checks :attr:`failed` once the h5py
    call returns (:meth:`check`) and raises the :class:`WriteError`."""

    failed: OSError | None = None

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        if self.failed is None:
            try:
                check_size_limit(self.tell() + n)
                while view:
                    view = view[super().write(view) or 0 :]
            except OSError as e:
                self.failed = e
        return n

    def truncate(self, size: int | None = None) -> int:
        if self.failed is None:
            try:
                return super().truncate(size)
            except OSError as e:
                self.failed = e
        return self.tell() if size is None else size

    def check(self, path: str | os.PathLike, outcome: str) -> None:
        """Raise the :class:`WriteError` of ``path`` if a write failed."""
        if self.failed is not None:
            raise write_error(path, self.failed, outcome) from self.failed


def _is_write_of(e: BaseException, tmp: Path) -> bool:
    """Whether ``e`` is a failed write of ``tmp`` (not, say, a failed read of another file)."""
    if write_errno(e) is None:
        return False
    names = [str(n) for n in (getattr(e, "filename", None), getattr(e, "filename2", None)) if n is not None]
    return not names or str(tmp) in names


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``path`` only if the block completes.

    An interrupted write therefore never leaves a file under the final name, and a failed one
    (disk full, file-size limit) leaves the file that was there as it was: the temporary is removed
    and a :class:`WriteError` names ``path`` and the cause. The temporary name holds the process
    id and a random part, so concurrent writers never share one. When ``path`` is a symbolic
    link, the file it points to is replaced (the link stays); a path that cannot be resolved is a
    ConfigError (:func:`resolve_path`).
    """
    shown = Path(path)
    path = Path(os.path.realpath(resolve_path(shown, what="output")))
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{shown}: cannot create its directory ({e.strerror})", param="path", value=path) from None
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, (OSError, RuntimeError)) and _is_write_of(e, tmp):
            outcome = f"{shown} is as it was" if existed else "nothing was written under that name"
            raise write_error(shown, e, outcome) from e
        raise


def atomic_write(path: str | os.PathLike, data: bytes | bytearray | memoryview | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` under a temporary name, flushed to the disk, then
    renamed (:func:`atomic_path`): all of it or, with a :class:`WriteError`, nothing."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            check_size_limit(memoryview(raw).nbytes)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# what each kind is called in messages
KIND_NAMES = {
    "cache": "a poodle feature cache",
    "partial": "a split being extracted (poodle staging file)",
    "episodes": "a poodle episode file",
    "results": "a poodle results file",
    "hdf5": "an HDF5 file",
    "json": "a JSON file",
    "empty": "an empty file",
    "other": "a file of unknown content",
    "directory": "a directory",
}


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing file holds, judged by content: ``cache``, ``partial``, ``episodes``,
    ``results`` (``poodle solve --json``), ``grid-results``, ``hdf5``, ``json``, ``empty``, ``other``,
    ``directory``; ``None`` when nothing is there."""
    p = Path(path)
    if not p.exists():
        return None
    if p.is_dir():
        return "directory"
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if not head:
                return "empty"
            if head == _HDF5_SIGNATURE:
                try:
                    with h5py.File(p, "r") as h:
                        fmt = h.attrs.get("format")
                except OSError:
                    return "hdf5"
                fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
                return {
                    "poodle-features": "cache",
                    "poodle-features-partial": "partial",
                    "poodle-episodes": "episodes",
                }.get(str(fmt), "hdf5")
            f.seek(0)
            first = f.readline(1 << 20).strip()
    except OSError:
        return "other"
    if first.startswith(b"{"):
        try:
            obj = json.loads(first)
        except ValueError:  # a pretty-printed JSON document: parse it whole
            try:
                obj = json.loads(p.read_bytes())
            except ValueError:
                return "other"
        if isinstance(obj, dict) and (
            obj.get("command") == "solve" or obj.get("format") in ("poodle-results", "poodle-grid-results")
        ):
            return "results"
        return "json"
    return "other"


def check_output(
    path: str | os.PathLike,
    kind: str,
    *,
    inputs: Iterable[str | os.PathLike | None] = (),
    what: str = "output",
    param: str | None = None,
) -> None:
    """ConfigError unless ``path`` may receive a file of ``kind``: never one of ``inputs``, never a
    file of another kind (judged by content; an empty file may be replaced), in a writable directory.
    A file of the same kind is replaced later, atomically, by whoever writes it. ``param``: the
    library parameter that named ``path`` (the errors say it, for the front end to map)."""
    params = () if param is None else (param,)
    p = resolve_path(path, param, what)
    what = mark(param) if param else what
    for inp in inputs:
        if inp is not None and Path(inp).exists() and p.exists() and os.path.samefile(p, inp):
            raise ConfigError(
                f"{what} {path} is the input file {inp}; choose another name", params=params, param=param, value=path
            )
    found = file_kind(p)
    if found is not None and found not in (kind, "empty"):
        raise ConfigError(
            f"{what} {path} already exists and is {KIND_NAMES.get(found, found)}, not "
            f"{KIND_NAMES.get(kind, kind)}: refusing to overwrite it (choose another name or remove it)",
            params=params,
            param=param,
            value=path,
        )
    check_writable_dir(p, what, param)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in agreement: ``1 class``, ``3 classes``, ``0 images`` (``plural``: the
    plural when adding ``s``/``es`` is wrong)."""
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {plural}"
