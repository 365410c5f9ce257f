"""The expert checksum of routepack/checksum.h (rp_checksum_expert: XXH64 of the XXH64s
of 4 KiB blocks, as 8-byte little-endian words) computed with torch ops on the tensors'
own device: no host copy of the bytes, one read of the [n] results at the end.

Every 4 KiB block of every expert of a call is hashed at once (XXH64's 128 stripes of a
block are a loop of tensor ops over all blocks), then each expert's block hashes (its
outer XXH64, vectorised over the experts with a mask for their lengths). An expert's
bytes are gathered into one contiguous uint8 buffer on the device first, a batch of
experts at a time (at most ``batch_bytes``): staging in device memory, bounded. Little-
endian devices only (x86 and CUDA), as the C checksum's format.

64-bit arithmetic: int64 tensors, whose multiplication and addition wrap modulo 2^64 as
XXH64's unsigned ones; right shifts are made logical with a mask."""

from __future__ import annotations

import torch

BLOCK = 4096   # RP_CHECKSUM_BLOCK


def _s64(v):
    """An unsigned 64-bit constant as the int64 of the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


P1 = _s64(0x9E3779B185EBCA87)
P2 = _s64(0xC2B2AE3D27D4EB4F)
P3 = _s64(0x165667B19E3779F9)
P4 = _s64(0x85EBCA77C2B2AE63)
P5 = _s64(0x27D4EB2F165667C5)
EMPTY = 0xEF46DB3751D8E999   # XXH64 of no bytes: the checksum of an empty expert


def _shr(x, r):
    """Logical right shift of int64 bits."""
    return (x >> r) & ((1 << (64 - r)) - 1)


def _rotl(x, r):
    return (x << r) | _shr(x, 64 - r)


def _round(acc, lane):
    return _rotl(acc + lane * P2, 31) * P1


def _merge(acc, val):
    acc = acc ^ _round(torch.zeros_like(val), val)
    return acc * P1 + P4


def _avalanche(h):
    h = h ^ _shr(h, 33)
    h = h * P2
    h = h ^ _shr(h, 29)
    h = h * P3
    return h ^ _shr(h, 32)


def _words(rows, begin, count, width):
    """rows[:, begin : begin + count * width] as little-endian words of `width` bytes
    (8 or 4), int64 [n, count] (4-byte words zero-extended)."""
    b = rows[:, begin:begin + count * width].contiguous()
    w = b.view(torch.int64 if width == 8 else torch.int32)
    return w if width == 8 else w.to(torch.int64) & 0xFFFFFFFF


def xxh64_rows(rows):
    """XXH64 (seed 0) of each row of a uint8 tensor [n, L] (all of one length), int64 [n]."""
    n, length = rows.shape
    dev = rows.device
    stripes = length // 32
    if stripes:
        lanes = _words(rows, 0, stripes * 4, 8).view(n, stripes, 4)
        v = torch.tensor([_s64((P1 + P2) & (2**64 - 1)), P2, 0, -P1], dtype=torch.int64,
                         device=dev).expand(n, 4).clone()
        for s in range(stripes):
            v = _round(v, lanes[:, s, :])
        h = _rotl(v[:, 0], 1) + _rotl(v[:, 1], 7) + _rotl(v[:, 2], 12) + _rotl(v[:, 3], 18)
        for i in range(4):
            h = _merge(h, v[:, i])
    else:
        h = torch.full((n,), P5, dtype=torch.int64, device=dev)
    h = h + length
    at = stripes * 32
    words8 = (length - at) // 8
    if words8:
        w = _words(rows, at, words8, 8)
        for i in range(words8):
            h = h ^ _round(torch.zeros_like(h), w[:, i])
            h = _rotl(h, 27) * P1 + P4
        at += 8 * words8
    if length - at >= 4:
        h = h ^ (_words(rows, at, 1, 4)[:, 0] * P1)
        h = _rotl(h, 23) * P2 + P3
        at += 4
    for i in range(at, length):
        h = h ^ (rows[:, i].to(torch.int64) * P5)
        h = _rotl(h, 11) * P1
    return _avalanche(h)


def _outer(block_hashes, counts):
    """XXH64 of each expert's block hashes as 8-byte little-endian words: block_hashes
    int64 [n, m] (row e's first counts[e] are expert e's; the rest ignored), counts int64
    [n] (>= 1). int64 [n]."""
    n, m = block_hashes.shape
    dev = block_hashes.device
    stripes = counts // 4                     # 4 words a stripe
    max_stripes = m // 4
    v = torch.tensor([_s64((P1 + P2) & (2**64 - 1)), P2, 0, -P1], dtype=torch.int64,
                     device=dev).expand(n, 4).clone()
    if max_stripes:
        lanes = block_hashes[:, :max_stripes * 4].reshape(n, max_stripes, 4)
        for s in range(max_stripes):
            live = (stripes > s).unsqueeze(1)
            v = torch.where(live, _round(v, lanes[:, s, :]), v)
    long_h = _rotl(v[:, 0], 1) + _rotl(v[:, 1], 7) + _rotl(v[:, 2], 12) + _rotl(v[:, 3], 18)
    for i in range(4):
        long_h = _merge(long_h, v[:, i])
    h = torch.where(stripes > 0, long_h, torch.full_like(long_h, P5)) + counts * 8
    # the 0-3 words after the last stripe
    idx = torch.arange(n, device=dev)
    for i in range(3):
        pos = stripes * 4 + i
        live = pos < counts
        w = block_hashes[idx, pos.clamp(max=m - 1)]
        nh = _rotl(h ^ _round(torch.zeros_like(h), w), 27) * P1 + P4
        h = torch.where(live, nh, h)
    return _avalanche(h)


def checksum_experts(experts, batch_bytes=256 << 20):
    """The checksum of each expert (rp_checksum_expert of the concatenation of its parts):
    ``experts`` a list whose item e is the list of tensors (any dtype, contiguous, on one
    device) that make up expert e, in order. Returns a list of int (unsigned 64-bit).
    Computed with torch ops on the parts' device; the bytes are gathered into a device
    buffer of at most about ``batch_bytes`` at a time (an expert larger than that alone)."""
    out = [0] * len(experts)
    flat = [[p.reshape(-1).view(torch.uint8) if p.numel() else p.new_empty(0, dtype=torch.uint8)
             for p in parts] for parts in experts]
    sizes = [sum(int(p.numel()) for p in parts) for parts in flat]
    e = 0
    while e < len(experts):
        group, total = [], 0
        while e < len(experts) and (not group or total + sizes[e] <= batch_bytes):
            group.append(e)
            total += sizes[e]
            e += 1
        for idx, value in zip(group, _checksum_group([flat[i] for i in group], [sizes[i] for i in group])):
            out[idx] = value
    return out


def _checksum_group(parts_list, sizes):
    dev = None
    for parts in parts_list:
        for p in parts:
            dev = p.device
            break
        if dev is not None:
            break
    if dev is None:
        dev = torch.device("cpu")
    n = len(sizes)
    full = [s // BLOCK for s in sizes]
    tail = [s % BLOCK for s in sizes]
    counts = [f + (1 if t else 0) for f, t in zip(full, tail)]
    # the bytes, one expert after another, each padded to whole blocks
    padded = torch.zeros(sum(counts) * BLOCK, dtype=torch.uint8, device=dev)
    starts, at = [], 0
    for parts, c in zip(parts_list, counts):
        starts.append(at)
        off = at
        for p in parts:
            padded[off:off + p.numel()].copy_(p, non_blocking=True)
            off += p.numel()
        at += c * BLOCK
    blocks = padded.view(-1, BLOCK)
    # every block as a whole one; an expert's shorter last block is hashed again below
    hashes = xxh64_rows(blocks) if blocks.shape[0] else torch.empty(0, dtype=torch.int64, device=dev)
    for length in sorted({t for t in tail if t}):
        rows = torch.tensor([starts[i] // BLOCK + full[i] for i in range(n) if tail[i] == length],
                            dtype=torch.int64, device=dev)
        hashes[rows] = xxh64_rows(blocks[rows][:, :length])
    m = max(max(counts), 1)
    per_expert = torch.zeros(n, m, dtype=torch.int64, device=dev)
    for i in range(n):
        if counts[i]:
            b0 = starts[i] // BLOCK
            per_expert[i, :counts[i]] = hashes[b0:b0 + counts[i]]
    cnt = torch.tensor(counts, dtype=torch.int64, device=dev)
    sums = _outer(per_expert, cnt.clamp(min=1))
    # no bytes at all: XXH64 of nothing (the outer hash of no block hashes)
    sums = torch.where(cnt == 0, torch.full_like(sums, _s64(EMPTY)), sums)
    return [v & (2**64 - 1) for v in sums.tolist()]   # the one read back to the host
