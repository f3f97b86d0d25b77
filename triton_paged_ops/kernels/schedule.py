"""Program scheduling shared by the unified kernel (``attention.py``) and the warp-specialized one (``hopper.py``):
which sequence, query block and keys a program of a ragged batch works on.

Sequence ``b`` owns the query blocks ``cu_seqlens_q[b] // BLOCK_Q + b`` onwards, so ``T // BLOCK_Q + B`` blocks bound
them all using shapes only (static under CUDA graphs); programs past a sequence's last block exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, block_id, BLOCK_Q: tl.constexpr):
    """Largest b < num_seqs with cu_seqlens_q[b] // BLOCK_Q + b <= block_id (binary search over B + 1 entries)."""
    # (lo as a run-time int: a constant would be a constexpr argument, which the search loop may not reassign)
    return _find_seq_between(cu_seqlens_q_ptr, num_seqs * 0, num_seqs - 1, block_id, BLOCK_Q)


@triton.jit
def _find_seq_between(cu_seqlens_q_ptr, lo, hi, block_id, BLOCK_Q: tl.constexpr):
    """``_find_seq`` where the answer is known to lie in [lo, hi] (lo if none there qualifies)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= block_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _one_token_tail(cu_seqlens_q_ptr, num_seqs, tail_seq, num_blocks, BLOCK_Q: tl.constexpr):
    """Where a batch said to end in one-token sequences from sequence ``tail_seq`` on (the caller's ``decode_tail``
    hint) has them: (that sequence, clamped to [0, B]; its first query block; the blocks real sequences use)."""
    total = tl.load(cu_seqlens_q_ptr + num_seqs)
    lo = tl.minimum(tl.maximum(tail_seq, 0), num_seqs)
    # Blocks of real sequences: [0, used); the tail's: [first, used). (Clamped: a bijection even for bad input.)
    used = tl.minimum(total // BLOCK_Q + num_seqs, num_blocks)
    first = tl.minimum(tl.load(cu_seqlens_q_ptr + lo) // BLOCK_Q + lo, used)
    return lo, first, used


@triton.jit
def _interleave_one_token_rows(block_id, first, used):
    """The query block that dispatch position ``block_id`` runs in a batch that ends in one-token sequences from
    block ``first`` on (a mixed batch: prompts' chunks, then decodes; see ``_one_token_tail``): those blocks
    alternate with the others' (each kept in its own order, the longest first) until one kind runs out, so decode
    rows stream while the chunks compute instead of all at once at the end. A bijection of the grid whatever
    ``first`` and the batch hold (so a wrong hint costs time, never results)."""
    pairs = tl.minimum(first, used - first)
    if block_id < 2 * pairs:
        mapped = tl.where(block_id % 2 == 0, block_id // 2, first + block_id // 2)
    elif block_id < used:
        mapped = tl.where(first > used - first, block_id - pairs, first + block_id - pairs)
    else:
        mapped = block_id
    return mapped


@triton.jit
def _find_seq_with_tail(cu_seqlens_q_ptr, num_seqs, block_id, tail, first, BLOCK_Q: tl.constexpr):
    """``_find_seq``'s answer where sequence ``tail`` starts at block ``first`` and the sequences from it on are said
    to hold one token each: blocks before ``first`` search the sequences before ``tail`` only (for one prompt: no
    load at all), a tail block computes its sequence as if the hint held and checks it against the two offsets it
    loads anyway, searching the tail's sequences only where it does not hold. The same answer whatever the hint."""
    if block_id < first:
        seq = _find_seq_between(cu_seqlens_q_ptr, tail * 0, tail - 1, block_id, BLOCK_Q)
    else:
        lo = tl.minimum(tail, num_seqs - 1)
        c0 = tl.load(cu_seqlens_q_ptr + lo)
        # Sequence lo + i of a one-token tail starts at block (c0 + i) // BLOCK_Q + lo + i: the largest x = c0 + i
        # with x + x // BLOCK_Q <= block_id - lo + c0.
        r = block_id - lo + c0
        x = r - r // (BLOCK_Q + 1) - (r % (BLOCK_Q + 1) == BLOCK_Q).to(tl.int32)
        guess = tl.minimum(tl.maximum(x - c0 + lo, lo), num_seqs - 1)
        starts_by = tl.load(cu_seqlens_q_ptr + guess) // BLOCK_Q + guess <= block_id
        next_after = tl.load(cu_seqlens_q_ptr + guess + 1) // BLOCK_Q + guess + 1 > block_id
        if starts_by & (next_after | (guess == num_seqs - 1)):
            seq = guess
        else:
            seq = _find_seq_between(cu_seqlens_q_ptr, lo, num_seqs - 1, block_id, BLOCK_Q)
    return seq


@triton.jit
def _query_block(cu_seqlens_q_ptr, seq, block_id, num_tokens, BLOCK_Q: tl.constexpr):
    """(first token, new tokens, query block) of dispatch block ``block_id`` in sequence ``seq`` (which owns the
    blocks from ``cu_seqlens_q[seq] // BLOCK_Q + seq`` on). A sequence's blocks run last one first: under a causal
    mask it sees the most keys, and the longest programs should start early rather than trail at the end of the
    launch. A negative block: the sequence holds fewer blocks than that (the program has nothing to do)."""
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.minimum(tl.load(cu_seqlens_q_ptr + seq + 1), num_tokens)
    owned = q_end // BLOCK_Q - q_start // BLOCK_Q + 1
    return q_start, q_end - q_start, owned - 1 - (block_id - (q_start // BLOCK_Q + seq))


@triton.jit
def _sequence_keys(seq_lens_ptr, block_table_rows_ptr, seq, max_pages, num_bt_rows, PAGE_SIZE: tl.constexpr,
                   HAS_BT_ROWS: tl.constexpr):  # fmt: skip
    """Sequence ``seq``'s key count and block table row: never past the row's end whatever ``seq_lens`` says; with
    ``HAS_BT_ROWS`` the row is picked by index (a request pool's table, used in place), and a row outside the table
    (an illegal access otherwise) gives the sequence no keys."""
    kv_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_pages * PAGE_SIZE)
    if HAS_BT_ROWS:
        bt_row = tl.load(block_table_rows_ptr + seq).to(tl.int64)
        row_ok = (bt_row >= 0) & (bt_row < num_bt_rows)
        kv_len = tl.where(row_ok, kv_len, 0)
        bt_row = tl.where(row_ok, bt_row, 0)
    else:
        bt_row = seq.to(tl.int64)
    return kv_len, bt_row
