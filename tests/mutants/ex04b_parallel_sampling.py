"""Plausible wrong answers to notebook 04's parallel-sampling exercise; each must fail
tests/graders/ex04b_parallel_sampling.py.

Each entry: (what the mistake is, old text of solutions/ex04b_parallel_sampling.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # fork
    (
        "fork: the new sequence gets the very same list (its copy-on-write rewrites the other's table)",
        "    return list(table)\n    ### END SOLUTION",
        "    return table\n    ### END SOLUTION",
    ),
    (
        "fork: reference counts not raised (a shared block looks like anyone's own)",
        "    for block in table:\n        ref_counts[block] += 1\n",
        "",
    ),
    (
        "fork: the partly filled last block left out of the new table",
        "    return list(table)\n    ### END SOLUTION",
        "    return list(table[:-1])\n    ### END SOLUTION",
    ),
    # block_to_write
    (
        "block: always the table's last block, wherever the position falls",
        "    index = num_computed_tokens // block_size\n",
        "    index = num_blocks_held - 1\n",
    ),
    (
        "block: off by one ((n - 1) // block_size, the last position written, not the next)",
        "    index = num_computed_tokens // block_size\n",
        "    index = max(0, num_computed_tokens - 1) // block_size\n",
    ),
    (
        "block: a position just past the table counted as inside its last block",
        "    return index if index < num_blocks_held else None",
        "    return index if index <= num_blocks_held else None",
    ),
    # copy_on_write
    (
        "cow: copies a block the sequence holds alone (every writer copies)",
        "if index is None or ref_counts[table[index]] <= 1:",
        "if index is None or ref_counts[table[index]] < 1:",
    ),
    ("cow: the shared block keeps its count (it is never freed)", "    ref_counts[shared] -= 1\n", ""),
    (
        "cow: the fresh block is not put into the table (the sequence still writes the shared one)",
        "    table[index] = fresh\n",
        "",
    ),
    (
        "cow: no copy when the position is a block's first (offset 0), though the block is shared",
        "if index is None or ref_counts[table[index]] <= 1:",
        "if index is None or ref_counts[table[index]] <= 1 or num_computed_tokens % block_size == 0:",
    ),
    ("cow: the copy reported backwards (fresh -> shared)", "    return shared, fresh\n", "    return fresh, shared\n"),
    (
        "cow: the last block of the table copied, not the block the position falls in",
        "    index = block_to_write(num_computed_tokens, block_size, len(table))\n",
        "    index = len(table) - 1 if table else None\n",
    ),
]
