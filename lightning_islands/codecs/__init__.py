"""Pseudo-gradient codecs: quantize once, ship bytes, dequantize bit-identically everywhere.

Every ``H`` inner steps each island turns its flat fp32 pseudo-gradient into a byte payload with
:meth:`Codec.encode`; the islands exchange payloads, and every island runs :meth:`Codec.decode` on
all of them and sums in island order. Decoding is a pure function of the payload bytes made of
exact operations plus one correctly rounded fp32 multiply per element (``q.float() * scale``),
so every island, on CPU or GPU, reconstructs bit-identical tensors and hence the same merge.

Codecs are selected by a spec string (see :func:`make_codec`)::

    fp32                raw float32 (exact)
    bf16                bfloat16, round-to-nearest-even (relative error <= 2**-8)
    fp8                 float8_e4m3fn values, one fp32 scale = absmax/448 per block
    int8 | int4 | int2  symmetric blockwise absmax quantization, q in [-qmax, qmax],
                        qmax = 127 | 7 | 1, scale = absmax/qmax (fp32) per block
    sign                one bit per value (its sign), scale = mean |x| (fp32) per block
    topk:F              keep the ceil(F*n) largest-magnitude entries, values as fp32
    topk:F+int4         ... values quantized by the inner codec (any of the above)
    <codec>/B           block size B (default 128, a positive multiple of 4), e.g. "int4/64"

The wire format (header, body layouts, packing) and the quantization rule are documented in
:mod:`lightning_islands.codecs.wire`. The modules of this package, one idea each:

    wire        header, codec ids, body layouts           spec        spec strings -> codecs
    base        the Codec interface and validation        dense       fp32, bf16
    blockwise   fp8, int8/4/2 (BlockCodec)                sign        the 1-bit sign codec
    packing     planar 4/2/1-bit packing                  topk        the top-k codec
    selection   which entries top-k keeps                 elias_fano  top-k index coding
    feedback    error feedback and metrics                buffers     named scratch tensors, reused
    checksum    CRC-32 of payloads (zlib-ng, GPU)         crc32       CRC-32 algebra (shift, combine)
    paths       Triton or torch, per tensor               probe       inputs a fast kernel must match
    triton_kernels  the blockwise codecs on CUDA (Triton, imported on first use)
    triton_crc      the CRC-32 of GPU payloads, on the GPU (Triton, imported on first use)

Every codec has one reference implementation in torch, which runs on every device. On CPU it is
cache-blocked: the blockwise codecs process slabs of about 2**20 elements (a Python loop over
~4 MiB slabs, never over blocks or elements) so their fp32 temporaries stay in cache instead of
streaming through DRAM; on other devices the whole vector is one slab.

On CUDA the blockwise codecs (fp8, int8/4/2, also inside top-k) run the Triton kernels of
:mod:`lightning_islands.codecs.triton_kernels` instead, which write the same bytes in fewer passes;
each codec checks them against the torch path on a probe vector (:mod:`lightning_islands.codecs.probe`)
before their first use on a device and keeps the torch path, with a warning, where they differ
(:meth:`~lightning_islands.codecs.blockwise.BlockCodec._triton`). Payload checksums of large CUDA
bodies are taken on the GPU the same way. ``LI_TRITON=0`` turns both off; ``LI_TRITON=interpret``
(with ``TRITON_INTERPRET=1``) runs the kernels on CPU tensors under Triton's interpreter, to check
them without a GPU.
"""

from __future__ import annotations

from lightning_islands.codecs.base import Codec
from lightning_islands.codecs.blockwise import Float8Codec, IntCodec
from lightning_islands.codecs.dense import BFloat16Codec, Float32Codec
from lightning_islands.codecs.feedback import (
    ErrorFeedback,
    add_residual_,
    check_decay,
    compression_ratio,
    quantization_error,
    with_residual,
)
from lightning_islands.codecs.sign import SignCodec
from lightning_islands.codecs.spec import default_error_feedback, make_codec
from lightning_islands.codecs.topk import TopKCodec
from lightning_islands.codecs.wire import (
    BASE_CODECS,
    DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    PACK_GROUP,
)

__all__ = [
    "BASE_CODECS",
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "PACK_GROUP",
    "BFloat16Codec",
    "Codec",
    "ErrorFeedback",
    "Float8Codec",
    "Float32Codec",
    "IntCodec",
    "SignCodec",
    "TopKCodec",
    "check_decay",
    "compression_ratio",
    "default_error_feedback",
    "make_codec",
    "quantization_error",
    "add_residual_",
    "with_residual",
]
