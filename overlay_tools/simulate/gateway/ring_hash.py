"""BLAKE3 of a short string (one chunk, at most 1,024 bytes), in pure Python: the hash smg's ring
places workers and keys with (``model_gateway/src/worker/hash_ring.rs:165``: the first 8 bytes of
``blake3::hash``, little-endian), so the replay's ring is smg's own without the ``blake3`` package.
The algorithm is the BLAKE3 specification's (the compression function with its message
permutation; a single chunk's blocks chained with CHUNK_START / CHUNK_END / ROOT)."""

from __future__ import annotations

IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
CHUNK_START, CHUNK_END, ROOT = 1, 2, 8
CHUNK_LEN, BLOCK_LEN = 1024, 64
MASK = 0xFFFFFFFF


def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & MASK


def _g(s: list[int], a: int, b: int, c: int, d: int, mx: int, my: int) -> None:
    s[a] = (s[a] + s[b] + mx) & MASK
    s[d] = _rotr(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & MASK
    s[b] = _rotr(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b] + my) & MASK
    s[d] = _rotr(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & MASK
    s[b] = _rotr(s[b] ^ s[c], 7)


def _compress(cv: list[int], words: list[int], counter: int, block_len: int, flags: int) -> list[int]:
    s = [*cv, *IV[:4], counter & MASK, (counter >> 32) & MASK, block_len, flags]
    m = list(words)
    for r in range(7):
        _g(s, 0, 4, 8, 12, m[0], m[1])
        _g(s, 1, 5, 9, 13, m[2], m[3])
        _g(s, 2, 6, 10, 14, m[4], m[5])
        _g(s, 3, 7, 11, 15, m[6], m[7])
        _g(s, 0, 5, 10, 15, m[8], m[9])
        _g(s, 1, 6, 11, 12, m[10], m[11])
        _g(s, 2, 7, 8, 13, m[12], m[13])
        _g(s, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in PERMUTATION]
    return [s[i] ^ s[i + 8] for i in range(8)] + [s[i + 8] ^ cv[i] for i in range(8)]


def blake3_digest(data: bytes) -> bytes:
    """The 32-byte BLAKE3 hash of ``data`` (at most one chunk)."""
    if len(data) > CHUNK_LEN:
        raise ValueError(f"{len(data)} bytes: this BLAKE3 hashes one chunk ({CHUNK_LEN} bytes) at most")
    blocks = [data[i:i + BLOCK_LEN] for i in range(0, len(data), BLOCK_LEN)] or [b""]
    cv = list(IV)
    out: list[int] = []
    for n, block in enumerate(blocks):
        last = n == len(blocks) - 1
        flags = (CHUNK_START if n == 0 else 0) | ((CHUNK_END | ROOT) if last else 0)
        padded = block.ljust(BLOCK_LEN, b"\0")
        words = [int.from_bytes(padded[i:i + 4], "little") for i in range(0, BLOCK_LEN, 4)]
        out = _compress(cv, words, 0, len(block), flags)
        cv = out[:8]
    return b"".join(w.to_bytes(4, "little") for w in out[:8])
