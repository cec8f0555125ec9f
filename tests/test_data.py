"""Tests for the offline byte corpus, its sharding, datasets and datamodule (real files, no mocks)."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from lightning_islands.data import (
    CACHE_ENV,
    SEPARATOR,
    ByteCorpusDataModule,
    ShardSpec,
    TrainWindows,
    ValWindows,
    decode,
    default_cache_dir,
    encode,
    load_corpus,
    resolve_files,
    shard_range,
    split_point,
)

TEXT = "def f(x):\n    return x * 2  # doubled\n\nclass Héllo:\n    '''ünïcode — 日本語 🚀'''\n"


def make_text_folder(root: Path, n_files: int = 4, repeat: int = 40) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        sub = root / ("sub" if i % 2 else "") / f"file{i}.txt"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f"# file {i}\n" + TEXT * repeat, encoding="utf-8")
    return root


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return make_text_folder(tmp_path / "src")


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# ----------------------------------------------------------------------------------------- encode/decode


def test_byte_round_trip_unicode():
    s = "héllo wörld — 日本語 🚀\n\ttabs and\x00nul"
    t = encode(s)
    assert t.dtype == torch.long and t.ndim == 1
    assert t.tolist() == list(s.encode("utf-8"))
    assert decode(t) == s
    assert decode(t.numpy()) == s
    assert decode(t.tolist()) == s
    assert decode(encode("")) == ""
    # invalid UTF-8 is replaced, not raised
    assert decode([0xFF, ord("a")]) == "\ufffda"


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_round_trip_property(s):
    assert decode(encode(s)) == s
    assert all(0 <= v < 256 for v in encode(s).tolist())


# ------------------------------------------------------------------------------------------ the corpus


def test_folder_corpus_concatenates_sorted_files_with_separator(corpus_dir, cache_dir):
    c = load_corpus(str(corpus_dir), cache_dir=cache_dir)
    files = resolve_files(str(corpus_dir))
    assert files == sorted(files) and len(files) == 4
    expected = bytes([SEPARATOR]).join(Path(f).read_bytes() for f in files)
    assert bytes(c.tokens) == expected
    assert c.tokens.dtype == np.uint8 and not c.tokens.flags.writeable
    assert c.cache_path.parent == cache_dir


def test_glob_source_and_max_bytes(corpus_dir, cache_dir):
    c = load_corpus(str(corpus_dir / "sub" / "*.txt"), cache_dir=cache_dir, max_bytes=100)
    assert c.n_tokens == 100
    assert len(c.files) == 2 and all("/sub/" in f for f in c.files)
    assert bytes(c.tokens) == Path(c.files[0]).read_bytes()[:100]


def test_stdlib_corpus_found_and_non_trivial(cache_dir):
    c = load_corpus("stdlib", cache_dir=cache_dir, max_bytes=200_000)
    assert c.n_tokens == 200_000
    assert len(c.files) > 100
    assert all(f.endswith(".py") for f in c.files)
    assert not any("site-packages" in f or "dist-packages" in f for f in c.files)
    text = decode(c.tokens[:200_000])
    assert "import" in text and "def " in text


def test_cache_is_reused_and_invalidated(corpus_dir, cache_dir):
    first = load_corpus(str(corpus_dir), cache_dir=cache_dir)
    assert first.built
    mtime = os.stat(first.cache_path).st_mtime_ns
    second = load_corpus(str(corpus_dir), cache_dir=cache_dir)
    assert not second.built
    assert second.cache_path == first.cache_path
    assert os.stat(second.cache_path).st_mtime_ns == mtime
    assert np.array_equal(first.tokens, second.tokens)
    # a changed source file gives a new cache file
    (corpus_dir / "file0.txt").write_text("changed content, different size", encoding="utf-8")
    third = load_corpus(str(corpus_dir), cache_dir=cache_dir)
    assert third.built and third.cache_path != first.cache_path
    # a different cap is a different cache file too
    capped = load_corpus(str(corpus_dir), cache_dir=cache_dir, max_bytes=50)
    assert capped.built and capped.cache_path != third.cache_path
    assert not [p for p in os.listdir(cache_dir) if p.endswith(".tmp")]


def test_concurrent_builds_do_not_corrupt(corpus_dir, cache_dir):
    results, errors = [], []

    def worker():
        try:
            results.append(bytes(load_corpus(str(corpus_dir), cache_dir=cache_dir).tokens))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 4 and len(set(results)) == 1
    final = load_corpus(str(corpus_dir), cache_dir=cache_dir).cache_path.name
    assert sorted(os.listdir(cache_dir)) == [final]


def test_cache_dir_env_var(monkeypatch, tmp_path, corpus_dir):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "envcache"))
    assert default_cache_dir() == tmp_path / "envcache" / "corpus"
    c = load_corpus(str(corpus_dir))
    assert c.cache_path.parent == tmp_path / "envcache" / "corpus"
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_islands" / "corpus"


def test_cache_inside_source_folder_is_not_read(corpus_dir):
    inner = corpus_dir / "cache"
    a = load_corpus(str(corpus_dir), cache_dir=inner)
    b = load_corpus(str(corpus_dir), cache_dir=inner)
    assert not b.built and a.cache_path == b.cache_path


# ---------------------------------------------------------------------------------------------- errors


def test_error_empty_folder(tmp_path, cache_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"contains no files.*data\.source"):
        load_corpus(str(empty), cache_dir=cache_dir)


def test_error_zero_bytes(tmp_path, cache_dir):
    folder = tmp_path / "zeros"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"")
    (folder / "b.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"0 bytes.*data\.source"):
        load_corpus(str(folder), cache_dir=cache_dir)


def test_error_missing_path(tmp_path, cache_dir):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist.*data\.source"):
        load_corpus(str(missing), cache_dir=cache_dir)
    with pytest.raises(ValueError, match=r"matched no files"):
        load_corpus(str(tmp_path / "nope" / "*.txt"), cache_dir=cache_dir)


def test_error_too_small_corpus(tmp_path, cache_dir):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "a.txt").write_text("only a few bytes here", encoding="utf-8")
    dm = ByteCorpusDataModule(source=str(folder), seq_len=64, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match=r"too small.*seq_len\+1=65"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"fewer than one window"):
        TrainWindows(np.zeros(10, dtype=np.uint8), seq_len=10, batch_size=2)
    # train fits, validation does not
    dm = ByteCorpusDataModule(source=str(folder), seq_len=8, val_fraction=0.1, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match=r"too small for validation"):
        dm.setup("fit")


# ------------------------------------------------------------------------------------ split and shards


def test_split_point():
    assert split_point(1000, 0.05) == 950
    assert split_point(1000, 0.0) == 1000
    with pytest.raises(ValueError):
        split_point(10, 1.0)


def test_shards_two_islands_disjoint_and_covering():
    n = 10_007
    ranges = [
        shard_range(n, island=0, num_islands=2, rank=0, world_size=2),
        shard_range(n, island=0, num_islands=2, rank=1, world_size=2),
        shard_range(n, island=1, num_islands=2, rank=0, world_size=1),
    ]
    assert ShardSpec(1, 2, 0, 1).range(n) == ranges[2]
    ranges.sort()
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, e0), (s1, _) in itertools.pairwise(ranges):
        assert e0 == s1
    # islands get equal halves (within one token)
    assert abs((ranges[1][1] - ranges[0][0]) - (ranges[2][1] - ranges[2][0])) <= 1

    # windows stay inside their shard: with tokens = positions, every value lies in the range
    tokens = np.arange(n, dtype=np.int64)
    for spec in [ShardSpec(0, 2, 0, 2, "contiguous"), ShardSpec(0, 2, 1, 2, "contiguous"),
                 ShardSpec(1, 2, 0, 1, "contiguous")]:
        lo, hi = spec.range(n)
        ds = TrainWindows(tokens, seq_len=16, batch_size=32, shard=spec, seed=7)
        for x, y in itertools.islice(iter(ds), 20):
            assert int(x.min()) >= lo and int(y.max()) < hi
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_interleaved_streams_are_disjoint_and_each_spans_the_corpus():
    n, seq = 200_000, 16
    tokens = np.arange(n, dtype=np.int64)
    specs = [ShardSpec(0, 2, 0, 2, chunk=4096), ShardSpec(0, 2, 1, 2, chunk=4096), ShardSpec(1, 2, 0, 1, chunk=4096)]
    owners: dict[int, int] = {}
    for k, spec in enumerate(specs):
        ds = TrainWindows(tokens, seq_len=seq, batch_size=64, shard=spec, seed=3)
        assert ds.chunk_len == 4096
        seen = set()
        for x, y in itertools.islice(iter(ds), 30):
            first, last = x[:, 0], y[:, -1]
            assert torch.equal(first // ds.chunk_len, last // ds.chunk_len), "a window crossed a chunk boundary"
            seen.update(int(c) for c in first // ds.chunk_len)
        for c in seen:
            assert owners.setdefault(c, k) == k, f"chunk {c} is read by two streams"
            assert c % 2 == spec.island
        # every stream samples from the whole corpus, not one region of it
        assert min(seen) * ds.chunk_len < n // 8 and max(seen) * ds.chunk_len > n - n // 8
    # small corpora shrink the chunk so every island still gets chunks
    assert TrainWindows(tokens[:20_000], seq, 2, shard=ShardSpec(1, 2, 0, 1)).chunk_len == 20_000 // 32


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 5000),
    world_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_shard_ranges_partition_property(n, world_sizes):
    k = len(world_sizes)
    ranges = sorted(shard_range(n, i, k, r, w) for i, w in enumerate(world_sizes) for r in range(w))
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, e0), (s1, _) in itertools.pairwise(ranges):
        assert e0 == s1


def test_shard_range_rejects_bad_indices():
    with pytest.raises(ValueError):
        shard_range(100, island=2, num_islands=2, rank=0, world_size=1)
    with pytest.raises(ValueError):
        shard_range(100, island=0, num_islands=1, rank=1, world_size=1)


# -------------------------------------------------------------------------------------------- datasets


def _take(ds, k):
    return list(itertools.islice(iter(ds), k))


def test_train_windows_determinism(corpus_dir, cache_dir):
    train, _ = load_corpus(str(corpus_dir), cache_dir=cache_dir).split(0.05)
    a = _take(TrainWindows(train, seq_len=32, batch_size=4, seed=1), 5)
    b = _take(TrainWindows(train, seq_len=32, batch_size=4, seed=1), 5)
    c = _take(TrainWindows(train, seq_len=32, batch_size=4, seed=2), 5)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, 32) and ya.shape == (4, 32) and xa.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert any(not torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    # batches within one stream differ, and different ranks read different windows
    assert not torch.equal(a[0][0], a[1][0])
    r0 = TrainWindows(train, 32, 4, shard=ShardSpec(0, 1, 0, 2, "contiguous"), seed=1)
    r1 = TrainWindows(train, 32, 4, shard=ShardSpec(0, 1, 1, 2, "contiguous"), seed=1)
    assert r0.end <= r1.start


def test_train_windows_resumption(corpus_dir, cache_dir):
    train, _ = load_corpus(str(corpus_dir), cache_dir=cache_dir).split(0.05)
    spec = ShardSpec(island=1, num_islands=2, rank=0, world_size=1)
    full = _take(TrainWindows(train, 16, 3, shard=spec, seed=5), 10)
    resumed_ds = TrainWindows(train, 16, 3, shard=spec, seed=5, start_batch=5)
    resumed = list(itertools.islice(DataLoader(resumed_ds, batch_size=None, num_workers=0), 5))
    for (xf, yf), (xr, yr) in zip(full[5:], resumed):
        assert torch.equal(xf, xr) and torch.equal(yf, yr)
    finite = TrainWindows(train, 16, 3, shard=spec, seed=5, start_batch=8, num_batches=10)
    assert len(list(finite)) == 2


def test_val_windows_fixed_and_split_across_ranks(corpus_dir, cache_dir):
    _, val = load_corpus(str(corpus_dir), cache_dir=cache_dir).split(0.2)
    vw = ValWindows(val, seq_len=24, n_windows=10)
    assert len(vw) == 10
    assert vw.starts[0] == 0 and vw.starts[-1] == len(val) - 25
    x, y = vw[3]
    assert x.shape == (24,) and y.shape == (24,) and torch.equal(x[1:], y[:-1])
    assert torch.equal(ValWindows(val, 24, 10)[3][0], x)
    all_items = {tuple(vw[i][0].tolist()) for i in range(len(vw))}
    for world in (1, 2, 3):
        seen = [tuple(vw[i][0].tolist()) for r in range(world) for i in range(r, len(vw), world)]
        assert len(seen) == len(vw) and set(seen) == all_items


# ------------------------------------------------------------------------------------------ datamodule


def test_datamodule_without_trainer(corpus_dir, cache_dir, monkeypatch):
    monkeypatch.delenv("LI_ISLAND", raising=False)
    monkeypatch.delenv("LI_NUM_ISLANDS", raising=False)
    dm = ByteCorpusDataModule(source=str(corpus_dir), seq_len=16, batch_size=2, cache_dir=str(cache_dir))
    with pytest.raises(RuntimeError, match="setup"):
        _ = dm.n_train_tokens
    dm.prepare_data()
    dm.setup("fit")
    assert dm.shard() == ShardSpec(0, 1, 0, 1)
    assert dm.n_train_tokens + dm.n_val_tokens == dm.corpus.n_tokens
    desc = dm.describe()
    assert "4 of 4 files" in desc and str(dm.corpus.cache_path) in desc
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and y.shape == (2, 16)
    assert len(dm.val_dataloader().dataset) == 64

    monkeypatch.setenv("LI_ISLAND", "1")
    monkeypatch.setenv("LI_NUM_ISLANDS", "3")
    assert dm.shard() == ShardSpec(1, 3, 0, 1)
    explicit = ByteCorpusDataModule(source=str(corpus_dir), cache_dir=str(cache_dir), island=2, num_islands=3)
    assert explicit.shard() == ShardSpec(2, 3, 0, 1)
    bad = ByteCorpusDataModule(source=str(corpus_dir), cache_dir=str(cache_dir), island=3, num_islands=3)
    with pytest.raises(ValueError, match="outside"):
        bad.shard()
    no_val = ByteCorpusDataModule(source=str(corpus_dir), seq_len=16, cache_dir=str(cache_dir), val_windows=0)
    no_val.setup("fit")
    assert no_val.val_dataloader() == []


class TaggedSingleDeviceStrategy(SingleDeviceStrategy):
    """A real single-device strategy that also says which island it belongs to."""

    island_index = 1
    num_islands = 2


def _trainer(**kw):
    base = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    base.update(kw)
    return pl.Trainer(**base)


def test_datamodule_reads_island_from_strategy(corpus_dir, cache_dir, monkeypatch):
    monkeypatch.setenv("LI_ISLAND", "0")
    monkeypatch.setenv("LI_NUM_ISLANDS", "5")
    trainer = _trainer(strategy=TaggedSingleDeviceStrategy(device=torch.device("cpu")))
    dm = ByteCorpusDataModule(source=str(corpus_dir), seq_len=16, cache_dir=str(cache_dir))
    dm.trainer = trainer
    dm.setup("fit")
    assert dm.shard() == ShardSpec(island=1, num_islands=2, rank=0, world_size=1)
    ds = dm.train_dataloader().dataset
    assert (ds.start, ds.end) == shard_range(dm.n_train_tokens, 1, 2, 0, 1)


class TinyLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(256, 8)
        self.head = torch.nn.Linear(8, 256)
        self.seen: list[torch.Tensor] = []
        self.val_batches = 0

    def _loss(self, batch):
        x, y = batch
        logits = self.head(self.emb(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_datamodule_fit_with_validation(corpus_dir, cache_dir):
    dm = ByteCorpusDataModule(
        source=str(corpus_dir),
        seq_len=16,
        batch_size=4,
        val_windows=8,
        val_batch_size=4,
        seed=3,
        cache_dir=str(cache_dir),
    )
    model = TinyLM()
    trainer = _trainer(
        max_steps=2,
        accumulate_grad_batches=2,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    assert model.val_batches >= 2
    assert "val_loss" in trainer.callback_metrics
    # the fit consumed exactly batches 0..3 of the deterministic stream
    reference = TrainWindows(dm._train, 16, 4, shard=dm.shard(), seed=3)
    assert len(model.seen) == 4
    for b, x in enumerate(model.seen):
        assert torch.equal(x, reference.batch(b)[0])
    # a loader built now (as after a resume) continues at global_step * accumulate_grad_batches
    assert dm.train_dataloader().dataset.start_batch == 4


def test_datamodule_resume_from_checkpoint_continues_stream(corpus_dir, cache_dir, tmp_path):
    def make_dm():
        return ByteCorpusDataModule(
            source=str(corpus_dir), seq_len=16, batch_size=4, val_windows=4, val_batch_size=4, seed=3,
            cache_dir=str(cache_dir),
        )  # fmt: skip

    common = dict(
        accumulate_grad_batches=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0
    )
    first = TinyLM()
    trainer = _trainer(max_steps=3, default_root_dir=str(tmp_path), **common)
    trainer.fit(first, datamodule=make_dm())
    trainer.save_checkpoint(tmp_path / "step3.ckpt")

    second = TinyLM()
    dm = make_dm()
    trainer = _trainer(max_steps=5, default_root_dir=str(tmp_path), **common)
    trainer.fit(second, datamodule=dm, ckpt_path=str(tmp_path / "step3.ckpt"))
    reference = TrainWindows(dm._train, 16, 4, shard=dm.shard(), seed=3)
    assert len(first.seen) == 6 and len(second.seen) == 4
    for b, x in enumerate(first.seen + second.seen):
        assert torch.equal(x, reference.batch(b)[0]), f"batch {b} differs from the uninterrupted stream"
