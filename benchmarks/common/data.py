"""The byte corpus, its held-out split by file, and deterministic (optionally
data-parallel) batches.

The default corpus needs no download: the ``*.py`` source files of the running
Python's standard library (``sysconfig.get_paths()["stdlib"]``, without
``site-packages``). Any text file or folder can be used instead.

Split. A file goes to validation when the first 8 bytes of
``sha256(relative POSIX path)``, read as an integer u, satisfy
``u / 2⁶⁴ < val_fraction``: the split depends on the path only — not on the file
system's listing order, the machine or the Python hash seed — and train and
validation never share a file. A single file (or a folder whose hash split leaves
one side empty) is split by position instead: its last ``val_fraction`` of bytes
are held out. Files are joined in sorted path order with a NUL byte between
them (a document boundary that does not occur in source code).

Batches. Batch ``t`` of a :class:`BatchSampler` is a pure function of
``(seed, t)``: B windows of ``seq_len + 1`` bytes at offsets drawn from a generator
seeded by ``sha256(f"{seed}:{t}")``, so every optimizer in a comparison sees the
same data order and a run can resume at any step. Under data parallelism rank r
of N takes rows ``[r·B/N, (r+1)·B/N)`` of the same global batch, so the shards
concatenated in rank order are exactly the single-process batch.

Example:
    >>> from benchmarks.common.data import BatchSampler, load_corpus
    >>> corpus = load_corpus()                    # the standard library's sources
    >>> sampler = BatchSampler(corpus.train, batch_size=8, seq_len=64, seed=0)
    >>> x, y = sampler.batch(0)                   # the global batch of step 0
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([8, 64]), True)
    >>> x0, _ = sampler.batch(0, rank=0, world_size=2)   # rank 0's half of it
    >>> bool((x0 == x[:4]).all())
    True
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
import pathlib
import platform
import sysconfig

import torch

__all__ = [
    "BatchSampler",
    "Corpus",
    "default_corpus_path",
    "load_corpus",
    "shard_rows",
    "validation_batches",
]

DOC_SEPARATOR = b"\x00"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus_path() -> pathlib.Path:
    """The running Python's standard library folder."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation bytes (``torch.uint8``, 1-D) and where they came from.

    Attributes:
        train: the training bytes.
        val: the held-out bytes.
        train_files: relative paths of the training files (sorted).
        val_files: relative paths of the held-out files (sorted); empty when a
            single file was split by position.
        source: what was read, without machine paths: ``"python-stdlib 3.11.7"`` for
            the default corpus, else the file or folder's name.
        split: ``"by_file"`` or ``"by_position"``.
        digest: sha256 of the train bytes followed by the validation bytes, to tell
            whether two runs saw the same data.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    source: str
    split: str
    digest: str

    def describe(self) -> dict[str, object]:
        """The JSON-friendly facts a result file records."""
        return {
            "source": self.source,
            "split": self.split,
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "sha256": self.digest,
        }


def _is_held_out(relative: str, val_fraction: float) -> bool:
    u = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")
    return u / 2.0**64 < val_fraction


def _looks_binary(path: pathlib.Path) -> bool:
    with path.open("rb") as f:
        return b"\x00" in f.read(8192)


def _list_files(folder: pathlib.Path, pattern: str | None) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        # Prune in place (sorted for a stable walk): skip installed third-party code,
        # caches and hidden folders such as .git.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or (pattern is not None and not fnmatch.fnmatch(name, pattern)):
                continue
            path = pathlib.Path(dirpath) / name
            if not path.is_file() or (pattern is None and _looks_binary(path)):
                continue
            files.append(path.relative_to(folder).as_posix())
    return sorted(files)


def _join(folder: pathlib.Path, files: list[str]) -> bytes:
    return DOC_SEPARATOR.join((folder / f).read_bytes() for f in files)


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.08,
    pattern: str | None = None,
) -> Corpus:
    """Read a corpus and split it into train and validation bytes.

    Args:
        path: a folder (every file under it matching ``pattern``) or one text file;
            default the standard library's sources (:func:`default_corpus_path`).
        val_fraction: the share held out, in (0, 0.5].
        pattern: file-name glob; default ``"*.py"`` for the standard library and
            every non-binary file (no NUL byte in its first 8 KiB) otherwise.

    Raises:
        ValueError: ``val_fraction`` outside (0, 0.5], ``path`` missing, or no file
            (or too few bytes) to train on.

    Examples:
        >>> from benchmarks.common.data import load_corpus
        >>> c = load_corpus(val_fraction=0.08)
        >>> set(c.train_files).isdisjoint(c.val_files)
        True
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction!r}")
    if path is None:
        root = default_corpus_path()
        pattern = "*.py" if pattern is None else pattern
    else:
        root = pathlib.Path(path)
    if not root.exists():
        raise ValueError(f"corpus path {str(root)!r} does not exist")

    if root.is_file():
        files, folder = [root.name], root.parent
    else:
        files, folder = _list_files(root, pattern), root
        if not files:
            raise ValueError(
                f"no file under {str(root)!r} matches pattern={pattern!r}"
                + (" (binary files are skipped)" if pattern is None else "")
            )
    val_files = [f for f in files if _is_held_out(f, val_fraction)]
    train_files = [f for f in files if not _is_held_out(f, val_fraction)]
    if val_files and train_files:
        split = "by_file"
        train, val = _join(folder, train_files), _join(folder, val_files)
    else:
        # One file, or so few that the hash put them all on one side: hold out the
        # tail of the joined bytes instead (still deterministic).
        split = "by_position"
        data = _join(folder, files)
        cut = len(data) - max(1, int(len(data) * val_fraction))
        train, val = data[:cut], data[cut:]
        train_files, val_files = files, []
    digest = hashlib.sha256(train + b"|" + val).hexdigest()
    return Corpus(
        train=_to_tensor(train),
        val=_to_tensor(val),
        train_files=tuple(train_files),
        val_files=tuple(val_files),
        source=(f"python-stdlib {platform.python_version()}" if path is None else root.name),
        split=split,
        digest=digest,
    )


def shard_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """Rows of a global batch that ``rank`` of ``world_size`` owns.

    Raises:
        ValueError: ``world_size < 1``, ``rank`` outside ``[0, world_size)``, or
            ``batch_size`` not a multiple of ``world_size`` (every rank must get the
            same number of rows so that averaged gradients equal the global mean).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} must be a multiple of world_size={world_size}")
    per_rank = batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _generator(seed: int, step: int) -> torch.Generator:
    key = hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8]
    return torch.Generator().manual_seed(int.from_bytes(key, "big") >> 1)


class BatchSampler:
    """Deterministic random windows of a byte stream: ``batch(step)`` → ``(x, y)``.

    ``x`` and ``y`` are ``int64`` of shape ``(B, seq_len)`` (``B = batch_size /
    world_size`` for a shard) with ``y[:, i] = x[:, i + 1]`` within the window — the
    next byte to predict.

    Args:
        data: 1-D ``uint8`` bytes (``Corpus.train``).
        batch_size: the *global* batch size.
        seq_len: window length.
        seed: the data-order seed.

    Raises:
        ValueError: non-positive sizes, or ``data`` shorter than ``seq_len + 1``.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D bytes, got shape {tuple(data.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    def offsets(self, step: int) -> torch.Tensor:
        """Start offsets of the global batch of ``step``."""
        high = self.data.numel() - self.seq_len  # last valid start + 1
        return torch.randint(0, high, (self.batch_size,), generator=_generator(self.seed, step))

    def batch(
        self, step: int, *, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (shard of the) global batch of ``step``; see the module docstring."""
        rows = shard_rows(self.batch_size, rank, world_size)
        starts = self.offsets(step)[rows]
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[index].long()
        return window[:, :-1].to(device), window[:, 1:].to(device)


def validation_batches(
    data: torch.Tensor,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 1234,
    rank: int = 0,
    world_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of ``n_batches`` validation batches (the same for every run with
    the same arguments), sharded like :meth:`BatchSampler.batch`.

    Raises:
        ValueError: ``n_batches < 1`` or the arguments :class:`BatchSampler` rejects.
    """
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    sampler = BatchSampler(data, batch_size, seq_len, seed)
    return [sampler.batch(i, rank=rank, world_size=world_size) for i in range(n_batches)]
