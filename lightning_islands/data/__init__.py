"""Offline byte-level data: the cached corpus, per-island sharding, datasets and the datamodule; a
sampler that shards any map-style dataset by island and rank."""

from lightning_islands.data.corpus import (
    CACHE_ENV,
    ISLAND_ENV,
    NUM_ISLANDS_ENV,
    SEPARATOR,
    VOCAB_SIZE,
    ByteCorpus,
    ByteCorpusDataModule,
    ShardSpec,
    TrainWindows,
    ValWindows,
    batch_seed,
    decode,
    default_cache_dir,
    encode,
    load_corpus,
    resolve_files,
    shard_range,
    split_point,
    stdlib_dir,
)
from lightning_islands.data.sampler import IslandSampler

__all__ = [
    "CACHE_ENV",
    "ISLAND_ENV",
    "NUM_ISLANDS_ENV",
    "SEPARATOR",
    "VOCAB_SIZE",
    "ByteCorpus",
    "ByteCorpusDataModule",
    "IslandSampler",
    "ShardSpec",
    "TrainWindows",
    "ValWindows",
    "batch_seed",
    "decode",
    "default_cache_dir",
    "encode",
    "load_corpus",
    "resolve_files",
    "shard_range",
    "split_point",
    "stdlib_dir",
]
