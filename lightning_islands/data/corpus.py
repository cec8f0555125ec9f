"""Offline byte-level corpus: discovery, caching, train/val split, per-island sharding, datasets.

Everything here works without network access. A *source* is one of

* ``"stdlib"`` (default): the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), skipping anything below ``site-packages``/``dist-packages``;
* a folder: every regular file below it (read as raw bytes, whatever the extension);
* a glob pattern (contains ``*``, ``?`` or ``[``), e.g. ``/data/*.txt`` or ``/data/**/*.md``.

Files are sorted by path and tokenized as bytes (vocabulary of 256, token = byte value). Their bytes are
concatenated once, with a single byte ``0`` (:data:`SEPARATOR`) between consecutive files, into one
``uint8`` file in a cache folder, named by a hash of the sorted file list with sizes and mtimes (and the
``max_bytes`` cap). It is then opened as a read-only :class:`numpy.memmap`. The cache file is written to a
temporary file in the same folder and moved into place with :func:`os.replace`, so several processes
that start at once never see a half-written cache (the last writer wins, with identical content).

Split rule: the last ``floor(n_tokens * val_fraction)`` tokens are validation, everything before them is
train. Sharding rule: the train range is split into ``num_islands`` contiguous parts of (nearly) equal
length (boundaries ``i * n // k``), then the island's part into ``world_size`` parts the same way, so
every rank of every island reads a disjoint stream and together they cover the train range.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

VOCAB_SIZE = 256
"""Byte-level vocabulary size."""

SEPARATOR = 0
"""Byte value written between two consecutive files of the concatenated corpus."""

CACHE_ENV = "LIGHTNING_ISLANDS_CACHE"
"""Environment variable naming the project cache root (corpus files go to ``<root>/corpus``)."""

ISLAND_ENV = "LI_ISLAND"
NUM_ISLANDS_ENV = "LI_NUM_ISLANDS"

_FORMAT_VERSION = "li-bytes-v1"
_FIX_HINT = "set data.source to a folder or glob of text files (or 'stdlib')"
_GLOB_CHARS = ("*", "?", "[")


# --------------------------------------------------------------------------------------------- tokens


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``torch.long`` tensor (values 0..255)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(data)


def decode(tokens: torch.Tensor | np.ndarray | Sequence[int] | bytes) -> str:
    """Inverse of :func:`encode`: byte values to text, invalid UTF-8 replaced by U+FFFD."""
    if isinstance(tokens, (bytes, bytearray)):
        raw = bytes(tokens)
    else:
        if isinstance(tokens, torch.Tensor):
            values = tokens.detach().cpu().reshape(-1).tolist()
        elif isinstance(tokens, np.ndarray):
            values = tokens.reshape(-1).tolist()
        else:
            values = list(tokens)
        raw = bytes(int(v) for v in values)  # raises ValueError for values outside 0..255
    return raw.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------- file discovery


def stdlib_dir() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(name: str) -> bool:
    return name in ("site-packages", "dist-packages")


def _is_within(path: str, folder: str | None) -> bool:
    if folder is None:
        return False
    try:
        return os.path.commonpath([os.path.realpath(path), folder]) == folder
    except ValueError:
        return False


def resolve_files(source: str = "stdlib", exclude_dir: str | os.PathLike | None = None) -> list[str]:
    """Sorted absolute paths of the regular files that make up ``source``.

    ``exclude_dir`` (normally the cache folder) is never read, even if it lies inside the source folder.
    Raises :class:`FileNotFoundError` for a missing folder/file and :class:`ValueError` when nothing
    matches.
    """
    excluded = os.path.realpath(exclude_dir) if exclude_dir is not None else None
    files: list[str] = []
    if source == "stdlib":
        root = stdlib_dir()
        if not root.is_dir():
            raise FileNotFoundError(
                f"standard library folder {str(root)!r} not found for this interpreter; {_FIX_HINT}"
            )
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not _skip_dir(d)]
            files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
        files = [f for f in files if os.path.isfile(f)]
    elif any(ch in source for ch in _GLOB_CHARS):
        pattern = os.path.expanduser(source)
        files = [os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not files:
            raise ValueError(f"data source glob {source!r} matched no files; {_FIX_HINT}")
    else:
        path = Path(os.path.expanduser(source))
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist; {_FIX_HINT}")
        if path.is_file():
            files = [str(path.resolve())]
        else:
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                files.extend(os.path.join(dirpath, f) for f in filenames)
            files = [os.path.abspath(f) for f in files if os.path.isfile(f)]
    files = sorted({f for f in files if not _is_within(f, excluded)})
    if not files:
        raise ValueError(f"data source {source!r} contains no files; {_FIX_HINT}")
    return files


# ---------------------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """Corpus cache folder.

    ``$LIGHTNING_ISLANDS_CACHE/corpus`` if that variable is set, else ``~/.cache/lightning_islands/corpus``.
    """
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(os.path.expanduser(root)) / "corpus"
    return Path.home() / ".cache" / "lightning_islands" / "corpus"


def _stat_files(files: Sequence[str]) -> list[tuple[str, int, int]]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append((f, st.st_size, st.st_mtime_ns))
    return out


def _cache_key(stats: Sequence[tuple[str, int, int]], max_bytes: int | None) -> str:
    h = hashlib.sha256()
    h.update(f"{_FORMAT_VERSION}\nsep={SEPARATOR}\nmax_bytes={max_bytes}\n".encode())
    for path, size, mtime in stats:
        h.update(f"{path}\0{size}\0{mtime}\n".encode("utf-8", errors="surrogateescape"))
    return h.hexdigest()[:24]


def _planned_length(sizes: Sequence[int], max_bytes: int | None) -> tuple[int, int]:
    """(total bytes after cap, number of files that contribute at least one byte or separator)."""
    total = 0
    used = 0
    for i, size in enumerate(sizes):
        if max_bytes is not None and total >= max_bytes:
            break
        total += size + (1 if i > 0 else 0)
        used += 1
    if max_bytes is not None:
        total = min(total, max_bytes)
    return total, used


def _write_cache(stats: Sequence[tuple[str, int, int]], target: Path, max_bytes: int | None) -> int:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    written = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for i, (path, size, _) in enumerate(stats):
                if max_bytes is not None and written >= max_bytes:
                    break
                with open(path, "rb") as f:
                    chunk = f.read(size)
                if i > 0:
                    chunk = bytes([SEPARATOR]) + chunk
                if max_bytes is not None:
                    chunk = chunk[: max_bytes - written]
                out.write(chunk)
                written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        if written > 0:
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return written


@dataclass
class ByteCorpus:
    """A cached, memory-mapped byte corpus.

    ``tokens`` is the read-only ``uint8`` memmap of the whole concatenation; ``built`` is True when this
    call wrote the cache file (False when an existing one was reused).
    """

    source: str
    files: list[str]
    n_files_used: int
    cache_path: Path
    tokens: np.ndarray = field(repr=False)
    max_bytes: int | None = None
    built: bool = False

    @property
    def n_tokens(self) -> int:
        """Length of the concatenated corpus in bytes/tokens."""
        return int(self.tokens.shape[0])

    def split(self, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
        """``(train, val)`` views of :attr:`tokens` (see :func:`split_point`)."""
        cut = split_point(self.n_tokens, val_fraction)
        return self.tokens[:cut], self.tokens[cut:]


def load_corpus(
    source: str = "stdlib",
    cache_dir: str | os.PathLike | None = None,
    max_bytes: int | None = None,
) -> ByteCorpus:
    """Find the files of ``source``, build the cache file if it is missing, and memory-map it.

    ``max_bytes`` keeps only the first ``max_bytes`` bytes of the concatenation (for tiny runs/tests).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    files = resolve_files(source, exclude_dir=folder)
    stats = _stat_files(files)
    sizes = [size for _, size, _ in stats]
    expected, used = _planned_length(sizes, max_bytes)
    if sum(sizes) == 0:
        raise ValueError(f"data source {source!r} has {len(files)} file(s) but 0 bytes in total; {_FIX_HINT}")
    target = folder / f"bytes-{_cache_key(stats, max_bytes)}.u8"
    built = False
    if not (target.is_file() and target.stat().st_size == expected):
        written = _write_cache(stats, target, max_bytes)
        if written == 0:
            raise ValueError(f"data source {source!r} yielded 0 bytes when read; {_FIX_HINT}")
        built = True
    tokens = np.memmap(target, dtype=np.uint8, mode="r")
    return ByteCorpus(
        source=source,
        files=files,
        n_files_used=used,
        cache_path=target,
        tokens=tokens,
        max_bytes=max_bytes,
        built=built,
    )


# ------------------------------------------------------------------------------------ split and shards


def split_point(n_tokens: int, val_fraction: float = 0.05) -> int:
    """Index where validation starts: tokens ``[0, cut)`` are train, ``[cut, n_tokens)`` validation.

    ``cut = n_tokens - floor(n_tokens * val_fraction)``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return n_tokens - int(n_tokens * val_fraction)


def shard_range(n_tokens: int, island: int, num_islands: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of the train tokens that ``rank`` of ``island`` reads.

    ``[0, n_tokens)`` is cut into ``num_islands`` contiguous parts, the island's part into ``world_size``
    contiguous parts; part ``i`` of ``k`` over a length ``n`` is ``[i*n//k, (i+1)*n//k)``. Ranges of
    different (island, rank) pairs are disjoint and together cover ``[0, n_tokens)``.
    """
    if num_islands < 1 or not 0 <= island < num_islands:
        raise ValueError(
            f"island must be in [0, num_islands), got island={island}, num_islands={num_islands}"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    lo = island * n_tokens // num_islands
    hi = (island + 1) * n_tokens // num_islands
    length = hi - lo
    return lo + rank * length // world_size, lo + (rank + 1) * length // world_size


SHARD_LAYOUTS = ("interleaved", "contiguous")
"""``interleaved``: disjoint chunks dealt round-robin (every stream sees the whole corpus's mix);
``contiguous``: one contiguous range per stream (streams see different parts: a non-IID split)."""


def chunk_length(n_tokens: int, num_islands: int, chunk: int, seq_len: int) -> int:
    """Chunk size of the interleaved layout: ``chunk``, shrunk for small corpora so every island gets
    at least 16 chunks, never below one window. Depends only on values every island shares."""
    return max(seq_len + 1, min(chunk, n_tokens // (16 * num_islands)))


def interleaved_chunks(n_tokens: int, island: int, num_islands: int, rank: int, world_size: int,
                       chunk: int) -> np.ndarray:
    """Indices of the ``chunk``-token chunks of ``[0, n_tokens)`` that ``rank`` of ``island`` reads.

    Chunk ``c`` belongs to island ``c % num_islands``; that island's chunks, in order, are dealt to its
    ranks round-robin. Streams are disjoint, and each one samples the whole corpus evenly. A trailing
    partial chunk is not used.
    """
    shard_range(n_tokens, island, num_islands, rank, world_size)  # validates the indices
    n_chunks = n_tokens // chunk
    own = np.arange(island, n_chunks, num_islands, dtype=np.int64)
    return own[rank::world_size]


@dataclass(frozen=True)
class ShardSpec:
    """Which part of the train stream a process reads: ``rank`` of ``world_size`` inside ``island``.

    ``layout`` is ``"interleaved"`` (default: disjoint chunks of ``chunk`` tokens dealt round-robin)
    or ``"contiguous"`` (one contiguous range, see :func:`shard_range`).
    """

    island: int = 0
    num_islands: int = 1
    rank: int = 0
    world_size: int = 1
    layout: str = "interleaved"
    chunk: int = 65536

    def range(self, n_tokens: int) -> tuple[int, int]:
        """``(start, end)`` of the contiguous-layout shard in a train array of ``n_tokens`` tokens."""
        return shard_range(n_tokens, self.island, self.num_islands, self.rank, self.world_size)

    def chunks(self, n_tokens: int, seq_len: int) -> tuple[np.ndarray, int]:
        """Interleaved layout: this shard's chunk indices and the chunk length used."""
        length = chunk_length(n_tokens, self.num_islands, self.chunk, seq_len)
        return interleaved_chunks(n_tokens, self.island, self.num_islands, self.rank, self.world_size,
                                  length), length


# ------------------------------------------------------------------------------------------- datasets


def batch_seed(seed: int, island: int, rank: int, batch_index: int) -> int:
    """63-bit generator seed for batch ``batch_index`` of (``island``, ``rank``) under ``seed``."""
    digest = hashlib.blake2b(f"{seed}|{island}|{rank}|{batch_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))


class TrainWindows(IterableDataset):
    """Infinite, resumable stream of ``(x, y)`` batches of random windows from one shard.

    ``tokens`` is the train array (any 1-D integer array, normally the corpus memmap's train view);
    the shard ``shard.range(len(tokens))`` is where every window of ``seq_len + 1`` tokens lies.
    Batch ``b`` draws ``batch_size`` window starts with a :class:`torch.Generator` seeded by
    :func:`batch_seed` ``(seed, island, rank, b)``, so it depends on nothing else: a stream started at
    ``start_batch`` yields exactly what an uninterrupted stream yields from that index on. ``x`` and
    ``y`` are ``LongTensor[batch_size, seq_len]`` with ``y`` = ``x`` shifted by one token.

    Use with ``DataLoader(ds, batch_size=None, num_workers=0)``. With ``num_workers > 0`` the workers
    take batch indices round-robin, which the DataLoader reassembles in the same order.
    ``num_batches`` (optional) makes the stream finite: batches ``start_batch .. num_batches - 1``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        shard: ShardSpec | None = None,
        seed: int = 1234,
        start_batch: int = 0,
        num_batches: int | None = None,
    ) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shard = shard if shard is not None else ShardSpec()
        self.seed = seed
        self.start_batch = start_batch
        self.num_batches = num_batches
        if self.shard.layout not in SHARD_LAYOUTS:
            raise ValueError(f"shard layout must be one of {SHARD_LAYOUTS}, got {self.shard.layout!r}")
        self.start, self.end = self.shard.range(len(tokens))
        self.chunk_ids, self.chunk_len = self.shard.chunks(len(tokens), seq_len)
        if self.shard.layout == "interleaved" and len(self.chunk_ids) == 0:
            raise ValueError(
                f"train shard {self.shard} gets fewer than one window of seq_len+1={seq_len + 1}: no chunk of "
                f"{self.chunk_len} tokens out of {len(tokens)}; use more data (data.source / data.max_bytes), "
                f"a smaller seq_len, or fewer islands/ranks"
            )
        if self.shard.layout == "contiguous" and self.end - self.start < seq_len + 1:
            raise ValueError(
                f"train shard {self.shard} holds {self.end - self.start} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; use more data (data.source / data.max_bytes), a smaller "
                f"seq_len, or fewer islands/ranks"
            )

    def window_starts(self, batch_index: int) -> np.ndarray:
        """Absolute start indices (into ``tokens``) of the windows of batch ``batch_index``."""
        g = torch.Generator().manual_seed(
            batch_seed(self.seed, self.shard.island, self.shard.rank, batch_index)
        )
        if self.shard.layout == "interleaved":
            which = torch.randint(0, len(self.chunk_ids), (self.batch_size,), generator=g).numpy()
            offset = torch.randint(0, self.chunk_len - self.seq_len, (self.batch_size,), generator=g).numpy()
            return self.chunk_ids[which] * self.chunk_len + offset
        starts = torch.randint(self.start, self.end - self.seq_len, (self.batch_size,), generator=g)
        return starts.numpy()

    def batch(self, batch_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``batch_index`` of the stream, computed directly."""
        w = _windows(self.tokens, self.window_starts(batch_index), self.seq_len + 1)
        return w[:, :-1], w[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        b, step = self.start_batch, 1
        if info is not None:
            b, step = self.start_batch + info.id, info.num_workers
        while self.num_batches is None or b < self.num_batches:
            yield self.batch(b)
            b += step


class ValWindows(Dataset):
    """Fixed validation windows: ``n_windows`` evenly spaced starts over ``tokens`` (the val array).

    Item ``i`` is ``(x, y)``, two ``LongTensor[seq_len]`` with ``y`` = ``x`` shifted by one. Starts are
    ``i * (len(tokens) - seq_len - 1) // (n_windows - 1)``, so the first window begins at the first
    validation token and the last one ends at the last.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, n_windows: int = 64) -> None:
        super().__init__()
        if seq_len < 1 or n_windows < 0:
            raise ValueError(f"seq_len must be >= 1 and n_windows >= 0, got {seq_len} and {n_windows}")
        if n_windows > 0 and len(tokens) < seq_len + 1:
            raise ValueError(
                f"validation split holds {len(tokens)} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; use more data, a larger val_fraction or a smaller seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        span = len(tokens) - seq_len - 1
        if n_windows <= 1:
            self.starts = np.zeros(n_windows, dtype=np.int64)
        else:
            self.starts = np.array([i * span // (n_windows - 1) for i in range(n_windows)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = _windows(self.tokens, self.starts[i : i + 1], self.seq_len + 1)[0]
        return w[:-1], w[1:]


# ---------------------------------------------------------------------------------------- datamodule


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


class ByteCorpusDataModule(pl.LightningDataModule):
    """LightningDataModule over a :class:`ByteCorpus`, sharded by island and rank.

    Rank and world size come from the attached trainer's strategy (its data-parallel rank and size,
    ``distributed_sampler_kwargs``, so tensor-parallel ranks read the same batches), else the
    trainer's ``global_rank``/``world_size`` (within the island's own process group), else 0/1.
    The island index and count come from the explicit
    arguments, else the strategy's ``island_index``/``num_islands`` attributes, else the environment
    variables ``LI_ISLAND``/``LI_NUM_ISLANDS``, else 0/1.

    The train loader is an infinite :class:`TrainWindows` stream starting at batch
    ``trainer.global_step * trainer.accumulate_grad_batches``, so a run resumed from a checkpoint
    continues the stream where it stopped. This assumes exactly one optimizer step per
    ``accumulate_grad_batches`` batches. Because the stream has no length, validate with an integer
    ``val_check_interval`` (or ``limit_train_batches``) and stop with ``max_steps``. Trainer should use
    ``use_distributed_sampler=False``; this module shards by itself.

    Validation uses the same :class:`ValWindows` set on every island; rank ``r`` of ``W`` gets items
    ``r::W``. When ``val_windows`` is not a multiple of ``W`` ranks can get different numbers of
    batches, which hangs sharded (FSDP) models; a warning is emitted in that case.
    """

    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        val_windows: int = 64,
        val_batch_size: int = 32,
        seed: int = 1234,
        cache_dir: str | None = None,
        max_bytes: int | None = None,
        island: int | None = None,
        num_islands: int | None = None,
        shard_layout: str = "interleaved",
        shard_chunk: int = 65536,
    ) -> None:
        super().__init__()
        if shard_layout not in SHARD_LAYOUTS:
            raise ValueError(f"shard_layout must be one of {SHARD_LAYOUTS}, got {shard_layout!r}")
        if seq_len < 1 or batch_size < 1 or val_batch_size < 1:
            raise ValueError("seq_len, batch_size and val_batch_size must be >= 1")
        if val_windows < 0:
            raise ValueError(f"val_windows must be >= 0, got {val_windows}")
        split_point(1, val_fraction)  # validates val_fraction
        self.source = source
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.val_windows = val_windows
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self.island = island
        self.num_islands = num_islands
        self.shard_layout = shard_layout
        self.shard_chunk = shard_chunk
        self.corpus: ByteCorpus | None = None
        self._train: np.ndarray | None = None
        self._val: np.ndarray | None = None

    # -- placement ------------------------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        try:  # data-parallel rank and size: the ranks of a tensor-parallel group read the same batches
            kwargs = trainer.strategy.distributed_sampler_kwargs
        except (AttributeError, AssertionError):
            kwargs = None
        if kwargs and "num_replicas" in kwargs and "rank" in kwargs:
            return int(kwargs["rank"]), int(kwargs["num_replicas"])
        return int(trainer.global_rank), int(trainer.world_size)

    def _islands(self) -> tuple[int, int]:
        strategy = None
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            strategy = getattr(trainer, "strategy", None)
        island = self.island
        if island is None:
            island = getattr(strategy, "island_index", None)
        if island is None:
            island = _env_int(ISLAND_ENV)
        num = self.num_islands
        if num is None:
            num = getattr(strategy, "num_islands", None)
        if num is None:
            num = _env_int(NUM_ISLANDS_ENV)
        return (0 if island is None else int(island)), (1 if num is None else int(num))

    def shard(self) -> ShardSpec:
        """This process's :class:`ShardSpec` (island, island count, rank, world size)."""
        island, num = self._islands()
        rank, world = self._rank_world()
        if not 0 <= island < num:
            raise ValueError(f"island index {island} is outside [0, num_islands={num})")
        return ShardSpec(island=island, num_islands=num, rank=rank, world_size=world, layout=self.shard_layout,
                         chunk=self.shard_chunk)

    # -- lifecycle ------------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build the cache file once per node (other ranks then only open it in :meth:`setup`)."""
        load_corpus(self.source, cache_dir=self.cache_dir, max_bytes=self.max_bytes)

    def setup(self, stage: str | None = None) -> None:
        """Open the cached corpus, split it, and check that this shard holds at least one window."""
        if self.corpus is None:
            self.corpus = load_corpus(self.source, cache_dir=self.cache_dir, max_bytes=self.max_bytes)
            self._train, self._val = self.corpus.split(self.val_fraction)
        shard = self.shard()
        start, end = shard.range(self.n_train_tokens)
        if end - start < self.seq_len + 1:
            raise ValueError(
                f"corpus {self.source!r} ({self.corpus.n_tokens} tokens, {self.n_train_tokens} train) is too "
                f"small: the shard of island {shard.island}/{shard.num_islands}, rank "
                f"{shard.rank}/{shard.world_size} holds {end - start} tokens, fewer than one window of "
                f"seq_len+1={self.seq_len + 1}; use more data (data.source / data.max_bytes), a smaller "
                f"seq_len, or fewer islands/ranks"
            )
        if self.val_windows > 0 and self.n_val_tokens < self.seq_len + 1:
            raise ValueError(
                f"corpus {self.source!r} is too small for validation: {self.n_val_tokens} validation "
                f"tokens (val_fraction={self.val_fraction}) but one window needs seq_len+1="
                f"{self.seq_len + 1}; use more data, a larger val_fraction, a smaller seq_len, or "
                f"val_windows=0"
            )

    def _require(self) -> ByteCorpus:
        if self.corpus is None:
            raise RuntimeError("ByteCorpusDataModule.setup() has not been called yet")
        return self.corpus

    @property
    def n_train_tokens(self) -> int:
        """Number of train tokens (all islands together)."""
        self._require()
        return len(self._train)

    @property
    def n_val_tokens(self) -> int:
        """Number of validation tokens."""
        self._require()
        return len(self._val)

    def describe(self) -> str:
        """One-line summary: files, bytes, train/val tokens, cache path."""
        c = self._require()
        cap = f" (first {c.max_bytes:,} bytes)" if c.max_bytes is not None else ""
        return (
            f"byte corpus {c.source!r}: {c.n_files_used:,} of {len(c.files):,} files, {c.n_tokens:,} bytes"
            f"{cap}, train {self.n_train_tokens:,} / val {self.n_val_tokens:,} tokens, cache {c.cache_path}"
        )

    # -- loaders --------------------------------------------------------------------------------------

    def _start_batch(self) -> int:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        return int(trainer.global_step) * int(trainer.accumulate_grad_batches)

    def train_dataloader(self) -> DataLoader:
        """Infinite :class:`TrainWindows` loader for this shard, resumed at the trainer's position."""
        self._require()
        ds = TrainWindows(
            self._train,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            shard=self.shard(),
            seed=self.seed,
            start_batch=self._start_batch(),
        )
        return DataLoader(ds, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        """This rank's share (items ``rank::world_size``) of the fixed validation windows."""
        self._require()
        if self.val_windows == 0:
            return []
        rank, world = self._rank_world()
        full = ValWindows(self._val, self.seq_len, self.val_windows)
        mine = Subset(full, list(range(rank, len(full), world)))
        counts = {-(-len(range(r, len(full), world)) // self.val_batch_size) for r in range(world)}
        if len(counts) > 1:
            warnings.warn(
                f"val_windows={self.val_windows} over world_size={world} with val_batch_size="
                f"{self.val_batch_size} gives ranks different numbers of validation batches; sharded "
                f"models may hang. Use a val_windows that is a multiple of world_size.",
                stacklevel=2,
            )
        return DataLoader(mine, batch_size=self.val_batch_size, shuffle=False, num_workers=0)
