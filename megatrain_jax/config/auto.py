"""How the automatic settings resolve: for long sequences, which attention a layer runs, how
its MLP is tiled, and the chunk of the blockwise attention; the dtype the layer gradients
travel to the host in.

Pure Python without JAX, so that the model (when its layer is traced) and the planner (before
JAX starts) make the same choice from the same numbers:

    attention_path("auto", seq_len=262144, on_gpu=True, dtype_bytes=2)   # -> "cudnn"
    attention_path("auto", seq_len=1048576, on_gpu=True, dtype_bytes=2)  # -> "blockwise"
    mlp_tile(0, tokens=262144)                                            # -> 8192
    attention_chunk(0, seq_len=262144)                                    # -> 1024
    grad_dtype("auto", "bfloat16", micro_batches=1, devices=1)            # -> "bfloat16"
"""

from __future__ import annotations

# cuDNN's fused attention (bf16/fp16 on a GPU) is used up to this length, beyond it the
# blockwise attention. On the H200, 7b trained with it at 1 x 262144 and two layers of 7b's
# width at 1 x 524288 (about 22 s a layer, some 450 TFLOP/s: benchmarks/RESULTS.md,
# 2026-11-25), the longest length measured; `benchmarks/attention_limits.py` times both paths.
CUDNN_MAX_SEQ = 524288
# XLA's attention holds [rows, H, S, S] fp32 scores and their gradient (at 4096 tokens and
# 32 heads, 2 GiB a copy): beyond this length `auto` runs the blockwise attention instead.
XLA_MAX_SEQ = 4096
# Query and key chunk of the blockwise attention, in tokens (`stream.attention_chunk=0`).
ATTENTION_CHUNK = 1024
# The MLP runs in tiles of MLP_TILE tokens when a micro-batch holds more than MLP_TILE_FROM
# tokens (`stream.mlp_tile=0`). Up to that, the H200 holds the untiled MLP (7b at 1 x 131072
# peaked at 59.3 GiB) and tiling would only add the MLP's recompute (about a tenth of the
# step at 32k tokens, less at longer ones where attention dominates).
MLP_TILE_FROM = 131072
MLP_TILE = 8192
# The attention paths whose output and statistics a layer can keep for its backward, which
# then does not attend again (model/replay.py); XLA's backward needs its [S, S] probabilities.
KEEPS_ATTENTION = ("cudnn", "blockwise")
# `stream.keep_attention=auto` keeps it for rows of at least this many tokens. Below, the
# attention is a small part of the recompute (7b's forward: 0.3 of 13.5 GFLOP a token at
# 1024 tokens, 2.2 of 15.4 at 8192; one layer's backward measured 5% shorter at 8192 on the
# H200, 17% at 32768) and the GPU memory is better left free.
KEEP_ATTENTION_FROM = 8192


def grad_dtype(requested: str, compute_dtype: str, micro_batches: int, devices: int) -> str:
    """The dtype the layers' weight gradients travel to the host and rest there in.

    A layer that casts its fp32 weights to bf16 has bf16 values for their gradients (the
    step's programs keep every bf16 value as the program writes it: stream/programs.py), so
    `auto` takes bfloat16 with bf16 compute, one micro-batch and one device. Summed over a
    mesh's devices they are fp32 values and `auto` keeps them fp32; `bfloat16` there rounds
    them. Summed over micro-batches (on the device) or with fp32 compute they stay fp32
    whatever is asked.
    """
    if compute_dtype != "bfloat16" or micro_batches != 1:
        return "float32"
    if requested == "auto":
        return "bfloat16" if devices == 1 else "float32"
    return requested


# Rotary angles are exact for positions of magnitude below 2**24 (model/ops.py says why).
MAX_POSITION = 2**24


def attention_path(requested: str, seq_len: int, on_gpu: bool, dtype_bytes: int,
                   packed: bool = False) -> str:
    """`xla`, `cudnn` or `blockwise`: what `model.attention=requested` runs at `seq_len`.

    `auto`: cuDNN on a GPU with a 16-bit compute dtype (it needs one) up to CUDNN_MAX_SEQ,
    XLA elsewhere up to XLA_MAX_SEQ; blockwise beyond. `packed` rows (segment ids: examples
    that must not see each other) reach cuDNN and XLA as a dense [B, S, S] mask, 16 GiB a
    row at 131072 tokens: beyond XLA_MAX_SEQ they go blockwise, which masks block by block.
    """
    if requested != "auto":
        return requested
    if packed and seq_len > XLA_MAX_SEQ:
        return "blockwise"
    if on_gpu and dtype_bytes == 2:
        return "cudnn" if seq_len <= CUDNN_MAX_SEQ else "blockwise"
    return "xla" if seq_len <= XLA_MAX_SEQ else "blockwise"


def mlp_tile(requested: int, tokens: int) -> int:
    """Tokens per MLP tile for a micro-batch of `tokens`; 0 when the MLP runs untiled.

    `requested` > 0 is the tile (a tile of at least `tokens` is no tiling); 0 is automatic:
    MLP_TILE beyond MLP_TILE_FROM tokens, untiled below.
    """
    tile = requested or (MLP_TILE if tokens > MLP_TILE_FROM else 0)
    return tile if 0 < tile < tokens else 0


def attention_chunk(requested: int, seq_len: int) -> int:
    """Tokens per query and key chunk of the blockwise attention at `seq_len`."""
    return min(requested or ATTENTION_CHUNK, seq_len)
